"""A run whose checkpoints are sharded ``.dcp`` folders: ``consolidate`` turns one into the
single .pt file a one-process run would have saved (verified, loadable into the plain model),
and ``evaluate``, ``export`` and ``--init-from`` read the folders directly."""

import contextlib
import hashlib
import io
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from handlers.checkpoint.formats import read_checkpoint
from recipes.__main__ import main
from recipes.runner.commands.trained import load_trained
from recipes.runner.config.registry import load_recipe
from recipes.runner.console import interpreter
from tests.helpers import (
    CHARLM_RUN,
    RunsCodeWhenUnpickled,
    digests,
    evaluated,
    leave_the_group,
    one_error_line,
    plant_build_on_a_class,
    plant_pickle_in_a_bytes_entry,
    recorded,
    write_text,
)


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Path:
    """A tiny charlm run under ``--strategy fsdp`` on one process (a one-rank group, which
    writes every shard of its ``.dcp`` checkpoints)."""
    folder = tmp_path_factory.mktemp("sharded")
    write_text(folder / "text.txt", words=800)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert main([*CHARLM_RUN, "--text", str(folder / "text.txt"), "--strategy", "fsdp",
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
    assert main([*CHARLM_RUN, "--text", str(text), "--init-from", str(sharded_run),
                 "--run-dir", str(tmp_path / "new")]) == 0
    record = json.loads((tmp_path / "new" / "config.json").read_text())["init_from"]
    # best.dcp is a symbolic link: the record names the folder it pointed at.
    assert Path(record["path"]).samefile(sharded_run / "checkpoints" / "best.dcp")


def test_the_closing_lines_name_the_sharded_best_checkpoint(sharded_run):
    printed = (sharded_run.parent / "train.out").read_text()
    assert f"  best     {sharded_run / 'checkpoints' / 'best.dcp'}: loss " in printed
    assert f"  evaluate {interpreter()} -m recipes charlm evaluate {sharded_run}" in printed


# --- a .dcp folder whose .metadata would run code -------------------------------------------



def plant_metadata(folder: Path, marker: Path) -> None:
    """Make ``.metadata`` of the sharded checkpoint ``folder`` a payload that creates
    ``marker``, with sidecars that match it (whoever plants a folder can write those too)."""
    (folder / ".metadata").write_bytes(pickle.dumps(RunsCodeWhenUnpickled(marker)))
    for sidecar in folder.parent.glob("*.dcp.json"):
        facts = json.loads(sidecar.read_text())
        if (folder.parent / facts["file"]).resolve() != folder.resolve():
            continue
        files = {name: {"sha256": hashlib.sha256((folder / name).read_bytes()).hexdigest(),
                        "size_bytes": (folder / name).stat().st_size} for name in facts["files"]}
        facts.update(files=files, size_bytes=sum(f["size_bytes"] for f in files.values()),
                     sha256=hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest())
        sidecar.write_text(json.dumps(facts))


@pytest.fixture
def trapped_run(sharded_run, tmp_path) -> tuple[Path, Path]:
    """A copy of the sharded run whose every checkpoint folder holds the payload."""
    copy, marker = tmp_path / "run", tmp_path / "code-ran"
    shutil.copytree(sharded_run, copy, symlinks=True)
    folders = list((copy / "checkpoints").glob("*step-*.dcp"))
    assert folders and all(".metadata" in json.loads(Path(f"{folder}.json").read_text())["files"]
                           for folder in folders)
    for folder in folders:
        plant_metadata(folder, marker)
    return copy, marker


@pytest.mark.parametrize("command", ["evaluate", "generate", "export", "consolidate",
                                     "init-from"])
def test_no_command_runs_the_code_of_a_planted_metadata(sharded_run, trapped_run, tmp_path,
                                                        capsys, command):
    run_dir, marker = trapped_run
    before = digests(run_dir)
    args = {"evaluate": ["charlm", "evaluate", str(run_dir)],
            "generate": ["charlm", "generate", str(run_dir), "--prompt", "def"],
            "export": ["charlm", "export", str(run_dir), "--format", "safetensors",
                       "--out", str(tmp_path / "weights.safetensors")],
            "consolidate": ["charlm", "consolidate", str(run_dir)],
            "init-from": [*CHARLM_RUN, "--text", str(sharded_run.parent / "text.txt"),
                          "--init-from", str(run_dir), "--run-dir", str(tmp_path / "new")],
            }[command]
    code = main(args)
    one_error_line(code, capsys.readouterr().err, "best.dcp",
                   "refused: its .metadata names posix.mkdir")
    assert not marker.exists()
    assert digests(run_dir) == before
    assert not (tmp_path / "weights.safetensors").exists() and not (tmp_path / "new").exists()


def test_a_resume_falls_back_past_a_planted_folder_unrun(sharded_run, tmp_path, caplog, capsys):
    run_dir, marker = tmp_path / "run", tmp_path / "code-ran"
    shutil.copytree(sharded_run, run_dir, symlinks=True)
    (run_dir / "summary.json").unlink()  # killed before its summary: the start resumes it
    checkpoints = run_dir / "checkpoints"
    newest = (checkpoints / "last.dcp").resolve()
    planted = checkpoints / "step-00000099.dcp"  # newer than any the run wrote
    shutil.copytree(newest, planted)
    sidecar = json.loads(Path(f"{newest}.json").read_text())
    Path(f"{planted}.json").write_text(json.dumps({**sidecar, "file": planted.name}))
    plant_metadata(planted, marker)

    code = main([*CHARLM_RUN, "--text", str(sharded_run.parent / "text.txt"),
                 "--run-dir", str(run_dir)])
    leave_the_group()
    assert code == 0, capsys.readouterr().err
    assert not marker.exists()
    rejected = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert len(rejected) == 1 and f"{planted} rejected: refused: its .metadata names " \
                                   "posix.mkdir" in rejected[0], rejected


@pytest.mark.parametrize("plant", ["a pickle in a byte entry", "BUILD on a class"])
@pytest.mark.parametrize("command", ["evaluate", "consolidate"])
def test_no_command_runs_a_byte_entry_pickle_or_builds_a_class(sharded_run, tmp_path, capsys,
                                                               command, plant):
    run_dir, marker = tmp_path / "run", tmp_path / "code-ran"
    shutil.copytree(sharded_run, run_dir, symlinks=True)
    best = (run_dir / "checkpoints" / "best.dcp").resolve()
    if plant == "a pickle in a byte entry":
        plant_pickle_in_a_bytes_entry(best, marker)
        fragment = "is not plain data"
    else:
        plant_build_on_a_class(best)
        fragment = "sets attributes of <class 'pathlib.PosixPath'> (BUILD)"
    before = digests(run_dir)
    code = main(["charlm", command, str(run_dir)])
    one_error_line(code, capsys.readouterr().err, "best.dcp: refused: ", fragment)
    assert not marker.exists() and str(Path("/a/b")) == "/a/b"
    assert digests(run_dir) == before
