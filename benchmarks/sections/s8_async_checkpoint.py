"""Section 8: how long a checkpoint save holds the training step, written synchronously
against behind training (``--async-checkpoint``), on charlm's model and AdamW state. The
target of issue #48: the step held at most 10% of a synchronous save's time.

Each repeat times the save call itself, ``Checkpointer.save_last`` on the model, its AdamW
state (one step taken), the trainer and the RNG state, as a run's save at that step: the
synchronous save returns once the checkpoint is committed (written, fsync'd, sidecar,
``last.pt`` switched); the asynchronous one once the state is copied, and ``wait()`` then
times the rest, the write and commit behind training. The arms alternate, their order rotated
each repeat, in a folder under ``runs/`` (the disk a run writes to, not a RAM-backed /tmp).
Training does not run meanwhile: what the background write costs a step running beside it
on the same cores is not measured here.

``python -m benchmarks.sections.s8_async_checkpoint [--quick] [--out PATH]`` prints (or
writes) the section.
"""

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from benchmarks.harness.machine import load_average
from benchmarks.harness.report import table
from benchmarks.harness.section_cli import emit, progress_log, section_parser
from benchmarks.harness.timing import interleaved_order, number
from engine.run_state import RngState
from engine.trainer import create_trainer
from handlers.checkpoint.checkpointer import Checkpointer
from recipes.charlm.config import Config
from recipes.charlm.model import GPT
from recipes.common.optimizers import build_optimizer

ARMS = ("sync", "async")
TARGET = 0.10  # the step held at most this fraction of a synchronous save's time


@dataclass(frozen=True)
class Shape:
    name: str
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    repeats: int


SHAPES = (
    Shape("default (4 layers, width 128, block 128)", 4, 4, 128, 128, 7),
    Shape("widest CPU run in performance.md (4 layers, width 256, block 256)", 4, 4, 256, 256,
          7),
    Shape("GPT-2 small (12 layers, width 768, block 1024)", 12, 12, 768, 1024, 3),
)
QUICK_SHAPES = (Shape("tiny (1 layer, width 16, block 8)", 1, 2, 16, 8, 2),)


@dataclass(frozen=True)
class ShapeResult:
    shape: Shape
    parameters: int
    checkpoint_mb: float
    seconds: dict[str, list[float]]  # "sync", "async" (the step held), "behind"


def _checkpointer(shape: Shape, folder: Path, asynchronous: bool) -> Checkpointer:
    """charlm's model and optimizer as the recipe builds them, with AdamW's state made by
    one step on random bytes, in a Checkpointer as a run's (without its logs' states)."""
    torch.manual_seed(0)
    config = Config(n_layer=shape.n_layer, n_head=shape.n_head, n_embd=shape.n_embd,
                    block_size=shape.block_size)
    model = GPT(256, shape.block_size, shape.n_layer, shape.n_head, shape.n_embd)
    optimizer = build_optimizer(config, model, own="adamw", normalize=False, lr=config.lr,
                                betas=(0.9, 0.99))
    window = torch.randint(256, (1, shape.block_size + 1))
    logits = model(window[:, :-1])
    nn.functional.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    trainer = create_trainer(model, optimizer, nn.CrossEntropyLoss())
    return Checkpointer(folder, {"model": model, "optimizer": optimizer, "trainer": trainer,
                                 "rng": RngState()},
                        run_id="bench", keep_last=2, asynchronous=asynchronous)


def _save(checkpointer: Checkpointer, step: int) -> float:
    """The save call's seconds, as the step would wait for it."""
    state = checkpointer.trainer.state
    state.iteration = state.optimizer_step = step
    started = time.perf_counter()
    checkpointer.save_last(checkpointer.trainer)
    return time.perf_counter() - started


def _timed(call: Callable[[], None]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def measure_shape(shape: Shape, root: Path, log: Callable[[str], None]) -> ShapeResult:
    folders = {arm: root / arm for arm in ARMS}
    checkpointers = {arm: _checkpointer(shape, folders[arm], arm == "async") for arm in ARMS}
    model = checkpointers["sync"].to_save["model"]
    seconds: dict[str, list[float]] = {"sync": [], "async": [], "behind": []}
    for arm in ARMS:  # a first save each, untimed: allocations and the folder's first files
        _save(checkpointers[arm], 1)
        checkpointers[arm].wait()
    for repeat, arm in interleaved_order(ARMS, shape.repeats):
        seconds[arm].append(_save(checkpointers[arm], repeat + 2))
        if arm == "async":
            seconds["behind"].append(_timed(checkpointers[arm].wait))
        log(f"  {shape.name}: repeat {repeat + 1}, {arm}: {seconds[arm][-1] * 1e3:.1f} ms")
    size = (folders["sync"] / "last.pt").stat().st_size
    return ShapeResult(shape, sum(p.numel() for p in model.parameters()), size / 2**20, seconds)


def measure(shapes: tuple[Shape, ...], log: Callable[[str], None]) -> list[ShapeResult]:
    Path("runs").mkdir(exist_ok=True)
    results = []
    for shape in shapes:
        log(f"async checkpoint: {shape.name}")
        with tempfile.TemporaryDirectory(prefix="bench-async-checkpoint-", dir="runs") as root:
            results.append(measure_shape(shape, Path(root), log))
    return results


def _ms(values: list[float]) -> str:
    return f"{number(min(values) * 1e3)} / {number(statistics.median(values) * 1e3)}"


def held_fraction(result: ShapeResult) -> float:
    """The step held by an asynchronous save, as a fraction of a synchronous save (medians)."""
    return statistics.median(result.seconds["async"]) / statistics.median(result.seconds["sync"])


def render(results: list[ShapeResult], load: str) -> str:
    rows = [[result.shape.name, f"{result.parameters / 1e6:.2f}M",
             number(result.checkpoint_mb), str(result.shape.repeats),
             _ms(result.seconds["sync"]), _ms(result.seconds["async"]),
             f"{held_fraction(result) * 100:.2f}%", _ms(result.seconds["behind"]),
             "met" if held_fraction(result) <= TARGET else "missed"]
            for result in results]
    return f"""## 8. Checkpoints written behind training (`--async-checkpoint`)

How long one `last` save holds the training step: `Checkpointer.save_last` on charlm's model,
its AdamW state (one step taken), the trainer and the RNG state, synchronous (the call returns
once the checkpoint is committed: written, fsync'd, sidecar, `last.pt` switched) against
`asynchronous=True` (the call returns once the state is copied into CPU memory; the write and
commit follow on a background thread, timed by the `wait()` after it). Min / median over the
repeats, the arms alternating, after a first save each (untimed: it allocates the copy's
buffers, which later saves refill); files on the run folders' disk; {torch.get_num_threads()} torch
thread(s). No training runs beside the background write, so what it costs a step running on
the same cores (and, the write being a Python thread, for the interpreter's lock) is not in
these figures. Load average after: {load}.

{table(["shape", "parameters", "checkpoint, MB", "repeats", "sync save, ms",
        "async: step held, ms", "held / sync (medians)", "async: behind the step, ms",
        f"target ≤ {TARGET:.0%}"], rows)}"""


def main(argv: list[str]) -> int:
    parser = section_parser("benchmarks.sections.s8_async_checkpoint", __doc__,
                            "smoke run: a tiny model, 2 repeats")
    args = parser.parse_args(argv)
    log = progress_log()
    results = measure(QUICK_SHAPES if args.quick else SHAPES, log)
    return emit(render(results, load_average()), args.out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
