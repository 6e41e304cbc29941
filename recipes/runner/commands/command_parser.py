"""The arguments of a command next to training (``recipes.runner.commands``): the run or
checkpoint it reads, ``--checkpoint``, ``--device``, and the argument types the commands share."""

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from handlers.atomic_write import os_error_behind
from recipes.runner.api import Recipe
from recipes.runner.commands.trained import CHECKPOINTS
from recipes.runner.config.command_line import ConfigError, text_problem
from recipes.runner.config.run_keys import MAX_SEED


class CommandParser(argparse.ArgumentParser):
    """A command's arguments: the run or checkpoint, ``--checkpoint`` and ``--device``
    (default ``device``; None: the run's own), and the command's own; a mistake raises
    ``ConfigError`` (one line, exit 2)."""

    def __init__(self, recipe: Recipe, command: str, description: str,
                 device: str | None = None) -> None:
        super().__init__(prog=f"python -m recipes {recipe.name} {command}",
                         description=description)
        self.command = command
        self.add_argument("source", metavar="RUN_OR_CHECKPOINT",
                          help="a run folder (runs/<recipe>/<name>) or a checkpoint .pt file")
        self.add_argument("--checkpoint", choices=CHECKPOINTS, default="best",
                          help="which checkpoint of a run folder (default: best)")
        shown = device or "the run's own"
        self.add_argument("--device", default=device,
                          help=f"cpu | cuda | cuda:N | auto (default: {shown})")

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.command}: {message}")


def positive_int(text: str) -> int:
    """An argument type: an integer >= 1 (argparse names the flag in its message)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def output_path(text: str, suffixes: tuple[str, ...]) -> Path:
    """``--out``: a file ending in one of ``suffixes`` whose folder exists."""
    path = Path(text).expanduser()
    if path.suffix.lower() not in suffixes:
        raise ConfigError(f"--out {text}: must end in {' or '.join(suffixes)}")
    if not path.parent.is_dir():
        raise ConfigError(f"--out {text}: the folder {path.parent} does not exist")
    return path


def seed_int(text: str) -> int:
    """An argument type: a seed, an integer from 0 to ``MAX_SEED`` (what torch takes)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to {MAX_SEED}, got {text!r}")
    return value


def utf8_text(text: str) -> str:
    """An argument type: UTF-8 text without NUL bytes (``text_problem``)."""
    problem = text_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Around the writes of a command's output ``path`` (its folder made, the file written
    through a temp file): the disk's ``OSError`` comes out naming ``path`` rather than the
    temp file or nothing (a full disk's write names no file; torch's zip writer reports it
    as a ``RuntimeError`` with the ``OSError`` in its chain)."""
    try:
        yield
    except (OSError, RuntimeError) as error:
        refused = os_error_behind(error)
        if refused is None:
            raise
        raise OSError(refused.errno, refused.strerror, str(path)) from error
