"""The command line of a section that also runs on its own
(``python -m benchmarks.sections.<name> [--quick] [--out PATH]``): its parser, its log of
timed progress lines on stderr, and where the section goes."""

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path


def section_parser(module: str, doc: str, quick_help: str) -> argparse.ArgumentParser:
    """``--quick`` (``quick_help`` says what it shrinks) and ``--out``; a section adds its own."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}",
                                     description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, default=None, help="write the section here")
    return parser


def progress_log() -> Callable[[str], None]:
    """A log that prefixes each line with the seconds since it was made, on stderr, so that
    the section itself alone reaches stdout."""
    started = time.perf_counter()

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {line}", file=sys.stderr, flush=True)

    return log


def emit(section: str, out: Path | None) -> int:
    """The section on stdout, or in ``out``; the command's exit code."""
    if out is None:
        print(section)
    else:
        out.write_text(section + "\n")
    return 0
