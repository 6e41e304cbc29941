"""The checkpointer on resume: an exact resume, each checkpoint verified before it loads
(a bad one named and passed over), each reason's exact wording, the other format's
checkpoints and what a killed save leaves."""

import hashlib
import json
import logging
import os
import zipfile
from pathlib import Path

import pytest
import torch
from ignite.engine import Events
from torch import nn

import handlers.checkpoint.files as checkpoint_files_module
from handlers.checkpoint.checkpointer import Checkpointer
from handlers.checkpoint.files import CheckpointError
from tests.handlers.checkpoint.checkpoint_run import (
    DATA,
    _append_junk,
    _build,
    _commit_by_hand,
    _exactly,
    _flip_a_byte,
    _garble_sidecar,
    _move_trainer_to,
    _names,
    _one_save,
    _reason,
    _remove_sidecars,
    _sharded_checkpoint,
    _three_saves,
    _truncate_to_half,
    _truncate_to_zero,
    _weights,
    _WritesAFileWhenUnpickled,
)


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
    with caplog.at_level(logging.WARNING, logger="handlers.checkpoint.checkpointer"):
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
