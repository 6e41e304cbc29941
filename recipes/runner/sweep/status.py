"""The sweep's table: every trial (number, values, metric, state, time), the best trial's
folder and the command that trains its configuration for longer. Printed when a sweep ends
and by ``sweep --status``."""

import datetime
import json
import shlex
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from handlers.progress import format_duration
from recipes.runner.config.command_line import flag_name
from recipes.runner.console import recipes_command
from recipes.runner.sweep.claims import FOLDER, held_by_a_live_worker, trial_folder
from recipes.runner.sweep.search_space import shown_param
from recipes.runner.sweep.trials import SURPLUS

STATES = {TrialState.COMPLETE: "finished", TrialState.PRUNED: "pruned",
          TrialState.FAIL: "failed", TrialState.WAITING: "waiting"}


def status_lines(study: optuna.Study, recipe: str, metric: str, sweep_dir: Path,
                 wanted: int | None = None) -> list[str]:
    """The table and what to do with the best trial."""
    trials = [trial for trial in study.get_trials(deepcopy=False)
              if not trial.user_attrs.get(SURPLUS)]
    names = sorted({name for trial in trials for name in trial.params})
    rows = [["trial", *(flag_name(name) for name in names), metric, "state", "time"]]
    for trial in trials:
        rows.append([str(trial.number),
                     *(shown_param(trial.params[name]) if name in trial.params else "-"
                       for name in names),
                     "-" if trial.value is None else f"{trial.value:.4g}",
                     _state(trial, sweep_dir), _time(trial, sweep_dir)])
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    done = sum(trial.state in (TrialState.COMPLETE, TrialState.PRUNED) for trial in trials)
    lines = [f"sweep {study.study_name}: {done}"
             + (f" of {wanted}" if wanted is not None else "")
             + f" trials finished or pruned ({study.direction.name.lower()} {metric})"]
    lines += [("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
               ).rstrip() for row in rows]
    lines += best_lines(study, recipe, metric, sweep_dir)
    return lines


def best_lines(study: optuna.Study, recipe: str, metric: str, sweep_dir: Path) -> list[str]:
    finished = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not finished:
        return ["  best     none yet (no trial has finished)"]
    best = study.best_trial
    folder = _near(Path(best.user_attrs.get(FOLDER) or trial_folder(sweep_dir, best.number)))
    epochs = _saved_epochs(folder)
    longer = f" --epochs {2 * epochs}" if epochs else ""
    return [f"  best     trial {best.number}, {metric} {best.value:.4g}: {folder}",
            f"  evaluate {recipes_command(recipe)} evaluate {shlex.quote(str(folder))}",
            f"  longer   {recipes_command(recipe)} --config "
            f"{shlex.quote(str(folder / 'config.json'))}{longer} (a new run with its keys)",
            f"  curves   tensorboard --logdir {shlex.quote(str(sweep_dir))} (HParams: every "
            "trial)"]


def _near(folder: Path) -> Path:
    """``folder`` relative to the working folder when it lies under it (as a run's lines name
    its folder), else as recorded (absolute)."""
    try:
        return folder.relative_to(Path.cwd())
    except ValueError:
        return folder


def _state(trial: FrozenTrial, sweep_dir: Path) -> str:
    if trial.state == TrialState.PRUNED:
        return f"pruned at step {trial.last_step}" if trial.last_step is not None else "pruned"
    if trial.state == TrialState.RUNNING:
        return ("running" if held_by_a_live_worker(sweep_dir, trial.number)
                else "interrupted")
    return STATES[trial.state]


def _time(trial: FrozenTrial, sweep_dir: Path) -> str:
    """The trial's training time, its resumes together (its summary's), else its time in
    Optuna's records."""
    summary = _summary(Path(trial.user_attrs.get(FOLDER) or trial_folder(sweep_dir,
                                                                          trial.number)))
    seconds = summary.get("wall_time_sec")
    if not isinstance(seconds, int | float):
        end = trial.datetime_complete or datetime.datetime.now()
        seconds = (end - trial.datetime_start).total_seconds() if trial.datetime_start else 0
    return format_duration(seconds)


def _saved_epochs(folder: Path) -> int | None:
    try:
        epochs = json.loads((folder / "config.json").read_text())["config"]["epochs"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return epochs if isinstance(epochs, int) else None


def _summary(folder: Path) -> dict[str, Any]:
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}
