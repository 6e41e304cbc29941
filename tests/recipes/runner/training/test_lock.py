import contextlib
import fcntl
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recipes.runner.config.command_line import ConfigError
from recipes.runner.training.lock import LOCK_NAME, RunLock

REPO = Path(__file__).resolve().parents[4]
HOLD_SCRIPT = """
import sys, time
from recipes.runner.training.lock import RunLock
lock = RunLock(sys.argv[1])
lock.acquire()
print("locked", flush=True)
time.sleep(60)
"""


def try_from_another_process(run_dir: Path) -> subprocess.CompletedProcess:
    script = ("import sys\nfrom recipes.runner.training.lock import RunLock\n"
              "from recipes.runner.config.command_line import ConfigError\n"
              "try:\n    RunLock(sys.argv[1]).acquire()\n"
              "except ConfigError as error:\n    print(error)\n    sys.exit(2)\n")
    return subprocess.run([sys.executable, "-c", script, str(run_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def holder(tmp_path):
    """A child python holding the lock on ``tmp_path / 'run'``; killed at the end."""
    child = subprocess.Popen([sys.executable, "-c", HOLD_SCRIPT, str(tmp_path / "run")],
                             cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "locked\n"
        yield child
    finally:
        child.kill()
        child.wait()


def test_second_writer_in_another_process_fails_at_once_naming_folder_and_holder(tmp_path):
    run_dir = tmp_path / "runs" / "cifar" / "x"
    with RunLock(run_dir) as lock:
        assert lock.held
        assert (run_dir / LOCK_NAME).read_text() == f"{os.getpid()} {socket.gethostname()}\n"
        other = try_from_another_process(run_dir)
    assert other.returncode == 2
    assert other.stdout == (
        f"{run_dir} is in use by process {os.getpid()} on host {socket.gethostname()} "
        "(another run is writing it); wait for it or choose another --run-name\n"
    )
    assert not lock.held


def test_a_held_lock_refuses_without_waiting(tmp_path, holder):
    start = time.monotonic()
    with pytest.raises(ConfigError, match=f"in use by process {holder.pid} on host"):
        RunLock(tmp_path / "run").acquire()
    assert time.monotonic() - start < 0.5


def test_release_then_acquire_again(tmp_path):
    first = RunLock(tmp_path / "run")
    first.acquire()
    with pytest.raises(ConfigError, match="is in use by"):  # one writer, even in one process
        RunLock(tmp_path / "run").acquire()
    first.release()
    assert (tmp_path / "run" / LOCK_NAME).read_text() == ""  # no holder named any more
    first.release()  # a no-op
    with RunLock(tmp_path / "run"):
        pass
    assert try_from_another_process(tmp_path / "run").returncode == 0


def test_a_holder_killed_with_sigkill_leaves_no_stale_lock(tmp_path, holder):
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert str(holder.pid) in (tmp_path / "run" / LOCK_NAME).read_text()  # the file stays...
    with RunLock(tmp_path / "run") as lock:  # ...but the lock died with the process
        assert lock.held


FORKING_HOLDER = """
import os, sys, time
from recipes.runner.training.lock import RunLock
RunLock(sys.argv[1]).acquire()
child = os.fork()  # as a DataLoader forks its workers
if child == 0:
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
time.sleep(60)
"""


def test_a_forked_child_of_a_killed_holder_does_not_keep_the_lock(tmp_path):
    """A DataLoader worker forked by the run outlives a kill -9 of the run for a few
    seconds: the immediate rerun must still get the lock."""
    holder = subprocess.Popen([sys.executable, "-c", FORKING_HOLDER, str(tmp_path / "run")],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    child = int(holder.stdout.readline())
    try:
        assert try_from_another_process(tmp_path / "run").returncode == 2
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        os.kill(child, 0)  # the forked child is still alive
        with RunLock(tmp_path / "run") as lock:
            assert lock.held
    finally:
        holder.kill()
        os.kill(child, signal.SIGKILL)


def test_the_lock_file_is_not_inherited_by_executed_programs(tmp_path):
    with RunLock(tmp_path / "run") as lock:
        assert fcntl.fcntl(lock._fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        # A child started with every inheritable fd kept outlives our release and must not
        # hold the run locked.
        child = subprocess.Popen(["sleep", "30"], close_fds=False)
    try:
        with RunLock(tmp_path / "run"):
            pass
    finally:
        child.kill()
        child.wait()


def test_acquiring_twice_on_one_object_is_a_bug(tmp_path):
    with RunLock(tmp_path / "run") as lock, pytest.raises(RuntimeError, match="already held"):
        lock.acquire()


def test_a_lock_that_is_a_symbolic_link_is_refused_and_its_target_untouched(tmp_path):
    """A ``.lock`` linking elsewhere must not be followed: opening it would truncate the
    file it points at."""
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_NAME).symlink_to(target)
    with pytest.raises(ConfigError, match="not a regular file") as refused:
        RunLock(run_dir).acquire()
    assert "\n" not in str(refused.value) and str(run_dir / LOCK_NAME) in str(refused.value)
    assert target.read_text() == "keep me\n"


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_lock_that_is_not_a_regular_file_is_refused(tmp_path, kind):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock_path = run_dir / LOCK_NAME
    if kind == "folder":
        lock_path.mkdir()
    else:
        os.mkfifo(lock_path)
    with pytest.raises(ConfigError, match="not a regular file") as refused:
        RunLock(run_dir).acquire()
    assert "\n" not in str(refused.value)


SPAWNING_HOLDER = """
import multiprocessing, os, sys, time
from recipes.runner.training.lock import RunLock


def hold(lock):
    worker = os.fork()  # as its DataLoader forks its workers
    if worker == 0:
        time.sleep(60)
        os._exit(0)
    print(os.getpid(), worker, flush=True)
    time.sleep(60)


if __name__ == "__main__":
    lock = RunLock(sys.argv[1])
    lock.acquire()
    context = multiprocessing.get_context("spawn")  # as --nproc spawns its processes
    context.Process(target=hold, args=(lock,)).start()
    time.sleep(60)
"""


def test_a_spawned_process_holds_the_lock_until_it_exits_even_after_a_kill_9_of_its_parent(
        tmp_path):
    """The ``--nproc`` parent passes its ``RunLock`` to each process it spawns, which then
    holds the lock too: killed with ``kill -9``, the parent leaves the folder locked while a
    process it spawned lives on (that process's own forked workers do not hold it)."""
    script = tmp_path / "holder.py"
    script.write_text(SPAWNING_HOLDER)
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, str(script), str(run_dir)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    spawned, worker = map(int, holder.stdout.readline().split())
    try:
        holder.kill()
        holder.wait()
        refused = try_from_another_process(run_dir)
        assert refused.returncode == 2
        assert (f"in use by processes {holder.pid}, {spawned} on host {socket.gethostname()} "
                in refused.stdout), refused.stdout
        os.kill(spawned, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while try_from_another_process(run_dir).returncode == 2:  # until it is reaped
            assert time.monotonic() < deadline, "the lock outlived the spawned process"
        os.kill(worker, 0)  # its forked worker is still alive, and holds nothing
    finally:
        for pid in (spawned, worker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_only_a_held_lock_can_be_passed_to_a_spawned_process(tmp_path):
    with pytest.raises(RuntimeError, match="not held"):
        pickle.dumps(RunLock(tmp_path / "run"))
