"""The run's experiment tracker (``--tracker``, ``recipes.runner.training.trackers``): opened
on rank 0 before the handlers are built, finished once the summary and curves are written."""

from pathlib import Path
from typing import Any

from recipes.runner.config.run_keys import RunConfig
from recipes.runner.console import say
from recipes.runner.resume.request import stored_config
from recipes.runner.training.environment import REPO, git_revision
from recipes.runner.training.trackers import TrackedRun, Tracker, start_tracker

ARTIFACTS = ("checkpoints/best.pt", "curves.png")  # in the run folder and the tracker's run


def open_tracker(recipe: str, config: RunConfig, run_dir: Path, run_id: str
                 ) -> Tracker | None:
    """The tracker's run for this run folder; None for ``--tracker none`` or when the tracker
    cannot be reached (it said so in one line)."""
    if config.tracker == "none":
        return None
    return start_tracker(config, TrackedRun(run_dir, run_id, recipe, stored_config(config),
                                            git_revision(REPO)))


def tracker_sinks(tracker: Tracker | None) -> dict[str, Any]:
    """The scalar sinks the run's logger adds for the tracker (``RunSite.sinks``)."""
    return {} if tracker is None else {"tracker": tracker.sink}


def close_tracker(tracker: Tracker | None, status: str, run_dir: Path) -> None:
    """The best checkpoint and the curves as artifacts, and the run's end status; then the
    tracker's closing line under the run's (where its run went, how to browse it)."""
    if tracker is not None:
        tracker.finish(status, {name: run_dir / name for name in ARTIFACTS})
        line = tracker.closing_line()
        if line:
            say(line, flush=True)
