"""The checkpointer against bad weights, bad disks and a process killed inside a save, and
the code's own rules (weights_only everywhere)."""

import ast
import contextlib
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from ignite.engine import Engine
from torch import nn

import handlers.checkpoint.checkpointer as checkpoint_module
import handlers.checkpoint.files as checkpoint_files_module
import handlers.checkpoint.sharded as sharded_checkpoint_module
from handlers.checkpoint.checkpointer import Checkpointer
from handlers.checkpoint.files import CheckpointError
from handlers.checkpoint.formats import read_checkpoint
from handlers.goal import Goal
from handlers.jsonl_sink import JsonLinesSink
from tests.handlers.checkpoint.checkpoint_run import (
    DATA,
    FILE_SIZE_LIMIT_SCRIPT,
    REPO_ROOT,
    _build,
    _enospc,
    _move_trainer_to,
    _names,
    _permission_denied,
    _read_only,
    _run_until_killed,
    _save_every_step,
    _three_saves,
    _zip_writer_failure,
)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_non_finite_weights_are_never_saved(tmp_path, caplog, asynchronous):
    """Written behind training, the copy is checked there, and nothing of it committed."""
    run = _build(tmp_path, best=Goal("acc", "max"), asynchronous=asynchronous)
    _move_trainer_to(run, 1)
    run.ckpt.save_last(run.trainer)
    run.ckpt.wait()
    with torch.no_grad():
        run.model[3].bias[1] = float("inf")
    with caplog.at_level(logging.WARNING, logger="handlers.checkpoint.checkpointer"):
        _move_trainer_to(run, 2)
        run.ckpt.save_last(run.trainer)
        run.ckpt.wait()
        evaluator = Engine(lambda engine, batch: None)
        evaluator.state.metrics = {"acc": 1.0}
        run.ckpt.save_best(evaluator)
        run.ckpt.wait()
    assert "model tensor '3.bias' is not finite" in caplog.text
    assert _names(tmp_path) == {"step-00000001.pt", "step-00000001.pt.json", "last.pt",
                                "last.pt.json"}


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


def _written_behind(*params, slow: bool = False):
    """A case whose saves are written behind training (``asynchronous=True``)."""
    return pytest.param(*params, True, marks=[pytest.mark.slow] if slow else [],
                        id="-".join(map(str, (*params, "async"))))


@pytest.mark.parametrize(
    ("phase", "resumed_file", "resumed_iteration", "asynchronous"),
    [("mid_write:2", "last.pt", 1, False), ("before_link:2", "step-00000002.pt", 2, False),
     ("during_eviction:2", "last.pt", 2, False),
     # The same phases reached on the background thread, and the phases of its own.
     _written_behind("mid_write:2", "last.pt", 1),
     _written_behind("before_link:2", "step-00000002.pt", 2, slow=True),
     _written_behind("during_eviction:2", "last.pt", 2, slow=True),
     _written_behind("after_copy:2", "last.pt", 1),
     _written_behind("background_start:2", "last.pt", 1)],
)
def test_a_process_killed_inside_a_save_resumes_from_a_complete_checkpoint(
    tmp_path, phase, resumed_file, resumed_iteration, asynchronous
):
    _run_until_killed(tmp_path, phase, asynchronous)
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
        ({"asynchronous": "yes"}, "asynchronous must be True or False"),
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


@pytest.mark.parametrize(("phase", "asynchronous"), [
    ("mid_write", False), ("before_rename", False), ("before_dir_fsync", False),
    ("before_sidecar", False), _written_behind("background_start"),
    _written_behind("before_sidecar", slow=True)])
def test_a_process_killed_inside_its_first_save_starts_fresh(tmp_path, caplog, phase,
                                                             asynchronous):
    """Nothing was committed: whatever .pt the save left is not a checkpoint yet."""
    _run_until_killed(tmp_path, phase, asynchronous)
    fresh = _save_every_step(_build(tmp_path, seed=5, keep_last=1))
    with caplog.at_level(logging.WARNING, logger="handlers.checkpoint.checkpointer"):
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
