"""``--resume`` is a request for one start, not a setting of the run.

config.json never stores it (a later plain start must continue from the newest good
checkpoint, not from a file given once), a saved one is never taken back, and a checkpoint
file named by ``--resume`` is verified before anything is written. When config.json is lost,
the run's id and config come from its newest checkpoint that verifies: a new id would make
every checkpoint of the run "from another run".

``read_saved_config`` reads an earlier start's ``config.json`` (None for a new run; an
unreadable one is a one-line ``ConfigError``).
"""

import dataclasses
import json
from pathlib import Path
from typing import Any

from handlers.checkpoint.files import (
    CHECKPOINT_NAME,
    LINK_NAMES,
    CheckpointError,
    claimed_position,
)
from handlers.checkpoint.formats import read_checkpoint
from recipes.runner.config.command_line import ConfigError
from recipes.runner.console import say

REQUEST_KEYS = ("resume",)  # keys that ask something of one start, not of the run


def stored_config(config: Any) -> dict[str, Any]:
    """The config as config.json keeps it: every key but the requests."""
    return {key: value for key, value in dataclasses.asdict(config).items()
            if key not in REQUEST_KEYS}


def without_requests(saved: dict[str, Any] | None) -> dict[str, Any] | None:
    """A saved run (config.json) with the requests an older version stored dropped."""
    if saved is None or "config" not in saved:
        return saved
    return {**saved, "config": {key: value for key, value in saved["config"].items()
                                if key not in REQUEST_KEYS}}


def saved_in_checkpoints(checkpoints: Path) -> dict[str, Any] | None:
    """config.json's content (run id, config, data) as the newest checkpoint that verifies
    holds it, or None when no checkpoint does."""
    if not checkpoints.is_dir():
        return None
    candidates = [path for path in checkpoints.iterdir()
                  if path.name in LINK_NAMES or CHECKPOINT_NAME.match(path.name)]
    for path in sorted(candidates, key=claimed_position, reverse=True):
        try:
            meta = read_checkpoint(path, whole=False)["meta"]
        except CheckpointError:
            continue
        config = dict(meta.get("config") or {})
        data = config.pop("data", None)
        say(f"config.json is missing: the run id and config come from {path}")
        return {"run_id": meta["run_id"], "config": config,
                **({"data": data} if data is not None else {})}
    return None


def check_resume_file(resume: str, run_id: str) -> None:
    """Refuse ``--resume <file>`` that does not verify as a checkpoint of run ``run_id``
    (ConfigError, one line), before the data are loaded or anything is written."""
    if resume in ("auto", "never"):
        return
    try:
        read_checkpoint(resume, expected_run_id=run_id, whole=False)
    except CheckpointError as error:
        raise ConfigError(f"--resume: {error}; a checkpoint resumes only in its own run "
                          "folder (its --run-name or --run-dir)") from None


def read_saved_config(run_dir: Path) -> dict[str, Any] | None:
    """The ``config.json`` of an earlier start of this run, or None for a new run."""
    path = run_dir / "config.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"{path} is unreadable ({error}); fix it or use another --run-name"
        ) from None
