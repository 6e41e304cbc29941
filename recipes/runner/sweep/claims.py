"""Which worker trains which trial: a worker holds a trial's claim, a ``RunLock`` on
``<sweep-dir>/.claims/trial-NNNN``, from before it trains the trial until Optuna has its
result.

A trial Optuna lists as RUNNING whose claim no process holds was left by a worker that died
(the kernel drops a killed process's lock): a worker takes it over and continues it in its own
folder. The claim is a lock of its own, not the trial folder's ``.lock``, because the run
layer takes that one itself while the trial trains, in the same process. The trial's state is
read again once the claim is held: a worker that finished it in between has told Optuna
before letting go, so nothing is trained twice.
"""

import socket
import time
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState

from recipes.runner.config.command_line import ConfigError
from recipes.runner.training.lock import RunLock

CLAIMS = ".claims"
HOST, FOLDER = "host", "folder"  # the trial's user attributes: where it trains
# A RUNNING trial without a host yet is one whose worker asked for it microseconds ago (it
# claims it, then names its host and folder), or died in between: taken over after this long.
UNNAMED_AFTER_SEC = 60.0


def trial_folder(sweep_dir: Path, number: int) -> Path:
    return sweep_dir / f"trial-{number:04d}"


def claim(sweep_dir: Path, study: optuna.Study, number: int) -> RunLock | None:
    """The claim of trial ``number`` if no one holds it and the trial is still RUNNING, else
    None."""
    lock = RunLock(sweep_dir / CLAIMS / f"trial-{number:04d}")
    try:
        lock.acquire()
    except ConfigError:  # another worker trains it
        return None
    if _state(study, number) != TrialState.RUNNING:
        lock.release()
        return None
    return lock


def held_by_a_live_worker(sweep_dir: Path, number: int) -> bool:
    """Whether a process holds trial ``number``'s claim (for ``--status``: running or not)."""
    lock = RunLock(sweep_dir / CLAIMS / f"trial-{number:04d}")
    if not lock.path.exists():
        return False
    try:
        lock.acquire()
    except ConfigError:
        return True
    lock.release()
    return False


def orphans(study: optuna.Study) -> list[FrozenTrial]:
    """The RUNNING trials this worker may take over if no one holds their claim: those that
    train on this host, or in a folder this host sees (a shared filesystem), and those that
    never got a host."""
    now = time.time()
    found = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        host, folder = trial.user_attrs.get(HOST), trial.user_attrs.get(FOLDER)
        if host is None:
            started = trial.datetime_start.timestamp() if trial.datetime_start else now
            if now - started > UNNAMED_AFTER_SEC:
                found.append(trial)
        elif host == socket.gethostname() or (folder and Path(folder).is_dir()):
            found.append(trial)
    return found


def name_place(trial: optuna.Trial, folder: Path) -> None:
    """Record where ``trial`` trains (once its claim is held)."""
    trial.set_user_attr(HOST, socket.gethostname())
    trial.set_user_attr(FOLDER, str(folder.resolve()))


def _state(study: optuna.Study, number: int) -> TrialState | None:
    return next((trial.state for trial in study.get_trials(deepcopy=False)
                 if trial.number == number), None)
