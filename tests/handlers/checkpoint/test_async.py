"""Saves written behind training (``Checkpointer(asynchronous=True)``): the step waits for a
copy of the state only, one save is in flight at a time, the checkpoints are those a
synchronous save writes, a disk error behind training is raised by the next save or
``wait()``, and the run's end (stopped or not) commits the last save before it returns.
The kills at each phase, the new ones included, are test_failures.py's and test_sharded.py's."""

import os
import threading
from pathlib import Path

import pytest
import torch
from ignite.engine import Events
from torch import nn

from handlers.checkpoint.background import StagedCopies
from handlers.checkpoint.files import CheckpointError
from handlers.checkpoint.formats import read_checkpoint
from tests.handlers.checkpoint.checkpoint_run import (
    DATA,
    _build,
    _enospc,
    _move_trainer_to,
    _names,
    _run_until_killed,
    _save_every_step,
)

HOLD_SEC = 30  # how long a held write waits for its release before the test fails


class HeldWrites:
    """Stands in for the format's ``write``: each write waits until ``release`` is set, and
    its start and end are logged, so a test sees what a save waited for."""

    def __init__(self, real) -> None:
        self.real, self.release, self.log = real, threading.Event(), []

    def __call__(self, path: Path, *args, **kwargs) -> None:
        self.log.append(("start", path.name))
        assert self.release.wait(HOLD_SEC), "the held write was never released"
        self.real(path, *args, **kwargs)
        self.log.append(("end", path.name))

    def release_after(self, seconds: float) -> None:
        threading.Timer(seconds, self.release.set).start()


def _held(run) -> HeldWrites:
    held = HeldWrites(run.ckpt.format.write)
    run.ckpt.format.write = held
    return held


def test_a_save_returns_before_its_write_and_the_next_save_waits_for_it(tmp_path):
    run = _build(tmp_path, asynchronous=True)
    held = _held(run)
    _move_trainer_to(run, 1)
    run.ckpt.save_last(run.trainer)  # returns while its write is held
    assert held.log in ([], [("start", "step-00000001.pt")])
    assert not (tmp_path / "last.pt").exists()

    held.release_after(0.3)
    _move_trainer_to(run, 2)
    run.ckpt.save_last(run.trainer)  # waits for step 1's write and commit first
    assert held.log[:2] == [("start", "step-00000001.pt"), ("end", "step-00000001.pt")]
    assert read_checkpoint(tmp_path / "step-00000001.pt")["meta"]["iteration"] == 1
    run.ckpt.wait()
    assert held.log[2:] == [("start", "step-00000002.pt"), ("end", "step-00000002.pt")]
    assert read_checkpoint(tmp_path / "last.pt")["meta"]["iteration"] == 2


def test_a_save_holds_the_state_of_its_step_while_training_changes_the_live_tensors(tmp_path):
    run = _build(tmp_path, asynchronous=True)
    held = _held(run)
    _move_trainer_to(run, 1)
    saved = {name: tensor.clone() for name, tensor in run.model.state_dict().items()}
    run.ckpt.save_last(run.trainer)
    with torch.no_grad():  # the next steps, while the write is held
        for parameter in run.model.parameters():
            parameter.mul_(-2.0)
    held.release.set()
    run.ckpt.wait()
    written = read_checkpoint(tmp_path / "last.pt")["model"]
    assert all(torch.equal(written[name], tensor) for name, tensor in saved.items())


def _payloads(dirname: Path, asynchronous: bool) -> dict[str, dict]:
    """Every checkpoint three saved steps leave, without the time in their meta."""
    run = _save_every_step(_build(dirname, keep_last=3, asynchronous=asynchronous))
    run.trainer.run(DATA[:3], max_epochs=1)
    run.ckpt.wait()
    payloads = {}
    for path in sorted(dirname.glob("*.pt")):
        payload = read_checkpoint(path)
        del payload["meta"]["saved_at_unix"]
        payloads[path.name] = payload
    return payloads


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _same(a[key], b[key]) for key in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b and type(a) is type(b)


def test_saves_behind_training_write_the_checkpoints_a_synchronous_save_writes(tmp_path):
    written = _payloads(tmp_path / "sync", False)
    behind = _payloads(tmp_path / "async", True)
    assert list(written) == ["last.pt", "step-00000001.pt", "step-00000002.pt",
                             "step-00000003.pt"]
    assert list(behind) == list(written)
    for name, payload in written.items():
        assert _same(behind[name], payload), name
    assert _names(tmp_path / "async") == _names(tmp_path / "sync")


@pytest.mark.parametrize("raised_by", ["the next save", "wait"])
def test_a_disk_error_behind_training_is_raised_as_a_synchronous_save_raises_it(
        tmp_path, monkeypatch, raised_by):
    run = _build(tmp_path, asynchronous=True)
    _move_trainer_to(run, 1)
    run.ckpt.save_last(run.trainer)
    run.ckpt.wait()
    state_before = run.ckpt.state_dict()

    _move_trainer_to(run, 2)
    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", _enospc)
        run.ckpt.save_last(run.trainer)  # returns: the write fails behind training
        with pytest.raises(CheckpointError,
                           match="step-00000002.pt: could not save: .*No space left on device"):
            if raised_by == "wait":
                run.ckpt.wait()
            else:
                _move_trainer_to(run, 3)
                run.ckpt.save_last(run.trainer)
    assert not [path for path in tmp_path.iterdir() if path.name.endswith(".tmp")]
    assert read_checkpoint(tmp_path / "last.pt", expected_run_id="run-a")["meta"]["iteration"] == 1
    assert not (tmp_path / "step-00000002.pt.json").exists()
    assert run.ckpt.state_dict() == state_before
    run.ckpt.wait()  # raised once: nothing is in flight any more

    _move_trainer_to(run, 4)  # the disk is fine again: saving goes on
    run.ckpt.save_last(run.trainer)
    run.ckpt.wait()
    assert read_checkpoint(tmp_path / "last.pt")["meta"]["iteration"] == 4


def _attached(tmp_path: Path):
    run = _build(tmp_path, asynchronous=True, save_every=1, keep_last=1)
    run.ckpt.attach(run.trainer)
    return run, _held(run)


def test_the_runs_end_commits_the_save_still_being_written(tmp_path):
    run, held = _attached(tmp_path)
    held.release_after(0.3)
    run.trainer.run(DATA[:3], max_epochs=1)
    assert held.log[-1] == ("end", "step-00000003.pt")
    assert read_checkpoint(tmp_path / "last.pt")["meta"]["iteration"] == 3


def test_a_stopped_run_commits_its_stop_save_before_the_run_returns(tmp_path):
    """As a graceful stop or a budget does: settle the step, save, then ``terminate()``."""
    run, held = _attached(tmp_path)
    held.release.set()

    def stop(engine) -> None:
        if engine.state.iteration == 2:
            held.release.clear()  # step 2's write is held
            held.release_after(0.3)
            engine.settle()  # the step and its counters (its OPTIMIZER_STEP saves it)
            run.ckpt.last_handler(engine)  # step 2 is in flight already: nothing more
            engine.terminate()

    run.trainer.add_event_handler(Events.ITERATION_COMPLETED, stop)
    run.trainer.run(DATA[:3], max_epochs=1)
    assert held.log[-1] == ("end", "step-00000002.pt")
    assert read_checkpoint(tmp_path / "last.pt")["meta"]["iteration"] == 2


def test_a_process_killed_while_its_end_waits_for_a_save_resumes_from_a_complete_one(tmp_path):
    """Killed wherever the last save's write had got: step 2 is still ``last``, or step 3
    is committed (linked or not yet)."""
    _run_until_killed(tmp_path, "final_wait:3", asynchronous=True)
    run = _build(tmp_path, seed=5, keep_last=1)
    info = run.ckpt.resume("auto")
    assert (info.path.name, info.meta["iteration"]) in {
        ("last.pt", 2), ("step-00000003.pt", 3), ("last.pt", 3)}
    assert not [path for path in tmp_path.iterdir() if path.name.endswith(".tmp")]


def test_the_copy_shares_what_the_state_shares_and_nothing_with_the_live_tensors():
    weight = nn.Parameter(torch.arange(6.0).reshape(2, 3))
    state = {"embedding": weight.detach(), "head": weight.detach(), "row": weight.detach()[1],
             "parameter": weight, "sizes": [torch.Size([2, 3]), ("a", 1)]}
    staged = StagedCopies()
    copied = staged.copy(state)
    with torch.no_grad():
        weight.zero_()
    assert torch.equal(copied["embedding"], torch.arange(6.0).reshape(2, 3))
    assert copied["embedding"].untyped_storage().data_ptr() == copied["head"].untyped_storage(
        ).data_ptr() == copied["row"].untyped_storage().data_ptr()
    assert torch.equal(copied["row"], torch.tensor([3.0, 4.0, 5.0]))
    assert type(copied["parameter"]) is nn.Parameter and copied["parameter"].requires_grad
    assert copied["sizes"] == state["sizes"] and copied["sizes"] is not state["sizes"]


def test_the_next_copy_refills_the_same_buffers_and_frees_those_left_unused():
    """The buffers are kept from save to save (a copy into mapped memory is faster); a
    storage the state no longer holds (an optimizer state replaced) lets its buffer go."""
    kept, dropped = torch.zeros(4), torch.zeros(3)
    staged = StagedCopies()
    first = staged.copy({"kept": kept, "dropped": dropped})
    kept.fill_(1.0)
    second = staged.copy({"kept": kept})
    assert second["kept"].untyped_storage().data_ptr() == first["kept"].untyped_storage(
        ).data_ptr()
    assert torch.equal(second["kept"], torch.ones(4))
    assert len(staged._buffers) == 1
