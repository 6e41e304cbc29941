"""Section 6: the image-folder data path (``recipes.images.recipe``): images/s of its
DataLoader with 0, 1 and 2 workers against the in-memory CIFAR path (``TrainBatches``) on
the same JPEG folders, and the share of the default model's training step spent waiting
for data.

``python -m benchmarks.sections.s6_image_folder [--quick] [--out PATH]`` prints (or writes)
one markdown section; ``measure`` and ``render`` are the same for another report.
"""

import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from ignite.engine import Events

from benchmarks.harness.machine import load_average
from benchmarks.harness.report import table
from benchmarks.harness.section_cli import emit, progress_log, section_parser
from benchmarks.harness.timing import Stats, interleaved_order, number
from engine.trainer import create_trainer
from recipes.cifar.batches import TrainBatches
from recipes.cifar.data import load_cifar10
from recipes.common.paths import SHARED_DATA
from recipes.images.data import (
    EpochBatchSampler,
    ImageFiles,
    NormaliseOnDevice,
    TrainLoader,
    list_image_folders,
    train_transform,
)
from recipes.images.recipe import Config, build, load_data
from recipes.runner.api import Context

SHARED_CIFAR = SHARED_DATA / "cifar10"  # the real data set, where this machine has it
IN_MEMORY = "TrainBatches, in memory (cifar recipe)"
WORKER_COUNTS = (0, 1, 2)
WAIT_WORKERS = 2
CIFAR_SIDE = 32


@dataclass(frozen=True)
class Plan:
    batch_size: int
    timed_batches: int  # per throughput repeat, after a first batch left out
    repeats: int
    wait_warmup_steps: int  # training steps before the wait is timed
    wait_timed_steps: int


FULL = Plan(batch_size=256, timed_batches=20, repeats=3, wait_warmup_steps=2,
            wait_timed_steps=6)
QUICK = Plan(batch_size=64, timed_batches=3, repeats=1, wait_warmup_steps=1,
             wait_timed_steps=2)


@dataclass
class LoaderResult:
    plan: Plan
    images_per_second: dict[str, list[float]] = field(default_factory=dict)  # one per repeat
    wait_seconds: list[float] = field(default_factory=list)  # per timed step
    step_seconds: list[float] = field(default_factory=list)
    load: str = ""


def steady_images_per_second(batches: Iterator, timed: int,
                             finish: Callable[[tuple], object]) -> float:
    """Images/s over ``timed`` batches after the first (worker start-up left out);
    ``finish(batch)`` is the work the training step would still do to the batch."""
    next(batches)
    images, start = 0, time.perf_counter()
    for _ in range(timed):
        batch = next(batches)
        finish(batch)
        images += batch[0].shape[0]
    return images / (time.perf_counter() - start)


def measure_throughput(data_dir: Path, plan: Plan, result: LoaderResult,
                       log: Callable[[str], None]) -> None:
    folders = list_image_folders(data_dir)
    dataset = ImageFiles(folders.train, train_transform(CIFAR_SIDE), seed=0)
    normalise = NormaliseOnDevice((0.5,) * 3, (0.25,) * 3)  # its cost, not its values
    arrays = load_cifar10(data_dir, download=False)  # decoded once, then cached
    in_memory = TrainBatches(arrays.train_images, arrays.train_labels, plan.batch_size, seed=0)

    def loader_batches(workers: int, repeat: int) -> Iterator:
        sampler = EpochBatchSampler(len(dataset), plan.batch_size, seed=repeat)
        return iter(TrainLoader(dataset, sampler, num_workers=workers))

    arms: dict[str, Callable[[int], Iterator]] = {
        IN_MEMORY: lambda repeat: in_memory.epoch_batches(repeat + 1)}
    for workers in WORKER_COUNTS:
        arms[f"image folder, DataLoader {workers} workers"] = (
            lambda repeat, workers=workers: loader_batches(workers, repeat))
    finishers = {arm: (lambda batch: None) if arm == IN_MEMORY
                 else (lambda batch: normalise(batch, torch.device("cpu"))) for arm in arms}
    for repeat, arm in interleaved_order(list(arms), plan.repeats):
        value = steady_images_per_second(arms[arm](repeat), plan.timed_batches, finishers[arm])
        result.images_per_second.setdefault(arm, []).append(value)
        log(f"  repeat {repeat + 1}/{plan.repeats} {arm}: {value:.0f} images/s")


def measure_wait(data_dir: Path, plan: Plan, result: LoaderResult,
                 log: Callable[[str], None]) -> None:
    """The recipe's default model and loader (``WAIT_WORKERS`` workers) in the engine's
    trainer: per step, the time from ``GET_BATCH_STARTED`` to ``GET_BATCH_COMPLETED``
    (waiting for the loader) against the whole step."""
    config = Config(data_dir=str(data_dir), batch_size=plan.batch_size,
                    num_workers=WAIT_WORKERS)
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        parts = build(config, load_data(config),
                      Context(torch.device("cpu"), 0, 1, Path(folder)))
    trainer = create_trainer(parts.model, parts.optimizer, parts.loss_fn,
                             prepare_batch=parts.prepare_batch)
    marks: dict[str, float] = {}

    @trainer.on(Events.GET_BATCH_STARTED)
    def batch_asked(_) -> None:
        marks["asked"] = time.perf_counter()

    @trainer.on(Events.GET_BATCH_COMPLETED)
    def batch_received(_) -> None:
        marks["received"] = time.perf_counter()

    @trainer.on(Events.ITERATION_COMPLETED)
    def step_done(engine) -> None:
        if engine.state.iteration > plan.wait_warmup_steps:
            result.wait_seconds.append(marks["received"] - marks["asked"])
            result.step_seconds.append(time.perf_counter() - marks["asked"])
            log(f"  step {engine.state.iteration}: waited {result.wait_seconds[-1]:.3f} s "
                f"of {result.step_seconds[-1]:.2f} s")

    trainer.run(parts.train_batches, max_epochs=1,
                epoch_length=plan.wait_warmup_steps + plan.wait_timed_steps)


def measure(data_dir: Path, plan: Plan, log: Callable[[str], None]) -> LoaderResult:
    result = LoaderResult(plan)
    log("image loader: throughput")
    measure_throughput(data_dir, plan, result, log)
    log(f"image loader: training step wait, {WAIT_WORKERS} workers")
    measure_wait(data_dir, plan, result, log)
    result.load = load_average()
    return result


def render(result: LoaderResult, data_dir: Path) -> str:
    plan = result.plan
    in_memory = Stats.of(result.images_per_second[IN_MEMORY]).median
    rows = [[arm, Stats.of(values).format(4),
             f"{number(Stats.of(values).median / in_memory)}×"]
            for arm, values in result.images_per_second.items()]
    waited, stepped = sum(result.wait_seconds), sum(result.step_seconds)
    return f"""## 6. Image-folder data path

CIFAR-10 as JPEG folders (`{data_dir.name}/`), batch {plan.batch_size}, {plan.timed_batches} \
timed batches per repeat after a first one left out (worker start-up), {plan.repeats} repeats \
interleaved;
load average after: {result.load}. Image folder: `recipes.images.data.TrainLoader`
(StatefulDataLoader; Pillow decode, reflect-pad-and-crop and flip per sample, seeded by
(seed, epoch, index)), then `NormaliseOnDevice`. In memory: `TrainBatches` over the same
images decoded once (crop, flip and normalisation as batched tensor ops). Workers run one
thread each and share the cores with the main process.

{table(["pipeline", "images/s", "vs in memory (medians)"], rows)}

**Does the training step wait for data?** `recipes.images.recipe` defaults (`{Config.model}`,
CIFAR-style stem), {WAIT_WORKERS} workers, the engine's trainer on the CPU: over
{len(result.step_seconds)} steps after {plan.wait_warmup_steps} warm-up steps, waiting for the
loader took {number(waited, 3)} s of {number(stepped, 3)} s
({number(100 * waited / stepped, 2)}% of step time)."""


def main(argv: list[str]) -> int:
    parser = section_parser("benchmarks.sections.s6_image_folder", __doc__, "smoke run: tiny sizes")
    parser.add_argument("--data-dir", type=Path, default=SHARED_CIFAR,
                        help="CIFAR-10 JPEG folders train/ and test/ (default: the shared ones)")
    args = parser.parse_args(argv)
    log = progress_log()
    section = render(measure(args.data_dir, QUICK if args.quick else FULL, log), args.data_dir)
    return emit(section, args.out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
