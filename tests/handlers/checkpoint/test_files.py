"""The checkpoint files (``handlers.checkpoint.files``): the single-file format's own steps,
``load_payload``'s refusals, ``read_checkpoint`` of a sharded folder (one process, no process
group: DCP writes it in-process), finding a checkpoint in a folder, and the ``Checkpointer``'s
refusal of a folder holding the other format's checkpoints. All in-process and fast: these
tests run in the mutation run (setup.cfg ``[mutmut]``)."""

import fractions
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.serialization
from torch import nn

from engine.trainer import create_trainer
from handlers.checkpoint.checkpointer import Checkpointer
from handlers.checkpoint.crash_points import CrashPoints
from handlers.checkpoint.files import (
    FORMAT_VERSION,
    CheckpointError,
    SingleFile,
    checkpoint_in,
    first_non_finite,
    is_checkpoint,
    load_payload,
    sha256_of,
    sidecar_of,
)
from handlers.checkpoint.formats import read_checkpoint
from handlers.checkpoint.sharded import ShardedFolder

META = {"format_version": FORMAT_VERSION, "run_id": "run-a", "epoch": 1, "iteration": 1,
        "optimizer_step": 1}


def _payload(**entries) -> dict:
    return {"meta": dict(META), "checkpointer": {}, **entries}


def _write_single(path: Path, payload: dict) -> None:
    SingleFile().write(path, payload, META, file_mode=0o640, crash=CrashPoints())


def _write_sharded(path: Path, model: nn.Module) -> None:
    """A sharded checkpoint folder as a one-process ``fully_shard`` run writes it."""
    folder = ShardedFolder()
    payload = folder.snapshot({"model": model}) | _payload()
    folder.write(path, payload, META, file_mode=0o640, crash=CrashPoints())


# SingleFile


def test_the_sidecar_names_its_file_with_its_size_and_sha256(tmp_path):
    path = tmp_path / "step-00000001.pt"
    _write_single(path, _payload(model={"w": torch.ones(2)}))
    assert json.loads(sidecar_of(path).read_bytes()) == {
        **META, "file": "step-00000001.pt", "size_bytes": path.stat().st_size,
        "sha256": sha256_of(path)}


def test_single_file_read_refuses_a_checkpoint_without_the_required_keys(tmp_path):
    path = tmp_path / "step-00000001.pt"
    _write_single(path, _payload(model={}))
    with pytest.raises(CheckpointError) as caught:
        SingleFile().read(path, expected_run_id=None, required_keys=("model", "scheduler"))
    assert caught.value.reason == "not a checkpoint of this setup: missing keys ['scheduler']"


class _Refuses:
    def load_state_dict(self, state: dict) -> None:
        raise ValueError("wrong shape")


def test_single_file_restore_names_the_file_and_the_object_that_refused(tmp_path):
    path = tmp_path / "step-00000001.pt"
    with pytest.raises(CheckpointError) as caught:
        SingleFile().restore(path, _payload(model={}), {"model": _Refuses()})
    assert (caught.value.path, caught.value.reason) == (path, "cannot restore 'model': wrong shape")


def test_deleting_a_checkpoint_half_deleted_before_finishes_without_an_error(tmp_path):
    """An eviction retried after a crash may find the .pt, its sidecar or both gone."""
    gone_sidecar, gone_file = tmp_path / "step-00000001.pt", tmp_path / "step-00000002.pt"
    for path in (gone_sidecar, gone_file):
        _write_single(path, _payload())
    sidecar_of(gone_sidecar).unlink()
    gone_file.unlink()
    for path in (gone_sidecar, gone_file, tmp_path / "step-00000003.pt"):
        SingleFile().delete(path, CrashPoints())
    assert list(tmp_path.iterdir()) == []


def test_removing_a_stale_temp_file_tolerates_one_already_gone(tmp_path):
    temp = tmp_path / ".step-00000001.pt.abcd.tmp"
    temp.write_bytes(b"partial")
    SingleFile().remove(temp)
    assert not temp.exists()
    SingleFile().remove(temp)


# load_payload


def test_a_checkpoint_saved_on_a_gpu_loads_onto_the_cpu(tmp_path, monkeypatch):
    path = tmp_path / "gpu.pt"
    with monkeypatch.context() as patch:  # torch.save tags each storage with its device
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(_payload(model={"w": torch.ones(2)}), path)
    payload = load_payload(path, path, ("model",))
    assert payload["model"]["w"].device == torch.device("cpu")
    assert torch.equal(payload["model"]["w"], torch.ones(2))


def test_weights_only_holds_even_where_the_environment_turns_it_off(tmp_path, monkeypatch):
    """torch.load's TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD overrides only a weights_only left
    unset; the refusal's first line is the reason."""
    path = tmp_path / "pickled.pt"
    torch.save(_payload(extra=fractions.Fraction(1, 3)), path)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(CheckpointError) as caught:
        load_payload(path, path, ())
    assert re.fullmatch(r"not a checkpoint: Weights only load failed\. This file can still be "
                        r"loaded[^\n]*", caught.value.reason), caught.value.reason


def test_an_error_without_a_message_is_named_by_its_type(tmp_path):
    path = tmp_path / "empty.pt"
    path.write_bytes(b"")
    with pytest.raises(CheckpointError) as caught:
        load_payload(path, path, ())
    assert caught.value.reason == "not a checkpoint: EOFError"


def test_a_payload_missing_reserved_or_required_keys_is_refused_naming_them(tmp_path):
    path = tmp_path / "partial.pt"
    torch.save({"meta": {}, "model": {}}, path)
    with pytest.raises(CheckpointError) as caught:
        load_payload(path, path, ("model", "optimizer"))
    assert caught.value.reason == ("not a checkpoint of this setup: missing keys "
                                   "['checkpointer', 'optimizer']")


# read_checkpoint of a sharded folder


@pytest.fixture
def sharded(tmp_path) -> tuple[Path, nn.Module]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    path = tmp_path / "step-00000001.dcp"
    _write_sharded(path, model)
    return path, model


def test_a_sharded_folder_reads_whole_by_default_and_only_its_state_when_not(sharded):
    path, model = sharded
    whole = read_checkpoint(path)
    assert whole.keys() == {"model", "meta", "checkpointer"}
    assert all(torch.equal(whole["model"][name], tensor)
               for name, tensor in model.state_dict().items())
    assert read_checkpoint(path, whole=False).keys() == {"meta", "checkpointer"}


def test_a_sharded_folder_from_another_run_is_refused(sharded):
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(sharded[0], expected_run_id="run-b")
    assert caught.value.reason == "from another run run-a (this run is run-b)"


def test_a_sharded_folder_without_a_required_key_is_refused(sharded):
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(sharded[0], required_keys=("model", "scheduler"))
    assert caught.value.reason == "not a checkpoint of this setup: missing keys ['scheduler']"


def test_a_sharded_checkpoint_whose_folder_is_gone_is_read_as_a_folder(sharded):
    """The name decides the format: a .dcp whose folder is missing is an incomplete sharded
    checkpoint, not an unreadable file."""
    shutil.rmtree(sharded[0])
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(sharded[0])
    assert caught.value.reason == "incomplete: the folder is missing"


# Finding checkpoints


def test_checkpoint_in_prefers_the_file_then_the_folder_else_none(tmp_path):
    (tmp_path / "best.dcp").mkdir()
    assert checkpoint_in(tmp_path, "best") == tmp_path / "best.dcp"
    (tmp_path / "best.pt").write_bytes(b"")
    assert checkpoint_in(tmp_path, "best") == tmp_path / "best.pt"
    assert checkpoint_in(tmp_path, "last") is None


def test_a_checkpoint_is_a_file_or_a_dcp_folder(tmp_path):
    (tmp_path / "step-00000001.pt").write_bytes(b"")
    (tmp_path / "step-00000001.dcp").mkdir()
    (tmp_path / "exports").mkdir()
    assert is_checkpoint(tmp_path / "step-00000001.pt")
    assert is_checkpoint(tmp_path / "step-00000001.dcp")
    assert not is_checkpoint(tmp_path / "exports")
    assert not is_checkpoint(tmp_path / "step-00000002.dcp")  # missing


# The Checkpointer and the other format


def _single_file_checkpointer(dirname: Path) -> Checkpointer:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, optimizer, nn.CrossEntropyLoss())
    return Checkpointer(dirname, {"model": model, "trainer": trainer}, run_id="run-a")


def test_a_folder_of_committed_sharded_checkpoints_is_refused_not_a_fresh_start(tmp_path):
    for step in (7, 8):
        (tmp_path / f"step-0000000{step}.dcp").mkdir()
        (tmp_path / f"step-0000000{step}.dcp.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"another format \(step-00000008\.dcp\), this run "
                                              r"reads \.pt ones$"):
        _single_file_checkpointer(tmp_path).resume("auto")


def test_a_sharded_folder_never_committed_leaves_a_fresh_start(tmp_path):
    (tmp_path / "step-00000001.dcp").mkdir()  # a first save killed before its sidecar
    assert _single_file_checkpointer(tmp_path).resume("auto") is None


@pytest.mark.parametrize(("state", "expected"), [
    ({"w": torch.tensor([1.0, float("nan")])}, "w"),  # one float tensor alone
    ({"w": torch.ones(2)}, None),
    ({"step": torch.tensor(3), "w": torch.ones(2), "b": torch.tensor([float("inf")])}, "b"),
    ({"step": torch.tensor(3)}, None),  # integers are never checked
])
def test_first_non_finite_names_the_first_float_tensor_holding_nan_or_inf(state, expected):
    assert first_non_finite(state) == expected
