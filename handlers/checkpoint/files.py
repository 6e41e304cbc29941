"""The checkpoint files on disk: names, sidecars, verified reads and crash-safe writes.

Layout of a checkpoint folder::

    step-00001200.pt        one per save of the newest state, named by optimizer step
    step-00001200.pt.json   its sidecar: sha256 and size of the .pt, run id, position, kind
    best-step-00000900.pt   (+ .json) one per new best score
    last.pt, last.pt.json   hard links to the newest committed checkpoint of either kind
    best.pt, best.pt.json   hard links to the best one

Each file is written by ``handlers.atomic_write.write_atomically`` (temp file, fsync, rename,
fsync of the folder), so a crash at any instant leaves the previous file whole. A .pt is
trusted only when its sidecar exists and the sha256 and size match (``read_file``).
``link_atomically`` switches ``last.pt``/``best.pt`` with ``os.link`` to a temp name and
``os.replace``: hard links keep their data alive whatever retention deletes (the folder must
support hard links). The ``Checkpointer`` (``checkpointer``) decides what to write when;
``SingleFile`` is this format as the ``Checkpointer`` is given it, and
``handlers.checkpoint.sharded.ShardedFolder`` the sharded one (a folder per checkpoint, written
by every process of a ``fully_shard`` run); ``handlers.checkpoint.formats.read_checkpoint`` reads
both.
"""

import hashlib
import json
import math
import os
import re
import secrets
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from handlers.atomic_write import fsync_dir, os_error_behind, write_atomically
from handlers.checkpoint.background import StagedCopies
from handlers.checkpoint.crash_points import CrashPoints
from handlers.checkpoint.untrusted import (
    SIDECAR_MAX_BYTES,
    CheckpointError,
    check_stored_zip,
    first_line,
    is_count,
    open_checkpoint_file,
    read_small_file,
)

FORMAT_VERSION = 1
# Keys of every checkpoint besides those of the saved objects.
RESERVED_KEYS = ("meta", "checkpointer")
SIDECAR_KEYS = {"format_version", "sha256", "size_bytes", "run_id", "iteration", "optimizer_step"}
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
STATE_DICT_KEYS = ("model", "optimizer")  # read by every command, not only by load_state_dict
META_POSITION = ("epoch", "iteration", "optimizer_step")  # whole numbers in every meta
# A checkpoint of either format: step-00001200.pt (a file), step-00001200.dcp (a folder).
CHECKPOINT_NAME = re.compile(r"^(best-)?step-(\d+)\.(pt|dcp)$")
LINK_NAMES = ("last.pt", "best.pt", "last.dcp", "best.dcp")
TEMP_NAME = re.compile(r"^\.((best-)?step-\d+|last|best)\.pt(\.json)?\..+\.tmp$")
_PLAIN_TYPES = (str, bytes, int, float, bool, complex, type(None), torch.Size, torch.dtype,
                torch.device)


def read_file(path: str | os.PathLike, *, expected_run_id: str | None = None,
              required_keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """Verify the .pt file ``path`` against its sidecar and load it onto the CPU with
    ``weights_only=True`` (``handlers.checkpoint.formats.read_checkpoint`` reads either format). The
    file is opened once (``open_checkpoint_file``), its size and sha256 checked and its
    archive's entries checked to be stored uncompressed before ``torch.load`` reads it.

    Raises ``CheckpointError`` whose ``reason`` is e.g. ``truncated (0 bytes)``,
    ``no checksum sidecar ...``, ``checksum mismatch``, ``from another run <id>``,
    ``refused: ...`` or ``not a checkpoint: <error>``.
    """
    path = Path(path)
    try:
        with open_checkpoint_file(path, owner=path, what="the file") as stream:
            size = os.fstat(stream.fileno()).st_size
            if size == 0:
                raise CheckpointError(path, "truncated (0 bytes)")
            sidecar = read_sidecar(path)
            committed = sidecar["size_bytes"]
            if size < committed:
                raise CheckpointError(path, f"truncated ({size} of {committed} bytes)")
            if size > committed:
                raise CheckpointError(path, f"checksum mismatch ({size} bytes, {committed} "
                                            "committed)")
            if sha256_of(stream) != sidecar["sha256"]:
                raise CheckpointError(path, "checksum mismatch")
            check_run_id(path, sidecar, expected_run_id)
            stream.seek(0)
            check_stored_zip(stream, size=size, owner=path, what="the file")
            return load_payload(path, stream, required_keys)
    except OSError as err:
        raise CheckpointError(path, f"unreadable: {err}") from err


def check_run_id(path: Path, sidecar: dict[str, Any], expected_run_id: str | None) -> None:
    if expected_run_id is not None and sidecar["run_id"] != expected_run_id:
        raise CheckpointError(
            path, f"from another run {sidecar['run_id']} (this run is {expected_run_id})"
        )


def load_payload(path: Path, stream: BinaryIO | Path,
                 required_keys: tuple[str, ...]) -> dict[str, Any]:
    """``torch.load(stream, weights_only=True)`` of checkpoint ``path``, checked to be a dict
    holding the reserved keys and ``required_keys``; the reserved entries and the model's and
    optimizer's state are dicts, and ``meta`` holds a run id and a position in whole numbers:
    what every reader of a checkpoint then indexes without checking again."""
    try:
        payload = torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as err:  # weights_only refusals, zip errors: all mean "not ours"
        raise CheckpointError(path, f"not a checkpoint: {first_line(err)}") from err
    if not isinstance(payload, dict):
        raise CheckpointError(path, f"not a checkpoint: it holds a {type(payload).__name__}")
    missing = [key for key in (*RESERVED_KEYS, *required_keys) if key not in payload]
    if missing:
        raise CheckpointError(path, f"not a checkpoint of this setup: missing keys {missing}")
    for key in (*RESERVED_KEYS, *STATE_DICT_KEYS):
        if key in payload and not isinstance(payload[key], dict):
            raise CheckpointError(path, f"not a checkpoint: its {key!r} is a "
                                        f"{type(payload[key]).__name__}, not a dict")
    meta = payload["meta"]
    wrong = [key for key in META_POSITION if not is_count(meta.get(key))]
    if wrong or not isinstance(meta.get("run_id"), str):
        raise CheckpointError(path, "not a checkpoint: its meta lacks a run id or a position "
                                    f"in whole numbers ({', '.join(wrong) or 'run_id'})")
    return payload


def restore_each(path: Path, payload: dict[str, Any], targets: dict[str, Any]) -> None:
    """``target.load_state_dict(payload[key])`` for each target; a failure names the file and
    the object."""
    for key, target in targets.items():
        try:
            target.load_state_dict(payload[key])
        except Exception as err:  # any failure: name the file and the object
            raise CheckpointError(path, f"cannot restore {key!r}: {err}") from err


class SingleFile:
    """The single-file format as the ``Checkpointer`` uses it (see the module docstring): one
    ``torch.save`` file per checkpoint, written by the one process that saves."""

    suffix = ".pt"

    def __init__(self) -> None:
        self._staged = StagedCopies()  # the copies written behind training

    def snapshot(self, to_save: dict[str, Any]) -> dict[str, Any]:
        """Every object's state dict: what the checkpoint will hold."""
        return {key: obj.state_dict() for key, obj in to_save.items()}

    def first_non_finite(self, model_state: dict[str, Any]) -> str | None:
        return first_non_finite(model_state)

    def unloadable(self, payload: dict[str, Any]) -> str | None:
        return unloadable_entry(payload)

    def write(self, path: Path, payload: dict[str, Any], meta: dict[str, Any], *,
              file_mode: int, crash: CrashPoints) -> None:
        """Commit ``path``: the .pt, then its sidecar (``meta`` plus its sha256 and size)."""
        write_atomically(path, lambda file: _torch_save(payload, file), file_mode=file_mode,
                         crash=crash)
        crash.reach("before_sidecar")
        sidecar = {**meta, "file": path.name, "size_bytes": path.stat().st_size,
                   "sha256": sha256_of(path)}
        write_atomically(sidecar_of(path),
                         lambda file: file.write(json.dumps(sidecar, indent=1).encode()),
                         file_mode=file_mode)

    def write_behind(self, path: Path, payload: dict[str, Any], meta: dict[str, Any], *,
                     file_mode: int, crash: CrashPoints) -> Callable[[], str | None]:
        """Copy ``payload`` into CPU memory (``StagedCopies``: the step waits for this only)
        and return the rest, for another thread: the check that the copied model is finite
        (on the CPU it reads the whole model, so it runs behind training too), then ``write``
        of the copy. The rest returns the first non-finite tensor's name, having written
        nothing, or None."""
        copied = self._staged.copy(payload)

        def check_and_write() -> str | None:
            bad_tensor = first_non_finite(copied["model"])
            if bad_tensor is None:
                self.write(path, copied, meta, file_mode=file_mode, crash=crash)
            return bad_tensor
        return check_and_write

    def failed_anywhere(self, failed: bool) -> bool:
        return failed  # one process writes each file: its outcome is the only one

    def read(self, path: Path, *, expected_run_id: str | None,
             required_keys: tuple[str, ...]) -> dict[str, Any]:
        return read_file(path, expected_run_id=expected_run_id, required_keys=required_keys)

    def restore(self, path: Path, payload: dict[str, Any], targets: dict[str, Any]) -> None:
        restore_each(path, payload, targets)

    def link(self, target: Path, links: list[Path]) -> None:
        """Switch each of ``links`` (last.pt, best.pt) to ``target``; durable on return."""
        for link in links:
            link_atomically(target, link)
        fsync_dir(target.parent)

    def delete(self, path: Path, crash: CrashPoints) -> None:
        """Delete an evicted checkpoint: the .pt, then its sidecar."""
        path.unlink(missing_ok=True)
        crash.reach("during_eviction")
        sidecar_of(path).unlink(missing_ok=True)

    def stale_temps(self, dirname: Path) -> list[Path]:
        """What interrupted saves left in ``dirname``: temp files."""
        return [path for path in dirname.iterdir() if TEMP_NAME.match(path.name)]

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)


def _torch_save(payload: dict[str, Any], file: BinaryIO) -> None:
    """``torch.save``, with a failed write as the ``OSError`` it is: the zip writer reports a
    full disk or a file-size limit as a RuntimeError (``inline_container.cc``), the disk's
    own ``OSError`` (errno and reason) in its chain."""
    try:
        torch.save(payload, file)
    except RuntimeError as err:
        raise os_error_behind(err) or OSError(
            (str(err).strip().splitlines() or [type(err).__name__])[0]) from err


def first_non_finite(state: dict[str, Any]) -> str | None:
    """The name of the first tensor holding NaN/inf, or None; one device wait when all are fine."""
    names, checks = [], []
    for name, value in state.items():
        if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
            names.append(name)
            checks.append(torch.isfinite(value).all())
    if not checks:
        return None
    finite = torch.stack([check.to(checks[0].device) for check in checks])
    if bool(finite.all()):
        return None
    return names[int(torch.nonzero(~finite)[0, 0])]


def checkpoint_in(folder: Path, name: str) -> Path | None:
    """``<folder>/<name>.pt``, else the sharded ``<name>.dcp``, whichever exists, or None."""
    for path in (folder / f"{name}.pt", folder / f"{name}.dcp"):
        if path.exists():
            return path
    return None


def committed_checkpoints(folder: Path) -> list[Path]:
    """The checkpoints of either format in ``folder`` that were committed: those whose
    sidecar exists (written last: a first save killed before it committed nothing; one whose
    file has gone since was committed all the same), and the ``last``/``best`` links. The one
    answer to "does this run hold a checkpoint" for every caller: the resume, ``--resume
    never``, ``--init-from`` and the format check."""
    if not folder.is_dir():
        return []
    names = {path.name for path in folder.iterdir()}
    return sorted(folder / name for name in names if name in LINK_NAMES) + sorted(
        folder / name.removesuffix(".json") for name in names
        if name.endswith(".json") and CHECKPOINT_NAME.match(name.removesuffix(".json")))


def is_checkpoint(path: Path) -> bool:
    """A checkpoint file, or a sharded checkpoint folder."""
    return path.is_file() or (path.suffix == ".dcp" and path.is_dir())


def link_atomically(target: Path, link: Path) -> None:
    """Point ``link`` (and its sidecar) at ``target`` in one atomic rename each."""
    for source, destination in ((target, link), (sidecar_of(target), sidecar_of(link))):
        temp = destination.with_name(f".{destination.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.link(source, temp)
            os.replace(temp, destination)
        finally:
            temp.unlink(missing_ok=True)  # stays when destination already was this file


def sidecar_of(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def read_sidecar(path: Path) -> dict[str, Any]:
    """The sidecar of checkpoint ``path``, checked: a JSON object of at most
    ``SIDECAR_MAX_BYTES`` with every ``SIDECAR_KEYS`` key of the right type (a size and a
    position in whole numbers, a sha256 in hex). ``CheckpointError`` otherwise."""
    sidecar_path = sidecar_of(path)
    name = f"sidecar {sidecar_path.name}"
    try:
        data = read_small_file(sidecar_path, owner=path, what=f"its {name}",
                               max_bytes=SIDECAR_MAX_BYTES)
        sidecar = json.loads(data)
    except FileNotFoundError:
        raise CheckpointError(path, f"no checksum sidecar {sidecar_path.name}") from None
    except RecursionError:
        raise CheckpointError(path, f"unreadable {name}: nested too deeply") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(path, f"unreadable {name}: {first_line(err)}") from err
    if not isinstance(sidecar, dict) or not sidecar.keys() >= SIDECAR_KEYS:
        raise CheckpointError(path, f"unreadable {name}: not a sidecar")
    wrong = [key for key in ("size_bytes", "iteration", "optimizer_step", "format_version")
             if not is_count(sidecar[key])]
    if not (isinstance(sidecar["sha256"], str) and SHA256_HEX.fullmatch(sidecar["sha256"])):
        wrong.append("sha256")
    if not isinstance(sidecar["run_id"], str):
        wrong.append("run_id")
    if wrong:
        raise CheckpointError(path, f"unreadable {name}: {', '.join(wrong)} out of range or of "
                                    "the wrong type")
    if sidecar["format_version"] != FORMAT_VERSION:
        raise CheckpointError(path, f"format version {sidecar['format_version']}, this code "
                                    f"reads {FORMAT_VERSION}")
    return sidecar


def claimed_position(path: Path) -> tuple[float, float]:
    """(optimizer step, iteration) to order resume candidates, newest first: the step from
    the file name, else from the sidecar; without a readable sidecar ``last.pt`` (``last.dcp``)
    still comes first and ``best.pt`` last. Only an order: every candidate is verified before
    use."""
    try:
        sidecar = read_sidecar(path)
        claimed = (sidecar["optimizer_step"], sidecar["iteration"])
    except CheckpointError:
        claimed = (math.inf, math.inf) if path.name in ("last.pt", "last.dcp") else (-1, -1)
    named = CHECKPOINT_NAME.match(path.name)
    return (int(named[2]), claimed[1]) if named else claimed


def unloadable_entry(value: Any, where: str = "checkpoint") -> str | None:
    """Describe the first entry that ``torch.load(weights_only=True)`` would refuse, or None."""
    if type(value) in (torch.Tensor, nn.Parameter) or type(value) in _PLAIN_TYPES:
        return None
    if type(value) in (dict, OrderedDict):
        for key, item in value.items():
            found = unloadable_entry(key, f"{where} key {key!r}")
            found = found or unloadable_entry(item, f"{where}[{key!r}]")
            if found:
                return found
        return None
    if type(value) in (list, tuple, set):
        for index, item in enumerate(value):
            found = unloadable_entry(item, f"{where}[{index}]")
            if found:
                return found
        return None
    return f"{where} is a {type(value).__name__}, which torch.load(weights_only=True) refuses"


def sha256_of(file: Path | BinaryIO) -> str:
    """The sha256 of a file: a path, or an open stream read from where it stands."""
    if isinstance(file, Path):
        with open(file, "rb") as stream:
            return hashlib.file_digest(stream, "sha256").hexdigest()
    return hashlib.file_digest(file, "sha256").hexdigest()
