"""A run's folder: where it is, what config it was started with, and its JSON files."""

import json
import math
import time
from pathlib import Path
from typing import Any

from handlers.atomic_write import write_atomically
from recipes.runner.config.command_line import ConfigError


def resolve_run_dir(recipe: str, run_name: str, run_dir: str) -> Path:
    """``run_dir`` when given, else ``runs/<recipe>/<run_name or a timestamp>``."""
    if run_dir:
        return Path(run_dir).expanduser()
    return Path("runs") / recipe / (run_name or time.strftime("%Y%m%d-%H%M%S"))


def _strict_json(value: Any) -> Any:
    """NaN and infinities as null: strict JSON has no spelling for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _strict_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_strict_json(item) for item in value]
    return value


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as sorted, indented JSON through ``write_atomically`` (temp file,
    fsync, rename, fsync of the folder): readers never see half a file, and once written it
    survives a power cut as a checkpoint does. Non-finite numbers are written as null."""
    text = json.dumps(_strict_json(payload), indent=2, sort_keys=True, allow_nan=False) + "\n"
    write_atomically(path, lambda file: file.write(text.encode()))


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
