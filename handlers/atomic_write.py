"""The one crash-safe way this project replaces a file: checkpoints, their sidecars, a run's
``config.json`` and ``summary.json``, and the decoded-image cache all go through it.

``write_atomically`` writes a temp file in the same folder → ``write(file)`` → flush + fsync →
``os.replace`` → fsync of the folder. A crash at any instant leaves either the previous file
or the new one, whole; after it returns, the new file and its name survive a power cut.
``os_error_behind`` finds the ``OSError`` behind a writer's own exception (``torch.save``'s
zip writer reports a full disk as a ``RuntimeError``). ``write_json_atomic`` writes a dict through
it as sorted, indented, strict JSON (NaN and infinities as null).
"""

import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from handlers.checkpoint.crash_points import CrashPoints


def write_atomically(path: Path, write: Callable[[BinaryIO], Any], *,
                     file_mode: int | None = None, crash: CrashPoints | None = None) -> None:
    """Write ``path`` through ``write(file)`` so that it either appears whole or not at all,
    with permissions ``file_mode`` (None: those a plain ``open`` gives, 0o666 less the umask);
    ``crash`` stops the process at each phase in fault tests."""
    reach = crash.reach if crash is not None else lambda phase: None
    reach("before_temp")
    mode = 0o666 & ~current_umask() if file_mode is None else file_mode
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            os.fchmod(file.fileno(), mode)  # mkstemp's file is 0o600 whatever the umask
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


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it: setting it to read
    it back would, for that instant, give other threads' new files no mask at all."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines()
                        if line.startswith("Umask:")), 8)
    except (OSError, StopIteration):
        mask = os.umask(0o077)  # the strictest mask, should another thread create a file now
        os.umask(mask)
        return mask


def fsync_dir(dirname: Path) -> None:
    """Make renames and new names in ``dirname`` durable."""
    fd = os.open(dirname, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def os_error_behind(error: BaseException) -> OSError | None:
    """The first ``OSError`` with an errno in ``error``'s chain (``error`` itself, then its
    ``__cause__`` or ``__context__``, and so on), as a new ``OSError`` of that errno, reason
    and file; None when there is none. ``torch.save``'s zip writer turns the ``OSError(28)``
    of a full disk into ``RuntimeError("[enforce fail at inline_container.cc:...] unexpected
    pos ...")``, which says nothing of the disk; the OSError is its ``__context__``."""
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        if isinstance(link, OSError) and link.errno is not None:
            return OSError(link.errno, link.strerror, *([link.filename] if link.filename
                                                        else []))
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


def _strict_json(value: Any) -> Any:
    """NaN and infinities as null: strict JSON has no spelling for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _strict_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_strict_json(item) for item in value]
    return value


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as sorted, indented JSON through ``write_atomically`` (temp file,
    fsync, rename, fsync of the folder): readers never see half a file, and once written it
    survives a power cut as a checkpoint does. Non-finite numbers are written as null."""
    text = json.dumps(_strict_json(payload), indent=2, sort_keys=True, allow_nan=False) + "\n"
    write_atomically(path, lambda file: file.write(text.encode()))
