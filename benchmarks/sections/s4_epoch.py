"""Section 4: CIFAR-10 epoch time on this machine, estimated from a fixed number of training
iterations and a slice of the evaluation, with and without channels_last."""

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from ignite.engine import Engine, Events
from ignite.metrics import Accuracy

from benchmarks.arms.loops import quiet_stdout
from benchmarks.arms.recipe_handlers import RecipeHandlers
from benchmarks.harness.report import table
from benchmarks.harness.timing import Stats, WindowTimer, interleaved_order
from benchmarks.sections.s3_data import FetchShare
from engine.trainer import create_evaluator, create_trainer
from recipes.cifar.batches import EvalBatches, TrainBatches
from recipes.cifar.model import build_model, flip_tta_predict
from recipes.cifar.recipe import Config
from recipes.common.optimizers import param_groups

CIFAR_TRAIN, CIFAR_TEST = 50_000, 10_000  # samples
LAYOUTS = {"channels_last": True, "contiguous (NCHW)": False}


class FetchTimer:
    """Seconds between ``GET_BATCH_STARTED`` and ``GET_BATCH_COMPLETED`` of the iterations
    after ``warmup``."""

    def __init__(self, engine: Engine, warmup: int) -> None:
        self.warmup, self.seconds, self._start = warmup, 0.0, 0.0
        engine.add_event_handler(Events.GET_BATCH_STARTED, self._started)
        engine.add_event_handler(Events.GET_BATCH_COMPLETED, self._completed)

    def _started(self, engine: Engine) -> None:
        self._start = time.perf_counter()

    def _completed(self, engine: Engine) -> None:
        if engine.state.iteration >= self.warmup:  # the batch of iteration state.iteration+1
            self.seconds += time.perf_counter() - self._start


@dataclass(frozen=True)
class EpochRun:
    iteration_seconds: float  # training, per iteration: fetch + step + handlers
    fetch_seconds: float  # per iteration
    end_seconds: float  # after the last iteration: the epoch checkpoint, end of run
    eval_seconds_per_image: float  # flip TTA: two forward passes per image


def epoch_run(images: torch.Tensor, labels: torch.Tensor, eval_images: torch.Tensor,
              eval_labels: torch.Tensor, channels_last: bool, batch_size: int, warmup: int,
              timed: int) -> EpochRun:
    config = Config()
    batches = TrainBatches(images, labels, batch_size, seed=0, channels_last=channels_last,
                           crop_padding=config.crop_padding)
    torch.manual_seed(0)
    model = build_model(config.model)
    model.init_whitening(batches.normalise(images[:5000]))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(param_groups(model, config.weight_decay), lr=config.lr,
                                momentum=config.momentum, nesterov=config.nesterov)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=config.label_smoothing)
    trainer = create_trainer(model, optimizer, loss_fn, max_grad_norm=config.max_grad_norm)
    fetch = FetchTimer(trainer, warmup)
    timer = WindowTimer(warmup, timed)
    with tempfile.TemporaryDirectory(prefix="bench-epoch-") as run_dir:
        handlers = RecipeHandlers(trainer, Path(run_dir), batch_size,
                                  steps_per_epoch=warmup + timed, config=config)
        trainer.add_event_handler(Events.ITERATION_COMPLETED,
                                  lambda e: timer.mark(e.state.iteration))
        try:
            with quiet_stdout():
                trainer.run(batches, max_epochs=1, epoch_length=warmup + timed)
        finally:
            handlers.close()
        end_seconds = time.perf_counter() - timer.end
    evaluator = create_evaluator(model, {"accuracy": Accuracy()}, predict=flip_tta_predict)
    eval_batches = EvalBatches(eval_images, eval_labels, min(1024, len(eval_labels)),
                               channels_last=channels_last)
    start = time.perf_counter()
    evaluator.run(eval_batches)
    eval_seconds = time.perf_counter() - start
    return EpochRun(timer.seconds / timed, fetch.seconds / timed, end_seconds,
                    eval_seconds / len(eval_labels))


@dataclass
class EpochResult:
    batch_size: int
    warmup: int
    timed: int
    eval_images: int
    train_images: int
    runs: dict[str, list[EpochRun]]  # layout -> one per repeat

    @property
    def iterations_per_epoch(self) -> int:
        return CIFAR_TRAIN // self.batch_size  # the recipe drops the last partial batch

    def epoch_seconds(self, run: EpochRun) -> float:
        return (run.iteration_seconds * self.iterations_per_epoch + run.end_seconds
                + run.eval_seconds_per_image * CIFAR_TEST)

    def fetch_shares(self) -> list[FetchShare]:
        return [FetchShare(f"airbench, batch {self.batch_size}, {layout}",
                           [run.fetch_seconds for run in runs],
                           [run.iteration_seconds for run in runs])
                for layout, runs in self.runs.items()]


def synthetic_images(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random uint8 CIFAR-shaped images and labels: the cost of an iteration does not
    depend on pixel values."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=generator)
    return images, torch.randint(0, 10, (n,), generator=generator)


def measure(batch_size: int, warmup: int, timed: int, eval_images: int, repeats: int,
            train_images: int, log: Callable[[str], None]) -> EpochResult:
    """``train_images`` is the pool the batches are drawn from (CIFAR-10's size in the full
    run, so the gathers touch as much memory as the recipe's)."""
    images, labels = synthetic_images(train_images)
    runs: dict[str, list[EpochRun]] = {layout: [] for layout in LAYOUTS}
    for repeat, layout in interleaved_order(list(LAYOUTS), repeats):
        run = epoch_run(images, labels, images[:eval_images], labels[:eval_images],
                        LAYOUTS[layout], batch_size, warmup, timed)
        runs[layout].append(run)
        log(f"  epoch repeat {repeat + 1}/{repeats} {layout}: "
            f"{run.iteration_seconds:.3f} s/iteration")
    return EpochResult(batch_size, warmup, timed, eval_images, train_images, runs)


def render(result: EpochResult) -> str:
    rows = []
    for layout, runs in result.runs.items():
        rows.append([
            layout,
            Stats.of([run.iteration_seconds for run in runs]).format(4, 1e3),
            Stats.of([result.batch_size / run.iteration_seconds for run in runs]).format(4),
            Stats.of([run.eval_seconds_per_image * CIFAR_TEST for run in runs]).format(3),
            Stats.of([run.end_seconds for run in runs]).format(3, 1e3),
            Stats.of([result.epoch_seconds(run) / 60 for run in runs]).format(3),
        ])
    gpu = (f"{torch.cuda.get_device_name(0)} present but not measured by this benchmark"
           if torch.cuda.is_available() else "no GPU on this machine")
    return f"""## 4. CIFAR-10 epoch time on this CPU

An **estimate**, not a timed epoch: our trainer with the recipe's handler set, fed by
`TrainBatches` (batch {result.batch_size}, crop + flip) from {result.train_images} synthetic
uint8 images, runs {result.warmup} warm-up + {result.timed} timed iterations; epoch =
time per iteration × {result.iterations_per_epoch} iterations + run end (the epoch
checkpoint) + evaluation time per image × {CIFAR_TEST} (flip TTA, measured on
{result.eval_images} images in one batch of up to 1024). fp32, the recipe's defaults
otherwise.

{table(["layout", "ms / iteration", "images/s (train)", "evaluation, s / epoch",
        "run end, ms", "epoch estimate, min"], rows)}

GPU: {gpu}; bf16 with and without `torch.compile` untested."""
