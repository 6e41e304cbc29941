"""``make bench-gpu``: one command, one table, on a bare GPU machine that received the working
tree (see docs/performance.md for how the data and wheels travel), in under 8 minutes.

``python -m benchmarks.tools.gpu_table [--dry-run] [--doc docs/performance.md]``

Rows: the CIFAR recipe at its defaults x3 eager (the first row), with its 1024-sample step as
one micro-batch x3, and compiled x3 (with CUDA graphs on a GPU); airbench94's own ``train94``
x3; the time to 90.6% test accuracy (the fastest of those
arms whose mean reaches it); ms per training step at batch 256 and 1024, eager and compiled;
aten ops dispatched per step (counted on the CPU, where the count is the same and a
dispatch mode can see every op); charlm at GPT-2-small shape, tokens/s and MFU.

Each phase has a time budget; a phase that would start after the whole budget is spent is
left out of the table with that reason, so the command ends in time even on a slow card.
``--dry-run`` runs every phase that can run on this CPU at a toy size (synthetic CIFAR, one
short epoch, a small charlm) to prove the code runs: its figures are no GPU figures and the
table says so. ``--doc`` puts the table into that file between the bench-gpu markers
(not a dry run's).
"""

import argparse
import json
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from recipes.__main__ import main as recipes_main

TOTAL_BUDGET_SEC = 7 * 60  # under 8 minutes with the start and the data's unpacking
TARGET_ACCURACY = 0.906  # airbench94's
REPEATS = 3
STEP_BATCH_SIZES = (256, 1024)
OPS_BATCH_SIZE = 16
# What the CIFAR runs leave for the step timings, the op count and charlm on a GPU: about
# 30 s of steps, 10 s of counting, a minute per charlm run with its compile.
LATER_PHASES_SEC = 150
MARKERS = ("<!-- bench-gpu: start -->", "<!-- bench-gpu: end -->")
# charlm at GPT-2-small shape in bf16, one short epoch (about 120 steps of 16k tokens).
CHARLM_GPU = ["--n-layer", "12", "--n-head", "12", "--n-embd", "768", "--block-size", "1024",
              "--batch-size", "16", "--precision", "bf16", "--epochs", "1",
              "--max-train-bytes", "2000000"]
CHARLM_DRY = ["--epochs", "1", "--max-train-bytes", "20000", "--max-val-bytes", "5000"]
CIFAR_DRY = ["--dataset", "synthetic", "--train-subset", "512", "--val-subset", "128",
             "--epochs", "1", "--batch-size", "128", "--tta", "none", "--final-tta", "none"]


@dataclass(frozen=True)
class Row:
    what: str
    figure: str  # the measured figure(s), or why there are none


class Budget:
    """The whole command's clock: a phase starts only while time is left."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds

    def left(self) -> float:
        return self.deadline - time.perf_counter()


def recipe_run(recipe: str, args: list[str]) -> dict:
    """One ``python -m recipes RECIPE ARGS`` in this process, in a temporary run folder: its
    ``summary.json`` with ``wall_sec``, the whole command's wall time."""
    torch.compiler.reset()  # each run compiles from cold, as a fresh command would
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as run_dir:
        started = time.perf_counter()
        with redirect_stdout(sys.stderr):  # its summary is progress here, not the table
            code = recipes_main([recipe, *args, "--run-dir", run_dir, "--progress", "off"])
        seconds = time.perf_counter() - started
        if code != 0:
            raise RuntimeError(f"python -m recipes {recipe} {shlex.join(args)} exited {code}")
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    return summary | {"wall_sec": seconds}


def spread(values: list[float], form: str) -> str:
    """``median (min-max)`` of ``values``, or the one value."""
    if len(values) == 1:
        return format(values[0], form)
    return (f"{format(statistics.median(values), form)} "
            f"({format(min(values), form)}-{format(max(values), form)})")


def cifar_arms(dry_run: bool, on_cuda: bool) -> dict[str, list[str]]:
    """The recipe's runs: its defaults eager (the table's first row), the same 1024-sample
    steps as one micro-batch (half the forward and backward dispatches, the GPU's choice in
    ``--accum-steps``' help), and compiled (with CUDA graphs on a GPU)."""
    base = CIFAR_DRY if dry_run else []
    one_batch = ["--batch-size", "256" if dry_run else "1024", "--accum-steps", "1"]
    compiled = ["--compile", "true"] + (["--cuda-graphs", "true"] if on_cuda else [])
    label = "compiled + CUDA graphs" if on_cuda else "compiled"
    return {"recipe defaults, eager": base,
            f"recipe, `{' '.join(one_batch)}`, eager": base + one_batch,
            f"recipe defaults, {label}": base + compiled}


def run_rows(arms: dict[str, Callable[[], tuple[float, float]]], repeats: int,
             budget: Budget, log: Callable[[str], None], reserve: float = 0.0,
             ) -> tuple[list[Row], dict[str, float]]:
    """Each arm ``repeats`` times (wall seconds, test accuracy); rows and each arm's median
    seconds when its mean accuracy reaches the target. A repeat starts only while the
    budget, less ``reserve`` (the later phases'), holds as long as the arm's last run took."""
    rows, reaching = [], {}
    for name, run in arms.items():
        results = []
        for repeat in range(repeats):
            if budget.left() - reserve <= (results[-1][0] if results else 0.0):
                break
            seconds, accuracy = run()
            results.append((seconds, accuracy))
            log(f"{name} {repeat + 1}/{repeats}: {seconds:.1f} s, {100 * accuracy:.2f}%")
        if not results:
            rows.append(Row(f"{name} x{repeats}", "not run: the time budget was spent"))
            continue
        seconds = [s for s, _ in results]
        accuracies = [a for _, a in results]
        rows.append(Row(f"{name} x{len(results)}",
                        f"{' / '.join(f'{s:.1f}' for s in seconds)} s wall, "
                        f"{' / '.join(f'{100 * a:.2f}' for a in accuracies)}% test"))
        if statistics.mean(accuracies) >= TARGET_ACCURACY:
            reaching[name] = statistics.median(seconds)
    return rows, reaching


def time_to_target(reaching: dict[str, float]) -> Row:
    what = f"time to {100 * TARGET_ACCURACY:.1f}% (mean of the runs)"
    if not reaching:
        return Row(what, f"no arm's mean reached {100 * TARGET_ACCURACY:.1f}%")
    name = min(reaching, key=reaching.get)
    return Row(what, f"{reaching[name]:.1f} s median wall: {name}")


def recipe_step(batch_size: int, device: str, compile: bool, cuda_graphs: bool):
    """The recipe's default model and optimizer in ``create_trainer``'s step, and batches."""
    from benchmarks.arms.workloads import cifar_workload
    from engine.trainer import create_trainer
    from recipes.cifar.recipe import Config
    from recipes.common.optimizers import build_optimizer

    config = Config()
    workload = cifar_workload(0, 4, batch_size)
    model, _ = workload.fresh()
    optimizer = build_optimizer(config, model, own="sgd", lr=config.lr,
                                momentum=config.momentum, nesterov=config.nesterov)
    trainer = create_trainer(model, optimizer, workload.loss_fn, device=device,
                             precision=config.precision, max_grad_norm=config.max_grad_norm,
                             compile=compile, cuda_graphs=cuda_graphs)
    batches = [(x.to(device), y.to(device)) for x, y in workload.batches]
    return trainer, batches


def step_ms(batch_size: int, device: str, compile: bool, cuda_graphs: bool,
            warmup_epochs: int, timed_epochs: int) -> float:
    """Milliseconds per step, the device synchronised only at the timed window's ends."""
    torch.compiler.reset()
    trainer, batches = recipe_step(batch_size, device, compile, cuda_graphs)
    trainer.run(batches, max_epochs=warmup_epochs)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    trainer.run(batches, max_epochs=warmup_epochs + timed_epochs)
    sync()
    return 1e3 * (time.perf_counter() - started) / (timed_epochs * len(batches))


class CountOps(TorchDispatchMode):
    """Counts every aten op dispatched under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def ops_per_step() -> float:
    """aten ops per steady-state training step of the recipe's default model and optimizer
    in ``create_trainer``'s eager step, on the CPU at batch 16."""
    trainer, batches = recipe_step(OPS_BATCH_SIZE, "cpu", False, False)
    trainer.run(batches, max_epochs=1)  # the optimizer's state exists from here
    with CountOps() as counted:
        trainer.run(batches, max_epochs=2)
    return sum(counted.ops.values()) / len(batches)


def charlm_row(args: list[str], name: str, log: Callable[[str], None]) -> Row:
    summary = recipe_run("charlm", args)
    mfu = summary.get("mfu")
    log(f"{name}: {summary['tokens_per_sec_per_device']:.0f} tokens/s, MFU {mfu}")
    return Row(name, f"{summary['tokens_per_sec_per_device'] / 1e3:.1f}k tokens/s, MFU "
                     f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'}, "
                     f"{summary['optimizer_steps']} steps")


def measure(dry_run: bool, budget: Budget, log: Callable[[str], None]) -> list[Row]:
    on_cuda = torch.cuda.is_available() and not dry_run
    device = "cuda" if on_cuda else "cpu"
    rows: list[Row] = []

    def phase(what: str, build: Callable[[], list[Row]]) -> None:
        if budget.left() <= 0:
            rows.append(Row(what, "not run: the time budget was spent"))
            return
        rows.extend(build())

    arms: dict[str, Callable[[], tuple[float, float]]] = {}
    for name, args in cifar_arms(dry_run, on_cuda).items():
        arms[name] = (lambda args=args: _cifar_result(recipe_run("cifar", args)))
    if on_cuda:
        arms["airbench94 (`airbench.train94`)"] = airbench_run()
    run_table, reaching = run_rows(arms, 1 if dry_run else REPEATS, budget, log,
                                   0.0 if dry_run else LATER_PHASES_SEC)
    rows += run_table
    if not on_cuda:
        rows.append(Row(f"airbench94 x{REPEATS}", "not run: airbench94 needs a CUDA device"))
    rows.append(time_to_target(reaching))

    sizes = (16,) if dry_run else STEP_BATCH_SIZES
    for batch_size in sizes:
        for compile in (False, True):
            if compile and dry_run:
                continue  # an inductor compile of the net takes a minute on a CPU
            label = ("compiled + CUDA graphs" if on_cuda else "compiled") if compile else "eager"
            what = f"ms per step, batch {batch_size}, {label}"
            timed = 1 if dry_run else 2
            phase(what, lambda b=batch_size, c=compile, w=what, t=timed: [
                Row(w, format(step_ms(b, device, c, c and on_cuda, 1, t), ".2f"))])
    phase(f"aten ops per step (CPU, batch {OPS_BATCH_SIZE}, eager)",
          lambda: [Row(f"aten ops per step (CPU, batch {OPS_BATCH_SIZE}, eager)",
                       f"{ops_per_step():.0f}")])
    if dry_run:
        phase("charlm (toy size, CPU)",
              lambda: [charlm_row(CHARLM_DRY + ["--device", "cpu"], "charlm, toy size", log)])
    else:
        for compile in (False, True):
            name = f"charlm GPT-2-small shape, bf16, {'compiled' if compile else 'eager'}"
            args = CHARLM_GPU + (["--compile", "true"] if compile else [])
            phase(name, lambda a=args, n=name: [charlm_row(a, n, log)])
    return rows


def _cifar_result(summary: dict) -> tuple[float, float]:
    return summary["wall_sec"], summary["final_val_accuracy"]


def airbench_run() -> Callable[[], tuple[float, float]]:
    """airbench94's own run on the shared CIFAR-10 folders (written once in its format)."""
    from benchmarks.arms import airbench94
    from benchmarks.sections.s5_gpu import SHARED_CIFAR
    from recipes.cifar.data import load_cifar10

    folder = airbench94.write_airbench_data(load_cifar10(SHARED_CIFAR, download=False),
                                            Path(tempfile.mkdtemp(prefix="bench-airbench-")))
    torch.backends.cudnn.benchmark = True  # airbench's import sets it: every arm alike
    return lambda: airbench94.full_run(folder)


def commit() -> str:
    """This tree's commit, from git where it is here."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git here)"


def render(rows: list[Row], dry_run: bool, seconds: float, revision: str) -> str:
    card = (torch.cuda.get_device_name() if torch.cuda.is_available() and not dry_run
            else f"none (CPU: {platform.processor() or platform.machine()})")
    title = ("DRY RUN on the CPU at toy sizes: these are no GPU figures" if dry_run
             else "measured")
    lines = [f"{title}; card {card}; torch {torch.__version__}; commit {revision}; "
             f"{seconds:.0f} s in all", "", "| what | figure |", "|---|---|"]
    lines += [f"| {row.what} | {row.figure} |" for row in rows]
    return "\n".join(lines)


def write_doc(path: Path, table: str) -> None:
    """Replace what stands between the bench-gpu markers of ``path`` with ``table``."""
    text = path.read_text()
    start, end = (text.index(marker) for marker in MARKERS)
    path.write_text(text[:start + len(MARKERS[0])] + "\n" + table + "\n" + text[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools.gpu_table",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="toy sizes on the CPU: proves the code runs, measures nothing")
    parser.add_argument("--commit", default=None,
                        help="the commit to name (default: git's; a GPU machine that got "
                             "the working tree has no git history: name it here)")
    parser.add_argument("--doc", type=Path, default=None,
                        help="write the table into this file between its bench-gpu markers")
    options = parser.parse_args(argv)
    if options.doc is not None and not all(m in options.doc.read_text() for m in MARKERS):
        print(f"error: --doc {options.doc} has no {MARKERS[0]} ... {MARKERS[1]} markers",
              file=sys.stderr)
        return 2
    if not options.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device here; `--dry-run` runs the CPU parts at toy sizes",
              file=sys.stderr)
        return 2
    started = time.perf_counter()

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - started:5.0f} s] {line}", file=sys.stderr, flush=True)

    rows = measure(options.dry_run, Budget(TOTAL_BUDGET_SEC), log)
    table = render(rows, options.dry_run, time.perf_counter() - started,
                   options.commit or commit())
    print(table)
    if options.doc is not None and not options.dry_run:  # toy CPU figures stay out of it
        write_doc(options.doc, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
