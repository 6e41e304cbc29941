"""Instructions per iteration of the tiny-model arms, counted by callgrind:
``python -m benchmarks.tools.instructions [--arms A,B,...] [--iterations N]``.

On a shared 2-core machine the wall-clock time of an arm drifts by 100 µs an iteration and
more between repeats (slow phases lasting seconds), far above the 10-40 µs differences
the overhead targets are about. Valgrind's callgrind counts the instructions a process
executes, in every thread (the TensorBoard writer's included), whatever the load: the
count of an arm's timed window (the same window as section 1 of ``make bench``: the
iterations after the warm-up) repeated to within 1.2% between processes. It is not
time: it misses cache misses and system calls. On this CPU the tuned hand loop ran 1.13 M
instructions in about 550-620 µs an iteration, about 2 per nanosecond.

Needs ``valgrind`` and a C compiler: the window's edges reach callgrind through its client
requests, C macros, compiled at start into a two-function library. Each arm runs in its
own process under valgrind, about 1.5 minutes each on this CPU; not part of ``make bench``.
Exit status 2 when valgrind, the compiler or callgrind's header is missing.
"""

import argparse
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.arms.loops import ARMS, run_arm
from benchmarks.arms.workloads import tiny_workload
from benchmarks.harness import timing
from benchmarks.harness.report import table

DEFAULT_ARMS = ("hand-tuned", "hand", "trainer", "trainer+recipe", "ignite")
REFERENCE = "hand-tuned"
WARMUP = 50
# A multiple of 100: every window holds the same share of the recipe's every-10 and
# every-100-step work (telemetry reports, layer norms, TensorBoard hand-offs).
DEFAULT_ITERATIONS = 300
CALLGRIND_HEADER = Path("/usr/include/valgrind/callgrind.h")
MARKER_SOURCE = """#include <valgrind/callgrind.h>
void window_open(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void window_close(void) { CALLGRIND_DUMP_STATS_AT("window"); CALLGRIND_STOP_INSTRUMENTATION; }
"""


class MissingTool(RuntimeError):
    """valgrind, the C compiler or callgrind's header is not installed."""


def build_marker(directory: Path) -> Path:
    """Compile the window marker library into ``directory``."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if shutil.which("valgrind") is None or compiler is None or not CALLGRIND_HEADER.is_file():
        raise MissingTool("needs valgrind, a C compiler (cc) and valgrind's header "
                          f"{CALLGRIND_HEADER}: install valgrind and gcc")
    source, library = directory / "marker.c", directory / "libmarker.so"
    source.write_text(MARKER_SOURCE)
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(source)],
                   check=True)
    return library


def window_instructions(callgrind_out: str) -> int:
    """The instruction count of a callgrind dump (its ``summary:`` line)."""
    match = re.search(r"^summary:\s+(\d+)", callgrind_out, re.MULTILINE)
    if match is None:
        raise ValueError("not a callgrind dump: no 'summary:' line")
    return int(match.group(1))


def count(arm: str, iterations: int, marker: Path, directory: Path) -> int:
    """Instructions of ``arm``'s timed window of ``iterations`` iterations."""
    out = directory / f"{arm}.callgrind"
    subprocess.run(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
         sys.executable, "-m", "benchmarks.tools.instructions", "--child", arm, str(iterations),
         str(marker)],
        # A fixed hash seed: with random ones, dict and set layouts (and the count) moved
        # by about 1% between processes.
        env={**os.environ, "PYTHONHASHSEED": "0"},
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    dump = directory / f"{arm}.callgrind.1"  # the window's dump; the whole run is in `out`
    return window_instructions(dump.read_text())


def run_child(arm: str, iterations: int, marker: Path) -> None:
    """Inside valgrind: run the arm once with the window's edges marked."""
    library = ctypes.CDLL(str(marker))
    edges = {"open": library.window_open, "close": library.window_close}
    timing.window_listeners.append(lambda event: edges[event]())  # one block: no "block"
    run_arm(arm, tiny_workload(WARMUP, iterations), threads=1)


def render(counts: dict[str, int], iterations: int) -> str:
    reference = counts.get(REFERENCE)
    rows = []
    for arm, instructions in counts.items():
        per_iteration = instructions / iterations
        over = "-" if reference is None or arm == REFERENCE else (
            f"{(instructions - reference) / iterations / 1e3:+.1f}")
        rows.append([f"`{arm}`", f"{per_iteration / 1e3:.1f}", over])
    return table(["arm", "k instructions / iteration", f"over `{REFERENCE}`, k"], rows)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        run_child(argv[1], int(argv[2]), Path(argv[3]))
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools.instructions",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                        help=f"comma-separated arms (default {','.join(DEFAULT_ARMS)})")
    parser.add_argument("--iterations", type=int, default=DEFAULT_ITERATIONS,
                        help=f"timed iterations per arm (default {DEFAULT_ITERATIONS})")
    args = parser.parse_args(argv)
    arms = [arm for arm in args.arms.split(",") if arm]
    unknown = [arm for arm in arms if arm not in ARMS or arm == "lightning"]
    if unknown or not arms:
        parser.error(f"unknown arm(s) {unknown}; allowed: "
                     f"{', '.join(arm for arm in ARMS if arm != 'lightning')}")
    if args.iterations < 1:
        parser.error(f"--iterations must be >= 1, got {args.iterations}")
    with tempfile.TemporaryDirectory(prefix="bench-instructions-") as tmp:
        try:
            marker = build_marker(Path(tmp))
        except MissingTool as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        counts = {}
        for arm in arms:
            counts[arm] = count(arm, args.iterations, marker, Path(tmp))
            print(f"{arm}: {counts[arm] / args.iterations / 1e3:.1f} k instructions/iteration",
                  file=sys.stderr, flush=True)
    print(f"torch {torch.__version__}, {args.iterations} timed iterations after {WARMUP} "
          f"warm-up, 1 thread\n")
    print(render(counts, args.iterations))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
