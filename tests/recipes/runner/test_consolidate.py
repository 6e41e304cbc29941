"""A run whose checkpoints are sharded ``.dcp`` folders: ``consolidate`` turns one into the
single .pt file a one-process run would have saved (verified, loadable into the plain model),
and ``evaluate``, ``export`` and ``--init-from`` read the folders directly."""

import contextlib
import io
import json
import shutil
from pathlib import Path

import ignite.distributed as idist
import pytest
import torch
import torch.distributed as dist

from handlers.checkpoint_files import read_checkpoint
from recipes.__main__ import main
from recipes.runner.interpreter import interpreter
from recipes.runner.registry import load_recipe
from recipes.runner.trained import load_trained
from tests.recipes.runner.test_commands import CHARLM, digests, evaluated, recorded
from tests.recipes.runner.test_run import one_error_line


def leave_the_group() -> None:
    """End the one-rank group a one-process fsdp run leaves in this process (and
    ``ignite.distributed``'s hold on it), so that what runs next runs without one."""
    if dist.is_initialized():
        idist.sync()
        idist.finalize()


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Path:
    """A tiny charlm run under ``--strategy fsdp`` on one process (a one-rank group, which
    writes every shard of its ``.dcp`` checkpoints)."""
    folder = tmp_path_factory.mktemp("sharded")
    words = ["def", "return", "self", "value", "import", "class", "for", "in", "if"]
    picks = torch.randint(len(words), (800,), generator=torch.Generator().manual_seed(0))
    (folder / "text.txt").write_text(" ".join(words[i] for i in picks.tolist()))
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert main([*CHARLM, "--text", str(folder / "text.txt"), "--strategy", "fsdp",
                     "--run-dir", str(folder / "run")]) == 0
    leave_the_group()
    (folder / "train.out").write_text(printed.getvalue())
    checkpoints = folder / "run" / "checkpoints"
    assert (checkpoints / "best.dcp").is_dir() and not list(checkpoints.glob("*.pt"))
    return folder / "run"


def test_consolidate_writes_the_single_file_checkpoint_of_a_sharded_one(sharded_run, capsys):
    before = digests(sharded_run)
    assert main(["charlm", "consolidate", str(sharded_run)]) == 0
    out = sharded_run / "export" / "best.pt"
    assert f"wrote {out} and best.pt.json" in capsys.readouterr().out
    single = read_checkpoint(out)  # verified against its sidecar
    sharded = read_checkpoint(sharded_run / "checkpoints" / "best.dcp")
    assert single["meta"] == sharded["meta"]
    for name, tensor in sharded["model"].items():
        assert torch.equal(single["model"][name], tensor), name
    # The plain model and optimizer take it as they are.
    trained = load_trained(load_recipe("charlm"), str(out))
    trained.parts.model.load_state_dict(torch.load(out, weights_only=True)["model"])
    trained.parts.optimizer.load_state_dict(single["optimizer"])
    assert json.loads((sharded_run / "export" / "best.pt.json").read_text())["file"] == "best.pt"
    after = digests(sharded_run)
    assert {name for name in after if name not in before} == {"export/best.pt",
                                                             "export/best.pt.json"}
    assert all(after[name] == digest for name, digest in before.items())


def test_evaluate_reads_a_sharded_checkpoint_and_reproduces_the_recorded_best(sharded_run):
    assert main(["charlm", "evaluate", str(sharded_run)]) == 0
    result = evaluated(sharded_run)
    assert result["checkpoint"].endswith("best.dcp")
    assert result["metrics"]["loss"] == recorded(sharded_run)["loss"]


def test_export_reads_a_sharded_checkpoint(sharded_run, tmp_path):
    out = tmp_path / "weights.safetensors"
    assert main(["charlm", "export", str(sharded_run), "--format", "safetensors",
                 "--out", str(out)]) == 0
    assert out.exists()


@pytest.mark.parametrize(("args", "fragments"), [
    (["--out", "x.txt"], ("--out x.txt", "must end in .pt")),
    (["--checkpoint", "first"], ("consolidate", "invalid choice")),
])
def test_consolidate_refuses_bad_arguments_in_one_line_writing_nothing(sharded_run, capsys,
                                                                       args, fragments):
    before = digests(sharded_run)
    code = main(["charlm", "consolidate", str(sharded_run), *args])
    one_error_line(code, capsys.readouterr().err, *fragments)
    assert digests(sharded_run) == before


def test_consolidate_refuses_a_damaged_folder_in_one_line(sharded_run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(sharded_run / "checkpoints", copy / "checkpoints", symlinks=True)
    victim = next((copy / "checkpoints").glob("best-step-*.dcp")) / "state.pt"
    victim.write_bytes(victim.read_bytes()[:-10])
    code = main(["charlm", "consolidate", str(copy)])
    one_error_line(code, capsys.readouterr().err, "best.dcp", "truncated state.pt")
    assert not (copy / "export").exists()


def test_a_new_run_takes_its_weights_from_a_sharded_run(sharded_run, tmp_path):
    text = sharded_run.parent / "text.txt"
    assert main([*CHARLM, "--text", str(text), "--init-from", str(sharded_run),
                 "--run-dir", str(tmp_path / "new")]) == 0
    record = json.loads((tmp_path / "new" / "config.json").read_text())["init_from"]
    # best.dcp is a symbolic link: the record names the folder it pointed at.
    assert Path(record["path"]).samefile(sharded_run / "checkpoints" / "best.dcp")


def test_the_closing_lines_name_the_sharded_best_checkpoint(sharded_run):
    printed = (sharded_run.parent / "train.out").read_text()
    assert f"  best     {sharded_run / 'checkpoints' / 'best.dcp'}: loss " in printed
    assert f"  evaluate {interpreter()} -m recipes charlm evaluate {sharded_run}" in printed
