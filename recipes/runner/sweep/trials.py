"""A sweep's worker: take the next trial (one a dead worker left first, else a new one), train
it as an ordinary run in ``<sweep-dir>/trial-NNNN``, tell Optuna its result; until the study
holds ``trials`` finished or pruned trials, counting those other workers are training.

Each trial is ``recipes.runner.training.run.run`` on the fixed keys plus the trial's values, with
``--run-dir`` its folder: its checkpoints, TensorBoard, metrics.jsonl and summary.json are a
run's, and a trial started again (its worker killed) resumes from its newest checkpoint as
any run does, bit-identical to one never interrupted.
"""

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from handlers.graceful_stop import EXIT_CODES as STOP_EXIT_CODES
from recipes.runner.api import Recipe
from recipes.runner.config.command_line import ExitCode, flag_name, validate
from recipes.runner.console import say, warn
from recipes.runner.sweep.claims import claim, name_place, orphans, trial_folder
from recipes.runner.sweep.pruning import TrialPruning, with_pruning
from recipes.runner.sweep.search_space import Search, shown_param
from recipes.runner.training.launch import USER_ERRORS
from recipes.runner.training.run import run

COUNTED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
SURPLUS = "surplus"  # a failed trial's user attribute: asked for once N were already under way


@dataclass(frozen=True)
class Sweep:
    """What every trial of a sweep shares: the recipe, the fixed keys (``config``, with the
    keys the command line gave), the searched keys, the metric Optuna optimizes, how many
    trials and where."""

    recipe: Recipe
    config: Any
    given: frozenset[str]
    searches: tuple[Search, ...]
    metric: str
    trials: int
    sweep_dir: Path
    study: optuna.Study


def work(sweep: Sweep) -> int:
    """Train trials until the study holds ``sweep.trials`` finished, pruned or running ones;
    the exit code of a trial that stopped the sweep (a signal, a full disk), else 0."""
    while True:
        taken = _take_orphan(sweep) or _take_new(sweep)
        if taken is None:
            return 0
        trial, lock = taken
        try:
            exit_code = train_trial(sweep, trial)
        finally:
            lock.release()  # after Optuna heard the result: no one takes it over again
        if exit_code != 0:
            return exit_code


def _take_orphan(sweep: Sweep) -> tuple[optuna.Trial, Any] | None:
    for frozen in orphans(sweep.study):
        lock = claim(sweep.sweep_dir, sweep.study, frozen.number)
        if lock is not None:
            say(f"\ntrial {frozen.number} was interrupted: continuing it")
            # Optuna has no public way to get a trial by number back as a Trial to report to.
            trial = optuna.Trial(sweep.study, frozen._trial_id)
            name_place(trial, trial_folder(sweep.sweep_dir, frozen.number))  # if it had none
            return trial, lock
    return None


def _take_new(sweep: Sweep) -> tuple[optuna.Trial, Any] | None:
    """A new trial, unless the study already counts ``trials`` (finished, pruned or being
    trained). Two workers that ask at once may both get one: the later is then surplus,
    failed at once and left out of the count and the table."""
    while _counted(sweep.study) < sweep.trials:
        trial = sweep.study.ask()
        lock = claim(sweep.sweep_dir, sweep.study, trial.number)
        if lock is None:  # another worker took it over in the instant after the ask
            continue
        before = [t for t in sweep.study.get_trials(deepcopy=False, states=COUNTED)
                  if t.number < trial.number]
        if len(before) >= sweep.trials:
            trial.set_user_attr(SURPLUS, True)
            sweep.study.tell(trial, state=TrialState.FAIL)
            lock.release()
            return None
        name_place(trial, trial_folder(sweep.sweep_dir, trial.number))
        return trial, lock
    return None


def _counted(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=COUNTED))


def train_trial(sweep: Sweep, trial: optuna.Trial) -> int:
    """Train ``trial`` (again, from its newest checkpoint, when it was interrupted) and tell
    Optuna how it ended; its exit code when that stops the sweep."""
    params = {search.name: search.suggest(trial) for search in sweep.searches}
    folder = trial_folder(sweep.sweep_dir, trial.number)
    config = dataclasses.replace(sweep.config, **params, run_dir=str(folder))
    say(f"\ntrial {trial.number}: {values_line(params)} in {folder}", flush=True)
    pruning = TrialPruning(trial, sweep.metric)
    try:
        validate(config)
        exit_code = run(with_pruning(sweep.recipe, pruning), config,
                        set(sweep.given) | set(params) | {"run_dir"})
    except USER_ERRORS as error:  # a value the search allows that this trial cannot use
        warn(f"error: trial {trial.number} ({values_line(params)}): {error}")
        _tell(sweep.study, trial, TrialState.FAIL)
        return ExitCode.USER_ERROR
    if exit_code in STOP_EXIT_CODES.values():  # saved; the same command continues it
        return exit_code
    if exit_code == ExitCode.NON_FINITE:  # the values diverged: a result, the sweep goes on
        _tell(sweep.study, trial, TrialState.FAIL)
        say(f"trial {trial.number}: failed (non-finite loss)")
        return 0
    if exit_code != 0:
        _tell(sweep.study, trial, TrialState.FAIL)
        return exit_code
    if pruning.pruned_at is not None:
        _tell(sweep.study, trial, TrialState.PRUNED)
        say(f"trial {trial.number}: pruned at step {pruning.pruned_at}")
        return 0
    value = _best_value(folder, sweep.metric)
    if value is None:
        _tell(sweep.study, trial, TrialState.FAIL)
        warn(f"error: trial {trial.number}: its summary.json holds no best_val_{sweep.metric}")
        return ExitCode.FAILED
    _tell(sweep.study, trial, TrialState.COMPLETE, value)
    say(f"trial {trial.number}: finished, {sweep.metric} {value:.4g}")
    return 0


def values_line(params: dict[str, Any]) -> str:
    return " ".join(f"{flag_name(name)} {shown_param(value)}" for name, value in params.items())


def _best_value(folder: Path, metric: str) -> float | None:
    try:
        value = json.loads((folder / "summary.json").read_text()).get(f"best_val_{metric}")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) else None


def _tell(study: optuna.Study, trial: optuna.Trial, state: TrialState,
          value: float | None = None) -> None:
    study.tell(trial, value, state=state, skip_if_finished=True)
