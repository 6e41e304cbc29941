"""Every line the run layer prints, to the person watching: ``say`` on stdout, ``warn`` (a
``warning:``/``note:``/``error:`` line) on stderr. The one module of the run layer that calls
``print`` (tests/recipes/runner/test_console.py checks it), so that where a line goes and when
it is flushed is decided here. Imports no torch: the config prints through it before torch
loads."""

import sys


def say(*lines: str, flush: bool = False) -> None:
    """Print ``lines`` on stdout, one per line; ``flush`` for a line that must show before a
    long step (or before other processes write)."""
    print("\n".join(lines), flush=flush)


def warn(line: str, flush: bool = False) -> None:
    """Print ``line`` on stderr: an error, a warning or a note beside the run's output."""
    print(line, file=sys.stderr, flush=flush)
