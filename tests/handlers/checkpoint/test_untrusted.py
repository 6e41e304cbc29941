"""A checkpoint is data: what a hostile author can put in a checkpoint's files (a pickle in a
sharded folder's byte entry, a BUILD on a class, links to /dev/zero, FIFOs, compressed
archives, claims larger than the shards, malformed sidecars) is refused with one reason by the
readers every command uses, before it runs code, hangs or allocates; the resume falls back
past it."""

import contextlib
import io
import json
import os
import pickle
import signal
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from handlers.checkpoint.crash_points import CrashPoints
from handlers.checkpoint.dcp_metadata import SafeFileSystemReader, SafeLoadPlanner, read_metadata
from handlers.checkpoint.files import SingleFile, claimed_position, sidecar_of
from handlers.checkpoint.formats import read_checkpoint
from handlers.checkpoint.sharded import ShardedFolder
from handlers.checkpoint.untrusted import CheckpointError, open_checkpoint_file
from tests.helpers import (
    BUILD_ON_A_CLASS,
    plant_build_on_a_class,
    plant_pickle_in_a_bytes_entry,
    reseal,
)

META = {"format_version": 1, "run_id": "run-a", "epoch": 1, "iteration": 1, "optimizer_step": 1}


@pytest.fixture(autouse=True)
def no_hang():
    """A read that hangs (a FIFO, /dev/zero) fails the test after 20 s instead."""
    def hung(*_):
        raise TimeoutError("the read hung")
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.fixture
def sharded(tmp_path) -> Path:
    """A one-process sharded checkpoint with an optimizer (whose param_groups DCP stores as
    byte entries)."""
    model, optimizer = _model_and_optimizer()
    folder = ShardedFolder()
    path = tmp_path / "step-00000001.dcp"
    payload = folder.snapshot({"model": model, "optimizer": optimizer})
    payload |= {"meta": dict(META), "checkpointer": {}}
    folder.write(path, payload, META, file_mode=0o640, crash=CrashPoints())
    return path


@pytest.fixture
def single(tmp_path) -> Path:
    model, optimizer = _model_and_optimizer()
    path = tmp_path / "step-00000001.pt"
    payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
               "meta": dict(META), "checkpointer": {}}
    SingleFile().write(path, payload, META, file_mode=0o640, crash=CrashPoints())
    return path


def _reason(path: Path, **options) -> str:
    with pytest.raises(CheckpointError) as raised:
        read_checkpoint(path, **options)
    assert raised.value.reason, "a reason is never empty"
    return raised.value.reason


# 1. No code from any part of a checkpoint


def test_a_pickle_in_a_byte_entry_is_refused_unrun_where_dcp_would_run_it(sharded, tmp_path):
    marker = tmp_path / "code-ran"
    plant_pickle_in_a_bytes_entry(sharded, marker)
    for whole in (True, False):  # a resume reads whole=False: it must meet it too
        reason = _reason(sharded, whole=whole)
        assert reason.startswith("refused: entry 'optimizer.param_groups"), reason
        assert "is not plain data" in reason
    model, optimizer = _model_and_optimizer()
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    with pytest.raises(BaseException, match="not plain data"):
        dcp.load(state, storage_reader=SafeFileSystemReader(sharded),
                 planner=SafeLoadPlanner(), no_dist=True)
    assert not marker.exists()
    # What the check stands between: DCP's own reader and planner run it.
    with contextlib.suppress(BaseException):  # whatever it makes of os.mkdir's None
        dcp.load(state, storage_reader=dcp.FileSystemReader(sharded), no_dist=True)
    assert marker.is_dir()


def test_build_on_a_class_is_refused_and_the_class_stays_as_it_was(sharded):
    plant_build_on_a_class(sharded)
    reason = _reason(sharded, whole=False)
    assert reason.startswith("refused: its .metadata sets attributes of <class 'pathlib."), reason
    assert "(BUILD)" in reason
    assert str(Path("/a/b")) == "/a/b"
    assert "_str" not in vars(type(Path("/a")))  # only the class's own slot descriptor
    with pytest.raises(CheckpointError, match="BUILD"):
        read_metadata(sharded)


@pytest.mark.parametrize("state", [
    b"}X\x09\x00\x00\x00__class__cpathlib\nPosixPath\ns",  # {"__class__": PosixPath}
    b"X\x01\x00\x00\x00x",  # a string, not a dict of attributes
])
def test_build_of_a_special_attribute_or_from_a_non_dict_is_refused(sharded, state):
    honest = (sharded / ".metadata").read_bytes()
    # Metadata(...) on the stack, then BUILD with the state above, then the rest discarded.
    hostile = (honest[:-1] + state + b"b.")  # the honest pickle ends with STOP
    (sharded / ".metadata").unlink()
    (sharded / ".metadata").write_bytes(hostile)
    with pytest.raises(CheckpointError, match=r"refused: its \.metadata (sets a special "
                                              r"attribute|builds from a state)"):
        read_metadata(sharded)


def test_build_on_an_enum_member_is_refused_and_the_member_stays_as_it_was(sharded):
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    member = _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    honest = (sharded / ".metadata").read_bytes()
    # _MEM_FORMAT_ENCODING(value) is the shared member; then BUILD {"_value_": 99} on it.
    hostile = (honest[:2] + b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n"
               + b"K" + bytes([member.value]) + b"\x85R}X\x07\x00\x00\x00_value_Kcsb0"
               + honest[2:])
    (sharded / ".metadata").unlink()
    (sharded / ".metadata").write_bytes(hostile)
    with pytest.raises(CheckpointError, match=r"sets attributes of .*\(BUILD\)"):
        read_metadata(sharded)
    assert member.value == member._value_ != 99


def test_the_build_prefix_does_run_under_plain_pickle():
    """The hostile prefix is what the test says: plain pickle builds the class (checked on a
    stand-in class, so that this process's paths stay whole)."""
    class Stand:
        __slots__ = ()
    prefix = BUILD_ON_A_CLASS.replace(b"cpathlib\nPosixPath\n", b"ctests.helpers\nStandIn\n")
    import tests.helpers as helpers

    helpers.StandIn = type("StandIn", (), {})
    try:
        built = pickle.loads(b"\x80\x04" + prefix[:-1] + b".")
        assert built is helpers.StandIn and helpers.StandIn._str == "X"
    finally:
        del helpers.StandIn


# 2. Only regular files, bounded


@pytest.mark.parametrize("target", ["/dev/zero", "fifo", "folder", "big"])
def test_a_sidecar_that_is_not_a_small_regular_file_is_rejected(single, tmp_path, target):
    sidecar = sidecar_of(single)
    sidecar.unlink()
    if target == "fifo":
        os.mkfifo(sidecar)
    elif target == "folder":
        sidecar.mkdir()
    elif target == "big":
        sidecar.write_bytes(b" " * (2**20))
    else:
        sidecar.symlink_to(target)
    reason = _reason(single)
    expected = {"/dev/zero": "is a symbolic link", "fifo": "is a FIFO, not a regular file",
                "folder": "is a folder, not a regular file", "big": "1048576 bytes, more than"}
    assert reason.startswith("refused: its sidecar step-00000001.pt.json "), reason
    assert expected[target] in reason
    assert claimed_position(single) == (1, -1)  # ordering a candidate never raises


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp", "state.pt"])
@pytest.mark.parametrize("target", ["/dev/zero", "fifo"])
def test_a_file_of_a_sharded_folder_that_is_a_link_or_fifo_is_refused(sharded, name, target):
    (sharded / name).unlink()
    if target == "fifo":
        os.mkfifo(sharded / name)
    else:
        (sharded / name).symlink_to(target)
    reason = _reason(sharded)
    assert reason.startswith(f"refused: {name} is "), reason


def test_a_checkpoint_file_that_is_a_link_is_refused(single, tmp_path):
    link = tmp_path / "step-00000002.pt"
    link.symlink_to(single)
    sidecar_of(link).write_bytes(sidecar_of(single).read_bytes())
    assert _reason(link) == ("refused: the file is a symbolic link; a checkpoint's files are "
                             "regular files of its own folder")


def test_a_dcp_link_that_leads_out_of_its_folder_is_refused(sharded, tmp_path):
    outside = tmp_path / "elsewhere"
    sharded.rename(outside)
    sharded.symlink_to(outside)
    assert _reason(sharded).startswith("refused: it links to ")


def test_open_checkpoint_file_passes_a_missing_file_through(tmp_path):
    with pytest.raises(FileNotFoundError):
        open_checkpoint_file(tmp_path / "none", owner=tmp_path, what="x")


# 3. Claims checked before allocation


def test_a_pt_whose_archive_is_compressed_is_refused(single):
    data = io.BytesIO()
    with zipfile.ZipFile(single) as source, zipfile.ZipFile(data, "w") as target:
        for entry in source.infolist():
            target.writestr(entry.filename, source.read(entry), zipfile.ZIP_DEFLATED)
    single.unlink()
    single.write_bytes(data.getvalue())
    _reseal_single(single)
    assert torch.load(single, weights_only=True)["meta"] == META  # torch would unpack it
    reason = _reason(single)
    assert reason.startswith("refused: the file holds compressed entries"), reason


def test_a_tensor_claimed_without_chunks_is_refused_before_allocation(sharded):
    metadata = pickle.loads((sharded / ".metadata").read_bytes())
    metadata.state_dict_metadata["model.huge"] = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size([2**28]), [])
    _rewrite_metadata(sharded, metadata)
    reason = _reason(sharded)
    assert reason == ("refused: its .metadata claims 'model.huge' of shape (268435456,), its "
                      "chunks hold 0 of its 268435456 elements")


def test_chunks_claiming_more_than_their_storage_are_refused(sharded):
    metadata = pickle.loads((sharded / ".metadata").read_bytes())
    entry = metadata.state_dict_metadata["model.weight"]
    entry.size = torch.Size([2**20, 3])
    entry.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2**20, 3]))]
    _rewrite_metadata(sharded, metadata)
    assert _reason(sharded).startswith("refused: its .metadata claims a chunk of "
                                       "'model.weight' (12582912 bytes) that no stored range")


def test_a_storage_range_beyond_its_file_is_refused(sharded):
    metadata = pickle.loads((sharded / ".metadata").read_bytes())
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index].length = 10**9
    _rewrite_metadata(sharded, metadata)
    assert " which holds " in _reason(sharded)


def test_storage_transforms_are_refused(sharded):
    metadata = pickle.loads((sharded / ".metadata").read_bytes())
    next(iter(metadata.storage_data.values())).transform_descriptors = ["stream.zstd"]
    _rewrite_metadata(sharded, metadata)
    assert "storage transforms" in _reason(sharded)


# 4. Every reader fails the same way


@pytest.mark.parametrize(("text", "reason"), [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"optimizer_step": 1e999}', "not a sidecar"),
    ("{", "Expecting property name"),
])
def test_a_malformed_sidecar_is_one_reason(single, text, reason):
    sidecar_of(single).unlink()
    sidecar_of(single).write_text(text)
    assert reason in _reason(single)


def test_a_sidecar_number_out_of_range_is_named(single):
    sidecar = json.loads(sidecar_of(single).read_text())
    sidecar["optimizer_step"] = 1e999
    sidecar_of(single).write_text(json.dumps(sidecar))
    assert _reason(single).endswith("optimizer_step out of range or of the wrong type")
    assert claimed_position(single) == (1, -1)


@pytest.mark.parametrize(("change", "reason"), [
    ({"model": [1, 2]}, "not a checkpoint: its 'model' is a list, not a dict"),
    ({"meta": {**META, "epoch": 1.5}}, "not a checkpoint: its meta lacks a run id or a "
                                       "position in whole numbers (epoch)"),
])
def test_a_payload_of_the_wrong_shape_is_refused(single, change, reason):
    payload = torch.load(single, weights_only=True) | change
    single.unlink()
    torch.save(payload, single)
    _reseal_single(single)
    assert _reason(single) == reason


def test_metadata_of_the_wrong_types_names_what(sharded):
    metadata = pickle.loads((sharded / ".metadata").read_bytes())
    metadata.state_dict_metadata["model.weight"].chunks = "nothing"
    _rewrite_metadata(sharded, metadata)
    assert _reason(sharded) == ("refused: its .metadata is not DCP metadata (entry "
                                "'model.weight' has no dtype, shape or chunk list)")


def test_a_huge_bytes_opcode_gives_a_reason(sharded):
    _replace(sharded / ".metadata", b"\x80\x04\x8e" + (2**40).to_bytes(8, "little") + b"x")
    reseal(sharded)
    assert _reason(sharded).startswith("unreadable .metadata: ")


def _rewrite_metadata(folder: Path, metadata) -> None:
    _replace(folder / ".metadata", pickle.dumps(metadata))
    reseal(folder)


def _replace(path: Path, data: bytes) -> None:
    path.unlink()
    path.write_bytes(data)


def _reseal_single(path: Path) -> None:
    import hashlib

    data = path.read_bytes()
    sidecar = json.loads(sidecar_of(path).read_text())
    sidecar.update(sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))
    sidecar_of(path).unlink()
    sidecar_of(path).write_text(json.dumps(sidecar))
