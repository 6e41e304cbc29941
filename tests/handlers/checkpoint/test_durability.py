"""What a killed process or a lost power supply cannot see: the order in which a save makes
its files durable, and the overwrite of a name that the ``last`` link still points at.

A killed process keeps the page cache, so a missing ``fsync`` shows in no kill test; only
the recorded order of the calls that make data and names durable does. A save that wrote
in place instead of to a temp file and a rename would destroy the checkpoint ``last.pt``
shares an inode with, but only when it overwrites an existing name, which a spike-guard
rollback does when it repeats a step number.
"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from ignite.engine import Engine
from torch import nn

import handlers.checkpoint.files as checkpoint_files
from engine.trainer import create_trainer
from handlers.atomic_write import current_umask, write_atomically
from handlers.checkpoint.checkpointer import Checkpointer
from handlers.checkpoint.formats import read_checkpoint
from handlers.goal import Goal

REPO_ROOT = Path(__file__).resolve().parents[3]
FOLDER = "<folder>"  # how the recorded calls name the checkpoint folder itself


def _checkpointer(dirname: Path, **kwargs) -> Checkpointer:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, optimizer, nn.CrossEntropyLoss())
    return Checkpointer(dirname, {"model": model, "optimizer": optimizer, "trainer": trainer},
                        run_id="run-a", **kwargs)


def _move_trainer_to(ckpt: Checkpointer, iteration: int, optimizer_step: int) -> None:
    """Script the trainer's position, as if it had run that far in a 10-iteration epoch."""
    state = ckpt.trainer.state
    state.epoch, state.epoch_length, state.max_epochs = 1, 10, 1
    state.iteration, state.optimizer_step = iteration, optimizer_step


class DurabilityCalls:
    """Records, in order, every fsync (naming the file or folder its descriptor was opened
    on), rename, replace, link and unlink, with names relative to the checkpoint folder and
    temp names without their random part (``.step-00000001.pt.tmp``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
        self.folder, self.calls = folder, []
        self._opened: dict[int, str] = {}  # descriptor -> what it was opened on, while open
        real = {name: getattr(os, name) for name in
                ("open", "fsync", "rename", "replace", "link", "unlink")}
        real_mkstemp = tempfile.mkstemp

        def mkstemp(*args, **kwargs):
            fd, path = real_mkstemp(*args, **kwargs)
            self._opened[fd] = self._name(path)
            return fd, path

        def open_(path, *args, **kwargs):
            fd = real["open"](path, *args, **kwargs)
            self._opened[fd] = self._name(path)
            return fd

        def fsync(fd):
            self.calls.append(("fsync", self._opened.get(fd, f"<fd {fd}>")))
            real["fsync"](fd)

        def renaming(name):
            def rename(source, destination, *args, **kwargs):
                self.calls.append((name, self._name(source), self._name(destination)))
                real[name](source, destination, *args, **kwargs)
            return rename

        def unlink(path, *args, **kwargs):
            if os.path.exists(path):  # not the temp-file clean-ups that find nothing left
                self.calls.append(("unlink", self._name(path)))
            real["unlink"](path, *args, **kwargs)

        monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
        for name, fake in (("open", open_), ("fsync", fsync), ("rename", renaming("rename")),
                           ("replace", renaming("replace")), ("link", renaming("link")),
                           ("unlink", unlink)):
            monkeypatch.setattr(os, name, fake)

    def _name(self, path: str | os.PathLike) -> str:
        path = Path(path)
        if path == self.folder:
            return FOLDER
        return re.sub(r"\.[^.]+\.tmp$", ".tmp", path.relative_to(self.folder).as_posix())


def _durable_write(name: str) -> list[tuple[str, ...]]:
    """``write_atomically``'s promise: the temp file's data is on disk before the rename
    makes it visible, and the rename is on disk (the folder fsynced) before anything else."""
    temp = f".{name}.tmp"
    return [("fsync", temp), ("replace", temp, name), ("fsync", FOLDER)]


def _switch(link: str, target: str) -> list[tuple[str, ...]]:
    return [("link", target, f".{link}.tmp"), ("replace", f".{link}.tmp", link)]


def test_a_save_makes_each_file_durable_before_its_name_and_the_links_before_eviction(
    tmp_path, monkeypatch
):
    ckpt = _checkpointer(tmp_path, keep_last=1)
    _move_trainer_to(ckpt, 1, 1)
    ckpt.save_last(ckpt.trainer)

    recorded = DurabilityCalls(monkeypatch, tmp_path)
    _move_trainer_to(ckpt, 2, 2)
    ckpt.save_last(ckpt.trainer)

    assert recorded.calls == [
        *_durable_write("step-00000002.pt"),
        *_durable_write("step-00000002.pt.json"),  # the sidecar commits the .pt: after it
        *_switch("last.pt", "step-00000002.pt"),
        *_switch("last.pt.json", "step-00000002.pt.json"),
        ("fsync", FOLDER),  # the switched links are durable before retention deletes
        ("unlink", "step-00000001.pt"),
        ("unlink", "step-00000001.pt.json"),
    ]


def test_a_best_save_makes_both_links_durable(tmp_path, monkeypatch):
    ckpt = _checkpointer(tmp_path, best=Goal("acc", "max"))
    _move_trainer_to(ckpt, 3, 3)
    evaluator = Engine(lambda engine, batch: None)
    evaluator.state.metrics = {"acc": 0.5}

    recorded = DurabilityCalls(monkeypatch, tmp_path)
    ckpt.save_best(evaluator)

    assert recorded.calls == [
        *_durable_write("best-step-00000003.pt"),
        *_durable_write("best-step-00000003.pt.json"),
        *_switch("last.pt", "best-step-00000003.pt"),
        *_switch("last.pt.json", "best-step-00000003.pt.json"),
        *_switch("best.pt", "best-step-00000003.pt"),
        *_switch("best.pt.json", "best-step-00000003.pt.json"),
        ("fsync", FOLDER),
    ]


def overwrite_step_2_and_crash_mid_write(dirname: str) -> None:
    """Saves at step 1 and 2, then at iteration 3 still at step 2 (as after a spike-guard
    rollback), which rewrites ``step-00000002.pt``: run in a child process with
    ``CKPT_TEST_CRASH_PHASE=mid_write:3`` it dies with that file half written."""
    ckpt = _checkpointer(Path(dirname))
    for iteration, optimizer_step in ((1, 1), (2, 2), (3, 2)):
        _move_trainer_to(ckpt, iteration, optimizer_step)
        with torch.no_grad():
            ckpt.to_save["model"].weight.fill_(iteration)
        ckpt.save_last(ckpt.trainer)


def test_a_crash_while_overwriting_the_name_last_points_at_leaves_last_verifying(tmp_path):
    script = ("import sys; sys.path.insert(0, 'tests/handlers/checkpoint'); "
              "import test_durability as t; "
              f"t.overwrite_step_2_and_crash_mid_write({str(tmp_path)!r})")
    env = {**os.environ, "CKPT_TEST_CRASH_PHASE": "mid_write:3"}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, timeout=300)
    assert done.returncode == 137

    assert (tmp_path / "last.pt").samefile(tmp_path / "step-00000002.pt")
    last = read_checkpoint(tmp_path / "last.pt", expected_run_id="run-a")
    assert last["meta"]["iteration"] == 2
    assert torch.equal(last["model"]["weight"], torch.full((2, 4), 2.0))

    resumed = _checkpointer(tmp_path)
    info = resumed.resume("auto")
    assert (info.path.name, info.meta["iteration"], info.rejected) == ("last.pt", 2, [])
    assert not [path for path in tmp_path.iterdir()
                if checkpoint_files.TEMP_NAME.match(path.name)]  # the resume removed it


class PhaseRecorder:
    """Stands in for ``CrashPoints``: adds each crash phase a save reaches, and each save
    start, to the recorded durability calls, so that a phase is seen where it sits."""

    def __init__(self, calls: list[tuple[str, ...]]) -> None:
        self.calls = calls

    def save_started(self) -> None:
        self.calls.append(("save_started",))

    def reach(self, phase: str) -> None:
        self.calls.append(("phase", phase))


def test_each_crash_phase_of_a_save_is_reached_where_its_name_says(tmp_path, monkeypatch):
    """The kill tests stop a save at a named phase; one reached elsewhere, or never, would
    test another crash than the one they name."""
    ckpt = _checkpointer(tmp_path, keep_last=1)
    _move_trainer_to(ckpt, 1, 1)
    ckpt.save_last(ckpt.trainer)

    recorded = DurabilityCalls(monkeypatch, tmp_path)
    ckpt._crash = PhaseRecorder(recorded.calls)
    _move_trainer_to(ckpt, 2, 2)
    ckpt.save_last(ckpt.trainer)

    def phased_write(name: str) -> list[tuple[str, ...]]:
        temp = f".{name}.tmp"
        return [("phase", "before_temp"), ("phase", "mid_write"), ("fsync", temp),
                ("phase", "before_rename"), ("replace", temp, name),
                ("phase", "before_dir_fsync"), ("fsync", FOLDER)]

    assert recorded.calls == [
        ("save_started",),
        *phased_write("step-00000002.pt"),
        ("phase", "before_sidecar"),
        *_durable_write("step-00000002.pt.json"),  # the write phases are the .pt's
        ("phase", "before_link"),
        *_switch("last.pt", "step-00000002.pt"),
        *_switch("last.pt.json", "step-00000002.pt.json"),
        ("fsync", FOLDER),
        ("unlink", "step-00000001.pt"),
        ("phase", "during_eviction"),
        ("unlink", "step-00000001.pt.json"),
    ]


def test_each_crash_phase_of_a_save_behind_training_is_reached_where_its_name_says(
        tmp_path, monkeypatch):
    """Written behind training, a save reaches the same phases in the same order on its
    background thread, after two of its own; the run's end reaches ``final_wait`` only
    while a save is in flight."""
    ckpt = _checkpointer(tmp_path, keep_last=1, asynchronous=True)
    _move_trainer_to(ckpt, 1, 1)
    ckpt.save_last(ckpt.trainer)
    ckpt.wait()

    recorded = DurabilityCalls(monkeypatch, tmp_path)
    ckpt._crash = PhaseRecorder(recorded.calls)
    _move_trainer_to(ckpt, 2, 2)
    ckpt.save_last(ckpt.trainer)
    ckpt.wait()
    ckpt.wait_handler(ckpt.trainer)  # nothing in flight
    phases = [call[1] for call in recorded.calls if call[0] == "phase"]
    assert phases == ["after_copy", "background_start", "before_temp", "mid_write",
                      "before_rename", "before_dir_fsync", "before_sidecar", "before_link",
                      "during_eviction"]
    assert recorded.calls[:3] == [("save_started",), ("phase", "after_copy"),
                                  ("phase", "background_start")]

    _move_trainer_to(ckpt, 3, 3)
    ckpt.save_last(ckpt.trainer)
    ckpt.wait_handler(ckpt.trainer)  # the run's end, the save in flight
    assert recorded.calls.count(("phase", "final_wait")) == 1


def test_a_write_without_crash_points_replaces_the_file_whole_with_its_mode(tmp_path):
    """config.json and summary.json are written with no fault injection at all."""
    target = tmp_path / "config.json"
    target.write_text("old")
    write_atomically(target, lambda file: file.write(b"new"), file_mode=0o640)
    assert target.read_text() == "new" and target.stat().st_mode & 0o777 == 0o640
    assert os.listdir(tmp_path) == ["config.json"]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_write_without_a_mode_honours_the_umask_as_open_does(tmp_path, umask, mode):
    """The default mode: run files (exports, JSON, caches) as a plain ``open`` creates them,
    so an exported model can be read by another account where the umask allows it."""
    target = tmp_path / "model.onnx"
    before = os.umask(umask)
    try:
        assert current_umask() == umask
        write_atomically(target, lambda file: file.write(b"new"))
        with open(tmp_path / "plain", "w"):
            pass
    finally:
        os.umask(before)
    assert target.stat().st_mode & 0o777 == mode == (tmp_path / "plain").stat().st_mode & 0o777
