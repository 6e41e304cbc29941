"""A sharded checkpoint's ``.metadata``, read without running code.

``torch.distributed.checkpoint``'s ``FileSystemReader.read_metadata`` unpickles ``.metadata``
with plain ``pickle``: a ``.dcp`` folder planted in a run folder, or handed to ``evaluate``,
would run whatever its pickle names as soon as it is read, and a sidecar cannot stop that
(whoever plants the folder writes a matching one). Here the file is unpickled by an
``Unpickler`` whose ``find_class`` allows only what DCP's metadata is made of: its own
dataclasses and enum, ``torch.Size``, torch dtypes and layouts, and ``pathlib`` paths (the
``checkpoint_id`` it records). Constructing those runs no code of the file's choosing. Any
other global is refused before it is imported, with a ``CheckpointError`` naming it.

``SafeFileSystemReader`` is DCP's reader with that ``read_metadata``; every load of a ``.dcp``
folder goes through it. ``read_sharded`` also reads the file up front, so that a resume meets
a refused folder while it verifies candidates, and falls back past it to an older checkpoint
as it does past a corrupt one.
"""

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from handlers.checkpoint_files import CheckpointError

METADATA_FILE = ".metadata"
MAX_METADATA_BYTES = 64 * 2**20  # a 1.5B-parameter model's metadata is a few MB

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = frozenset({
    (_DCP_METADATA, "Metadata"),
    (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout from its name, e.g. "torch.strided"
    ("pathlib", "PosixPath"),
    ("pathlib._local", "PosixPath"),  # where Python 3.13 pickles it from
})


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else (see the module docstring)."""

    def __init__(self, data: bytes, folder: Path) -> None:
        super().__init__(io.BytesIO(data))
        self.folder = folder

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(self.folder, f"refused: its {METADATA_FILE} names {module}.{name}, "
                                           "which checkpoint metadata never holds (loading it "
                                           "could run code)")


def read_metadata(folder: str | os.PathLike) -> Metadata:
    """Unpickle ``<folder>/.metadata`` allowing only DCP's metadata classes; check that every
    shard it names is a file of the folder itself. ``CheckpointError`` otherwise."""
    folder = Path(folder)
    file = folder / METADATA_FILE
    try:
        with open(file, "rb") as stream:
            data = stream.read(MAX_METADATA_BYTES + 1)
    except OSError as err:
        raise CheckpointError(folder, f"unreadable {METADATA_FILE}: {err}") from err
    if len(data) > MAX_METADATA_BYTES:
        raise CheckpointError(folder, f"refused: its {METADATA_FILE} is over "
                                      f"{MAX_METADATA_BYTES >> 20} MB")
    try:
        metadata = _MetadataUnpickler(data, folder).load()
    except CheckpointError:
        raise
    except Exception as err:  # a truncated or garbled pickle: any of pickle's many errors
        raise CheckpointError(folder, f"unreadable {METADATA_FILE}: {err}") from err
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(folder, f"refused: its {METADATA_FILE} is not DCP metadata")
    for info in metadata.storage_data.values():
        shard = getattr(info, "relative_path", None)
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            raise CheckpointError(folder, f"refused: its {METADATA_FILE} names a shard outside "
                                          f"the folder: {shard!r}")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``.metadata`` is read by ``read_metadata`` above
    instead of plain ``pickle`` (the shards themselves it already loads with
    ``torch.load(weights_only=True)``)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.folder = Path(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self.folder)
        # As FileSystemReader.read_metadata: the metadata carries this load's id.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
