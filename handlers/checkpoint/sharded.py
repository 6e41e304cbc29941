"""Sharded checkpoints of a ``fully_shard`` (FSDP2) run: a folder per checkpoint, each process
writing its own shards through ``torch.distributed.checkpoint`` (DCP), with the promises of
the single-file format (``handlers.checkpoint.files``).

Layout of a checkpoint folder's sharded checkpoints::

    step-00001200.dcp/          one per save, as step-00001200.pt is in the single-file format
        __0_0.distcp ...        each process's shards of the model and optimizer (DCP's files)
        .metadata               DCP's index of the shards: which process holds which slice
        state.pt                everything else, as a .pt checkpoint holds it (trainer position,
                                scheduler, handlers' states, ``checkpointer``, ``meta``); ``rng``
                                is a list with every process's generators, by rank
    step-00001200.dcp.json      the sidecar: a .pt sidecar's keys, ``files`` (sha256 and size
                                of every file in the folder) and ``world_size``
    best-step-00000900.dcp/     (+ .json) one per new best score
    last.dcp, best.dcp          symbolic links to the newest and the best folder
    last.dcp.json, best.dcp.json  hard links to their sidecars

The commit, in order (``ShardedFolder.write`` and ``link``): rank 0 creates
``.step-00001200.dcp.<random>.tmp/`` and tells every process its name; each process writes
its shards there (``dcp.save``, which fsyncs each file; rank 0 writes ``.metadata`` once all
have written); rank 0 writes ``state.pt`` (fsync), fsyncs the folder, renames it to
``step-00001200.dcp`` and fsyncs the checkpoint folder; then it writes the sidecar with the
checksum of every file, atomically: from then on the checkpoint is committed. Only then are
``last.dcp``/``best.dcp`` switched (a new symbolic link renamed over the old one, then the
sidecar's hard link) and evicted folders deleted. A crash at any instant leaves the previous
checkpoint whole: a folder without its sidecar, or whose files do not match it (a missing or
truncated shard, a half-switched link), fails verification and the resume takes the previous
one, as with .pt files. ``handlers.checkpoint.crash_points`` phases map onto these steps.
Written behind training (``ShardedFolder.write_behind``), the shards go through DCP's
``async_save`` on a gloo process group of the saves' own, and rank 0 does the rest of the
commit on the ``Checkpointer``'s writer thread once every process's shards are written.

Resuming, each process reads only its own slices (DCP reshards: a checkpoint written by N
processes loads on M) with no collective, so rank 0 may pick and load the checkpoint before
the others learn which. ``read_sharded(..., whole=True)`` gathers a folder into the single-file
checkpoint a one-process run would have written (what ``read_checkpoint`` returns for a
folder, and what ``python -m recipes <recipe> consolidate`` writes).
"""

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.tensor import DTensor

from handlers.atomic_write import fsync_dir, os_error_behind, write_atomically
from handlers.checkpoint.background import StagedCopies
from handlers.checkpoint.crash_points import CrashPoints
from handlers.checkpoint.dcp_metadata import (
    SafeFileSystemReader,
    SafeGatherPlanner,
    SafeLoadPlanner,
    check_entries,
    read_metadata,
)
from handlers.checkpoint.files import (
    CheckpointError,
    check_run_id,
    load_payload,
    read_sidecar,
    restore_each,
    sha256_of,
    sidecar_of,
    unloadable_entry,
)
from handlers.checkpoint.untrusted import (
    check_stored_zip,
    first_line,
    is_count,
    open_checkpoint_file,
)

logger = logging.getLogger(__name__)

SHARDED_KEYS = ("model", "optimizer")  # the to_save entries DCP writes, each process its shards
PER_RANK_KEYS = ("rng",)  # entries each process holds its own of: a list by rank in state.pt
STATE_FILE = "state.pt"
SHARDED_TEMP_NAME = re.compile(r"^\.((best-)?step-\d+|last|best)\.dcp(\.json)?\..+\.tmp$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class ShardedFolder:
    """The sharded format as the ``Checkpointer`` uses it (see the module docstring). Every
    process of the group calls ``snapshot``, ``first_non_finite`` and ``write`` at the same
    save (they are collectives); the rest of the commit, the links and the deletions are rank
    0's, and the other processes' calls return at once."""

    suffix = ".dcp"

    def __init__(self, collective_timeout: timedelta | None = None) -> None:
        # The timeout of the group's own collectives, for the saves written behind training
        # too (None: torch's default for gloo, 30 minutes).
        self._timeout = collective_timeout
        self._group: dist.ProcessGroup | None = None  # see _behind_group
        self._staged = StagedCopies()  # rank 0's state.pt entries written behind training

    def snapshot(self, to_save: dict[str, Any]) -> dict[str, Any]:
        """The model's and optimizer's sharded state dicts (this process's slices, as
        DTensors), every process's ``rng`` state (gathered on rank 0), and rank 0's state
        dicts of everything else."""
        model, optimizer = to_save["model"], to_save.get("optimizer")
        payload: dict[str, Any] = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            payload["optimizer"] = get_optimizer_state_dict(model, optimizer)
        for key in PER_RANK_KEYS:
            if key in to_save:
                payload[key] = _gather(to_save[key].state_dict())
        if _rank() == 0:
            payload |= {key: obj.state_dict() for key, obj in to_save.items()
                        if key not in payload}
        return payload

    def first_non_finite(self, model_state: dict[str, Any]) -> str | None:
        """The first tensor holding NaN/inf in any process's slice (the same answer on every
        process: one all-reduce), or None."""
        names, checks = [], []
        for name, value in model_state.items():
            local = value.to_local() if hasattr(value, "to_local") else value
            if isinstance(local, torch.Tensor) and local.is_floating_point():
                names.append(name)
                checks.append(torch.isfinite(local).all())
        if not checks:
            return None
        finite = torch.stack([check.to(checks[0].device) for check in checks]).int()
        if dist.is_initialized():
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        bad = torch.nonzero(finite == 0)
        return names[int(bad[0, 0])] if len(bad) else None

    def unloadable(self, payload: dict[str, Any]) -> str | None:
        """What ``state.pt`` could not load back (DCP writes the sharded entries); a sharded
        tensor anywhere else is named as such."""
        for key, value in payload.items():
            if key not in SHARDED_KEYS and _holds_dtensor(value):
                return (f"checkpoint[{key!r}] holds sharded tensors (DTensor): only "
                        f"{' and '.join(SHARDED_KEYS)} are saved sharded")
        return unloadable_entry({key: value for key, value in payload.items()
                                 if key not in SHARDED_KEYS})

    def write(self, path: Path, payload: dict[str, Any], meta: dict[str, Any], *,
              file_mode: int, crash: CrashPoints) -> None:
        """Commit the folder ``path`` and its sidecar (module docstring); every process
        writes its shards, rank 0 the rest. An ``OSError`` on any process's shards is
        raised on every process."""
        crash.reach("before_temp")
        temp = _agree_on_temp_folder(path)
        sharded, rest = _split(payload)
        with _removed_on_failure(temp), _dcp_failure_as_os_error(), _quiet_about_one_process():
            dcp.save(sharded, storage_writer=_shard_writer(temp), planner=_shard_planner())
        with _removed_on_failure(temp):
            _commit_folder(temp, path, rest, meta, sorted(sharded), file_mode=file_mode,
                           crash=crash)

    def write_behind(self, path: Path, payload: dict[str, Any], meta: dict[str, Any], *,
                     file_mode: int, crash: CrashPoints) -> Callable[[], str | None]:
        """``write`` behind training. On the training thread: the check that the model is
        finite (a collective: every process at once), then each process's shards copied
        into CPU memory and handed to DCP's ``async_save``, which writes them on its own
        thread over a process group of its own (``_behind_group``), and rank 0's other
        entries copied (``StagedCopies``). DCP's copy goes into new memory at every save: its
        writer, made per folder, keeps no buffers between saves. The returned rest, for
        another thread, waits for the shards and commits the folder as ``write`` does; it
        returns the first non-finite tensor's name, having written nothing, or None."""
        bad_tensor = self.first_non_finite(payload["model"])
        if bad_tensor is not None:
            return lambda: bad_tensor
        crash.reach("before_temp")
        temp = _agree_on_temp_folder(path)
        sharded, rest = _split(payload)
        with _removed_on_failure(temp):
            rest = self._staged.copy(rest) if _rank() == 0 else {}
            shards = dcp.async_save(sharded, storage_writer=_shard_writer(temp),
                                    planner=_shard_planner(), process_group=self._behind_group())

        def finish() -> None:
            with _removed_on_failure(temp):
                with _dcp_failure_as_os_error():
                    shards.result()
                _commit_folder(temp, path, rest, meta, sorted(sharded), file_mode=file_mode,
                               crash=crash)
        return finish

    def failed_anywhere(self, failed: bool) -> bool:
        """Whether a save written behind training failed on any process: one all-reduce on
        its group, which every process makes after waiting for its part (rank 0's state.pt,
        sidecar and links may fail where the others' shards did not)."""
        if self._group is None:
            return failed
        flag = torch.tensor([int(failed)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def _behind_group(self) -> dist.ProcessGroup | None:
        """The process group of the saves written behind training, made at the first one
        (every process reaches it together): gloo, which DCP's ``async_save`` needs, and one
        of their own, as their collectives run on DCP's thread while training's run on the
        default group: two threads issuing collectives on one group may pair them
        differently on each process. None without a process group."""
        if dist.is_initialized() and self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        return self._group

    def read(self, path: Path, *, expected_run_id: str | None,
             required_keys: tuple[str, ...]) -> dict[str, Any]:
        return read_sharded(path, expected_run_id=expected_run_id, required_keys=required_keys)

    def restore(self, path: Path, payload: dict[str, Any], targets: dict[str, Any]) -> None:
        """Load this process's slices of the model and optimizer (no collective), its own
        ``rng`` state, and everything else from ``payload``."""
        model, optimizer = targets["model"], targets.get("optimizer")
        try:
            sharded: dict[str, Any] = {"model": get_model_state_dict(model)}
            if optimizer is not None:
                sharded["optimizer"] = get_optimizer_state_dict(model, optimizer)
            with _quiet_about_one_process():
                dcp.load(sharded, storage_reader=SafeFileSystemReader(path),
                         planner=SafeLoadPlanner(), no_dist=True)
            set_model_state_dict(model, sharded["model"])
            if optimizer is not None:
                set_optimizer_state_dict(model, optimizer, sharded["optimizer"])
        except (Exception, CheckpointException) as err:  # name the file, not DCP's internals
            raise CheckpointError(path, f"cannot restore the sharded model or optimizer: "
                                        f"{_first_line(err)}") from err
        own = {key: _own_entry(path, payload[key]) for key in PER_RANK_KEYS
               if key in targets and key in payload}
        rest = {key: target for key, target in targets.items() if key not in SHARDED_KEYS}
        restore_each(path, {**payload, **own}, rest)

    def link(self, target: Path, links: list[Path]) -> None:
        """Switch each of ``links`` (last.dcp, best.dcp) to the folder ``target``: the
        symbolic link, then the sidecar's hard link; durable on return (rank 0)."""
        if _rank() != 0:
            return
        for link in links:
            for make, destination in ((lambda temp: os.symlink(target.name, temp), link),
                                      (lambda temp: os.link(sidecar_of(target), temp),
                                       sidecar_of(link))):
                temp = destination.with_name(f".{destination.name}.{secrets.token_hex(4)}.tmp")
                try:
                    make(temp)
                    os.replace(temp, destination)
                finally:
                    if temp.is_symlink() or temp.exists():
                        temp.unlink()
        fsync_dir(target.parent)

    def delete(self, path: Path, crash: CrashPoints) -> None:
        """Delete an evicted checkpoint (rank 0): the folder (renamed to a temp name first,
        so a half-deleted one is never taken for a checkpoint), then its sidecar."""
        if _rank() != 0:
            return
        if path.exists():
            doomed = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
            os.rename(path, doomed)
            shutil.rmtree(doomed)
        crash.reach("during_eviction")
        sidecar_of(path).unlink(missing_ok=True)

    def stale_temps(self, dirname: Path) -> list[Path]:
        """Temp folders, links and sidecars that interrupted saves left in ``dirname``."""
        return [path for path in dirname.iterdir() if SHARDED_TEMP_NAME.match(path.name)]

    def remove(self, path: Path) -> None:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def read_sharded(path: str | os.PathLike, *, expected_run_id: str | None = None,
                 required_keys: tuple[str, ...] = (), whole: bool = False) -> dict[str, Any]:
    """Verify the folder ``path`` against its sidecar (every file's size and sha256) and load
    its ``state.pt`` with ``weights_only=True``. ``whole``: also gather the shards into whole
    tensors on the CPU, the optimizer's state keyed by index as ``optimizer.state_dict()``
    keys it, and ``rng`` as rank 0's, giving what a single-file checkpoint holds.

    ``CheckpointError`` reasons as for a .pt file, and ``incomplete: <file> is missing``,
    ``truncated <file> (n of m bytes)``, ``checksum mismatch in <file>``."""
    path = Path(path)
    sidecar = read_sidecar(path)
    files = sidecar.get("files")
    if not (isinstance(files, dict) and STATE_FILE in files
            and all(isinstance(name, str) and Path(name).name == name
                    and name not in ("", ".", "..")
                    and isinstance(facts, dict) and is_count(facts.get("size_bytes"))
                    and isinstance(facts.get("sha256"), str) for name, facts in files.items())):
        raise CheckpointError(path, f"unreadable sidecar {sidecar_of(path).name}: not a "
                                    "sharded checkpoint's sidecar")
    _check_folder_link(path)
    if not path.is_dir():
        raise CheckpointError(path, "incomplete: the folder is missing")
    try:
        for name, facts in files.items():
            _verify_file(path, name, facts)
    except OSError as err:
        raise CheckpointError(path, f"unreadable: {err}") from err
    check_run_id(path, sidecar, expected_run_id)
    # Refuses a .metadata that would run code or claims more than its shards hold, and any
    # entry that is not plain data, before anything loads them.
    check_entries(path, read_metadata(path))
    sharded = tuple(sidecar.get("sharded", ()))
    try:
        with open_checkpoint_file(path / STATE_FILE, owner=path, what=STATE_FILE) as stream:
            check_stored_zip(stream, size=os.fstat(stream.fileno()).st_size, owner=path,
                             what=STATE_FILE)
            payload = load_payload(path, stream,
                                   tuple(key for key in required_keys if key not in sharded))
    except OSError as err:
        raise CheckpointError(path, f"unreadable: {err}") from err
    if whole:
        payload |= _gather_shards(path)
        for key in PER_RANK_KEYS:
            if key in payload:
                payload[key] = payload[key][0]
    return payload


def _check_folder_link(path: Path) -> None:
    """``last.dcp`` and ``best.dcp`` are symbolic links to a folder beside them; a link that
    leads anywhere else is refused."""
    if path.is_symlink():
        target = os.readlink(path)
        if Path(target).name != target or target in (".", ".."):
            raise CheckpointError(path, f"refused: it links to {target!r}, not to a checkpoint "
                                        "folder beside it")


def _verify_file(path: Path, name: str, facts: dict[str, Any]) -> None:
    """One file of the folder against its sidecar's size and sha256, read once; a file larger
    than committed is refused before it is read."""
    committed = facts["size_bytes"]
    try:
        stream = open_checkpoint_file(path / name, owner=path, what=name)
    except FileNotFoundError:
        raise CheckpointError(path, f"incomplete: {name} is missing") from None
    with stream:
        size = os.fstat(stream.fileno()).st_size
        if size < committed:
            raise CheckpointError(path, f"truncated {name} ({size} of {committed} bytes)")
        if size > committed or sha256_of(stream) != facts["sha256"]:
            raise CheckpointError(path, f"checksum mismatch in {name}")


def _gather_shards(path: Path) -> dict[str, Any]:
    """The model's and optimizer's whole tensors, the optimizer's state re-keyed from
    parameter names to indices. Gathered as DCP's ``dcp_to_torch_save`` gathers them (its
    private ``_load_state_dict`` with the planner that loads every entry the metadata lists;
    the public ``dcp.load`` loads only the keys it is given), but through
    ``SafeFileSystemReader``, and without that function's ``torch.load(weights_only=False)``
    round trip."""
    tensors: dict[str, Any] = {}
    try:
        with _quiet_about_one_process():
            _load_state_dict(tensors, storage_reader=SafeFileSystemReader(path),
                             planner=SafeGatherPlanner(), no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:
        raise CheckpointError(path, f"not a checkpoint: {_first_line(err)}") from err
    if "optimizer" in tensors:
        tensors["optimizer"] = _keyed_by_index(tensors["optimizer"])
    return tensors


def _keyed_by_index(optimizer: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name (DCP's) keyed by index instead, the
    parameters numbered across groups in order, as ``torch.optim.Optimizer.state_dict``
    does, so that it loads with ``optimizer.load_state_dict`` into an unsharded model."""
    index, groups = {}, []
    for group in optimizer["param_groups"]:
        params = []
        for name in group["params"]:
            index.setdefault(name, len(index))
            params.append(index[name])
        groups.append({**group, "params": params})
    state = {index[name]: value for name, value in optimizer["state"].items()}
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def _own_entry(path: Path, by_rank: list[Any]) -> Any:
    """This process's entry of a by-rank list; rank 0's (with a warning) when the
    checkpoint was written by fewer processes."""
    rank = _rank()
    if rank < len(by_rank):
        return by_rank[rank]
    logger.warning("%s was written by %d process(es): rank %d takes rank 0's random state",
                   path, len(by_rank), rank)
    return by_rank[0]


def _holds_dtensor(value: Any) -> bool:
    if isinstance(value, DTensor):
        return True
    if isinstance(value, dict):
        return any(_holds_dtensor(item) for item in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_dtensor(item) for item in value)
    return False


def _gather(value: Any) -> list[Any]:
    """Every process's ``value``, by rank, on every process."""
    if not dist.is_initialized():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _split(payload: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The entries DCP writes as shards, and those ``state.pt`` holds."""
    return ({key: value for key, value in payload.items() if key in SHARDED_KEYS},
            {key: value for key, value in payload.items() if key not in SHARDED_KEYS})


def _shard_writer(temp: Path) -> dcp.FileSystemWriter:
    return dcp.FileSystemWriter(temp, sync_files=True)  # fsyncs every file it writes


def _shard_planner() -> DefaultSavePlanner:
    """A tensor every process holds whole (a BatchNorm buffer, which FSDP does not shard and
    each process keeps its own of) is written from rank 0, as state.pt is; DCP would
    otherwise spread such writes over the processes."""
    return DefaultSavePlanner(dedup_save_to_lowest_rank=True)


def _commit_folder(temp: Path, path: Path, rest: dict[str, Any], meta: dict[str, Any],
                   sharded: list[str], *, file_mode: int, crash: CrashPoints) -> None:
    """Rank 0's part of a save once every process's shards are in ``temp``: ``state.pt``,
    the rename to ``path`` and the sidecar (module docstring); the others return at once."""
    if _rank() != 0:
        return
    crash.reach("mid_write")  # the shards are written, state.pt is not
    _write_durably(temp / STATE_FILE, rest)
    files = {}
    for file in sorted(temp.iterdir()):
        os.chmod(file, file_mode)
        files[file.name] = {"sha256": sha256_of(file), "size_bytes": file.stat().st_size}
    fsync_dir(temp)
    crash.reach("before_rename")
    _replace_folder(temp, path)
    crash.reach("before_dir_fsync")
    fsync_dir(path.parent)
    crash.reach("before_sidecar")
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    sidecar = {**meta, "file": path.name, "size_bytes": sum(
        facts["size_bytes"] for facts in files.values()), "sha256": digest,
        "files": files, "sharded": sharded, "world_size": _world_size()}
    write_atomically(sidecar_of(path),
                     lambda file: file.write(json.dumps(sidecar, indent=1).encode()),
                     file_mode=file_mode)


@contextmanager
def _removed_on_failure(temp: Path) -> Iterator[None]:
    """Rank 0 removes the temp folder of a save that failed; DCP raises only once every
    process has stopped writing into it."""
    try:
        yield
    except BaseException:
        if _rank() == 0:
            shutil.rmtree(temp, ignore_errors=True)
        raise


@contextmanager
def _dcp_failure_as_os_error() -> Iterator[None]:
    """DCP gathers every process's failure into a ``CheckpointException``: raise the disk's
    ``OSError`` behind it, or one with its first line."""
    try:
        yield
    except CheckpointException as err:
        raise _disk_error(err) or OSError(_first_line(err)) from err


def _agree_on_temp_folder(path: Path) -> Path:
    """Rank 0 creates a fresh temp folder next to ``path`` and every process learns its name
    (or that rank 0 could not create it: then every process raises)."""
    made: list[Any] = [None]
    if _rank() == 0:
        try:
            made[0] = tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        except OSError as err:
            made[0] = err
    if dist.is_initialized():
        shared: list[Any] = [made[0] if isinstance(made[0], str) else None]
        dist.broadcast_object_list(shared, src=0)
        if _rank() > 0:
            made = shared
    if isinstance(made[0], OSError):
        raise made[0]
    if made[0] is None:
        raise OSError(f"rank 0 could not create a temp folder in {path.parent}")
    return Path(made[0])


def _write_durably(file: Path, payload: dict[str, Any]) -> None:
    """``torch.save`` into a new file, flushed and fsync'd; a full disk raises OSError."""
    with open(file, "xb") as stream:
        try:
            torch.save(payload, stream)
        except RuntimeError as err:  # the zip writer reports a failed write so
            raise os_error_behind(err) or OSError(_first_line(err)) from err
        stream.flush()
        os.fsync(stream.fileno())


def _replace_folder(temp: Path, path: Path) -> None:
    """Rename ``temp`` to ``path``. A folder already there (the same step saved again after a
    resume from an older checkpoint) is first renamed to a temp name and deleted after."""
    doomed = None
    if path.exists():
        doomed = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        os.rename(path, doomed)
    os.rename(temp, path)
    if doomed is not None:
        shutil.rmtree(doomed)


@contextmanager
def _quiet_about_one_process() -> Iterator[None]:
    """DCP warns at every save or load without a process group, and at every load with
    ``no_dist``: here both are meant (a one-process run; each process reading its own
    slices), so the warning would only repeat at every checkpoint."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _disk_error(err: CheckpointException) -> OSError | None:
    """The disk's ``OSError`` behind the first process's failure that has one (a full disk:
    DCP's writer reports it as torch.save's ``RuntimeError``)."""
    for _, (failure, _) in sorted(err.failures.items()):
        found = os_error_behind(failure)
        if found is not None:
            return found
    return None


def _first_line(err: BaseException) -> str:
    """The first line of ``err``; for DCP's ``CheckpointException``, whose own first line only
    lists ranks, that of the first process's error."""
    if isinstance(err, CheckpointException) and err.failures:
        failure = next(iter(err.failures.values()))
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return _first_line(inner)
    return first_line(err)
