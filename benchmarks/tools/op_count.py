"""Aten ops dispatched per training iteration of the CIFAR recipe at its defaults, with the
handlers a default run attaches: ``python -m benchmarks.tools.op_count``.

On a GPU this small net's step is bound by the host, which dispatches one op in about
30 µs; the number of ops the host dispatches per iteration is the same on the CPU, so it is
counted here, with a ``TorchDispatchMode``, on any machine and whatever its load. The run is
the recipe's own (``recipes.runner.training.build.build_run``: model, Muon, trainer,
standard handlers, Lookahead), at batch 8 on synthetic images so that it takes seconds: the
count does not depend on the batch size. The window is ten iterations inside an epoch after
Lookahead has started: it holds one telemetry report and one Lookahead average (at least
their share in a default run) and no epoch boundary, evaluation or checkpoint save.

Each op is charged to a component by the innermost frame of its Python stack that tells
(``component_of``); backward ops run from ``loss.backward()`` and count as backward.
"""

import argparse
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType

import torch
from ignite.engine import Events
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.harness.report import table
from recipes.cifar.recipe import RECIPE, Config

# Steady state at batch 8 and 25 iterations an epoch, 8 epochs (the default) = 200 steps:
# Lookahead starts at 30% of them (step 60) and averages every 20 steps (a tenth of the
# run); epoch 4 is iterations 76-100. The window, iterations 77-86, holds one telemetry
# report (step 80) and one average (step 80): at least their share in a default run, where
# a report comes every 10 steps and an average every 20.
BATCH_SIZE, EPOCH_LENGTH = 8, 25
WINDOW = range(77, 87)
VALIDATION_SAMPLES = 32
# The target of issue 38: the host's dispatches, not the device, bound the step on a GPU.
MAX_OPS_PER_ITERATION = 250

_REPO = Path(__file__).resolve().parents[2]
_TORCH = Path(torch.__file__).parent
# (path prefix, component), the first match of the innermost frame that matches wins.
_RULES = (
    (_TORCH / "autograd", "model backward"),
    (_TORCH / "nn" / "modules", "model forward + loss"),
    (_REPO / "recipes" / "cifar" / "model.py", "model forward + loss"),
    (_REPO / "recipes" / "cifar" / "batches.py", "data (batch, augmentation)"),
    (_REPO / "recipes" / "common" / "data_order.py", "data (batch, augmentation)"),
    (_REPO / "engine" / "muon.py", "optimizer"),
    (_TORCH / "optim", "optimizer"),
    (_REPO / "engine" / "update_gate.py", "gate (norm, clip, non-finite)"),
    (_REPO / "engine" / "gradients.py", "gate (norm, clip, non-finite)"),
    (_REPO / "engine" / "nonfinite.py", "gate (norm, clip, non-finite)"),
    (_REPO / "handlers", "handlers"),
    (_REPO / "engine", "engine (step, loop)"),
)
COMPONENTS = tuple(dict.fromkeys(component for _, component in _RULES))
OTHER = "other"


def component_of(frame: FrameType | None) -> str:
    """The component of the innermost frame from ``frame`` outwards that a rule names."""
    while frame is not None:
        filename = frame.f_code.co_filename
        for prefix, component in _RULES:
            if filename.startswith(str(prefix)):
                return component
        frame = frame.f_back
    return OTHER


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active, by component and by op."""

    def __init__(self) -> None:
        super().__init__()
        self.by_component: Counter[str] = Counter()
        self.by_op: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_component[component_of(sys._getframe(1))] += 1
        self.by_op[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class OpCount:
    iterations: int
    by_component: Counter[str]
    by_op: Counter[str]

    def per_iteration(self, component: str | None = None) -> float:
        total = (sum(self.by_component.values()) if component is None
                 else self.by_component[component])
        return total / self.iterations


def default_config(run_dir: Path) -> Config:
    """The recipe's defaults on synthetic data, at the tool's batch size, on the CPU."""
    return replace(Config(), dataset="synthetic", batch_size=BATCH_SIZE,
                   train_subset=BATCH_SIZE * EPOCH_LENGTH, val_subset=VALIDATION_SAMPLES,
                   device="cpu", run_dir=str(run_dir))


@contextmanager
def _counting_window(trainer, window: range) -> Iterator[OpCounter]:
    """Counts ops from the end of iteration ``window.start - 1`` to the end of
    ``window.stop - 1``, then stops the run."""
    counter = OpCounter()

    def edge(engine) -> None:
        if engine.state.iteration == window.start - 1:
            counter.__enter__()
        elif engine.state.iteration == window.stop - 1:
            counter.__exit__(None, None, None)
            engine.terminate()

    trainer.add_event_handler(Events.ITERATION_COMPLETED, edge)
    yield counter


def count_recipe_ops(config: Config, window: range = WINDOW) -> OpCount:
    """Ops of ``window``'s iterations of a run of the CIFAR recipe with ``config``."""
    from recipes.runner.training.build import build_run
    from recipes.runner.training.start_checks import Started

    run_dir = Path(config.run_dir)
    started = Started(run_dir, "op-count", {}, RECIPE.load_data(config))
    # Progress and the run's lines print to stdout: the tool prints only its table.
    with open(os.devnull, "w") as devnull, redirect_stdout(devnull):
        trainer, _, parts, handlers = build_run(RECIPE, config, started)
        try:
            with _counting_window(trainer, window) as counter:
                trainer.run(parts.train_batches.bind(trainer), max_epochs=config.epochs)
        finally:
            handlers.stop.restore()
            if handlers.logger is not None:
                handlers.logger.close()
    return OpCount(len(window), counter.by_component, counter.by_op)


def render(counts: dict[str, OpCount]) -> str:
    """One row per optimizer setting: ops per iteration by component, and the total."""
    headers = ["optimizer", *COMPONENTS, OTHER, "total"]
    rows = [[name, *(f"{count.per_iteration(c):.0f}" for c in (*COMPONENTS, OTHER)),
             f"**{count.per_iteration():.0f}**"] for name, count in counts.items()]
    return table(headers, rows)


def render_section(counts: dict[str, OpCount]) -> str:
    """The report's row: section 2's neighbour, another count that load does not move."""
    return f"""### Aten ops per training iteration

The CIFAR recipe at its defaults with the handlers a default run attaches (Lookahead
included), batch {BATCH_SIZE} on synthetic images, CPU, fp32: the aten ops dispatched per
iteration over iterations {WINDOW.start}-{WINDOW.stop - 1} (one telemetry report, one
Lookahead average, no epoch boundary), counted by a `TorchDispatchMode` and charged to the
innermost component on each op's Python stack (`benchmarks/tools/op_count.py`). On a GPU this
small net's step is bound by the host dispatching these ops. Target: at most
{MAX_OPS_PER_ITERATION} with the default optimizer (Muon).

{render(counts)}"""


def measure() -> dict[str, OpCount]:
    """The default (Muon) and ``--optimizer sgd``."""
    counts = {}
    for optimizer in ("muon", "sgd"):
        with tempfile.TemporaryDirectory(prefix="op-count-") as run_dir:
            config = replace(default_config(Path(run_dir)), optimizer=optimizer)
            counts[optimizer] = count_recipe_ops(config)
    return counts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools.op_count",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=0, help="also list the N most dispatched ops")
    args = parser.parse_args(argv)
    counts = measure()
    print(render(counts))
    for name, count in counts.items():
        if args.top:
            top = ", ".join(f"{op} {n / count.iterations:.1f}"
                            for op, n in count.by_op.most_common(args.top))
            print(f"{name}: {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
