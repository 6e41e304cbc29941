"""Section 7: what a sweep adds to its trials (``python -m recipes <recipe> sweep``): the wall
time of a 4-trial tiny charlm sweep, one command, against the sum of its trials' own run
times (each trial's ``wall_time_sec`` in its summary.json). The target of issue #47: at most
1.1x that sum plus 2 s a trial (the study, each trial's data and model built, the process's
start).

``python -m benchmarks.sections.s7_sweep [--quick] [--out PATH]`` prints (or writes) the
section.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.harness.machine import load_average
from benchmarks.harness.report import table
from benchmarks.harness.timing import number

TINY_CHARLM = ["--val-fraction", "0.2", "--block-size", "8", "--n-layer", "1", "--n-head",
               "2", "--n-embd", "16", "--batch-size", "16", "--progress", "off", "--device",
               "cpu", "--text", "text.txt"]
WORDS = ["def", "return", "self", "value", "import", "class", "for", "in", "if"]


@dataclass(frozen=True)
class SweepResult:
    trials: int
    epochs: int
    wall_seconds: float
    trial_seconds: list[float]
    load: str

    @property
    def budget_seconds(self) -> float:
        return 1.1 * sum(self.trial_seconds) + 2 * self.trials


def measure(trials: int, epochs: int, log: Callable[[str], None]) -> SweepResult:
    """One sweep of ``trials`` trials, ``epochs`` each, on one thread, in a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as folder:
        picks = torch.randint(len(WORDS), (2000,), generator=torch.Generator().manual_seed(0))
        (Path(folder) / "text.txt").write_text(" ".join(WORDS[i] for i in picks.tolist()))
        command = [sys.executable, "-m", "recipes", "charlm", "sweep", "--trials", str(trials),
                   "--search", "lr=1e-3:1e-1:log", "--pruner", "none", "--sweep-dir", "sweep",
                   "--epochs", str(epochs), *TINY_CHARLM]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        log(f"sweep: {trials} trials of {epochs} epochs")
        started = time.perf_counter()
        subprocess.run(command, cwd=folder, env=env, check=True, capture_output=True)
        wall = time.perf_counter() - started
        seconds = [json.loads(path.read_text())["wall_time_sec"]
                   for path in sorted((Path(folder) / "sweep").glob("trial-*/summary.json"))]
    return SweepResult(trials, epochs, wall, seconds, load_average())


def render(result: SweepResult) -> str:
    total = sum(result.trial_seconds)
    rows = [[f"trial {index}", number(seconds)] for index, seconds in
            enumerate(result.trial_seconds)]
    rows += [["sum of the trials' run times", number(total)],
             ["the sweep's wall time (one command)", number(result.wall_seconds)],
             ["target: 1.1 × sum + 2 s a trial", number(result.budget_seconds)]]
    verdict = "within" if result.wall_seconds <= result.budget_seconds else "over"
    return f"""## 7. Sweeps: what the sweep adds to its trials

`python -m recipes charlm sweep --trials {result.trials}` on the tiny charlm job ({result.epochs} \
epochs a trial, one thread, SQLite study in the sweep folder, `--pruner none`): the command's
wall time against the sum of its trials' run times (`wall_time_sec` of each summary.json). The
difference is the sweep's own cost: the process's start (Python, torch, Optuna), the study,
and each trial's data and model built and its folder written. Load average after:
{result.load}.

{table(["what", "seconds"], rows)}

The sweep is {verdict} its target ({number(result.wall_seconds)} s against \
{number(result.budget_seconds)} s)."""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sections.s7_sweep",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 trials of 1 epoch")
    parser.add_argument("--out", type=Path, default=None, help="write the section here")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {line}", file=sys.stderr, flush=True)

    section = render(measure(2, 1, log) if args.quick else measure(4, 2, log))
    if args.out is None:
        print(section)
    else:
        args.out.write_text(section + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
