"""A sharded checkpoint read as untrusted input: its ``.metadata`` unpickled without running
code, its claims checked before anything is allocated, its entries loaded ``weights_only``.

``torch.distributed.checkpoint`` (DCP) trusts its folders: ``FileSystemReader.read_metadata``
unpickles ``.metadata`` with plain ``pickle``, and ``DefaultLoadPlanner.load_bytes`` loads each
non-tensor entry (an optimizer's ``param_groups``, say) with ``torch.load(weights_only=False)``.
A folder planted in a run folder, or handed to ``evaluate``, would run whatever its pickles
name; a sidecar cannot stop that (whoever plants the folder writes a matching one).

**``.metadata``** is unpickled by ``_MetadataUnpickler``, Python's own pure-Python unpickler
with every opcode that can call or change something limited. Torch's ``weights_only``
unpickler would be the first choice, but it reads pickle protocol 2 only and DCP writes
protocol 4 (``FRAME``, ``MEMOIZE``, ``STACK_GLOBAL``). Ours is enough because pickle can do
only these things with a value that is not plain data, and each is checked:

- import a global (``GLOBAL``, ``STACK_GLOBAL``, ``INST``, the ``EXT`` codes): only the exact
  names of ``_ALLOWED_GLOBALS`` (DCP's metadata classes, ``torch.Size``, dtypes, the layout
  lookup, ``PosixPath``); ``INST`` and ``EXT`` are refused outright (DCP never writes them);
- call something (``REDUCE``, ``NEWOBJ``, ``NEWOBJ_EX``, ``OBJ``): only those classes and the
  layout lookup, whose constructors store their arguments and run no code of the file's choice;
- set attributes (``BUILD``): only on an *instance* of an allowed class, never on a class
  (``BUILD`` on ``PosixPath`` itself would change every path of the process) or an enum member
  (a singleton too), and never a ``__dunder__`` name (no ``__class__`` swap);
- call ``append``/``extend``/``__setitem__``/``add`` (``APPEND(S)``, ``SETITEM(S)``,
  ``ADDITEMS``): only on a real list, dict or set;
- ``PERSID``/``BINPERSID``: refused (pickle's default).

The result is then checked against DCP's schema (types, shapes, a shard named by a plain file
name, no storage transforms) and its claims against the shards' sizes: every tensor covered by
its chunks, every chunk backed by at least its bytes of storage, every storage range inside its
file, and all tensors together no larger than the shards. A folder claiming a 40 GB tensor
from 0.5 MB of shards is refused before anything is allocated.

**Entries** are read by ``SafeFileSystemReader``, DCP's reader whose files are opened by
``handlers.checkpoint.untrusted.open_checkpoint_file`` (no link, regular files only), each entry's
``torch.save`` archive checked to be stored uncompressed, and whose ``read_data`` accepts only
the planners below, which load byte entries with ``weights_only=True``.
"""

import enum
import io
import math
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from handlers.checkpoint.untrusted import (
    CheckpointError,
    FileWindow,
    check_stored_zip,
    first_line,
    is_count,
    open_checkpoint_file,
    read_small_file,
)

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
_REFUSED_OPCODES = (pickle.INST, pickle.OBJ, pickle.EXT1, pickle.EXT2, pickle.EXT4,
                    pickle.PERSID, pickle.BINPERSID)


class _MetadataUnpickler(pickle._Unpickler):
    """Unpickles DCP metadata and nothing else (see the module docstring)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes, folder: Path) -> None:
        super().__init__(io.BytesIO(data))
        self.folder = folder
        self.allowed: set[Any] = set()  # the globals found so far: what may be called or built

    def refuse(self, what: str) -> None:
        raise CheckpointError(self.folder, f"refused: its {METADATA_FILE} {what}, which "
                                           "checkpoint metadata never does (it could run code "
                                           "or change a class)")

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            found = super().find_class(module, name)
            if isinstance(found, type) or callable(found):
                self.allowed.add(found)
            return found
        self.refuse(f"names {module}.{name}")

    def _check_callable(self, target: Any, opcode: str) -> None:
        if not any(target is allowed for allowed in self.allowed):
            self.refuse(f"calls {type(target).__name__} {target!r:.60} ({opcode})")

    def load_reduce(self) -> None:
        self._check_callable(self.stack[-2], "REDUCE")
        super().load_reduce()

    def load_newobj(self) -> None:
        self._check_callable(self.stack[-2], "NEWOBJ")
        super().load_newobj()

    def load_newobj_ex(self) -> None:
        self._check_callable(self.stack[-3], "NEWOBJ_EX")
        super().load_newobj_ex()

    def load_build(self) -> None:
        state, target = self.stack[-1], self.stack[-2]
        # An enum member is a process-wide singleton, as a class is: never built on.
        if isinstance(target, type | enum.Enum) or not any(type(target) is allowed
                                                          for allowed in self.allowed):
            self.refuse(f"sets attributes of {target!r:.60} (BUILD)")
        if "__setstate__" in vars(type(target)):  # the allowed class's own code reads it
            super().load_build()
            return
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
        for part in parts:
            if part is not None and not isinstance(part, dict):
                self.refuse("builds from a state that is not a dict (BUILD)")
            if part and any(not isinstance(key, str) or key.startswith("__") for key in part):
                self.refuse("sets a special attribute (BUILD)")
        super().load_build()

    def load_append(self) -> None:
        if type(self.stack[-2]) is not list:
            self.refuse(f"appends to a {type(self.stack[-2]).__name__} (APPEND)")
        super().load_append()

    def load_appends(self) -> None:
        if type(self.metastack[-1][-1] if self.metastack else None) is not list:
            self.refuse("extends something that is not a list (APPENDS)")
        super().load_appends()

    def load_setitem(self) -> None:
        if type(self.stack[-3]) is not dict:
            self.refuse(f"sets an item of a {type(self.stack[-3]).__name__} (SETITEM)")
        super().load_setitem()

    def load_setitems(self) -> None:
        if type(self.metastack[-1][-1] if self.metastack else None) is not dict:
            self.refuse("sets items of something that is not a dict (SETITEMS)")
        super().load_setitems()

    def load_additems(self) -> None:
        if type(self.metastack[-1][-1] if self.metastack else None) is not set:
            self.refuse("adds to something that is not a set (ADDITEMS)")
        super().load_additems()

    def load_refused(self) -> None:
        self.refuse("uses a pickle opcode that can import or call code")

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.APPEND[0]] = load_append
    dispatch[pickle.APPENDS[0]] = load_appends
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.ADDITEMS[0]] = load_additems
    for _opcode in _REFUSED_OPCODES:
        dispatch[_opcode[0]] = load_refused


def read_metadata(folder: str | os.PathLike) -> Metadata:
    """Unpickle ``<folder>/.metadata`` as the module docstring says and check it: DCP's
    schema, shards that are regular files of the folder, claims within the shards' sizes.
    ``CheckpointError`` otherwise."""
    folder = Path(folder)
    try:
        data = read_small_file(folder / METADATA_FILE, owner=folder, what=METADATA_FILE,
                               max_bytes=MAX_METADATA_BYTES)
    except OSError as err:
        raise CheckpointError(folder, f"unreadable {METADATA_FILE}: {err}") from err
    try:
        metadata = _MetadataUnpickler(data, folder).load()
    except CheckpointError:
        raise
    except Exception as err:  # a truncated or garbled pickle: any of pickle's many errors
        raise CheckpointError(folder, f"unreadable {METADATA_FILE}: {first_line(err)}") from err
    problem = _schema_problem(metadata)
    if problem:
        raise CheckpointError(folder, f"refused: its {METADATA_FILE} is not DCP metadata "
                                      f"({problem})")
    for info in metadata.storage_data.values():
        shard = info.relative_path
        if Path(shard).name != shard or shard in ("", ".", ".."):
            raise CheckpointError(folder, f"refused: its {METADATA_FILE} names a shard outside "
                                          f"the folder: {shard!r}")
    _check_claims(folder, metadata, _shard_sizes(folder, metadata))
    return metadata


def _schema_problem(metadata: Any) -> str | None:
    """What in unpickled metadata is not of the types DCP's reader relies on, or None."""
    if not isinstance(metadata, Metadata):
        return f"it holds a {type(metadata).__name__}"
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        return "no entry or storage table"
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            return "an entry without a name"
        if isinstance(entry, BytesStorageMetadata):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            return f"entry {fqn!r} is a {type(entry).__name__}"
        if not (isinstance(entry.properties, TensorProperties)
                and isinstance(entry.properties.dtype, torch.dtype)
                and _is_shape(entry.size) and isinstance(entry.chunks, list)):
            return f"entry {fqn!r} has no dtype, shape or chunk list"
        for chunk in entry.chunks:
            if not (isinstance(chunk, ChunkStorageMetadata) and _is_shape(chunk.offsets)
                    and _is_shape(chunk.sizes)
                    and len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
                    and all(start + length <= whole for start, length, whole
                            in zip(chunk.offsets, chunk.sizes, entry.size, strict=True))):
                return f"entry {fqn!r} has a chunk outside its shape"
    for index, info in storage.items():
        if not (isinstance(index, MetadataIndex) and isinstance(index.fqn, str)
                and (index.offset is None or _is_shape(index.offset))
                and isinstance(info, _StorageInfo) and isinstance(info.relative_path, str)
                and is_count(info.offset) and is_count(info.length)):
            return "a storage record of the wrong types"
        if info.transform_descriptors:
            return f"storage transforms {info.transform_descriptors!r:.60}, which our saves " \
                   "never use"
    return None


def _is_shape(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(is_count(length) for length in value)


def _shard_sizes(folder: Path, metadata: Metadata) -> dict[str, int]:
    """The size of every file the metadata names, each checked to be a regular file (not a
    link) of the folder."""
    sizes = {}
    for name in {info.relative_path for info in metadata.storage_data.values()}:
        try:
            with open_checkpoint_file(folder / name, owner=folder, what=name) as stream:
                sizes[name] = os.fstat(stream.fileno()).st_size
        except FileNotFoundError:
            raise CheckpointError(folder, f"incomplete: {name} is missing") from None
        except OSError as err:
            raise CheckpointError(folder, f"unreadable {name}: {err}") from err
    return sizes


def _check_claims(folder: Path, metadata: Metadata, sizes: dict[str, int]) -> None:
    """Refuse metadata whose storage ranges leave their files, whose tensors their chunks do
    not cover or back with bytes, or whose tensors together exceed the shards' bytes."""
    storage = metadata.storage_data
    for index, info in storage.items():
        if info.offset + info.length > sizes[info.relative_path]:
            raise CheckpointError(folder, f"refused: its {METADATA_FILE} places {index.fqn!r} at "
                                          f"bytes {info.offset}-{info.offset + info.length} of "
                                          f"{info.relative_path}, which holds "
                                          f"{sizes[info.relative_path]}")
    claimed = 0
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            continue
        itemsize = entry.properties.dtype.itemsize
        covered = 0
        for chunk in entry.chunks:
            info = storage.get(MetadataIndex(fqn, chunk.offsets))
            chunk_bytes = math.prod(chunk.sizes) * itemsize
            if info is None or info.length < chunk_bytes:
                raise CheckpointError(folder, f"refused: its {METADATA_FILE} claims a chunk of "
                                              f"{fqn!r} ({chunk_bytes} bytes) that no stored "
                                              "range of that size holds")
            covered += math.prod(chunk.sizes)
        if covered != math.prod(entry.size):
            raise CheckpointError(folder, f"refused: its {METADATA_FILE} claims {fqn!r} of shape "
                                          f"{tuple(entry.size)}, its chunks hold {covered} of its "
                                          f"{math.prod(entry.size)} elements")
        claimed += covered * itemsize
    held = sum(sizes.values())
    if claimed > held:
        raise CheckpointError(folder, f"refused: its {METADATA_FILE} claims tensors of {claimed} "
                                      f"bytes, its shards hold {held}")


class _SafeBytes:
    """A DCP load planner whose byte entries load with ``weights_only=True``: DCP's own
    ``load_bytes`` runs ``torch.load(weights_only=False)``, so it is handed the entry loaded
    safely here and saved again (plain values only, nothing left to run)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as err:
            raise ValueError(f"entry {read_item.dest_index.fqn!r} is not plain data: "
                             f"{first_line(err)}") from None
        clean = io.BytesIO()
        torch.save(loaded, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """``DefaultLoadPlanner`` (loads the keys it is given) with safe byte entries."""


class SafeGatherPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    """The planner that loads every entry the metadata lists, with safe byte entries."""


class _CheckedFileSystem(FileSystem):
    """DCP's file access for reading, every file opened by ``open_checkpoint_file``."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[BinaryIO]:
        if mode != "rb":
            raise PermissionError(f"{path}: a checkpoint is only read here")
        with open_checkpoint_file(Path(path), owner=self.folder, what=Path(path).name) as stream:
            yield stream


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` that reads as the module docstring says: ``.metadata``
    through ``read_metadata``, files opened without following links, each entry's archive
    checked before ``torch.load``, byte entries only through ``SafeLoadPlanner`` or
    ``SafeGatherPlanner``."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.folder = Path(path)
        self.fs = _CheckedFileSystem(self.folder)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self.folder)
        # As FileSystemReader.read_metadata: the metadata carries this load's id.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        if not isinstance(planner, _SafeBytes):
            raise TypeError(f"SafeFileSystemReader loads only with SafeLoadPlanner or "
                            f"SafeGatherPlanner, not {type(planner).__name__}")
        return super().read_data(plan, planner)

    def _slice_file(self, file: BinaryIO, sinfo: _StorageInfo) -> BinaryIO:
        window = io.BufferedReader(FileWindow(file, sinfo.offset, sinfo.length))
        check_stored_zip(window, size=sinfo.length, owner=self.folder,
                         what=f"an entry of {sinfo.relative_path}")
        return window


def check_entries(folder: Path, metadata: Metadata) -> None:
    """Check every entry's archive as ``SafeFileSystemReader`` will, and load every byte entry
    ``weights_only``: a resume meets a hostile folder while it verifies candidates (and falls
    back past it) rather than once it has chosen one."""
    by_file: dict[str, list[tuple[MetadataIndex, _StorageInfo]]] = {}
    for index, info in metadata.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((index, info))
    byte_entries = {fqn for fqn, entry in metadata.state_dict_metadata.items()
                    if isinstance(entry, BytesStorageMetadata)}
    try:
        for name, entries in by_file.items():
            with open_checkpoint_file(folder / name, owner=folder, what=name) as stream:
                for index, info in entries:
                    window = io.BufferedReader(FileWindow(stream, info.offset, info.length))
                    check_stored_zip(window, size=info.length, owner=folder,
                                     what=f"entry {index.fqn!r} of {name}")
                    if index.fqn in byte_entries:
                        _load_plain(window, folder, f"entry {index.fqn!r} of {name}")
    except OSError as err:
        raise CheckpointError(folder, f"unreadable: {err}") from err


def _load_plain(stream: BinaryIO, folder: Path, what: str) -> None:
    try:
        torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as err:  # weights_only refusals, broken archives
        raise CheckpointError(folder, f"refused: {what} is not plain data (torch.load with "
                                      f"weights_only refuses it: {first_line(err)})") from None
