"""``--tracker wandb`` on charlm's tiny run, offline, read back from the run file W&B wrote
(``run-<id>.wandb``: W&B's record log, parsed here with W&B's own protobuf classes): the
config, every scalar at its optimizer step, the run files, the exit code; a resume continues
the same W&B run; a bad ``WANDB_MODE`` or folder exits 2 with nothing written. Everything but
the missing-package test needs W&B (the ``wandb`` extra) and skips without it."""

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.__main__ import main
from tests.helpers import (
    CHARLM,
    RUN_RECIPE,
    digests,
    one_error_line,
    scalar_steps,
    scalar_tags,
    write_text,
)

needs_wandb = pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None,
    reason="W&B is not installed (pip install -e '.[wandb]'); CI installs only .[dev]")

BLOCK = 32768  # W&B's record log: LevelDB's log format after a 7-byte file header
FULL, LAST = 1, 4  # the record kinds that end a record


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """The tracker's own default, whatever the machine running the tests has set."""
    for name in ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)


def train(tmp_path, *args: str) -> int:
    text = tmp_path / "corpus.txt"
    if not text.exists():
        write_text(text, words=1200)
    return main([*CHARLM, "--text", str(text), "--run-dir", str(tmp_path / "run"),
                 "--tracker", "wandb", "--eval-every", "1", "--log-every", "2", *args])


def records(path: Path) -> list:
    """The protobuf records of one W&B run file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    found, pending, position = [], b"", 7
    while position + 7 <= len(data):
        left = BLOCK - position % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            found.append(record)
            pending = b""
    return found


def offline_runs(folder: Path) -> list[Path]:
    """The offline run folders W&B wrote under ``folder``, oldest first."""
    return sorted((folder / "wandb").glob("offline-run-*"))


def read_run(run_folder: Path) -> dict:
    """What one offline run folder holds: the run record, config, history rows, exit code."""
    (path,) = run_folder.glob("run-*.wandb")
    found = {"history": [], "config": {}}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            found["run"] = record.run
            found["config"].update({item.key: json.loads(item.value_json)
                                    for item in record.run.config.update})
        elif kind == "history":
            found["history"].append({item.key or "/".join(item.nested_key):
                                     json.loads(item.value_json) for item in record.history.item})
        elif kind == "exit":
            found["exit_code"] = record.exit.exit_code
    return found


def wandb_steps(history: list[dict], tag: str) -> list[int]:
    return sorted(row["optimizer_step"] for row in history if tag in row)


@needs_wandb
def test_the_offline_wandb_run_holds_the_config_scalars_and_files(tmp_path, capsys):
    assert train(tmp_path, "--epochs", "1") == 0
    run_dir = tmp_path / "run"
    (folder,) = offline_runs(run_dir)  # offline, in the run folder by default
    found = read_run(folder)
    saved = json.loads((run_dir / "config.json").read_text())
    state = json.loads((run_dir / "wandb.json").read_text())
    assert state == {"dir": str(run_dir), "run_id": found["run"].run_id}
    assert found["run"].project == "charlm" and found["run"].display_name == "run"
    config = found["config"]
    meta = config.pop("run")
    assert {key: value for key, value in config.items()
            if not key.startswith("_")} == saved["config"]
    assert meta["run_id"] == saved["run_id"] and meta["recipe"] == "charlm"
    assert meta["git_revision"].startswith(saved["environment"]["git"]["commit"])
    # Every scalar TensorBoard got, at its optimizer step.
    logged = {key for row in found["history"] for key in row if not key.startswith("_")}
    assert logged == {*scalar_tags(run_dir), "optimizer_step"}
    for tag in ("train/loss", "train/lr", "val/loss"):
        assert wandb_steps(found["history"], tag) == scalar_steps(run_dir, tag), tag
    assert found["exit_code"] == 0
    files = folder / "files"
    assert (files / "curves.png").read_bytes() == (run_dir / "curves.png").read_bytes()
    assert (files / "checkpoints" / "best.pt").resolve() == (
        run_dir / "checkpoints" / "best.pt").resolve()
    # The run's last line says where the offline run is and how to upload it.
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"  wandb    run {state['run_id']} offline in {run_dir / 'wandb'} (upload: wandb sync "
        f"{run_dir / 'wandb'}/offline-run-*-{state['run_id']})")


@needs_wandb
def test_a_resumed_run_continues_the_same_wandb_run_in_the_same_folder(tmp_path):
    where = tmp_path / "wandb-files"
    assert train(tmp_path, "--epochs", "1", "--tracker-uri", str(where)) == 0
    # The same run folder, one epoch longer, without --tracker-uri: it keeps its folder.
    assert main([*CHARLM, "--text", str(tmp_path / "corpus.txt"), "--run-dir",
                 str(tmp_path / "run"), "--epochs", "2"]) == 0
    first, second = (read_run(folder) for folder in offline_runs(where))
    assert first["run"].run_id == second["run"].run_id
    assert second["exit_code"] == 0 and not (tmp_path / "run" / "wandb").exists()
    steps = wandb_steps(first["history"] + second["history"], "val/loss")
    assert len(steps) == 2 and steps == scalar_steps(tmp_path / "run", "val/loss")


@needs_wandb
def test_a_run_killed_mid_way_continues_its_wandb_run_each_step_once(tmp_path):
    args = [*CHARLM, "--text", str(write_text(tmp_path / "corpus.txt", words=1200)),
            "--run-dir", str(tmp_path / "run"), "--epochs", "1", "--tracker", "wandb",
            "--log-every", "2", "--checkpoint-every", "10"]
    killed = subprocess.run([sys.executable, str(RUN_RECIPE), *args], cwd=tmp_path,
                            env=os.environ | {"RELIABILITY_SIGNAL_AT": "SIGKILL:iteration:25"},
                            capture_output=True, text=True, timeout=600, check=False)
    assert killed.returncode == -9, killed.stderr
    started = json.loads((tmp_path / "run" / "wandb.json").read_text())["run_id"]
    assert main(args) == 0
    killed_start, resumed = offline_runs(tmp_path / "run")
    found = read_run(resumed)
    assert found["run"].run_id == started and found["exit_code"] == 0
    # The resumed start logs from its checkpoint (step 20) on, each step once. What the
    # killed start logged is lost offline: W&B's own process writes the run file in 32 KiB
    # blocks and died with the run before its first block was full (a limit of W&B's, in
    # docs/reference.md).
    assert wandb_steps(found["history"], "train/loss") == [*range(22, 37, 2), 37]
    assert (killed_start / f"run-{started}.wandb").stat().st_size <= 32768


@needs_wandb
def test_the_sink_logs_only_at_flush_each_record_at_its_step():
    from recipes.runner.training.trackers.wandb import WandbSink

    class Run:
        def __init__(self):
            self.logged = []

        def log(self, row):
            self.logged.append(row)

    run = Run()
    sink = WandbSink(run)
    sink.write(4, 1, 100.0, {"train/loss": 2.5, "train/lr": 0.1})
    sink.write(8, 1, 101.5, {"train/loss": 2.0, "train/lr": 0.2})
    assert run.logged == []  # nothing among the step's work
    sink.flush()
    sink.flush()  # nothing new: no call
    assert run.logged == [{"train/loss": 2.5, "train/lr": 0.1, "optimizer_step": 4},
                          {"train/loss": 2.0, "train/lr": 0.2, "optimizer_step": 8}]


@needs_wandb
def test_a_sink_that_fails_warns_once_then_drops_what_it_gets(capsys):
    from recipes.runner.training.trackers.wandb import WandbSink

    class BrokenRun:
        calls = 0

        def log(self, row):
            self.calls += 1
            raise ConnectionError("Connection refused\nsecond line")

    run = BrokenRun()
    sink = WandbSink(run)
    for step in range(3):
        sink.write(step, 1, 1.0, {"train/loss": 1.0})
        sink.flush()
    sink.close()
    assert run.calls == 1 and sink.failed
    assert capsys.readouterr().err.splitlines() == [
        "warning: W&B: logging failed (ConnectionError: Connection refused); the run goes on "
        "without W&B"]


@needs_wandb
@pytest.mark.parametrize(("status", "code"), [
    ("completed", 0), ("interrupted by SIGINT", 255), ("diverged", 1)])
def test_finish_ends_the_wandb_run_with_the_status_and_its_exit_code(tmp_path, monkeypatch,
                                                                    status, code):
    import wandb

    from recipes.runner.training.trackers.wandb import WandbTracker

    class Run:
        dir = str(tmp_path / "files")
        summary: dict = {}

        def finish(self, exit_code):
            self.exit_code = exit_code

    monkeypatch.setattr(wandb, "teardown", lambda: None)
    run = Run()
    WandbTracker(run, "offline").finish(status, {"curves.png": tmp_path / "missing.png"})
    assert run.exit_code == code and run.summary == {"status": status}
    assert not (tmp_path / "files").exists()  # a missing file is left out


@needs_wandb
def test_wandb_mode_set_by_the_user_wins_and_a_bad_one_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offlne")
    write_text(tmp_path / "corpus.txt")
    before = digests(tmp_path)
    one_error_line(train(tmp_path), capsys.readouterr().err, "WANDB_MODE='offlne'",
                   "offline, online, disabled")
    assert digests(tmp_path) == before and not (tmp_path / "run").exists()
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert train(tmp_path, "--epochs", "1") == 0
    assert not offline_runs(tmp_path / "run")
    assert "  wandb    run" not in capsys.readouterr().out  # nothing to upload: no line


@needs_wandb
def test_a_folder_that_cannot_be_written_exits_2_and_writes_nothing(tmp_path, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    write_text(tmp_path / "corpus.txt")
    before = digests(tmp_path)
    code = train(tmp_path, "--tracker-uri", str(blocker / "wandb-files"))
    one_error_line(code, capsys.readouterr().err, "--tracker wandb", "is not a folder")
    assert digests(tmp_path) == before and not (tmp_path / "run").exists()


def test_tracker_wandb_without_wandb_installed_exits_2_and_writes_nothing(
        tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    code = train(tmp_path)
    one_error_line(code, capsys.readouterr().err, "--tracker wandb", "pip install -e "
                   "'.[wandb]'")
    assert not (tmp_path / "run").exists()
