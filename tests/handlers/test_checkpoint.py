import ast
import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from ignite.engine import Engine, Events
from torch import nn

import handlers.checkpoint as checkpoint_module
import handlers.checkpoint_files as checkpoint_files_module
import handlers.sharded_checkpoint as sharded_checkpoint_module
from engine import Trainer, TrainEvents, create_trainer
from engine.run_state import RngState
from handlers.checkpoint import Checkpointer, CheckpointError, read_checkpoint
from handlers.goal import Goal
from handlers.jsonl_sink import JsonLinesSink

REPO_ROOT = Path(__file__).resolve().parents[2]


def _batches(n_batches: int, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=generator), torch.randint(0, 3, (4,), generator=generator))
            for _ in range(n_batches)]


DATA = _batches(4)


@dataclass
class Run:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    trainer: Trainer
    ckpt: Checkpointer


def _build(dirname, seed=0, run_id="run-a", with_rng=True, **ckpt_kwargs) -> Run:
    """A tiny model whose Dropout makes the result depend on torch's global RNG."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = create_trainer(model, optimizer, nn.CrossEntropyLoss())
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer}
    if with_rng:
        to_save["rng"] = RngState()
    ckpt = Checkpointer(dirname, to_save, run_id=run_id, **ckpt_kwargs)
    return Run(model, optimizer, trainer, ckpt)


def _save_every_step(run: Run) -> Run:
    run.trainer.add_event_handler(TrainEvents.OPTIMIZER_STEP(every=1), run.ckpt.save_last)
    run.trainer.add_event_handler(Events.EPOCH_COMPLETED, run.ckpt.save_last)
    return run


def _move_trainer_to(run: Run, step: int) -> None:
    """Script the trainer's position, as if it had run ``step`` iterations and steps."""
    run.trainer.state.iteration = run.trainer.state.optimizer_step = step


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def _names(dirname: Path) -> set[str]:
    return {path.name for path in dirname.iterdir()}


# Exact resume


def test_one_epoch_then_resume_then_one_epoch_is_bit_identical_to_two_epochs(tmp_path):
    straight = _build(tmp_path / "straight")
    straight.trainer.run(DATA, max_epochs=2)

    first = _build(tmp_path / "ckpt")
    first.trainer.add_event_handler(Events.EPOCH_COMPLETED, first.ckpt.save_last)
    first.trainer.run(DATA, max_epochs=1)

    resumed = _build(tmp_path / "ckpt", seed=99)  # other weights and RNG until resumed
    info = resumed.ckpt.resume("auto")
    assert info.path.name == "last.pt" and info.rejected == []
    assert (resumed.trainer.state.epoch, resumed.trainer.state.iteration) == (1, len(DATA))
    resumed.trainer.run(DATA, max_epochs=2)

    for name, tensor in straight.model.state_dict().items():
        assert torch.equal(tensor, resumed.model.state_dict()[name]), name

    # The control: without the RNG state the dropout masks differ, and so do the weights.
    no_rng = _build(tmp_path / "ckpt", seed=99, with_rng=False)
    no_rng.ckpt.resume("auto")
    no_rng.trainer.run(DATA, max_epochs=2)
    assert not torch.equal(straight.model[0].weight, no_rng.model[0].weight)


# Layout, retention, links, modes


def test_history_keeps_the_last_n_and_last_pt_is_the_newest(tmp_path, monkeypatch):
    saves = []
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f: saves.append(1) or real_save(obj, f))
    run = _save_every_step(_build(tmp_path, keep_last=2, config={"lr": 0.1, "tags": ["a"]}))
    run.trainer.run(DATA[:3], max_epochs=1)
    run.trainer.run(DATA[:3], max_epochs=2)  # 6 steps; each epoch end is the step just saved

    assert len(saves) == 6
    assert _names(tmp_path) == {"step-00000005.pt", "step-00000005.pt.json", "step-00000006.pt",
                                "step-00000006.pt.json", "last.pt", "last.pt.json"}
    assert (tmp_path / "last.pt").samefile(tmp_path / "step-00000006.pt")
    assert (tmp_path / "last.pt.json").samefile(tmp_path / "step-00000006.pt.json")
    loaded = torch.load(tmp_path / "last.pt", weights_only=True)
    for name, tensor in run.model.state_dict().items():
        assert torch.equal(loaded["model"][name], tensor)
    meta = loaded["meta"]
    position = (meta["epoch"], meta["iteration"], meta["optimizer_step"])
    assert (meta["run_id"], meta["kind"], position) == ("run-a", "last", (2, 6, 6))
    assert meta["config"] == {"lr": 0.1, "tags": ["a"]} and meta["format_version"] == 1
    sidecar = json.loads((tmp_path / "last.pt.json").read_text())
    assert sidecar["sha256"] == hashlib.sha256((tmp_path / "last.pt").read_bytes()).hexdigest()
    assert sidecar["size_bytes"] == (tmp_path / "last.pt").stat().st_size
    for path in tmp_path.iterdir():
        assert path.stat().st_mode & 0o777 == 0o640, path


def test_file_mode_0600_is_applied(tmp_path):
    run = _build(tmp_path, file_mode=0o600)
    _move_trainer_to(run, 1)
    run.ckpt.save_last(run.trainer)
    assert {path.stat().st_mode & 0o777 for path in tmp_path.iterdir()} == {0o600}


def _evaluate(run: Run, step: int, score: float, metric: str = "acc") -> None:
    """A scripted evaluation at ``step``; the model's first weight is tagged with the step."""
    _move_trainer_to(run, step)
    with torch.no_grad():
        run.model[0].weight[0, 0] = step
    evaluator = Engine(lambda engine, batch: None)
    evaluator.state.metrics = {metric: score}
    run.ckpt.save_best(evaluator)


def test_best_keeps_the_top_k_and_best_pt_is_the_best(tmp_path, caplog):
    run = _build(tmp_path, keep_best=2, best=Goal("acc", "max"))
    with caplog.at_level(logging.WARNING, logger="handlers.checkpoint"):
        for step, score in enumerate([0.1, 0.5, 0.3, float("nan"), 0.7, 0.2, 0.5], start=1):
            _evaluate(run, step, score)

    assert "acc=nan is not finite" in caplog.text
    assert sorted(name for name in _names(tmp_path) if name.startswith("best-")) == [
        "best-step-00000002.pt", "best-step-00000002.pt.json",
        "best-step-00000005.pt", "best-step-00000005.pt.json",
    ]  # step 7 ties with step 2 and ranks below it
    assert (tmp_path / "best.pt").samefile(tmp_path / "best-step-00000005.pt")
    assert (tmp_path / "last.pt").samefile(tmp_path / "best-step-00000005.pt")  # newest written
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    assert best["model"]["0.weight"][0, 0] == 5
    assert best["meta"]["metric"] == {"name": "acc", "value": 0.7}
    assert [entry["score"] for entry in run.ckpt.state_dict()["best"]] == [0.7, 0.5]


def test_mode_min_and_a_nan_first_score_is_never_best(tmp_path):
    run = _build(tmp_path, best=Goal("loss", "min"))
    _evaluate(run, 1, float("nan"), metric="loss")
    assert not list(tmp_path.iterdir())
    for step, score in [(2, 3.0), (3, 1.0), (4, 2.0)]:
        _evaluate(run, step, score, metric="loss")
    assert read_checkpoint(tmp_path / "best.pt")["meta"]["optimizer_step"] == 3
    assert not (tmp_path / "best-step-00000002.pt").exists()


def test_retention_and_best_tracking_survive_a_resume(tmp_path):
    run = _save_every_step(_build(tmp_path, keep_last=2, best=Goal("acc", "max")))
    run.trainer.run(DATA[:3], max_epochs=1)
    evaluator = Engine(lambda engine, batch: None)
    evaluator.state.metrics = {"acc": 0.9}
    run.ckpt.save_best(evaluator)  # best at step 3, after last saved it: a new, newer file

    resumed = _save_every_step(_build(tmp_path, seed=5, keep_last=2, best=Goal("acc", "max")))
    assert resumed.ckpt.resume("auto").path.name == "last.pt"
    assert resumed.ckpt.state_dict() == run.ckpt.state_dict()
    resumed.trainer.run(DATA[:3], max_epochs=2)
    evaluator.state.metrics = {"acc": 0.8}  # worse than the best before the resume
    resumed.ckpt.save_best(evaluator)

    assert _names(tmp_path) == {"step-00000005.pt", "step-00000005.pt.json", "step-00000006.pt",
                                "step-00000006.pt.json", "best-step-00000003.pt",
                                "best-step-00000003.pt.json", "best.pt", "best.pt.json",
                                "last.pt", "last.pt.json"}


def test_a_save_at_the_iteration_just_saved_is_skipped(tmp_path):
    run = _build(tmp_path)
    _move_trainer_to(run, 4)
    run.ckpt.save_last(run.trainer)
    first = (tmp_path / "last.pt").stat().st_ino
    run.ckpt.save_last(run.trainer)
    assert (tmp_path / "last.pt").stat().st_ino == first


def test_after_a_resume_a_save_at_the_resumed_iteration_is_skipped_for_last_and_best(tmp_path):
    run = _save_every_step(_build(tmp_path, best=Goal("acc", "max")))
    run.trainer.run(DATA[:3], max_epochs=1)
    evaluator = Engine(lambda engine, batch: None)
    evaluator.state.metrics = {"acc": 0.9}
    run.ckpt.save_best(evaluator)
    inodes = {name: (tmp_path / name).stat().st_ino for name in ("last.pt", "best.pt")}

    resumed = _build(tmp_path, seed=5, best=Goal("acc", "max"))
    resumed.ckpt.resume("auto")
    resumed.ckpt.save_last(resumed.trainer)
    evaluator.state.metrics = {"acc": 0.95}  # better, but the iteration was saved as best
    resumed.ckpt.save_best(evaluator)
    assert {name: (tmp_path / name).stat().st_ino for name in inodes} == inodes


def test_the_checkpointers_state_dict_carries_the_iterations_it_saved_last_and_best(tmp_path):
    run = _build(tmp_path, best=Goal("acc", "max"))
    _move_trainer_to(run, 2)
    run.ckpt.save_last(run.trainer)
    _evaluate(run, 3, 0.5)  # a best save is also the newest save
    state = run.ckpt.state_dict()
    assert (state["last_iteration"], state["best_iteration"]) == (3, 3)


def test_each_checkpoint_records_whether_it_was_saved_as_last_or_as_best_and_its_score(tmp_path):
    run = _build(tmp_path, best=Goal("acc", "max"))
    _move_trainer_to(run, 2)
    run.ckpt.save_last(run.trainer)
    _move_trainer_to(run, 3)
    _evaluate(run, 3, 0.5)
    metas = {name: read_checkpoint(tmp_path / name)["meta"]
             for name in ("step-00000002.pt", "best-step-00000003.pt")}
    assert {name: (meta["kind"], meta["metric"]) for name, meta in metas.items()} == {
        "step-00000002.pt": ("last", None),
        "best-step-00000003.pt": ("best", {"name": "acc", "value": 0.5})}


class Interrupted(BaseException):
    """Stops a save where a kill would, without being caught as an OSError."""


class InterruptAt:
    """Stands in for ``CrashPoints``: interrupts the save at ``phase``."""

    def __init__(self, phase: str) -> None:
        self.phase = phase

    def save_started(self) -> None:
        pass

    def reach(self, phase: str) -> None:
        if phase == self.phase:
            raise Interrupted(phase)


def test_a_resume_finishes_the_eviction_an_interrupted_save_left_halfway(tmp_path):
    run = _build(tmp_path, keep_last=1)
    state = run.trainer.state
    state.epoch, state.epoch_length, state.max_epochs = 1, 10, 1
    _move_trainer_to(run, 1)
    run.ckpt.save_last(run.trainer)
    run.ckpt._crash = InterruptAt("during_eviction")
    _move_trainer_to(run, 2)
    with pytest.raises(Interrupted):
        run.ckpt.save_last(run.trainer)  # step 1's .pt deleted, its sidecar not yet
    assert "step-00000001.pt.json" in _names(tmp_path)

    _build(tmp_path, seed=5, keep_last=1).ckpt.resume("auto")
    assert {name for name in _names(tmp_path) if name.startswith("step-")} == {
        "step-00000002.pt", "step-00000002.pt.json"}


def test_a_first_save_interrupted_before_its_sidecar_leaves_a_fresh_start(tmp_path):
    run = _build(tmp_path)
    _move_trainer_to(run, 1)
    run.ckpt._crash = InterruptAt("before_sidecar")
    with pytest.raises(Interrupted):
        run.ckpt.save_last(run.trainer)
    assert _names(tmp_path) == {"step-00000001.pt"}  # never committed
    assert _build(tmp_path, seed=5).ckpt.resume() is None  # the default source is "auto"


def test_a_checkpoint_from_another_folder_restores_the_run_but_not_its_retention(tmp_path):
    run = _save_every_step(_build(tmp_path / "a", keep_last=2))
    run.trainer.run(DATA[:3], max_epochs=1)

    other = _build(tmp_path / "b", seed=5, keep_last=2)
    info = other.ckpt.resume(tmp_path / "a" / "last.pt")
    assert info.rejected == [] and other.trainer.state.iteration == 3
    assert other.ckpt.state_dict()["history"] == []  # "a"'s files are not "b"'s to evict


def test_a_checkpoint_entry_this_run_does_not_restore_is_named_in_a_warning(tmp_path, caplog):
    run = _save_every_step(_build(tmp_path, with_rng=True))
    run.trainer.run(DATA[:1], max_epochs=1)
    with caplog.at_level(logging.WARNING, logger="handlers.checkpoint"):
        _build(tmp_path, seed=5, with_rng=False).ckpt.resume("auto")
    assert "also holds ['rng'], which this run does not restore" in caplog.text


def test_a_checkpointer_state_without_its_keys_is_refused_naming_them(tmp_path):
    with pytest.raises(ValueError, match=r"checkpointer state is missing "
                                         r"\['best', 'best_iteration', 'evict'"):
        _build(tmp_path).ckpt.load_state_dict({"history": []})


# Verification and fallback on resume


def _three_saves(dirname: Path) -> Run:
    run = _save_every_step(_build(dirname, keep_last=3))
    run.trainer.run(DATA[:3], max_epochs=1)
    return run


def _truncate_to_zero(path: Path) -> None:
    path.write_bytes(b"")


def _truncate_to_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _append_junk(path: Path) -> None:
    with open(path, "ab") as file:
        file.write(b"junk")


def _garble_sidecar(path: Path) -> None:
    path.with_name(path.name + ".json").write_text("{not json")  # last.pt.json is the same file


def _remove_sidecars(path: Path) -> None:
    path.with_name(path.name + ".json").unlink()
    (path.parent / "last.pt.json").unlink()


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (_truncate_to_zero, "truncated (0 bytes)"),
        (_truncate_to_half, "truncated ("),
        (_flip_a_byte, "checksum mismatch"),
        (_append_junk, "checksum mismatch ("),
        (_remove_sidecars, "no checksum sidecar"),
        (_garble_sidecar, "unreadable sidecar"),
    ],
)
def test_a_bad_newest_checkpoint_is_named_and_the_previous_one_loaded(tmp_path, caplog, corrupt,
                                                                       reason):
    _three_saves(tmp_path)
    step_2 = torch.load(tmp_path / "step-00000002.pt", weights_only=True)
    corrupt(tmp_path / "step-00000003.pt")  # last.pt is the same file (a hard link)

    resumed = _build(tmp_path, seed=5)
    with caplog.at_level(logging.WARNING, logger="handlers.checkpoint"):
        info = resumed.ckpt.resume("auto")

    assert info.path.name == "step-00000002.pt"
    assert [Path(name).name for name, _ in info.rejected] == ["last.pt", "step-00000003.pt"]
    assert all(why.startswith(reason) for _, why in info.rejected), info.rejected
    assert f"step-00000003.pt rejected: {reason}" in caplog.text
    assert resumed.trainer.state.iteration == 2
    for name, tensor in resumed.model.state_dict().items():
        assert torch.equal(tensor, step_2["model"][name])


def test_a_checkpoint_from_another_run_is_refused_naming_it(tmp_path):
    _three_saves(tmp_path)
    other = _build(tmp_path, run_id="run-b")
    _move_trainer_to(other, 10)
    other.ckpt.save_last(other.trainer)  # newer, intact, and last.pt now points at it

    info = _build(tmp_path, seed=5).ckpt.resume("auto")
    assert info.path.name == "step-00000003.pt"
    assert [Path(name).name for name, _ in info.rejected] == ["last.pt", "step-00000010.pt"]
    assert all(why.startswith("from another run run-b") for _, why in info.rejected)


def test_no_good_checkpoint_raises_with_every_reason(tmp_path):
    _three_saves(tmp_path)
    for path in tmp_path.glob("step-*.pt"):
        _truncate_to_zero(path)
    with pytest.raises(CheckpointError, match=r"no usable checkpoint \(last.pt: truncated"):
        _build(tmp_path).ckpt.resume("auto")


def test_never_and_an_empty_folder_load_nothing(tmp_path):
    _three_saves(tmp_path / "full")
    run = _build(tmp_path / "full", seed=5)
    before = _weights(run.model)
    assert run.ckpt.resume("never") is None
    assert all(torch.equal(before[name], t) for name, t in run.model.state_dict().items())
    assert _build(tmp_path / "empty").ckpt.resume("auto") is None


def test_an_explicit_path_loads_exactly_that_file_or_raises(tmp_path):
    _three_saves(tmp_path)
    run = _build(tmp_path, seed=5)
    info = run.ckpt.resume(tmp_path / "step-00000001.pt")
    assert info.meta["iteration"] == run.trainer.state.iteration == 1
    _flip_a_byte(tmp_path / "step-00000002.pt")
    with pytest.raises(CheckpointError, match="step-00000002.pt: checksum mismatch"):
        run.ckpt.resume(tmp_path / "step-00000002.pt")


def test_another_runs_file_loads_when_asked_and_retention_starts_fresh(tmp_path):
    _three_saves(tmp_path / "a")
    run = _build(tmp_path / "b", run_id="run-b", seed=5)
    with pytest.raises(CheckpointError, match="from another run run-a"):
        run.ckpt.resume(tmp_path / "a" / "last.pt")
    info = run.ckpt.resume(tmp_path / "a" / "last.pt", require_same_run=False)
    assert info.meta["run_id"] == "run-a" and run.trainer.state.iteration == 3
    assert run.ckpt.state_dict()["history"] == []


class _WritesAFileWhenUnpickled:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_pickle_payload_does_not_run_and_is_rejected(tmp_path):
    _three_saves(tmp_path)
    marker = tmp_path.parent / f"{tmp_path.name}-pwned"
    evil = tmp_path / "step-00000099.pt"
    payload = torch.load(tmp_path / "last.pt", weights_only=True)
    payload["model"]["extra"] = _WritesAFileWhenUnpickled(marker)
    torch.save(payload, evil)
    sidecar = {"format_version": 1, "run_id": "run-a", "iteration": 99, "optimizer_step": 99,
               "size_bytes": evil.stat().st_size,
               "sha256": hashlib.sha256(evil.read_bytes()).hexdigest()}
    evil.with_name(evil.name + ".json").write_text(json.dumps(sidecar))

    info = _build(tmp_path, seed=5).ckpt.resume("auto")
    assert info.path.name == "last.pt"
    assert info.rejected[0][0].endswith("step-00000099.pt")
    assert info.rejected[0][1].startswith("not a checkpoint:")
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(evil, weights_only=True)
    assert not marker.exists()
    torch.load(evil, weights_only=False)  # the control: the payload is live
    assert marker.exists()


def test_state_that_would_not_load_weights_only_is_refused_at_save_time(tmp_path):
    class Opaque:
        def state_dict(self):
            return {"callback": print}

        def load_state_dict(self, state):
            pass

    run = _build(tmp_path)
    run.ckpt.to_save["opaque"] = Opaque()
    _move_trainer_to(run, 1)
    with pytest.raises(CheckpointError, match=r"\['opaque'\]\['callback'\] is a builtin_function"):
        run.ckpt.save_last(run.trainer)
    assert not list(tmp_path.iterdir())


# Refusing bad weights, surviving bad disks


def test_non_finite_weights_are_never_saved(tmp_path, caplog):
    run = _build(tmp_path, best=Goal("acc", "max"))
    _move_trainer_to(run, 1)
    run.ckpt.save_last(run.trainer)
    with torch.no_grad():
        run.model[3].bias[1] = float("inf")
    with caplog.at_level(logging.WARNING, logger="handlers.checkpoint"):
        _move_trainer_to(run, 2)
        run.ckpt.save_last(run.trainer)
        evaluator = Engine(lambda engine, batch: None)
        evaluator.state.metrics = {"acc": 1.0}
        run.ckpt.save_best(evaluator)
    assert "model tensor '3.bias' is not finite" in caplog.text
    assert _names(tmp_path) == {"step-00000001.pt", "step-00000001.pt.json", "last.pt",
                                "last.pt.json"}


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _read_only(*args, **kwargs):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS))


def _permission_denied(*args, **kwargs):
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))


def _zip_writer_failure(*args, **kwargs):
    """What torch.save raises when a write fails under its zip writer (a full disk, a
    file-size limit): a RuntimeError, not an OSError."""
    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


@pytest.mark.parametrize(
    ("module", "name", "failure", "reason"),
    [
        (torch, "save", _enospc, "No space left on device"),
        (torch, "save", _zip_writer_failure, "inline_container.cc"),
        (os, "fsync", _enospc, "No space left on device"),
        (os, "replace", _read_only, "Read-only file system"),
        (tempfile, "mkstemp", _permission_denied, "Permission denied"),
        (os, "link", _enospc, "No space left on device"),
    ],
)
def test_a_disk_error_raises_keeps_the_previous_checkpoint_and_leaves_no_temp_file(
    tmp_path, monkeypatch, module, name, failure, reason
):
    run = _build(tmp_path)
    _move_trainer_to(run, 1)
    run.ckpt.save_last(run.trainer)
    state_before = run.ckpt.state_dict()

    _move_trainer_to(run, 2)
    with monkeypatch.context() as patch:
        patch.setattr(module, name, failure)
        with pytest.raises(CheckpointError, match=f"step-00000002.pt: could not save: .*{reason}"):
            run.ckpt.save_last(run.trainer)

    assert not [path for path in tmp_path.iterdir() if path.name.endswith(".tmp")]
    assert read_checkpoint(tmp_path / "last.pt", expected_run_id="run-a")["meta"]["iteration"] == 1
    assert run.ckpt.state_dict() == state_before


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_under_torch_saves_zip_writer_is_named_as_a_full_disk(tmp_path, monkeypatch):
    """On a full disk torch.save's zip writer raises ``RuntimeError("[enforce fail at
    inline_container.cc:672] . unexpected pos ...")``, which says nothing of the disk; the
    disk's OSError is its ``__context__``, and the save's reason is that OSError."""
    real_save = torch.save

    def save_on_a_full_disk(obj, file, *args, **kwargs):
        full = open("/dev/full", "wb")  # every write fails with ENOSPC  # noqa: SIM115
        try:
            real_save(obj, full, *args, **kwargs)
        finally:
            with contextlib.suppress(OSError):
                full.close()

    run = _build(tmp_path)
    _move_trainer_to(run, 1)
    run.ckpt.save_last(run.trainer)
    monkeypatch.setattr(torch, "save", save_on_a_full_disk)
    _move_trainer_to(run, 2)
    with pytest.raises(CheckpointError) as raised:
        run.ckpt.save_last(run.trainer)
    assert raised.value.reason == "could not save: [Errno 28] No space left on device"
    assert isinstance(raised.value.__cause__.__cause__, RuntimeError)  # torch's, kept
    assert read_checkpoint(tmp_path / "last.pt")["meta"]["iteration"] == 1


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_metrics_file_the_disk_refuses_in_the_snapshot_is_a_failed_save(tmp_path):
    """The logger's state_dict flushes metrics.jsonl into the checkpoint's snapshot: a disk
    that refuses it fails the save as a disk error (exit 4 in a run), not an OSError from
    outside the save, and the previous checkpoint stays."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.symlink_to("/dev/full")
    sink = JsonLinesSink(metrics)
    run = _build(tmp_path / "checkpoints")
    ckpt = Checkpointer(tmp_path / "checkpoints", {**run.ckpt.to_save, "metrics": sink},
                        run_id="run-a")
    _move_trainer_to(run, 1)
    ckpt.save_last(run.trainer)  # nothing to write yet
    sink.write(step=2, epoch=1, wall_time=0.0, scalars={"train/loss": 1.0})
    _move_trainer_to(run, 2)
    with pytest.raises(CheckpointError) as raised:
        ckpt.save_last(run.trainer)
    assert str(raised.value) == (f"{tmp_path / 'checkpoints' / 'step-00000002.pt'}: could not "
                                 f"save: [Errno 28] No space left on device: '{metrics}'")
    assert read_checkpoint(tmp_path / "checkpoints" / "last.pt")["meta"]["iteration"] == 1


FILE_SIZE_LIMIT_SCRIPT = """
import resource, signal, sys
sys.path.insert(0, "tests/handlers")
import test_checkpoint as t
from handlers.checkpoint import CheckpointError, read_checkpoint
run = t._build(sys.argv[1])
t._move_trainer_to(run, 1)
run.ckpt.save_last(run.trainer)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))  # smaller than a checkpoint
t._move_trainer_to(run, 2)
try:
    run.ckpt.save_last(run.trainer)
except CheckpointError as error:
    print(error)
print(read_checkpoint(t.Path(sys.argv[1]) / "last.pt")["meta"]["iteration"])
"""


def test_a_file_size_limit_during_a_save_is_a_checkpoint_error_and_keeps_the_last_one(
    tmp_path
):
    """A real failed write (``ulimit -f``): torch.save raises RuntimeError from its zip
    writer; the save must turn it into CheckpointError (the run exits 4 on it)."""
    done = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMIT_SCRIPT, str(tmp_path)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    error, iteration = done.stdout.strip().splitlines()
    assert error.startswith(f"{tmp_path / 'step-00000002.pt'}: could not save: "), error
    assert iteration == "1"
    assert not [path for path in tmp_path.iterdir() if path.name.endswith(".tmp")]


# Test hooks, arguments, the code itself


def _run_until_killed(dirname: Path, phase: str) -> None:
    script = (
        "import sys; sys.path.insert(0, 'tests/handlers'); import test_checkpoint as t; "
        f"run = t._save_every_step(t._build({str(dirname)!r}, keep_last=1)); "
        "run.trainer.run(t.DATA[:3], max_epochs=1)"
    )
    env = {**os.environ, "CKPT_TEST_CRASH_PHASE": phase}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, timeout=300)
    assert done.returncode == 137


@pytest.mark.parametrize(
    ("phase", "resumed_file", "resumed_iteration"),
    [("mid_write:2", "last.pt", 1), ("before_link:2", "step-00000002.pt", 2),
     ("during_eviction:2", "last.pt", 2)],
)
def test_a_process_killed_inside_a_save_resumes_from_a_complete_checkpoint(
    tmp_path, phase, resumed_file, resumed_iteration
):
    _run_until_killed(tmp_path, phase)
    run = _save_every_step(_build(tmp_path, seed=5, keep_last=1))
    info = run.ckpt.resume("auto")
    assert (info.path.name, info.meta["iteration"]) == (resumed_file, resumed_iteration)
    assert not [path for path in tmp_path.iterdir() if path.name.endswith(".tmp")]
    # The resume itself finishes an interrupted eviction: nothing is left pending.
    assert run.ckpt.state_dict()["evict"] == []
    if phase.startswith("during_eviction"):  # step 1's sidecar outlived its .pt until now
        assert not (tmp_path / "step-00000001.pt.json").exists()
    run.trainer.run(DATA[:3], max_epochs=1)
    assert _names(tmp_path) == {"step-00000003.pt", "step-00000003.pt.json", "last.pt",
                                "last.pt.json"}


def test_an_unknown_crash_phase_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_TEST_CRASH_PHASE", "mid_rite")
    with pytest.raises(ValueError, match="CKPT_TEST_CRASH_PHASE='mid_rite'.*mid_write"):
        _build(tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"keep_last": 0}, "keep_last"),
        ({"keep_best": 1.5}, "keep_best"),
        ({"best": "acc"}, "best must be a Goal"),
        ({"save_every": 0}, "save_every"),
        ({"run_id": ""}, "run_id"),
        ({"file_mode": 0o400}, "file_mode"),
        ({"config": {"root": Path("x")}}, r"config\['root'\] is a PosixPath"),
    ],
)
def test_bad_arguments_are_refused_by_name(tmp_path, kwargs, named):
    run = _build(tmp_path)
    to_save = {"model": run.model, "trainer": run.trainer}
    with pytest.raises(ValueError, match=named):
        Checkpointer(tmp_path, to_save, **{"run_id": "r", **kwargs})


@pytest.mark.parametrize(
    ("to_save", "named"),
    [({"model": nn.Linear(1, 1)}, "'trainer'"),
     ({"model": nn.Linear(1, 1), "trainer": Engine(lambda e, b: None)}, r"to_save\['trainer'\]"),
     ({"meta": nn.Linear(1, 1)}, "'model'")],
)
def test_to_save_must_hold_a_model_and_the_trainer(tmp_path, to_save, named):
    with pytest.raises(ValueError, match=named):
        Checkpointer(tmp_path, to_save, run_id="r")


def test_every_torch_load_in_the_checkpoint_code_passes_weights_only_true():
    loads = [node for module in (checkpoint_module, checkpoint_files_module,
                                 sharded_checkpoint_module)
             for node in ast.walk(ast.parse(Path(module.__file__).read_text()))
             if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load"]
    assert loads
    for call in loads:
        assert any(keyword.arg == "weights_only" and ast.unparse(keyword.value) == "True"
                   for keyword in call.keywords), ast.unparse(call)


@pytest.mark.parametrize("phase", ["mid_write", "before_rename", "before_dir_fsync",
                                   "before_sidecar"])
def test_a_process_killed_inside_its_first_save_starts_fresh(tmp_path, caplog, phase):
    """Nothing was committed: whatever .pt the save left is not a checkpoint yet."""
    _run_until_killed(tmp_path, phase)
    fresh = _save_every_step(_build(tmp_path, seed=5, keep_last=1))
    with caplog.at_level(logging.WARNING, logger="handlers.checkpoint"):
        assert fresh.ckpt.resume("auto") is None
    assert fresh.trainer.state.iteration == 0
    if phase in ("before_dir_fsync", "before_sidecar"):  # the .pt is in place, unsidecarred
        assert "step-00000001.pt never got its sidecar" in caplog.text
    fresh.trainer.run(DATA[:3], max_epochs=1)  # and the run goes on from the start
    assert _names(tmp_path) == {"step-00000003.pt", "step-00000003.pt.json", "last.pt",
                                "last.pt.json"}


def test_last_pt_without_any_sidecar_is_an_error_not_a_fresh_start(tmp_path):
    _three_saves(tmp_path)
    for sidecar in tmp_path.glob("*.json"):
        sidecar.unlink()
    with pytest.raises(CheckpointError, match=r"no usable checkpoint \(last.pt: no checksum"):
        _build(tmp_path).ckpt.resume("auto")


# attach


def test_attach_saves_on_the_cadence_at_each_epoch_end_and_at_each_evaluation(tmp_path):
    calls = []

    def recorded(save):
        def record_then_save(engine):
            calls.append((save.__name__, run.trainer.state.optimizer_step))
            save(engine)
        return record_then_save

    run = _build(tmp_path, best=Goal("acc", "max"), save_every=3, wrap_save=recorded)
    scores = iter([0.5, 0.4])
    evaluator = Engine(lambda engine, batch: None)
    evaluator.add_event_handler(Events.COMPLETED,
                                lambda engine: engine.state.metrics.update(acc=next(scores)))
    run.trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: evaluator.run([0]))
    run.ckpt.attach(run.trainer, evaluator)
    run.trainer.run(DATA, max_epochs=2)  # 4 steps an epoch
    # Step 3 and 6 on the cadence; 4 and 8 end an epoch, saved after its evaluation.
    assert calls == [("save_last", 3), ("save_best", 4), ("save_last", 4), ("save_last", 6),
                     ("save_best", 8), ("save_last", 8)]
    # Step 4's best checkpoint is also its last: that save_last is skipped.
    assert {name for name in _names(tmp_path) if name.endswith(".pt")} == {
        "step-00000003.pt", "step-00000006.pt", "step-00000008.pt", "last.pt",
        "best-step-00000004.pt", "best.pt"}


def test_a_cadence_step_that_ends_an_epoch_is_saved_once_by_the_epochs_save(tmp_path):
    calls = []

    def recorded(save):
        def record_then_save(engine):
            calls.append(run.trainer.state.optimizer_step)
            save(engine)
        return record_then_save

    run = _build(tmp_path, save_every=2, wrap_save=recorded)
    run.ckpt.attach(run.trainer)
    run.trainer.run(DATA, max_epochs=2)  # 4 steps an epoch: steps 4 and 8 end one
    assert calls == [2, 4, 6, 8]


def test_attach_without_an_evaluator_or_a_goal_saves_no_best(tmp_path):
    for options in ({"best": Goal("acc", "max")}, {}):
        run = _build(tmp_path / str(len(options)), **options)
        evaluator = Engine(lambda engine, batch: None)
        run.ckpt.attach(run.trainer, None if options else evaluator)
        assert not evaluator.has_event_handler(run.ckpt.best_handler, Events.COMPLETED)
        run.trainer.run(DATA, max_epochs=1)
        assert "best.pt" not in _names(run.ckpt.dirname) and "last.pt" in _names(run.ckpt.dirname)


def test_attach_to_another_trainer_is_refused(tmp_path):
    run, other = _build(tmp_path / "a"), _build(tmp_path / "b")
    with pytest.raises(ValueError, match="trainer in its to_save"):
        run.ckpt.attach(other.trainer)


def test_without_readable_sidecars_last_pt_ranks_first_then_the_steps_then_best_pt(tmp_path):
    """Only an order of what to verify first; a step-0 file (an epoch whose every step was
    skipped) still ranks above best.pt."""
    names = ["best.pt", "step-00000000.pt", "last.pt", "step-00000002.pt"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
        (tmp_path / f"{name}.json").write_text("not json")
    ranked = sorted((tmp_path / name for name in names), key=checkpoint_files_module
                    .claimed_position, reverse=True)
    assert [path.name for path in ranked] == [
        "last.pt", "step-00000002.pt", "step-00000000.pt", "best.pt"]


def test_without_readable_sidecars_last_dcp_ranks_first_as_last_pt_does(tmp_path):
    """The sharded format's link names rank as the single file's: last first, best last."""
    names = ["best.dcp", "step-00000001.dcp", "last.dcp"]
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / f"{name}.json").write_text("not json")
    ranked = sorted((tmp_path / name for name in names), key=checkpoint_files_module
                    .claimed_position, reverse=True)
    assert [path.name for path in ranked] == ["last.dcp", "step-00000001.dcp", "best.dcp"]


def test_resume_tries_last_pt_then_history_before_best_at_the_same_step_then_best_pt(tmp_path):
    run = _build(tmp_path, best=Goal("acc", "max"))
    _move_trainer_to(run, 3)
    run.ckpt.save_last(run.trainer)
    _evaluate(run, 3, 0.5)  # best-step-00000003.pt, which last.pt and best.pt now link to
    names = ["last.pt", "step-00000003.pt", "best-step-00000003.pt", "best.pt"]
    for name in names:  # each its own bad file
        (tmp_path / name).unlink()
        (tmp_path / name).write_bytes(b"garbage")
    with pytest.raises(CheckpointError) as error:
        _build(tmp_path, seed=5, best=Goal("acc", "max")).ckpt.resume("auto")
    tried = re.findall(r"([\w.-]+\.pt): ", str(error.value).partition("no usable checkpoint")[2])
    assert tried == names


# Each refusal's exact message, and the smallest values allowed


def _exactly(message: str) -> str:
    return f"^{re.escape(message)}$"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"run_id": ""}, "run_id must be a non-empty string, got ''"),
        ({"config": ["lr"]}, "config must be a dict or None, got list"),
        ({"config": {"root": Path("x")}}, "config must hold plain values: config['root'] is a "
                                          "PosixPath, which torch.load(weights_only=True) refuses"),
        ({"keep_last": 0}, "keep_last must be an int >= 1 (checkpoints), got 0"),
        ({"keep_best": 1.5}, "keep_best must be an int >= 1 (checkpoints), got 1.5"),
        ({"best": "acc"}, "best must be a Goal(metric, mode) or None, got 'acc'"),
        ({"save_every": 0}, "save_every must be an int >= 1 (optimizer steps), got 0"),
        ({"file_mode": 0o400}, "file_mode must be a permission such as 0o640 or 0o600 that lets "
                               "the owner read and write, got 256"),
        ({"file_mode": 0o1640}, "file_mode must be a permission such as 0o640 or 0o600 that "
                                "lets the owner read and write, got 928"),
        ({"file_mode": "0o640"}, "file_mode must be a permission such as 0o640 or 0o600 that "
                                 "lets the owner read and write, got '0o640'"),
        ({"file_mode": True}, "file_mode must be a permission such as 0o640 or 0o600 that lets "
                              "the owner read and write, got True"),
    ],
)
def test_each_bad_argument_is_refused_with_its_name_and_what_is_allowed(tmp_path, kwargs,
                                                                         message):
    run = _build(tmp_path / "run")
    to_save = {"model": run.model, "trainer": run.trainer}
    with pytest.raises(ValueError, match=_exactly(message)):
        Checkpointer(tmp_path / "refused", to_save, **{"run_id": "r", **kwargs})
    assert not (tmp_path / "refused").exists()  # nothing created before the checks passed


class _OnlyStateDict:
    def state_dict(self):
        return {}


class _OnlyLoadStateDict:
    def load_state_dict(self, state):
        pass


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({1: nn.Linear(1, 1)}, "to_save key 1 is not allowed: use a string other than meta, "
                               "checkpointer"),
        ({"half": _OnlyStateDict()}, "to_save['half'] has no state_dict()/load_state_dict()"),
        ({"half": _OnlyLoadStateDict()}, "to_save['half'] has no state_dict()/load_state_dict()"),
    ],
)
def test_each_to_save_entry_must_be_named_by_a_string_and_have_both_state_methods(
    tmp_path, extra, message
):
    run = _build(tmp_path)
    with pytest.raises(ValueError, match=_exactly(message)):
        Checkpointer(tmp_path, {"model": run.model, "trainer": run.trainer, **extra}, run_id="r")


def test_to_save_that_is_not_a_mapping_is_refused(tmp_path):
    with pytest.raises(ValueError, match=_exactly(
            "to_save must be a dict holding at least 'model' and 'trainer'")):
        Checkpointer(tmp_path, ("model", "trainer"), run_id="r")


def test_the_smallest_allowed_values_and_a_folder_whose_parents_do_not_exist_yet(tmp_path):
    run = _build(tmp_path / "run")
    to_save = {"model": run.model, "trainer": run.trainer}
    ckpt = Checkpointer(tmp_path / "new" / "deeper", to_save, run_id="r", keep_last=1,
                        keep_best=1, save_every=1, file_mode=0o600)
    assert ckpt.dirname.is_dir()
    assert (ckpt.keep_last, ckpt.keep_best, ckpt.save_every) == (1, 1, 1)


def test_any_mode_that_lets_the_owner_read_and_write_is_allowed(tmp_path):
    run = _build(tmp_path, file_mode=0o755)
    _move_trainer_to(run, 1)
    run.ckpt.save_last(run.trainer)
    assert {path.stat().st_mode & 0o777 for path in tmp_path.iterdir()} == {0o755}


def test_by_default_the_last_3_and_the_best_1_are_kept(tmp_path):
    run = _build(tmp_path, best=Goal("acc", "max"))
    for step in range(1, 5):
        _move_trainer_to(run, step)
        run.ckpt.save_last(run.trainer)
    for step, score in [(5, 0.5), (6, 0.7)]:
        _evaluate(run, step, score)
    state = run.ckpt.state_dict()
    assert state["history"] == ["step-00000002.pt", "step-00000003.pt", "step-00000004.pt"]
    assert [entry["file"] for entry in state["best"]] == ["best-step-00000006.pt"]


# What a save records, and what a failed eviction leaves


def _in_an_epoch_of_10(run: Run) -> Run:
    """Give the scripted trainer an epoch, so that a checkpoint of it restores."""
    state = run.trainer.state
    state.epoch, state.epoch_length, state.max_epochs = 1, 10, 1
    return run


def test_a_save_records_when_it_was_made_and_its_sidecar_names_its_file(tmp_path):
    run = _build(tmp_path)
    _move_trainer_to(run, 1)
    before = time.time()
    run.ckpt.save_last(run.trainer)
    after = time.time()
    meta = read_checkpoint(tmp_path / "last.pt")["meta"]
    assert before <= meta["saved_at_unix"] <= after
    sidecar = json.loads((tmp_path / "last.pt.json").read_text())
    assert sidecar["saved_at_unix"] == meta["saved_at_unix"]
    assert sidecar["file"] == "step-00000001.pt"


def test_a_resume_after_a_finished_eviction_leaves_nothing_pending(tmp_path, caplog):
    """The checkpoint lists what its save was about to evict; by the resume both files of
    step 1 are long gone, which is no failure to delete them."""
    run = _in_an_epoch_of_10(_build(tmp_path, keep_last=1))
    for step in (1, 2):
        _move_trainer_to(run, step)
        run.ckpt.save_last(run.trainer)
    assert read_checkpoint(tmp_path / "last.pt")["checkpointer"]["evict"] == ["step-00000001.pt"]

    resumed = _build(tmp_path, seed=5, keep_last=1)
    with caplog.at_level(logging.WARNING, logger="handlers.checkpoint"):
        resumed.ckpt.resume("auto")
    assert resumed.ckpt.state_dict()["evict"] == []
    assert "could not delete" not in caplog.text


def test_an_evicted_checkpoint_that_cannot_be_deleted_is_retried_at_the_next_save(
    tmp_path, monkeypatch, caplog
):
    run = _build(tmp_path, keep_last=1)
    _move_trainer_to(run, 1)
    run.ckpt.save_last(run.trainer)
    real_unlink, refused = os.unlink, []

    def unlink_refusing_step_1_once(path, *args, **kwargs):
        if Path(path).name == "step-00000001.pt" and not refused:
            refused.append(path)
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink_refusing_step_1_once)
    _move_trainer_to(run, 2)
    with caplog.at_level(logging.WARNING, logger="handlers.checkpoint"):
        run.ckpt.save_last(run.trainer)
    assert refused and "could not delete evicted checkpoint step-00000001.pt" in caplog.text
    assert run.ckpt.state_dict()["evict"] == ["step-00000001.pt"]
    assert {"step-00000001.pt", "step-00000001.pt.json"} <= _names(tmp_path)

    _move_trainer_to(run, 3)
    run.ckpt.save_last(run.trainer)
    assert run.ckpt.state_dict()["evict"] == []
    assert {name for name in _names(tmp_path) if name.startswith("step-")} == {
        "step-00000003.pt", "step-00000003.pt.json"}


def test_of_two_checkpoints_of_one_step_the_later_iteration_is_resumed_first(tmp_path):
    """A spike-guard rollback repeats a step number at a later iteration: step 3 saved at
    iteration 3, then its best at iteration 5."""
    run = _in_an_epoch_of_10(_build(tmp_path, best=Goal("acc", "max")))
    _move_trainer_to(run, 3)
    run.ckpt.save_last(run.trainer)
    run.trainer.state.iteration = 5
    evaluator = Engine(lambda engine, batch: None)
    evaluator.state.metrics = {"acc": 0.5}
    run.ckpt.save_best(evaluator)
    (tmp_path / "last.pt").unlink()
    (tmp_path / "last.pt").write_bytes(b"garbage")

    info = _build(tmp_path, seed=5, best=Goal("acc", "max")).ckpt.resume("auto")
    assert (info.path.name, info.meta["iteration"]) == ("best-step-00000003.pt", 5)


# Verified reads: each reason's exact wording


def _one_save(dirname: Path) -> Path:
    run = _in_an_epoch_of_10(_build(dirname))
    _move_trainer_to(run, 1)
    run.ckpt.save_last(run.trainer)
    return dirname / "step-00000001.pt"


def _reason(path: Path, **kwargs) -> str:
    with pytest.raises(CheckpointError) as error:
        read_checkpoint(path, **kwargs)
    assert error.value.path == path
    return error.value.reason


def _commit_by_hand(path: Path, **changes) -> None:
    """Write ``path``'s sidecar as a save would, so that the file verifies."""
    data = path.read_bytes()
    sidecar = {"format_version": 1, "run_id": "run-a", "iteration": 1, "optimizer_step": 1,
               "size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), **changes}
    path.with_name(path.name + ".json").write_text(json.dumps(sidecar))


def test_a_size_mismatch_is_worded_with_both_sizes(tmp_path):
    path = _one_save(tmp_path)
    size = path.stat().st_size
    _append_junk(path)
    assert _reason(path) == f"checksum mismatch ({size + 4} bytes, {size} committed)"
    os.truncate(path, size)
    _flip_a_byte(path)
    assert _reason(path) == "checksum mismatch"
    os.truncate(path, 10)
    assert _reason(path) == f"truncated (10 of {size} bytes)"


def test_a_file_that_verifies_but_does_not_load_names_torchs_error(tmp_path, monkeypatch):
    path = tmp_path / "step-00000001.pt"
    path.write_bytes(b"not a zip file")
    _commit_by_hand(path)
    assert _reason(path) == ("not a checkpoint: the file is not a torch.save archive (File is "
                             "not a zip file)")
    with zipfile.ZipFile(path, "w") as archive:  # a zip, but not torch.save's
        archive.writestr("data.txt", "x")
    _commit_by_hand(path)
    with pytest.raises(Exception) as torch_error:
        torch.load(path, weights_only=True)
    first_line = str(torch_error.value).strip().splitlines()[0]
    assert _reason(path) == f"not a checkpoint: {first_line}"

    def load_without_a_message(*args, **kwargs):
        raise EOFError()

    monkeypatch.setattr(torch, "load", load_without_a_message)
    assert _reason(path) == "not a checkpoint: EOFError"


def test_a_verified_checkpoint_without_an_entry_this_run_restores_is_refused(tmp_path):
    path = _one_save(tmp_path)
    assert _reason(path, required_keys=("model", "ema")) == (
        "not a checkpoint of this setup: missing keys ['ema']")
    run = _build(tmp_path, seed=5)
    with_ema = Checkpointer(tmp_path, {**run.ckpt.to_save, "ema": nn.Linear(1, 1)},
                            run_id="run-a")
    with pytest.raises(CheckpointError, match=r"missing keys \['ema'\]$"):
        with_ema.resume(path)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [({"size_bytes": "1234"}, "size_bytes out of range or of the wrong type"),
     ({"sha256": 1234}, "sha256 out of range or of the wrong type"),
     ({"optimizer_step": 1e999}, "optimizer_step out of range or of the wrong type"),
     ({"iteration": -1}, "iteration out of range or of the wrong type"),
     ({"run_id": None}, "not a sidecar")],
    ids=["size_as_text", "sha256_as_number", "step_infinite", "iteration_negative",
         "without_run_id"],
)
def test_a_sidecar_with_a_missing_key_or_a_wrong_value_is_rejected_naming_it(tmp_path,
                                                                            changes, reason):
    path = _one_save(tmp_path)
    _commit_by_hand(path, **changes)
    if changes == {"run_id": None}:
        sidecar = json.loads(path.with_name(path.name + ".json").read_text())
        del sidecar["run_id"]
        path.with_name(path.name + ".json").write_text(json.dumps(sidecar))
    assert _reason(path) == f"unreadable sidecar step-00000001.pt.json: {reason}"


def test_a_sidecar_that_is_not_an_object_is_not_a_sidecar(tmp_path):
    path = _one_save(tmp_path)
    path.with_name(path.name + ".json").write_text("[1, 2]")
    assert _reason(path) == "unreadable sidecar step-00000001.pt.json: not a sidecar"


@pytest.mark.parametrize(
    ("value", "description"),
    [
        ({"callback": print}, "checkpoint['callback'] is a builtin_function_or_method"),
        ({Path("x"): 1}, "checkpoint key PosixPath('x') is a PosixPath"),
        ({"hooks": [1, "a", print]}, "checkpoint['hooks'][2] is a builtin_function_or_method"),
        ({"hooks": (1, {"inner": [Path("y")]})},
         "checkpoint['hooks'][1]['inner'][0] is a PosixPath"),
    ],
)
def test_unloadable_entry_names_the_first_entry_weights_only_loading_refuses(value,
                                                                             description):
    found = checkpoint_files_module.unloadable_entry(value)
    assert found == f"{description}, which torch.load(weights_only=True) refuses"


def test_unloadable_entry_accepts_tensors_and_plain_values_in_dicts_lists_and_tuples():
    value = {"w": torch.zeros(2), "p": nn.Parameter(torch.ones(1)), "n": [1, 2.0, None, "s"],
             "t": (torch.Size([2]), torch.float32, torch.device("cpu"), True)}
    assert checkpoint_files_module.unloadable_entry(value) is None


# The other format's checkpoints, leftovers of a killed save, a checkpoint that does not fit


def _sharded_checkpoint(dirname: Path, name: str, committed: bool = True) -> None:
    """A ``.dcp`` checkpoint folder as ``ShardedFolder`` leaves it; only its name and sidecar
    matter to a single-file run."""
    (dirname / name).mkdir(parents=True)
    if committed:
        (dirname / f"{name}.json").write_text("{}")


def test_a_folder_of_only_the_other_formats_checkpoints_is_refused_naming_the_newest(tmp_path):
    _sharded_checkpoint(tmp_path, "step-00000001.dcp")
    _sharded_checkpoint(tmp_path, "step-00000002.dcp")
    with pytest.raises(CheckpointError, match=_exactly(
            f"{tmp_path}: holds checkpoints of another format (step-00000002.dcp), this run "
            f"reads .pt ones")):
        _build(tmp_path).ckpt.resume("auto")


def test_the_other_formats_uncommitted_folder_is_a_fresh_start(tmp_path):
    _sharded_checkpoint(tmp_path, "step-00000001.dcp", committed=False)
    assert _build(tmp_path).ckpt.resume("auto") is None


def test_a_folder_with_checkpoints_of_this_format_resumes_from_them_whatever_else_it_holds(
    tmp_path
):
    _one_save(tmp_path)
    _sharded_checkpoint(tmp_path, "step-00000009.dcp")
    info = _build(tmp_path, seed=5).ckpt.resume("auto")
    assert (info.path.name, info.rejected) == ("last.pt", [])  # the .dcp is not a candidate


def test_a_resume_removes_the_temp_files_a_killed_save_left_and_nothing_else(tmp_path):
    _one_save(tmp_path)
    leftovers = [".step-00000002.pt.1a2b3c4d.tmp", ".last.pt.json.5e6f7a8b.tmp"]
    for name in [*leftovers, "notes.tmp"]:
        (tmp_path / name).write_bytes(b"partial")
    _build(tmp_path, seed=5).ckpt.resume("auto")
    assert not set(leftovers) & _names(tmp_path) and "notes.tmp" in _names(tmp_path)


def test_a_checkpoint_that_does_not_fit_an_object_names_the_file_and_the_object(tmp_path):
    path = _one_save(tmp_path)
    run = _build(tmp_path, seed=5)
    other_shape = Checkpointer(tmp_path, {"model": nn.Linear(6, 3), "trainer": run.trainer},
                               run_id="run-a")
    with pytest.raises(CheckpointError) as error:
        other_shape.resume(path)
    assert error.value.path == path
    assert error.value.reason.startswith("cannot restore 'model': Error(s) in loading")


def test_checkpoint_in_finds_the_pt_file_first_then_the_dcp_folder(tmp_path):
    assert checkpoint_files_module.checkpoint_in(tmp_path, "best") is None
    (tmp_path / "best.dcp").mkdir()
    assert checkpoint_files_module.checkpoint_in(tmp_path, "best") == tmp_path / "best.dcp"
    (tmp_path / "best.pt").write_bytes(b"")
    assert checkpoint_files_module.checkpoint_in(tmp_path, "best") == tmp_path / "best.pt"


def test_is_checkpoint_takes_a_file_or_a_dcp_folder(tmp_path):
    (tmp_path / "step-00000001.pt").write_bytes(b"")
    for folder in ("step-00000002.dcp", "runs"):
        (tmp_path / folder).mkdir()
    verdicts = {name: checkpoint_files_module.is_checkpoint(tmp_path / name)
                for name in ("step-00000001.pt", "step-00000002.dcp", "runs", "missing.pt")}
    assert verdicts == {"step-00000001.pt": True, "step-00000002.dcp": True, "runs": False,
                        "missing.pt": False}
