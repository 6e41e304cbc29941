"""One writer per run folder: an exclusive ``flock`` on ``<run_dir>/.lock``.

    with RunLock(run_dir):   # raises ConfigError at once if another process holds it
        train()

The lock is the ``flock`` itself, which the kernel drops when the holder's file is
closed, so a process killed with ``kill -9`` never leaves a stale lock behind. A forked
child (a DataLoader worker) would share that open file, and with it the lock, for as long
as it outlives its parent: each child closes its copy as it starts (``os.register_at_fork``),
so only the process that took the lock holds it. The PIDs and host written into the file
only serve the message a second writer gets.

Under ``--nproc`` spawning, take the lock in the parent before spawning and pass the
``RunLock`` to every process spawned (an argument of the spawned function): pickled for a
spawned process, it carries the open lock file itself (``multiprocessing``'s ``DupFd``: the
descriptor is handed over as the process is created), so each process holds the one lock from
the moment it exists until it exits, and the kernel drops it only when the last of the
parent and its processes has ended, however each ends. Why not the alternatives:

- the parent alone: ``kill -9`` of the parent frees the lock while its processes still run
  (torch's spawn sends them SIGINT as their parent dies, and they finish the step and save,
  for seconds), and a start at once ran a second group beside them;
- each process dying with its parent (``PR_SET_PDEATHSIG``): a signal sent is not a process
  gone, the kernel frees its files only once it has exited, and a SIGKILL would throw away
  the step that the SIGINT lets it save;
- a shared lock each process takes as it starts, which a starter must take exclusively: the
  processes take it only seconds after they are created (Python and torch import first),
  and a parent killed in between leaves them running with no lock held.

torchrun's processes are not spawned by this code (its agent starts each in a session of
its own, and nothing signals them when torchrun itself is killed): there rank 0 takes the
lock before anything is written and holds it until it exits (``recipes.runner.training.group``). The
other ranks write only their shards of a sharded checkpoint, into a temporary folder that
rank 0 names and alone commits.
"""

import errno
import fcntl
import multiprocessing.reduction
import os
import socket
import stat
from pathlib import Path
from types import TracebackType
from typing import Any

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
        try:  # a full disk refuses the holder line: the lock is not taken, nor kept open
            os.ftruncate(fd, 0)
            _write_holder(fd)
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        _HELD.add(self)

    def __reduce__(self) -> tuple:
        """Pickled for a process being spawned: the process gets this open lock file, and with
        it the lock, which it holds until it exits (module docstring)."""
        if self._fd is None:
            raise RuntimeError(f"{self.path} is not held: only a held RunLock can be passed on")
        return _held_in_spawned_process, (self.run_dir, multiprocessing.reduction.DupFd(self._fd))

    def _open_regular_file(self) -> int:
        """Open (or create) the lock file itself: never through a link, which would truncate
        whatever it points at, and never a folder, FIFO or device."""
        # O_CLOEXEC: a program this process executes must not keep the run locked after we exit.
        # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just after).
        # O_APPEND: each spawned process adds its PID after the parent's, from its own copy.
        flags = (os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
                 | os.O_APPEND)
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


def _held_in_spawned_process(run_dir: Path, handle: Any) -> RunLock:
    """In a spawned process, as its arguments are unpickled: the parent's lock, now held here
    too, until this process exits (``handle``: what ``DupFd`` made of its open file)."""
    lock = RunLock(run_dir)
    lock._fd = handle.detach()
    os.set_inheritable(lock._fd, False)  # as O_CLOEXEC: not for a program this process runs
    _HELD.add(lock)  # this process's DataLoader workers close it, as the parent's do
    _write_holder(lock._fd)
    return lock


def _write_holder(fd: int) -> None:
    """Add this process's 'PID host' line to the lock file (appended: O_APPEND)."""
    os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())


def _read_holder(fd: int) -> str:
    """'process 1234 on host h' from the lock file ('processes 1234, 1235, 1236 on host h' for
    a spawning parent and its processes, some of which may have ended), or a vaguer phrase
    while the holder has not written it yet."""
    lines = [line.split() for line in os.pread(fd, 4096, 0).decode(errors="replace").splitlines()]
    if not lines or any(len(fields) != 2 or not fields[0].isdigit() for fields in lines):
        return "another process"
    pids, host = [fields[0] for fields in lines], lines[0][1]
    if len(pids) == 1:
        return f"process {pids[0]} on host {host}"
    return f"processes {', '.join(pids)} on host {host}"
