"""The two checkpoint formats and the one place that picks between them: ``SingleFile``
(``handlers.checkpoint.files``: one ``.pt`` file, written by rank 0) for one process and
``--strategy ddp``, ``ShardedFolder`` (``handlers.checkpoint.sharded``: a ``.dcp`` folder of
shards, written by every process of a ``fully_shard`` run) for ``--strategy fsdp``. Writing
picks by the strategy (``format_for``), reading by the path (``read_checkpoint``). The sharded
format is imported only when it is used: it pulls in ``torch.distributed.checkpoint``.
"""

import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from handlers.checkpoint.crash_points import CrashPoints
from handlers.checkpoint.files import SingleFile, read_file

SUFFIXES = {"ddp": ".pt", "fsdp": ".dcp"}  # the checkpoint's suffix by --strategy


def format_for(strategy: str, collective_timeout: timedelta | None = None
               ) -> "CheckpointFormat":
    """The format a run of ``--strategy`` writes and resumes from; ``collective_timeout``:
    how long a sharded save's collectives wait for the other processes (the run's
    ``--collective-timeout``)."""
    if strategy == "fsdp":
        from handlers.checkpoint.sharded import ShardedFolder  # torch.distributed only here

        return ShardedFolder(collective_timeout)
    return SingleFile()


def read_checkpoint(path: str | os.PathLike, *, expected_run_id: str | None = None,
                    required_keys: tuple[str, ...] = (), whole: bool = True) -> dict[str, Any]:
    """Verify ``path`` against its sidecar and load it onto the CPU with ``weights_only=True``.

    Raises ``CheckpointError`` whose ``reason`` is e.g. ``truncated (0 bytes)``,
    ``no checksum sidecar ...``, ``checksum mismatch``, ``from another run <id>`` or
    ``not a checkpoint: <error>``. Use it to read weights for evaluation:
    ``read_checkpoint("checkpoints/best.pt")["model"]``. A sharded checkpoint folder
    (``best.dcp``) reads the same way, its shards gathered into whole tensors
    (``handlers.checkpoint.sharded.read_sharded``); ``whole=False`` verifies every file of
    it but loads no shard (for its ``meta``: the whole model may not fit one process).
    """
    path = Path(path)
    if path.is_dir() or path.suffix == ".dcp":
        from handlers.checkpoint.sharded import read_sharded  # torch.distributed only here

        return read_sharded(path, expected_run_id=expected_run_id, required_keys=required_keys,
                            whole=whole)
    return read_file(path, expected_run_id=expected_run_id, required_keys=required_keys)


class CheckpointFormat(Protocol):
    """How one checkpoint is written, verified and read; ``SingleFile`` and
    ``handlers.checkpoint.sharded.ShardedFolder`` are the two. Under several processes every
    process calls each method at the same moment when the format's saves are collective."""

    suffix: str  # of a checkpoint's name: ".pt", ".dcp"

    def snapshot(self, to_save: dict[str, Any]) -> dict[str, Any]: ...
    def first_non_finite(self, model_state: dict[str, Any]) -> str | None: ...
    def unloadable(self, payload: dict[str, Any]) -> str | None: ...
    def write(self, path: Path, payload: dict[str, Any], meta: dict[str, Any], *,
              file_mode: int, crash: CrashPoints) -> None: ...
    # ``write`` behind training: copy what it writes now and return the rest, for another
    # thread, which returns the name of a model tensor that is not finite (nothing written).
    def write_behind(self, path: Path, payload: dict[str, Any], meta: dict[str, Any], *,
                     file_mode: int, crash: CrashPoints) -> Callable[[], str | None]: ...
    # Whether a save written behind training failed on any process, given this one's outcome.
    def failed_anywhere(self, failed: bool) -> bool: ...
    def read(self, path: Path, *, expected_run_id: str | None,
             required_keys: tuple[str, ...]) -> dict[str, Any]: ...
    def restore(self, path: Path, payload: dict[str, Any], targets: dict[str, Any]) -> None: ...
    def link(self, target: Path, links: list[Path]) -> None: ...
    def delete(self, path: Path, crash: CrashPoints) -> None: ...
    def stale_temps(self, dirname: Path) -> list[Path]: ...
    def remove(self, path: Path) -> None: ...
