"""A sharded checkpoint's ``.metadata`` is read by an unpickler that allows only DCP's
metadata classes: a real save reads back as DCP's own reader reads it, and a file naming any
other global (here ``os.mkdir``, which would create a marker folder) is refused unrun."""

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from handlers.checkpoint.dcp_metadata import (
    MAX_METADATA_BYTES,
    SafeFileSystemReader,
    SafeLoadPlanner,
    read_metadata,
)
from handlers.checkpoint.files import CheckpointError
from tests.helpers import RunsCodeWhenUnpickled


@pytest.fixture
def saved(tmp_path) -> Path:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    folder = tmp_path / "step-00000010.dcp"
    torch.save(model[0].weight.detach().clone(), tmp_path / "weight.pt")
    state = {"model": model.state_dict(), "extra": {"note": "x", "values": [1.0, None]}}
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    return folder


def test_a_real_save_reads_back_as_dcp_reads_it(saved):
    ours = read_metadata(saved)
    theirs = dcp.FileSystemReader(saved).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    assert "model.0.weight" in ours.state_dict_metadata


def test_the_safe_reader_loads_the_tensors(saved):
    saved_weight = torch.load(saved.parent / "weight.pt", weights_only=True)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    state = {"model": model.state_dict()}
    assert not torch.equal(state["model"]["0.weight"], saved_weight)
    with pytest.warns(UserWarning):
        dcp.load(state, storage_reader=SafeFileSystemReader(saved), planner=SafeLoadPlanner(),
                 no_dist=True)
    assert torch.equal(state["model"]["0.weight"], saved_weight)


def test_the_safe_reader_refuses_a_planner_that_loads_bytes_unsafely(saved):
    with pytest.raises(CheckpointException, match="loads only with SafeLoadPlanner"), \
            pytest.warns(UserWarning):
        dcp.load({"model": {}}, storage_reader=SafeFileSystemReader(saved), no_dist=True)


def _plant(folder: Path, payload: object) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(payload))


def test_a_metadata_that_would_run_code_is_refused_unrun(saved, tmp_path):
    marker = tmp_path / "code-ran"
    _plant(saved, RunsCodeWhenUnpickled(marker))
    with pytest.raises(CheckpointError) as raised:
        read_metadata(saved)
    assert raised.value.path == saved
    assert raised.value.reason.startswith("refused: its .metadata names posix.mkdir, ")
    assert "could run code" in raised.value.reason
    # DCP wraps the reader's error in its own CheckpointException, message kept.
    with pytest.raises(CheckpointException, match="refused: its .metadata names posix.mkdir"), \
            pytest.warns(UserWarning):
        dcp.load({"model": {}}, storage_reader=SafeFileSystemReader(saved),
                 planner=SafeLoadPlanner(), no_dist=True)
    assert not marker.exists()
    # What the check stands between: DCP's own reader runs it.
    with pytest.raises(AttributeError):  # after os.mkdir ran: None has no storage_meta
        dcp.FileSystemReader(saved).read_metadata()
    assert marker.is_dir()


def test_a_metadata_that_is_not_dcp_metadata_is_refused(saved):
    _plant(saved, {"state_dict_metadata": {}})
    with pytest.raises(CheckpointError, match=r"refused: its \.metadata is not DCP metadata"):
        read_metadata(saved)


def test_a_shard_outside_the_folder_is_refused(saved):
    metadata = read_metadata(saved)
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    _plant(saved, metadata)
    with pytest.raises(CheckpointError, match="names a shard outside the folder: "
                                              "'../../elsewhere.distcp'"):
        read_metadata(saved)


@pytest.mark.parametrize(("content", "reason"), [
    (b"", "unreadable .metadata: "),
    (b"\x80\x04garbage", "unreadable .metadata: "),
    (b"\0" * (MAX_METADATA_BYTES + 1), "refused: .metadata is 67108865 bytes, more than the "),
])
def test_an_empty_garbled_or_huge_metadata_is_one_reason(saved, content, reason):
    (saved / ".metadata").write_bytes(content)
    with pytest.raises(CheckpointError) as raised:
        read_metadata(saved)
    assert raised.value.reason.startswith(reason)


def test_a_missing_metadata_is_unreadable(saved):
    (saved / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="unreadable .metadata: .*No such file"):
        read_metadata(saved)
