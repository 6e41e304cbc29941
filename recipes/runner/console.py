"""Every line the run layer prints, to the person watching: ``say`` on stdout, ``warn`` (a
``warning:``/``note:``/``error:`` line) on stderr. The one module of the run layer that calls
``print`` (tests/recipes/runner/test_console.py checks it), so that where a line goes and when
it is flushed is decided here. Imports no torch: the config prints through it before torch
loads.

What the libraries below the run layer (``engine``, ``handlers``, the recipes' data) log, as
Ignite's handlers do, ``ConsoleVoice`` speaks in this voice
(``speak_for_libraries``): INFO as a plain line on stdout, WARNING as ``warning: ...`` and
ERROR as ``error: ...`` on stderr, each above an open progress bar. Every process installs
it; a process other than rank 0 speaks only its errors, since all ranks log the same events.

A printed command (a next step, the command that continues a run) names the Python that runs
it (``interpreter``), so that it runs as printed: ``python -m recipes ...`` fails outside an
activated virtual environment, since the project's packages are in ``.venv``. It is named
relative to the working folder when it lies under it (``.venv/bin/python``), by the word the
user typed when that finds the same interpreter on PATH (an activated environment), else by
its absolute path.
"""

import contextlib
import logging
import os
import shlex
import shutil
import sys
from pathlib import Path

LIBRARIES = ("engine", "handlers", "recipes")  # the loggers whose records the voice speaks


def say(*lines: str, flush: bool = False) -> None:
    """Print ``lines`` on stdout, one per line; ``flush`` for a line that must show before a
    long step (or before other processes write)."""
    print("\n".join(lines), flush=flush)


def warn(line: str, flush: bool = False) -> None:
    """Print ``line`` on stderr: an error, a warning or a note beside the run's output."""
    print(line, file=sys.stderr, flush=flush)


class ConsoleVoice(logging.Handler):
    """A library's log record as the console says it (see the module)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # a malformed record: say what logging would
            self.handleError(record)
            return
        if record.levelno >= logging.ERROR:
            line, stream = f"error: {message}", sys.stderr
        elif record.levelno >= logging.WARNING:
            line, stream = f"warning: {message}", sys.stderr
        else:
            line, stream = message, sys.stdout
        from tqdm import tqdm  # writes above open bars and draws them again below

        tqdm.write(line, file=stream)
        stream.flush()


def speak_for_libraries(rank: int = 0) -> None:
    """Install the voice on the libraries' loggers (once a process: again only sets the
    level): INFO and up on rank 0, errors alone on the other ranks. Ignite's engine logs
    every exception that leaves a run; the run layer says the ones it handles in its own
    line, so that logger is quiet (in every process: a spawned one starts without it)."""
    logging.getLogger("ignite.engine.engine").setLevel(logging.CRITICAL)
    level = logging.INFO if rank == 0 else logging.ERROR
    for name in LIBRARIES:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        if not any(isinstance(handler, ConsoleVoice) for handler in logger.handlers):
            logger.addHandler(ConsoleVoice())


def interpreter() -> str:
    """This process's Python as a command word that runs it again from this folder."""
    executable = Path(os.path.abspath(sys.executable))  # a venv's link, not its target
    try:
        return shlex.quote(str(executable.relative_to(Path.cwd())))
    except ValueError:
        pass
    typed = sys.orig_argv[0] if sys.orig_argv else ""
    found = shutil.which(typed) if typed else None
    if found is not None and Path(os.path.abspath(found)) == executable:
        return shlex.quote(typed)
    return shlex.quote(str(executable))


def recipes_command(recipe: str) -> str:
    """``<interpreter> -m recipes <recipe>``: the start of a printed command. ``recipe`` is a
    name, or the path of a recipe file (shown from the working directory when inside it)."""
    if recipe.endswith(".py"):
        with contextlib.suppress(ValueError):  # outside the working directory: as given
            recipe = str(Path(recipe).resolve().relative_to(Path.cwd()))
    return f"{interpreter()} -m recipes {shlex.quote(recipe)}"
