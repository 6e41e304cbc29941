"""The one crash-safe way this project replaces a file: checkpoints, their sidecars, a run's
``config.json`` and ``summary.json``, and the decoded-image cache all go through it.

``write_atomically`` writes a temp file in the same folder → ``write(file)`` → flush + fsync →
``os.replace`` → fsync of the folder. A crash at any instant leaves either the previous file
or the new one, whole; after it returns, the new file and its name survive a power cut.
"""

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from handlers.crash_points import CrashPoints


def write_atomically(path: Path, write: Callable[[BinaryIO], Any], *, file_mode: int = 0o600,
                     crash: CrashPoints | None = None) -> None:
    """Write ``path`` through ``write(file)`` so that it either appears whole or not at all,
    with permissions ``file_mode``; ``crash`` stops the process at each phase in fault tests."""
    reach = crash.reach if crash is not None else lambda phase: None
    reach("before_temp")
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            os.fchmod(file.fileno(), file_mode)
            write(file)
            reach("mid_write")
            file.flush()
            os.fsync(file.fileno())
        reach("before_rename")
        os.replace(temp, path)
        reach("before_dir_fsync")
        fsync_dir(path.parent)
    finally:
        Path(temp).unlink(missing_ok=True)  # already gone after a successful replace


def fsync_dir(dirname: Path) -> None:
    """Make renames and new names in ``dirname`` durable."""
    fd = os.open(dirname, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
