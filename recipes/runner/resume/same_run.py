"""Which run a command means, found on disk: the same command again continues its run, or says
it is done (``plan.py`` decides which; these functions find the folders).

A command with ``--run-name`` or ``--run-dir`` names its folder (``resolve_run_dir``:
``--run-dir``, else ``runs/<recipe>/<run-name>``; the run layer resumes it,
or says there is nothing left to train). Without either, the run folder is the newest
``runs/<recipe>/<timestamp>`` whose ``config.json`` holds the same keys as this command
(every key but ``RUN_REQUESTS``): an unfinished one is continued, and a new timestamped
folder is made when none matches, or for ``--resume never``. A folder without a readable
``config.json`` matches no command (its keys are unknown); a folder in use by another
process is refused by the run lock when the run takes it.

When that folder's ``summary.json`` says ``completed`` (and ``--resume`` is ``auto``), the
run is reported in two lines and nothing is loaded or written.
"""

import dataclasses
import json
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from recipes.runner.config.run_keys import RunConfig
from recipes.runner.console import interpreter

# Keys that ask something of this start, or place its output, without changing what is
# trained: two commands that differ only in these are the same run (a run stopped by
# --max-steps or --max-time goes on with the same command and a larger budget; one whose
# peer timed out, with a longer --collective-timeout).
RUN_REQUESTS = ("resume", "progress", "allow_data_change", "run_dir", "max_steps", "max_time",
                "collective_timeout")
TIMESTAMP = re.compile(r"(\d{8}-\d{6})(?:-(\d+))?")  # a default run folder; -N on a clash


def continue_command() -> str:
    """The command line of this process without its ``--resume``, on the interpreter that
    runs it (``interpreter``): run again, it continues the run (the default ``--resume auto``
    picks the newest good checkpoint)."""
    kept: list[str] = []
    args = iter(sys.orig_argv[1:])
    for arg in args:
        if arg == "--resume":
            next(args, None)  # and its value
        elif not arg.startswith("--resume="):
            kept.append(arg)
    return " ".join([interpreter(), shlex.join(kept)])


def _run_keys(config: RunConfig) -> dict[str, Any]:
    """The keys that define the run, as config.json stores them (tuples become lists)."""
    keys = json.loads(json.dumps(dataclasses.asdict(config)))
    return {key: value for key, value in keys.items() if key not in RUN_REQUESTS}


def _saved_run(run_dir: Path) -> tuple[str, dict[str, Any]] | None:
    """The run id and keys in ``run_dir/config.json``, or None when it is missing or
    unreadable (a run named on the command line then gets the run layer's own error for it)."""
    try:
        saved = json.loads((run_dir / "config.json").read_text())
        return str(saved.get("run_id", "")), dict(saved["config"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def newest_same_run(recipe: str, config: RunConfig, not_run: str = "") -> Path | None:
    """The newest timestamped folder of ``recipe`` started with the same keys, if any, other
    than run ``not_run``'s (the run whose config.json gave the keys)."""
    root = resolve_run_dir(recipe, "unused", "").parent
    folders = [path for path in root.iterdir() if TIMESTAMP.fullmatch(path.name)] \
        if root.is_dir() else []
    wanted = _run_keys(config)
    for folder in sorted(folders, key=_age, reverse=True):
        saved = _saved_run(folder)
        if saved is not None and not (not_run and saved[0] == not_run) and {
                key: value for key, value in saved[1].items()
                if key not in RUN_REQUESTS} == wanted:
            return folder
    return None


def _age(folder: Path) -> tuple[str, int]:
    stamp, clash = TIMESTAMP.fullmatch(folder.name).groups()
    return stamp, int(clash or 1)


def resolve_run_dir(recipe: str, run_name: str, run_dir: str) -> Path:
    """``run_dir`` when given, else ``runs/<recipe>/<run_name or a timestamp>``."""
    if run_dir:
        return Path(run_dir).expanduser()
    return Path("runs") / recipe / (run_name or time.strftime("%Y%m%d-%H%M%S"))


def new_timestamp_folder(recipe: str) -> Path:
    """``runs/<recipe>/<timestamp>``, with ``-2``, ``-3`` ... when a run started in the
    same second already has it."""
    first = resolve_run_dir(recipe, "", "")
    candidate, clash = first, 1
    while candidate.exists():
        clash += 1
        candidate = first.with_name(f"{first.name}-{clash}")
    return candidate


def report_if_complete(run_dir: Path, best: str, train_again: str) -> str | None:
    """Two lines on a run whose summary says it completed (where, its best metric, how to
    train again), else None."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("status") != "completed":
        return None
    value = summary.get(f"best_val_{best}")
    metric = f"best validation {best} {value:.4g}; " if isinstance(value, int | float) else ""
    return (f"the run is already complete: {run_dir} ({metric}{run_dir / 'summary.json'})\n"
            f"to train it again from the start, give {train_again}")
