"""Section 5, CUDA only: our CIFAR recipe against airbench94's own training code (the
``airbench`` package, bench extra), in one process, on the same GPU and the same CIFAR-10
bytes (``load_cifar10`` of the shared image folders, handed to airbench in its format).

Two tables: the training step at batch 256 and 1024 (ours through ``create_trainer``, eager
and compiled; airbench94's ``train94`` loop), and whole runs to a test accuracy (airbench94's
own 9.9 epochs; the recipe at its defaults and at airbench's batch 1024 with ``--lr 1.5``,
each eager and with ``--compile``).
"""

import importlib.util
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import redirect_stdout
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from ignite.engine import Events

from benchmarks.arms.workloads import cifar_workload
from benchmarks.harness.plan import Plan
from benchmarks.harness.report import table
from benchmarks.harness.timing import Stats, WindowTimer, interleaved_order
from engine.precision import resolve_precision
from engine.trainer import create_trainer
from recipes.__main__ import main as recipes_main
from recipes.cifar.data import CifarArrays, load_cifar10
from recipes.cifar.recipe import Config
from recipes.common.paths import SHARED_DATA
from recipes.runner.config.command_line import parse_args

SHARED_CIFAR = SHARED_DATA / "cifar10"  # the real data set, where this machine has it
BATCH_SIZES = (256, 1024)
EAGER, COMPILED, AIRBENCH = "recipe step, eager", "recipe step, compiled", "airbench94 loop"
STEP_ARMS = (EAGER, COMPILED, AIRBENCH)
AIRBENCH_PRECISION = "fp16"  # make_net94: .half() weights and activations, BatchNorm in fp32
# The recipe's runs: its defaults (two micro-batches of 512 a step), the same 1024-sample
# step as one micro-batch, and the batch-256 defaults it had before (LR scaled as airbench
# scales it, 1.5 per 1024 samples, and Muon's tuning at that batch).
RECIPE_RUNS = ((), ("--batch-size", "1024", "--accum-steps", "1"),
               ("--batch-size", "256", "--accum-steps", "1", "--lr", "0.375",
                "--muon-lr", "0.04", "--muon-momentum", "0.85"))


@dataclass(frozen=True)
class StepRow:
    arm: str
    batch_size: int
    precision: str
    ms_per_iteration: Stats

    @property
    def images_per_second(self) -> float:
        return 1e3 * self.batch_size / self.ms_per_iteration.median


@dataclass(frozen=True)
class RunRow:
    arm: str
    command: str
    batch_size: int
    precision: str
    epochs: float
    seconds: Stats
    accuracy: Stats  # a fraction of the test set


def skip_reason() -> str | None:
    """Why the section cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device on this machine"
    if importlib.util.find_spec("airbench") is None:
        return "airbench is not installed (`pip install -e '.[bench]'`)"
    if not SHARED_CIFAR.is_dir():
        return f"no CIFAR-10 image folders at `{SHARED_CIFAR}`"
    return None


def recipe_precision() -> str:
    """What the recipe's ``--precision`` default resolves to on this GPU."""
    return resolve_precision(Config().precision, "cuda").name


def _recipe_step_ms(arrays: CifarArrays, batch_size: int, compile: bool, warmup: int,
                    timed: int) -> float:
    config = Config()
    # Every arm compiles from a cold start: the graphs of earlier arms (other model instances,
    # other batch sizes) would otherwise count toward Dynamo's recompile limit, past which it
    # runs the forward eagerly without failing.
    torch.compiler.reset()
    workload = cifar_workload(warmup, timed, batch_size, arrays=arrays)
    model, optimizer = workload.fresh()
    trainer = create_trainer(model, optimizer, workload.loss_fn, device="cuda",
                             precision=config.precision, max_grad_norm=config.max_grad_norm,
                             compile=compile)
    batches = [(x.cuda(), y.cuda()) for x, y in workload.batches]
    timer = WindowTimer(warmup, timed)

    def mark(engine) -> None:
        if engine.state.iteration in (warmup, warmup + timed):
            torch.cuda.synchronize()  # only at the window's two ends
            timer.mark(engine.state.iteration)

    trainer.add_event_handler(Events.ITERATION_COMPLETED, mark)
    trainer.run(batches, max_epochs=1)
    return 1e3 * timer.seconds / timed


def measure_steps(arrays: CifarArrays, airbench_folder: Path, plan: Plan,
                  log: Callable[[str], None]) -> list[StepRow]:
    from benchmarks.arms import airbench94  # the bench extra: skip_reason checked it is there

    rows = []
    for batch_size in BATCH_SIZES:
        times: dict[str, list[float]] = {arm: [] for arm in STEP_ARMS}
        for repeat, arm in interleaved_order(STEP_ARMS, plan.gpu_repeats):
            if arm == AIRBENCH:
                ms = airbench94.step_ms(airbench_folder, batch_size, plan.gpu_warmup,
                                          plan.gpu_timed)
            else:
                ms = _recipe_step_ms(arrays, batch_size, arm == COMPILED, plan.gpu_warmup,
                                     plan.gpu_timed)
            times[arm].append(ms)
            log(f"  GPU step, batch {batch_size}, repeat {repeat + 1}/{plan.gpu_repeats} "
                f"{arm}: {ms:.2f} ms")
        precision = {EAGER: recipe_precision(), COMPILED: recipe_precision(),
                     AIRBENCH: AIRBENCH_PRECISION}
        rows += [StepRow(arm, batch_size, precision[arm], Stats.of(times[arm]))
                 for arm in STEP_ARMS]
    return rows


def recipe_args(options: tuple[str, ...], compile: bool, epochs: int | None) -> list[str]:
    """``python -m recipes`` arguments of one recipe run, less its data and run folders."""
    args = ["cifar", *options]
    if compile:
        args += ["--compile", "true"]
    if epochs is not None:
        args += ["--epochs", str(epochs)]
    return args


def _recipe_run(args: list[str]) -> tuple[float, float]:
    """Wall seconds of the whole ``python -m recipes`` run in this process (data from its
    decoded cache, build, compile, training, evaluations, checkpoints, summary) and its
    final test accuracy (the recipe's final TTA, mirror + translate)."""
    torch.compiler.reset()  # see _recipe_step_ms
    with tempfile.TemporaryDirectory(prefix="bench-recipe-") as run_dir:
        where = ["--data-dir", str(SHARED_CIFAR), "--run-dir", run_dir, "--progress", "off"]
        started = time.perf_counter()
        with redirect_stdout(sys.stderr):  # its summary is progress here, not the report
            code = recipes_main([*args, *where])
        seconds = time.perf_counter() - started
        if code != 0:
            raise RuntimeError(f"python -m recipes {shlex.join(args)} exited with {code}")
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    return seconds, summary["final_val_accuracy"]


@dataclass(frozen=True)
class RunArm:
    arm: str
    command: str
    batch_size: int
    precision: str
    epochs: float
    run: Callable[[], tuple[float, float]]  # wall seconds, test accuracy


def run_arms(airbench_folder: Path, epochs: int | None) -> list[RunArm]:
    """airbench94's run, then the recipe's at its defaults and at batch 1024, each eager and
    compiled; ``epochs`` shortens every run (a smoke run), None keeps each arm's own."""
    from benchmarks.arms import airbench94

    arms = [RunArm("airbench94", "`airbench.train94`, its defaults", airbench94.BATCH_SIZE,
                   AIRBENCH_PRECISION, epochs or airbench94.EPOCHS,
                   partial(airbench94.full_run, airbench_folder, epochs))]
    for options in RECIPE_RUNS:
        for compile in (False, True):
            args = recipe_args(options, compile, epochs)
            config, _ = parse_args(Config, args[1:])  # a typo fails here, before any run
            arms.append(RunArm("recipe, compiled" if compile else "recipe, eager",
                               f"`{shlex.join(['python', '-m', 'recipes', *args])}`",
                               config.batch_size * config.accum_steps, recipe_precision(),
                               config.epochs,
                               partial(_recipe_run, args)))
    return arms


def measure_runs(airbench_folder: Path, plan: Plan, log: Callable[[str], None]) -> list[RunRow]:
    arms = {arm.command: arm for arm in run_arms(airbench_folder, plan.gpu_run_epochs)}
    results: dict[str, list[tuple[float, float]]] = {command: [] for command in arms}
    for repeat, command in interleaved_order(list(arms), plan.gpu_run_repeats):
        seconds, accuracy = arms[command].run()
        results[command].append((seconds, accuracy))
        log(f"  GPU run {repeat + 1}/{plan.gpu_run_repeats} {command}: {seconds:.1f} s, "
            f"test accuracy {accuracy:.4f}")
    return [RunRow(arm.arm, arm.command, arm.batch_size, arm.precision, arm.epochs,
                   Stats.of([seconds for seconds, _ in results[command]]),
                   Stats.of([accuracy for _, accuracy in results[command]]))
            for command, arm in arms.items()]


def measure(plan: Plan, log: Callable[[str], None]) -> tuple[list[StepRow], list[RunRow]]:
    """Both tables, on the CIFAR-10 of the shared image folders (see ``skip_reason``)."""
    from benchmarks.arms import airbench94

    arrays = load_cifar10(SHARED_CIFAR, download=False)
    # Importing airbench turns cuDNN autotuning on for the whole process: set here, so that
    # every arm runs under it whichever module was imported first.
    torch.backends.cudnn.benchmark = True
    with tempfile.TemporaryDirectory(prefix="bench-airbench-") as root:
        folder = airbench94.write_airbench_data(arrays, Path(root))
        return measure_steps(arrays, folder, plan, log), measure_runs(folder, plan, log)


def _versus_airbench(row: StepRow, rows: list[StepRow]) -> str:
    """``row``'s images/s as a multiple of airbench94's at the same batch size."""
    base = next((other for other in rows
                 if other.arm == AIRBENCH and other.batch_size == row.batch_size), None)
    return "" if base is None else f"{row.images_per_second / base.images_per_second:.2f}x"


def render(steps: list[StepRow], runs: list[RunRow], reason: str | None) -> str:
    if reason is not None:
        return (f"## 5. GPU\n\nUnmeasured: {reason}. This section needs a CUDA device, the "
                "bench extra (airbench) and the CIFAR-10 image folders; there, `make bench` "
                "or `python -m benchmarks --only gpu` measures it.")
    step_cells = [[f"`{row.arm}`", str(row.batch_size), row.precision,
                   f"{row.images_per_second:.0f}", row.ms_per_iteration.format(3),
                   _versus_airbench(row, steps)] for row in steps]
    run_cells = [[row.arm, row.command, str(row.batch_size), row.precision, f"{row.epochs:g}",
                  row.seconds.format(3), row.accuracy.format(4, scale=100)] for row in runs]
    return f"""## 5. GPU: the CIFAR recipe against airbench94

One process, one GPU, the same CIFAR-10 bytes: the shared image folders as `load_cifar10`
decodes them, handed to airbench's own `CifarLoader` in its file format. airbench94 is the
`airbench` package's own code (network, optimizer, schedule, loader, evaluation), unchanged.
cuDNN autotuning (`cudnn.benchmark`) is on for every arm: importing airbench turns it on.

### Training step

Ours: `create_trainer`'s step (forward, loss, backward, gradient norm, SGD) at the recipe's
`--precision auto` (autocast over fp32 weights), on batches of the first training images,
augmented and on the device beforehand. airbench94: one iteration of `train94`'s loop (a
batch sliced from its loader's augmented copy, forward, summed loss, backward, SGD, LR
scheduler, Lookahead every 5 steps), fp16 weights and activations, BatchNorm in fp32.
Timed between two `torch.cuda.synchronize()` calls over iterations after the warm-up (which
holds the compilation), within one epoch.

{table(["arm", "batch", "precision", "images/s", "ms / iteration", "vs airbench94"],
       step_cells)}

### Time to accuracy

Wall seconds of whole runs, in this process: for the recipe the whole command
(data from its decoded cache, build, compilation, training, an evaluation per epoch,
checkpoints, summary); for airbench94 its loader and `train94` (an evaluation per epoch).
Test accuracy on the 10,000 test images with each arm's final test-time augmentation
(both: mirror and translate).

{table(["arm", "command", "batch", "precision", "epochs", "wall s", "test accuracy %"],
       run_cells)}"""
