"""One writer per run folder: an exclusive ``flock`` on ``<run_dir>/.lock``.

    with RunLock(run_dir):   # raises ConfigError at once if another process holds it
        train()

The lock is the ``flock`` itself, which the kernel drops when the holder's file is
closed, so a process killed with ``kill -9`` never leaves a stale lock behind. A forked
child (a DataLoader worker) would share that open file, and with it the lock, for as long
as it outlives its parent: each child closes its copy as it starts (``os.register_at_fork``),
so only the process that took the lock holds it. The PID
and host written into the file only serve the message a second writer gets.

Under ``--nproc`` spawning, take the lock in the parent before spawning and release it
after the group ends: the parent holds it for every rank.
"""

import errno
import fcntl
import os
import socket
import stat
from pathlib import Path
from types import TracebackType

from recipes.runner.config.command_line import ConfigError

LOCK_NAME = ".lock"
_HELD: set["RunLock"] = set()  # the locks this process holds, until released


class RunLock:
    """Exclusive, non-blocking lock on a run folder (created if missing); a context manager.

    ``acquire`` raises ``ConfigError`` at once, naming the folder and the holder's PID and
    host, when another process (or another ``RunLock`` in this one) holds it.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this RunLock")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = self._open_regular_file()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(
                f"{self.run_dir} is in use by {holder} (another run is writing it); "
                "wait for it or choose another --run-name"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        _HELD.add(self)

    def _open_regular_file(self) -> int:
        """Open (or create) the lock file itself: never through a link, which would truncate
        whatever it points at, and never a folder, FIFO or device."""
        # O_CLOEXEC: a program this process executes must not keep the run locked after we exit.
        # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just after).
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        refused = ConfigError(f"{self.path} is not a regular file (a link, folder or device); "
                              "remove it, or choose another --run-name")
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                raise refused from None
            raise ConfigError(f"cannot open {self.path}: {error.strerror}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise refused
        return fd

    def release(self) -> None:
        """Drop the lock; a no-op when not held. The file stays: deleting it would let a
        process that opened the old file and one that creates a new one both 'hold' it."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        _HELD.discard(self)
        try:
            os.ftruncate(fd, 0)  # still ours until the close: no stale holder in the file
        finally:
            os.close(fd)

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()


def _let_go_in_child() -> None:
    """In a freshly forked child: close its copies of the held lock files."""
    for lock in list(_HELD):
        fd, lock._fd = lock._fd, None
        if fd is not None:
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_let_go_in_child)


def _read_holder(fd: int) -> str:
    """'process 1234 on host h' from the lock file, or a vaguer phrase while the holder
    has not written it yet."""
    fields = os.pread(fd, 4096, 0).decode(errors="replace").split()
    if len(fields) == 2 and fields[0].isdigit():
        return f"process {fields[0]} on host {fields[1]}"
    return "another process"
