"""Section 7: what a sweep adds to its trials (``python -m recipes <recipe> sweep``): the wall
time of a 4-trial tiny charlm sweep, one command, against (a) the sum of its trials' run times
as their summaries record them (``wall_time_sec``: the training itself), (b) each trial's whole
run inside the sweep as Optuna timed it (its start to its completion: the checks, data, model,
training, summary and curves.png), and (c) the same four trials run one by one as plain
``python -m recipes`` commands, as a shell loop would; three times, side by side, verdicts on
the medians; for trials of 2 epochs (under a second each, where the one start of the sweep's
process weighs most) and of 8. The target of issue #47: at most 1.1x the trials' run times
plus 2 s a trial.

``python -m benchmarks.sections.s7_sweep [--quick] [--out PATH]`` prints (or writes) the
section.
"""

import json
import os
import statistics
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
FULL = (4, (2, 8), 3)  # trials, the epochs of a trial in each series, repeats
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

    def columns(self) -> tuple[list[float], list[float], list[float]]:
        return self.trial_seconds, self.in_sweep_seconds, self.command_seconds

    def machinery(self) -> float:
        """The sweep's time outside its trials' runs and the process's start."""
        return self.wall_seconds - sum(self.in_sweep_seconds) - self.process_start()

    def process_start(self) -> float:
        """What a trial's own command takes beyond its run inside the sweep: the start of a
        process that runs a recipe (the median over the trials)."""
        return statistics.median(command - run for command, run
                                 in zip(self.command_seconds, self.in_sweep_seconds,
                                        strict=True))


def measure(trials: int, epochs: tuple[int, ...], repeats: int, log: Callable[[str], None]
            ) -> list[list[SweepResult]]:
    """For each trial length, ``repeats`` times: a sweep and then its trials as plain runs,
    side by side."""
    return [[measure_once(trials, length, log) for _ in range(repeats)] for length in epochs]


def measure_once(trials: int, epochs: int, log: Callable[[str], None]) -> SweepResult:
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

    study = optuna.load_study(study_name=database.parent.name, storage=f"sqlite:///{database}")
    return [(trial.datetime_complete - trial.datetime_start).total_seconds()
            for trial in sorted(study.trials, key=lambda trial: trial.number)]


def _timed(command: list[str], folder: str, env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, cwd=folder, env=env, check=True, capture_output=True)
    return time.perf_counter() - started


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' * (count != 1)}"


def render(series: list[list[SweepResult]]) -> str:
    """The section: what is measured, then each trial length's repeats."""
    first = series[0][0]
    repeats = "once" if len(series[0]) == 1 else plural(len(series[0]), "time")
    lengths = " and ".join(plural(results[0].epochs, "epoch") for results in series)
    tables = "\n\n".join(render_series(results) for results in series)
    return f"""## 7. Sweeps: what the sweep adds to its trials

`python -m recipes charlm sweep --trials {first.trials}` on the tiny charlm job (one thread, \
SQLite study in the sweep folder, `--pruner none`), trials of {lengths}, one command, \
{repeats} each; after each sweep, the same {first.trials} trials one by one as plain \
`python -m recipes charlm ... --lr <its lr>` commands, as a shell loop would run them. Each \
sweep is held against the target of issue #47 (1.1 × the sum of its trials' run times + 2 s a \
trial) with the trials' run times counted three ways: as their summary.json records them \
(`wall_time_sec`: the training, its evaluations and saves), as their whole run inside the \
sweep (Optuna's start to completion of the trial: the checks, the data, the model, the \
training, the summary and curves.png), and as their own commands (the process's start and \
imports too). "Process start": what a trial's own command takes beyond the same trial's run \
in the sweep (the median over the trials): Python, torch, Ignite, matplotlib and the project \
imported, which any run pays once. "Machinery": the rest of the sweep's time outside its \
trials' runs (Optuna imported, the study created, each trial asked, claimed and told, the \
table). Load average after: {series[-1][-1].load}.

{tables}"""


def render_series(results: list[SweepResult]) -> str:
    """One trial length: the repeats side by side, each sweep against its own trials;
    verdicts on the median of each ratio (sweep / target), the trials of the median repeat."""
    first = results[0]
    ratios = [[result.wall_seconds / result.budget(times) for times in result.columns()]
              for result in results]
    medians = [statistics.median(column) for column in zip(*ratios, strict=True)]
    repeat_rows = [[str(index + 1), number(result.wall_seconds),
                    *(number(result.budget(times)) for times in result.columns()),
                    number(result.process_start()), number(result.machinery())]
                   for index, result in enumerate(results)]
    middle = sorted(results, key=lambda result: result.wall_seconds)[len(results) // 2]
    trial_rows = [[f"trial {index}", *map(number, times)]
                  for index, times in enumerate(zip(*middle.columns(), strict=True))]
    trial_rows.append(["sum", *(number(sum(times)) for times in middle.columns())])
    verdicts = ["within" if ratio <= 1 else "over" for ratio in medians]
    machinery = statistics.median(result.machinery() for result in results)
    return f"""### Trials of {plural(first.epochs, "epoch")}

{table(["repeat", "sweep, s", "target on summaries, s", "target on runs in the sweep, s",
        "target on commands, s", "process start, s", "machinery, s"], repeat_rows)}

Medians of sweep / target: {", ".join(f"{ratio:.3f}" for ratio in medians)} (summaries, runs \
in the sweep, commands): {verdicts[0]} the target counted on the summaries' run times, \
{verdicts[1]} it counted on the trials' runs in the sweep, {verdicts[2]} it counted on their \
own commands. The sweep's own machinery: {number(machinery)} s for {first.trials} trials \
(median), against the {2 * first.trials} s the target allows it.

The trials of the median repeat ({number(middle.wall_seconds)} s):

{table(["trial", "summary's run time, s", "its run in the sweep, s", "as its own command, s"],
       trial_rows)}"""


def main(argv: list[str]) -> int:
    parser = section_parser("benchmarks.sections.s7_sweep", __doc__,
                            "smoke run: 2 trials of 1 epoch, once")
    args = parser.parse_args(argv)
    log = progress_log()
    return emit(render(measure(2, (1,), 1, log) if args.quick else measure(*FULL, log)),
                args.out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
