"""One recipe on several processes, through ``ignite.distributed``: spawned here or by torchrun.

``python -m recipes cifar --nproc 2`` spawns two processes
(``idist.Parallel(backend, nproc_per_node=2)``); ``torchrun --nproc-per-node=2 -m recipes
cifar`` starts them itself, and each one joins their group (``torchrun_group``). Every process
then runs the same training function on its slice of each global batch (docs/design.md,
"Randomness and exact resume"); only rank 0 writes. Either way the group's collectives wait
``--collective-timeout`` seconds for a peer (``recipes.runner.training.peers``).

Rank 0's exit code is the run's (the others return 0 when they finish). A process that
raises ends the others at once (the spawner or torchrun stops them), and the spawner exits
with its code: 2 for a user error, which the failing process has already printed, else 1.
The spawner reports the cause, not its echo: a process leaving the group on a user error is
a lost peer to the others (exit 5), and one of them may exit first; so each process records
its exit code before it leaves, and the spawner reports a lost peer only when no process had
another reason to stop.

Restarts by torchrun (``--max-restarts N``): a restarted group continues its run. torchrun
starts every process of a restarted group with the command line of the first start,
and tells it which start this is in ``TORCHELASTIC_RESTART_COUNT``. The same command again
already continues its run (the run folder is chosen as for a second start by hand, the run
lock died with the processes that held it, ``--resume auto`` loads the newest good
checkpoint); what the first start's ``--resume`` asked (``never``: a new run; a file: that
checkpoint) would start the run over or go back to an older step, so a restart resumes
``auto`` whatever ``--resume`` says (``recipes.runner.resume.plan`` decides it from
``restart_count``).

torch 2.14.1's agent shares one TCP store with every start of the workers by default, and a
restarted group can then fail to join (gloo's ``connectFullMesh``: "Connection refused") or
hang (tests/reliability/torchrun_restart.py shows it without project code). With
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` and the c10d rendezvous each start gets its own
store: rank 0 of a first start with restarts allowed says so when that is not set.
"""

import atexit
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import ignite.distributed as idist
import torch
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from engine.precision import resolve_device
from handlers.checkpoint.files import CheckpointError
from recipes.runner.config.command_line import ConfigError, DataError, ExitCode
from recipes.runner.console import warn
from recipes.runner.training.lock import RunLock
from recipes.runner.training.peers import unless_peer_lost

# The exceptions that mean "the user must change something": exit 2, one line, no traceback.
USER_ERRORS = (ConfigError, DataError, CheckpointError)
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")  # set by torchrun for each process


def launched_by_torchrun() -> bool:
    """Whether a launcher (torchrun) started this process as one rank of a group."""
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


@dataclass(frozen=True)
class Launch:
    """How many processes run in all, and the backend of their group."""

    world_size: int
    backend: str


def plan_launch(nproc: int, backend: str, device: str, batch_size: int) -> Launch:
    """Check ``--nproc``/``--backend``/``--device``/``--batch-size`` against each other and
    against how this process was started; ``ConfigError`` naming the keys."""
    try:
        resolved = resolve_device(device)
    except ValueError as error:
        raise ConfigError(f"--device: {error}") from None
    if launched_by_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if nproc != 1:
            raise ConfigError(f"--nproc {nproc}: torchrun already started {world_size} "
                              "process(es) (WORLD_SIZE); use --nproc 1 under torchrun")
    else:
        world_size = per_node = nproc
    if batch_size % world_size:
        raise ConfigError(f"--batch-size {batch_size} (global) must be divisible by the "
                          f"{world_size} processes")
    if backend == "auto":
        backend = "nccl" if resolved.type == "cuda" else "gloo"
    if backend == "nccl" and resolved.type != "cuda":  # even where one process needs none
        raise ConfigError("--backend nccl needs CUDA devices; processes on the CPU "
                          "use --backend gloo (or auto)")
    if world_size > 1:
        if resolved.type == "cuda" and resolved.index is not None:
            raise ConfigError(f"--device {device}: each process uses cuda:<local rank>; "
                              "use --device cuda or auto")
        if resolved.type == "cuda" and per_node > torch.cuda.device_count():
            raise ConfigError(f"{per_node} processes on this machine but only "
                              f"{torch.cuda.device_count()} CUDA device(s): one process per GPU")
        if backend not in idist.available_backends():
            raise ConfigError(f"--backend {backend} is not available in this PyTorch build; "
                              f"available: {', '.join(idist.available_backends())}")
    return Launch(world_size, backend)


def process_device(device: str) -> torch.device:
    """This process's device: ``device`` alone; in a group, cuda:<local rank> or the CPU."""
    resolved = resolve_device(device)
    if idist.get_world_size() == 1 or resolved.type != "cuda":
        return resolved
    return torch.device("cuda", idist.get_local_rank())


def share_machine(device: torch.device) -> None:
    """Inside a process of a group: only rank 0 prints and warns (the others would repeat
    it; errors still reach stderr), and processes on the CPU split its cores instead of
    each using all of them."""
    if idist.get_world_size() == 1:
        return
    if idist.get_rank() > 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the rest of this process)
        logging.disable(logging.WARNING)
    if device.type == "cpu":
        cores = len(os.sched_getaffinity(0))
        torch.set_num_threads(max(1, cores // idist.get_nproc_per_node()))


def rank_zero_exit_code(exit_code: int) -> int:
    """``exit_code`` on rank 0, 0 on the others: rank 0 speaks for the group. The spawner
    and torchrun stop every process at the first non-zero exit, and another rank ending
    first (a non-finite stop is raised on all) must not cut rank 0's summary short."""
    return exit_code if idist.get_rank() == 0 else 0


def spawn(fn: Callable[..., int], *args: Any, nproc: int, backend: str, collective_timeout: int,
          lock: RunLock | None = None) -> int:
    """Run ``fn(local_rank, *args) -> exit code`` in ``nproc`` new processes forming a
    ``backend`` group on this machine, whose collectives wait ``collective_timeout`` seconds;
    return the first non-zero exit code, or 0. Each process holds ``lock`` (the run folder's,
    held here) from its start until it exits, so the folder stays locked while any of them
    lives, even if this process is killed."""
    # Ctrl-C reaches every process of the terminal's group: the trainers stop and save
    # on their own, and this process keeps waiting to report how they ended.
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    # Each process's exit code, written before it leaves the group (0 until then).
    exit_codes = torch.multiprocessing.get_context("spawn").Array("i", nproc)
    try:
        port = int(os.environ.get("MASTER_PORT") or _free_port())
        with idist.Parallel(backend=backend, nproc_per_node=nproc, master_port=port,
                            timeout=timedelta(seconds=collective_timeout)) as parallel:
            parallel.run(_process_main, lock, collective_timeout, exit_codes, fn, args)
    except ProcessRaisedException as failure:
        warn(f"error: process {failure.error_index} failed:{failure.msg}")
        return 1
    except ProcessExitedException as failure:
        if failure.signal_name is None:  # the process printed its own error
            return cause_of(failure.exit_code, list(exit_codes))
        warn(f"error: {failure}")
        return 128 - failure.exit_code  # killed by a signal: exit_code is minus its number
    finally:
        signal.signal(signal.SIGINT, previous)
    return 0


def cause_of(first_exit: int, exit_codes: list[int]) -> int:
    """The group's exit code when a process exited non-zero (``first_exit``, as the spawner
    saw it first): a lost peer only when no process recorded another cause."""
    if first_exit != ExitCode.PEER_LOST:
        return first_exit
    return next((code for code in exit_codes if code not in (0, ExitCode.PEER_LOST)),
                first_exit)


def _process_main(local_rank: int, lock: RunLock | None, collective_timeout: int,
                  exit_codes: Any, fn: Callable[..., int], args: tuple[Any, ...]) -> None:
    # ``lock`` needs no call: unpickled as this process started, it holds the run's lock
    # until the process exits (recipes.runner.training.lock).
    try:
        exit_code = unless_peer_lost(lambda: fn(local_rank, *args), collective_timeout,
                                     "to continue the run, run the same command again")
    except USER_ERRORS as error:
        warn(f"error: {error}", flush=True)
        exit_code = ExitCode.USER_ERROR
    exit_codes[local_rank] = exit_code  # before the others can see this process leave
    idist.finalize()  # what Ignite does once this function returns
    exit_process(exit_code)


@contextmanager
def torchrun_group(backend: str, collective_timeout: int) -> Iterator[None]:
    """Join torchrun's group for the block: its collectives wait ``collective_timeout``
    seconds. (``idist.Parallel(backend)`` joins it too, but passes no timeout: the group
    would wait 30 minutes for a peer that stopped answering.)"""
    idist.initialize(backend, timeout=timedelta(seconds=collective_timeout))
    try:
        yield
    finally:
        idist.finalize()


def exit_process(exit_code: int) -> NoReturn:
    """End a process of a group that has left it: flush and exit at once, without Python's
    interpreter shutdown. Gloo's worker thread frees a finished collective's tensors a moment
    after the collective returns; when that falls into the interpreter's shutdown, the thread
    cannot take the GIL and the process aborts ("terminate called without an active
    exception", seen in ~1 of 40 two-process runs here: a core dump shows
    ~AsyncBarrierWork -> TensorImpl::decref_pyobject -> take_gil -> pthread_exit; pytorch PR
    #179291 describes it). torchrun then restarts a run that had finished. The exit
    functions run first, as at a normal exit (logging's flush; multiprocessing's finalizers,
    which release e.g. tqdm's lock, else the spawner warns of leaked semaphores); what
    os._exit skips is only the interpreter's teardown that follows them."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def _free_port() -> int:
    """A TCP port free on this machine now, for the group's rendezvous (several runs at once
    would collide on a fixed one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RankZeroSave:
    """Rank 0 saves; every rank learns whether the save worked and raises the same
    ``CheckpointError`` if not, so all stop together with exit code 4. (A rank that went on
    alone would wait forever in the next all-reduce for the rank that stopped.) Attach it
    on every rank at the same events: under several processes it is a collective."""

    failure = "rank 0 could not save it"  # what the ranks without the cause raise

    def __init__(self, save: Callable[[Any], None]) -> None:
        self.save = self.__wrapped__ = save  # __wrapped__: how --describe names it

    def saves_here(self) -> bool:
        return idist.get_rank() == 0

    def __call__(self, engine: Any) -> None:
        error = None
        if self.saves_here():
            try:
                self.save(engine)
            except CheckpointError as raised:
                error = raised
        if idist.get_world_size() > 1 and idist.all_reduce(int(error is not None)):
            error = error or CheckpointError("checkpoint", self.failure)
        if error is not None:
            raise error


SHARED_STORE_HINT = (
    "warning: torchrun --max-restarts: a restarted group may fail to join while torchrun "
    "shares its store with the workers; start torchrun with "
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and --rdzv-backend c10d (docs/distributed.md, "
    "\"Restarts\")")


def restart_count() -> int:
    """Which start of torchrun's group this process belongs to: 0 for the first."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def how_to_continue() -> str:
    """What continues a torchrun group that has stopped on an error: torchrun itself while it
    has restarts left, else the same command again."""
    left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - restart_count()
    if left > 0:
        return (f"torchrun starts the group again ({left} restart(s) left); where a machine's "
                "torchrun is gone, run the same torchrun command there again")
    return "to continue the run, run the same torchrun command again on every machine"


def warn_if_store_shared() -> None:
    """Under torchrun, before the group joins: rank 0 of a first start that allows restarts
    warns when they may fail to join. (That a restart resumes ``auto`` is
    ``recipes.runner.resume.plan``'s.)"""
    count, rank = restart_count(), int(os.environ["RANK"])
    restarts_allowed = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if rank == 0 and count == 0 and restarts_allowed and shared:
        warn(SHARED_STORE_HINT, flush=True)
