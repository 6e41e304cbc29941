"""The engine arms: the same training work, driven by different loops.

Each arm trains a fresh copy of a workload's model on its batches and returns the
seconds of the timed window (iterations after the warm-up), the seconds from the last
iteration to the run's return (end-of-run handlers such as the epoch checkpoint), and
the probe loss of the trained model.

- ``hand``: the canonical loop, written plainly: autocast (off in fp32), scaled
  backward (GradScaler disabled in fp32), unscale, clip, scaler step, accumulation;
- ``hand-tuned``: the same work as fast as we know how to write it by hand: the norm
  with ``torch._foreach_norm`` and one host read, the clip coefficient decided on the
  host and a multiply only when it bites, ``model.train()`` once, no autocast, scaler
  or division where they do nothing (fp32, one micro-batch per step);
- ``trainer``: our ``create_trainer`` with no handlers;
- ``trainer-loop``: our ``Trainer``'s loop running the tuned loop's step (tiny model only);
- ``trainer+recipe``: ours with the CIFAR recipe's handler set (``RecipeHandlers``);
- ``trainer+recipe+mlflow``: the same with ``--tracker mlflow``'s scalar sink, logging to a
  local MLflow file store (only when MLflow is installed: the ``mlflow`` extra);
- ``ignite``: Ignite's ``create_supervised_trainer``, stock (no unscale, no clip: it
  cannot; it reads ``loss.item()`` every iteration for its output);
- ``lightning``: a ``LightningModule`` with automatic optimization and
  ``gradient_clip_val``, ``Trainer`` with logger, checkpointing, progress bar and model
  summary off.
"""

import contextlib
import functools
import importlib.util
import logging
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from ignite.engine import Engine, Events, create_supervised_trainer

from benchmarks.arms.recipe_handlers import RecipeHandlers
from benchmarks.arms.workloads import Workload
from benchmarks.harness.lockstep import run_lockstep
from benchmarks.harness.timing import WindowTimer
from engine.precision import resolve_precision
from engine.trainer import Trainer, create_trainer

T = TypeVar("T")


@dataclass(frozen=True)
class ArmResult:
    seconds: float  # the timed window: workload.timed iterations
    end_seconds: float  # last iteration done -> the run returned
    probe_loss: float
    blocks: tuple[float, ...] = ()  # the window's blocks of workload.block iterations

    @classmethod
    def of(cls, timer: WindowTimer, workload: Workload, model: torch.nn.Module) -> "ArmResult":
        """The result of a run that just returned, its window timed by ``timer``; the run's
        end is read before the probe loss is computed."""
        end_seconds = time.perf_counter() - timer.end
        return cls(timer.seconds, end_seconds, workload.probe_loss(model), tuple(timer.blocks))


def hand_loop(workload: Workload, accum_steps: int = 1) -> ArmResult:
    model, optimizer = workload.fresh()
    timer = WindowTimer(workload.warmup, workload.timed, workload.block)
    device, loss_fn, max_norm = torch.device("cpu"), workload.loss_fn, workload.max_grad_norm
    scaler = torch.amp.GradScaler(device.type, enabled=False)  # fp32: every call is a no-op
    model.train()
    for i, (x, y) in enumerate(workload.batches):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=False):
            loss = loss_fn(model(x), y)
        scaler.scale(loss / accum_steps).backward()
        if (i + 1) % accum_steps == 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        timer.mark(i + 1)
    return ArmResult.of(timer, workload, model)


def tuned_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn,
               max_norm: float) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """The tuned loop's training step on one batch, as a function: one Python call more
    per iteration than writing it inline, ~0.07 µs here (50 calls added to the loop side by
    side cost 3.4 µs)."""
    params = list(model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss_fn(model(x), y).backward()
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))).item()
        if norm > max_norm:  # clip_grad_norm_'s coefficient, computed on the host
            torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
        if math.isfinite(norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def tuned_hand_loop(workload: Workload) -> ArmResult:
    model, optimizer = workload.fresh()
    timer = WindowTimer(workload.warmup, workload.timed, workload.block)
    step = tuned_step(model, optimizer, workload.loss_fn, workload.max_grad_norm)
    model.train()
    for i, (x, y) in enumerate(workload.batches):
        step(x, y)
        timer.mark(i + 1)
    return ArmResult.of(timer, workload, model)


def _run_engine(engine: Engine, workload: Workload, model: torch.nn.Module) -> ArmResult:
    timer = WindowTimer(workload.warmup, workload.timed, workload.block)
    # Registered last, so each mark comes after every other handler of the iteration.
    engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: timer.mark(e.state.iteration))
    engine.run(workload.batches, max_epochs=1)
    return ArmResult.of(timer, workload, model)


def our_trainer(workload: Workload) -> ArmResult:
    model, optimizer = workload.fresh()
    trainer = create_trainer(model, optimizer, workload.loss_fn,
                             max_grad_norm=workload.max_grad_norm)
    return _run_engine(trainer, workload, model)


def our_trainer_loop(workload: Workload) -> ArmResult:
    """Our ``Trainer``'s epoch loop and events around the tuned loop's step: what the loop
    costs alone, the floor under the ``trainer`` arm."""
    model, optimizer = workload.fresh()
    step = tuned_step(model, optimizer, workload.loss_fn, workload.max_grad_norm)
    precision = resolve_precision("fp32", "cpu")
    model.train()
    trainer = Trainer(lambda engine, batch: step(*batch), model, optimizer,
                      precision.make_scaler(), precision, 1, workload.max_grad_norm, guard=None)
    return _run_engine(trainer, workload, model)


def our_trainer_with_recipe_handlers(workload: Workload, tracker: str = "none") -> ArmResult:
    model, optimizer = workload.fresh()
    trainer = create_trainer(model, optimizer, workload.loss_fn,
                             max_grad_norm=workload.max_grad_norm)
    with tempfile.TemporaryDirectory(prefix="bench-run-") as run_dir:
        handlers = RecipeHandlers(trainer, Path(run_dir), workload.batch_size,
                                  steps_per_epoch=len(workload.batches), tracker=tracker)
        try:
            return _run_engine(trainer, workload, model)
        finally:
            handlers.close()


def ignite_supervised(workload: Workload) -> ArmResult:
    model, optimizer = workload.fresh()
    trainer = create_supervised_trainer(model, optimizer, workload.loss_fn, device="cpu")
    return _run_engine(trainer, workload, model)


class _Batches:
    """The workload's batches as one iterable: Lightning reads a bare list as a list of
    dataloaders."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def lightning(workload: Workload) -> ArmResult:
    import pytorch_lightning as pl  # optional: the bench extra

    class Module(pl.LightningModule):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model, self.loss_fn = model, workload.loss_fn

        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.loss_fn(self.model(x), y)

        def configure_optimizers(self):
            return optimizer

    class MarkTimer(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            timer.mark(batch_idx + 1)

    model, optimizer = workload.fresh()
    timer = WindowTimer(workload.warmup, workload.timed, workload.block)
    for name in ("pytorch_lightning", "lightning_fabric", "lightning.pytorch"):
        logging.getLogger(name).setLevel(logging.ERROR)  # "GPU available: False" and tips
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation notes from its own imports
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, precision="32-true", max_epochs=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            gradient_clip_val=workload.max_grad_norm, gradient_clip_algorithm="norm",
            num_sanity_val_steps=0, use_distributed_sampler=False, benchmark=False,
            callbacks=[MarkTimer()],
        )
        trainer.fit(Module(model), train_dataloaders=_Batches(workload.batches))
    return ArmResult.of(timer, workload, model)


WITH_MLFLOW = "trainer+recipe+mlflow"  # an arm only where MLflow is installed
ARMS: dict[str, Callable[[Workload], ArmResult]] = {
    "hand": hand_loop,
    "hand-tuned": tuned_hand_loop,
    "trainer": our_trainer,
    "trainer-loop": our_trainer_loop,
    "trainer+recipe": our_trainer_with_recipe_handlers,
    **({WITH_MLFLOW: functools.partial(our_trainer_with_recipe_handlers, tracker="mlflow")}
       if importlib.util.find_spec("mlflow") is not None else {}),
    "ignite": ignite_supervised,
    "lightning": lightning,
}


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """Prints (the telemetry's health line, a library's notes) go to /dev/null: they would
    mix with the benchmark's log, and every arm's output then costs the same."""
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        yield


def run_arm(name: str, workload: Workload, threads: int) -> ArmResult:
    """One run of arm ``name`` alone, with ``threads`` intra-op threads, its prints
    discarded."""
    return _run_quietly(threads, [name], lambda: ARMS[name](workload))


def run_arms_lockstep(names: Sequence[str], workload: Workload, threads: int,
                      seed: int = 0) -> dict[str, ArmResult]:
    """One run of each arm in ``names``, all at once, block by block
    (``benchmarks.harness.lockstep``, its order of each round seeded by ``seed``), with ``threads``
    intra-op threads, their prints discarded."""
    return _run_quietly(threads, names, lambda: run_lockstep(
        {name: functools.partial(ARMS[name], workload) for name in names}, seed))


def _run_quietly(threads: int, names: Sequence[str], run: Callable[[], T]) -> T:
    """``run()`` with ``threads`` intra-op threads and stdout discarded; refuses a run whose
    arms changed the thread count."""
    torch.set_num_threads(threads)
    with quiet_stdout():
        result = run()
    if torch.get_num_threads() != threads:
        raise RuntimeError(f"an arm of {list(names)} changed the thread count to "
                           f"{torch.get_num_threads()}")
    return result
