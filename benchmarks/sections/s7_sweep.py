"""Section 7: what a sweep adds to its trials (``python -m recipes <recipe> sweep``): the wall
time of a 4-trial tiny charlm sweep, one command, against (a) the sum of its trials' run times
as their summaries record them (``wall_time_sec``: the training itself), (b) each trial's whole
run inside the sweep as Optuna timed it (its start to its completion: the checks, data, model,
training, summary and curves.png), and (c) the same four trials run one by one as plain
``python -m recipes`` commands, as a shell loop would. The target of issue #47: at most 1.1x
the trials' run times plus 2 s a trial.

``python -m benchmarks.sections.s7_sweep [--quick] [--out PATH]`` prints (or writes) the
section.
"""

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
from benchmarks.harness.section_cli import emit, progress_log, section_parser
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
    trial_seconds: list[float]  # each summary.json's wall_time_sec
    in_sweep_seconds: list[float]  # each trial's whole run in the sweep, as Optuna timed it
    command_seconds: list[float]  # each trial as its own python -m recipes command
    load: str

    def budget(self, seconds: list[float]) -> float:
        return 1.1 * sum(seconds) + 2 * self.trials


def measure(trials: int, epochs: int, log: Callable[[str], None]) -> SweepResult:
    """One sweep of ``trials`` trials, ``epochs`` each, on one thread, in a temporary folder;
    then each of its trials again as a plain run."""
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as folder:
        picks = torch.randint(len(WORDS), (2000,), generator=torch.Generator().manual_seed(0))
        (Path(folder) / "text.txt").write_text(" ".join(WORDS[i] for i in picks.tolist()))
        recipe = [sys.executable, "-m", "recipes", "charlm"]
        fixed = ["--epochs", str(epochs), *TINY_CHARLM]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        log(f"sweep: {trials} trials of {epochs} epochs")
        wall = _timed([*recipe, "sweep", "--trials", str(trials), "--search", "lr=1e-3:1e-1:log",
                       "--pruner", "none", "--sweep-dir", "sweep", *fixed], folder, env)
        runs = sorted((Path(folder) / "sweep").glob("trial-*"))
        seconds = [json.loads((run / "summary.json").read_text())["wall_time_sec"]
                   for run in runs]
        in_sweep = _optuna_durations(Path(folder) / "sweep" / "study.db")
        commands = []
        for index, run in enumerate(runs):
            lr = json.loads((run / "config.json").read_text())["config"]["lr"]
            log(f"the same trial {index} as a plain run")
            commands.append(_timed([*recipe, *fixed, "--lr", repr(lr), "--run-dir",
                                    f"loop/{run.name}"], folder, env))
    return SweepResult(trials, epochs, wall, seconds, in_sweep, commands, load_average())


def _optuna_durations(database: Path) -> list[float]:
    """Each trial's start to completion, as the study records them, by trial number."""
    import optuna  # the sweep extra: only this section needs it

    study = optuna.load_study(study_name=None, storage=f"sqlite:///{database}")
    return [(trial.datetime_complete - trial.datetime_start).total_seconds()
            for trial in sorted(study.trials, key=lambda trial: trial.number)]


def _timed(command: list[str], folder: str, env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, cwd=folder, env=env, check=True, capture_output=True)
    return time.perf_counter() - started


def render(result: SweepResult) -> str:
    columns = (result.trial_seconds, result.in_sweep_seconds, result.command_seconds)
    rows = [[f"trial {index}", *map(number, times)]
            for index, times in enumerate(zip(*columns, strict=True))]
    rows += [["sum", *(number(sum(times)) for times in columns)],
             ["target: 1.1 × sum + 2 s a trial", *(number(result.budget(times))
                                                   for times in columns)]]
    verdicts = [("within" if result.wall_seconds <= result.budget(times) else "over")
                for times in columns]
    machinery = result.wall_seconds - sum(result.in_sweep_seconds)
    return f"""## 7. Sweeps: what the sweep adds to its trials

`python -m recipes charlm sweep --trials {result.trials}` on the tiny charlm job \
({result.epochs} epochs a trial, one thread, SQLite study in the sweep folder, `--pruner none`)
took **{number(result.wall_seconds)} s**, one command. Against it: each trial's run time as its
summary.json records it (`wall_time_sec`: the training, its evaluations and saves), its whole
run inside the sweep as Optuna timed it (start to completion: the checks, the data, the model,
the training, the summary and curves.png), and the same trial run alone as `python -m recipes
charlm ... --lr <its lr>` (the whole command, the process's start and imports too), as a shell
loop over the trials would run them. Load average after: {result.load}.

{table(["trial", "summary's run time, s", "its run in the sweep, s", "as its own command, s"],
       rows)}

The sweep is {verdicts[0]} the target counted on the summaries' run times, {verdicts[1]} it \
counted on the trials' runs in the sweep and {verdicts[2]} it counted on the trials' own \
commands. Outside its trials' runs the sweep command spent {number(machinery)} s: the process's \
start and imports, the study's creation, reads and writes, and the table."""


def main(argv: list[str]) -> int:
    parser = section_parser("benchmarks.sections.s7_sweep", __doc__,
                            "smoke run: 2 trials of 1 epoch")
    args = parser.parse_args(argv)
    log = progress_log()
    return emit(render(measure(2, 1, log) if args.quick else measure(4, 2, log)), args.out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
