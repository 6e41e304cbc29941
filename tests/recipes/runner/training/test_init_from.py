"""``--init-from``: a new run begins with an earlier run's model weights (no optimizer, step
or schedule state) and records where they came from; bad sources exit 2 with one line and
write nothing; once the run has checkpoints it resumes and the flag is ignored."""

import json
import shutil
from pathlib import Path

import torch

from handlers.checkpoint.files import read_sidecar
from recipes.__main__ import main
from recipes.cifar.recipe import RECIPE as CIFAR
from recipes.runner.resume.plan import fresh_init_from
from recipes.runner.training.build import build_parts
from tests import helpers
from tests.helpers import CHARLM, digests, one_error_line, write_text

CIFAR_TINY = [*helpers.CIFAR, "--epochs", "1", "--warmup-epochs", "0.5", "--tta", "none",
              "--final-tta", "none", "--device", "cpu"]


def model_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, weights_only=True)["model"]


def test_a_charlm_run_starts_from_another_runs_weights_and_records_them(tmp_path, capsys):
    text = write_text(tmp_path / "corpus.txt")
    charlm = [*CHARLM, "--text", str(text)]
    assert main([*charlm, "--epochs", "1", "--run-dir", str(tmp_path / "source")]) == 0
    source = tmp_path / "source" / "checkpoints" / "best.pt"
    source_meta = torch.load(source, weights_only=True)["meta"]

    # An LR so small that training leaves the weights where they started: the run's last
    # weights are its first ones, which must be the source's (a fresh init is far off).
    quiet = [*charlm, "--lr", "1e-12"]
    capsys.readouterr()
    assert main([*quiet, "--epochs", "1", "--run-dir", str(tmp_path / "new"), "--init-from",
                 str(tmp_path / "source")]) == 0
    lines = capsys.readouterr().out.splitlines()
    # The header names the weights; the start-up check does not call their loss "near ln".
    assert (f"  init     --init-from: began with the weights of {source.resolve()} (epoch "
            f"{source_meta['epoch']}, step {source_meta['optimizer_step']})") in lines
    [check] = [line for line in lines if line.startswith("check: first loss")]
    assert check.endswith(" from trained weights (untrained: ln(256) = 5.545): ok"), check
    assert main([*quiet, "--epochs", "1", "--run-dir", str(tmp_path / "fresh")]) == 0
    new = torch.load(tmp_path / "new" / "checkpoints" / "last.pt", weights_only=True)
    fresh = model_weights(tmp_path / "fresh" / "checkpoints" / "last.pt")
    trained = model_weights(source)
    assert all(torch.allclose(new["model"][key], trained[key], atol=1e-6) for key in trained)
    assert not all(torch.allclose(fresh[key], trained[key], atol=1e-3) for key in trained)
    # Its own steps from 0 (as many as the source's one epoch), its own run id.
    assert new["meta"]["optimizer_step"] == source_meta["optimizer_step"]
    assert new["meta"]["run_id"] != source_meta["run_id"]

    record = json.loads((tmp_path / "new" / "config.json").read_text())["init_from"]
    assert record == {"path": str(source.resolve()), "sha256": read_sidecar(source)["sha256"],
                      "run_id": source_meta["run_id"], "kind": source_meta["kind"],
                      "epoch": source_meta["epoch"],
                      "optimizer_step": source_meta["optimizer_step"]}

    # Started: the run resumes, says the flag is ignored, and keeps its record.
    capsys.readouterr()
    assert main([*quiet, "--epochs", "2", "--run-dir", str(tmp_path / "new"), "--init-from",
                 str(tmp_path / "fresh")]) == 0
    out = capsys.readouterr().out
    assert "--init-from ignored" in out and "resumed from" in out
    assert json.loads((tmp_path / "new" / "config.json").read_text())["init_from"] == record


def test_a_cifar_run_begins_with_the_checkpoints_weights_and_no_optimizer_state(tmp_path):
    assert main([*CIFAR_TINY, "--run-dir", str(tmp_path / "source")]) == 0
    source = tmp_path / "source" / "checkpoints" / "last.pt"
    saved = json.loads((tmp_path / "source" / "config.json").read_text())["config"]
    config = CIFAR.config(**{**saved, "init_from": str(source), "run_dir": ""})
    _, parts, trainer = build_parts(CIFAR, config, CIFAR.load_data(config), tmp_path / "new",
                                    fresh_init_from(config, tmp_path / "new"))
    trained = model_weights(source)
    first = parts.model.state_dict()
    assert first.keys() == trained.keys()
    assert all(torch.equal(first[key], trained[key]) for key in trained)
    assert parts.optimizer.state_dict()["state"] == {}  # no momentum carried over
    assert trainer.state.iteration == 0 and getattr(trainer.state, "optimizer_step", 0) == 0

    # Through the command line: its steps count from 1, its record names the source.
    assert main([*CIFAR_TINY, "--run-dir", str(tmp_path / "new"), "--init-from", str(source),
                 "--checkpoint-every", "1", "--keep-last", "10"]) == 0
    first = torch.load(tmp_path / "new" / "checkpoints" / "step-00000001.pt", weights_only=True)
    assert first["meta"]["optimizer_step"] == 1
    record = json.loads((tmp_path / "new" / "config.json").read_text())["init_from"]
    assert record["path"] == str(source.resolve())


def test_bad_sources_exit_2_with_one_line_and_write_nothing(tmp_path, capsys):
    text = write_text(tmp_path / "corpus.txt")
    charlm = [*CHARLM, "--text", str(text), "--epochs", "1"]
    assert main([*charlm, "--run-dir", str(tmp_path / "source")]) == 0
    best = tmp_path / "source" / "checkpoints" / "best.pt"
    truncated = tmp_path / "cut" / "best.pt"
    truncated.parent.mkdir()
    shutil.copy(best, truncated)
    shutil.copy(best.with_name("best.pt.json"), truncated.with_name("best.pt.json"))
    truncated.write_bytes(best.read_bytes()[:1000])
    (tmp_path / "empty").mkdir()
    wider, deeper = list(charlm), list(charlm)
    wider[wider.index("--n-embd") + 1] = "32"
    deeper[deeper.index("--n-layer") + 1] = "2"
    cases = {
        "missing": (charlm, tmp_path / "nowhere", "no such file or folder"),
        "no checkpoints": (charlm, tmp_path / "empty", "no checkpoints/best.pt or last.pt"),
        "truncated": (charlm, truncated, "truncated"),
        "other depth": (deeper, best, "not in the checkpoint"),
        "other width": (wider, best, "has shape"),
        "other recipe": (CIFAR_TINY, best, "not in the checkpoint"),
    }
    for name, (args, source, fragment) in cases.items():
        before = digests(tmp_path)
        capsys.readouterr()
        code = main([*args, "--run-dir", str(tmp_path / "refused"), "--init-from", str(source)])
        line = one_error_line(code, capsys.readouterr().err, "--init-from", fragment)
        assert digests(tmp_path) == before, name
        assert not (tmp_path / "refused").exists(), (name, line)
