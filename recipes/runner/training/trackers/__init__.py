"""Experiment trackers: ``--tracker NAME`` picks the module of this package that ``TRACKERS``
(``recipes.runner.config.run_keys``, beside the key) names; another tracker is one module
more and one line in the table.

A tracker module has two functions:

- ``check(config, run_dir)``: raise ``ConfigError`` (exit 2, one line) for what the user must
  change (the package is not installed, the destination cannot be written); it runs before
  anything is written, and writes nothing itself;
- ``start(run: TrackedRun) -> Tracker | None``: open the tracker's run, or continue the one an
  earlier start of this run folder opened; rank 0 calls it once the run folder exists. A
  tracker that cannot be reached costs one warning line and gives None: the run goes on.

A ``Tracker`` has ``sink``, a scalar sink (``handlers.scalar_sink``) that gets every scalar
TensorBoard gets, ``finish(status, artifacts)``, called once the run has written its
summary and curves, and ``closing_line()``, the line printed after it: where the tracker's run
went and how to browse it (None: nothing to say). This package imports no torch and no tracker
package: the table is read while the command line is checked.
"""

import importlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from recipes.runner.config.run_keys import TRACKERS


@dataclass(frozen=True)
class TrackedRun:
    """What a tracker records of a run besides its scalars."""

    run_dir: Path
    run_id: str
    recipe: str
    config: Mapping[str, Any]  # the resolved config, as config.json stores it
    git: Mapping[str, Any] | None  # environment.git_revision: {"commit", "dirty"}


class Tracker(Protocol):
    sink: Any  # a ScalarSink

    def finish(self, status: str, artifacts: Mapping[str, Path]) -> None: ...

    def closing_line(self) -> str | None: ...


def _module(name: str) -> Any:
    return importlib.import_module(TRACKERS[name])


def check_tracker(config: Any, run_dir: Path) -> None:
    """The chosen tracker's checks (nothing for ``--tracker none``)."""
    if config.tracker != "none":
        _module(config.tracker).check(config, run_dir)


def start_tracker(config: Any, run: TrackedRun) -> Tracker | None:
    """The chosen tracker's run, or None (``--tracker none``, or it could not be reached)."""
    return None if config.tracker == "none" else _module(config.tracker).start(run)


def unwritable(path: Path) -> str | None:
    """Why ``path`` (a folder to write in, made if missing) cannot be written, else None:
    a tracker's ``check`` names it before anything is written."""
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def saved_state(file: Path) -> dict[str, Any]:
    """A tracker's state file in the run folder (the run a resume continues), or {} when
    there is none yet or it cannot be read: a new tracker run."""
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
