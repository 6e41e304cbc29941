"""LR scheduling: any torch scheduler, stepped on the clock its schedule is written in.

Three clocks:

- ``step``: once per applied optimizer step (``TrainEvents.OPTIMIZER_STEP``), so
  gradient accumulation and skipped fp16 steps do not shift the schedule;
- ``epoch``: once per ``Events.EPOCH_COMPLETED``;
- ``metric``: once per evaluation (evaluator ``Events.COMPLETED``), fed
  ``evaluator.state.metrics[metric]`` (``ReduceLROnPlateau``).

A torch scheduler does not record its unit, so ``build_scheduler`` picks the
clock for the schedules it builds and a raw scheduler is given its ``clock``.
The mismatches we can know are refused: ``ReduceLROnPlateau`` only on
``metric``, nothing else on ``metric``, ``OneCycleLR`` and ``CyclicLR`` (per-batch
schedules) only on ``step``.

``steps_per_epoch`` always counts optimizer steps, not batches:
``optimizer_steps_per_epoch(batches, accum_steps)``.
"""

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from ignite.engine import Engine, Events
from torch.optim import Optimizer, lr_scheduler

from engine.events import TrainEvents
from handlers.arguments import check_choice, check_int, check_number

CLOCKS = ("step", "epoch", "metric")
_REQUIRED_CLOCK = {
    lr_scheduler.ReduceLROnPlateau: "metric",
    lr_scheduler.OneCycleLR: "step",
    lr_scheduler.CyclicLR: "step",
}


class LRSchedulerHandler:
    """Steps a torch LR scheduler on its clock; ``attach`` registers it on the right event.

    Events: ``TrainEvents.OPTIMIZER_STEP`` (clock ``step``), trainer
    ``Events.EPOCH_COMPLETED`` (``epoch``), evaluator ``Events.COMPLETED`` (``metric``).

    Example::

        sched = LRSchedulerHandler(StepLR(optimizer, step_size=30), clock="epoch")
        sched.attach(trainer)
        plateau = LRSchedulerHandler(ReduceLROnPlateau(optimizer), "metric", metric="val_loss")
        plateau.attach(trainer, evaluator)
    """

    def __init__(
        self, scheduler: lr_scheduler.LRScheduler, clock: str, metric: str | None = None
    ) -> None:
        check_choice("clock", clock, CLOCKS)
        name = type(scheduler).__name__
        if not isinstance(scheduler, lr_scheduler.LRScheduler):
            raise ValueError(f"scheduler must be a torch.optim.lr_scheduler scheduler, got {name}")
        required = next((c for t, c in _REQUIRED_CLOCK.items() if isinstance(scheduler, t)), None)
        if required is not None and clock != required:
            raise ValueError(f"{name} needs clock={required!r}, got clock={clock!r}")
        if required is None and clock == "metric":
            raise ValueError(f"{name} takes no metric: use clock='step' or 'epoch'")
        if (clock == "metric") != (metric is not None):
            raise ValueError(
                "metric=<evaluator metric name> is needed with clock='metric' and only there, "
                f"got clock={clock!r}, metric={metric!r}"
            )
        self.scheduler, self.clock, self.metric = scheduler, clock, metric

    @property
    def current_lr(self) -> float:
        """The learning rate of the optimizer's first parameter group."""
        return self.scheduler.optimizer.param_groups[0]["lr"]

    def attach(self, trainer: Engine, evaluator: Engine | None = None) -> None:
        if self.clock == "step":
            trainer.add_event_handler(TrainEvents.OPTIMIZER_STEP, self)
        elif self.clock == "epoch":
            trainer.add_event_handler(Events.EPOCH_COMPLETED, self)
        elif evaluator is None:
            raise ValueError(f"clock='metric' needs the evaluator that computes {self.metric!r}")
        else:
            evaluator.add_event_handler(Events.COMPLETED, self)

    def __call__(self, engine: Engine) -> None:
        if self.clock == "metric":
            self.scheduler.step(engine.state.metrics[self.metric])
        else:
            self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return _plain(self.scheduler.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


def continue_with_new_settings(
    handler: LRSchedulerHandler,
    build: Callable[[], LRSchedulerHandler],
    *,
    old_lr: float,
    new_lr: float,
    optimizer_steps: int,
    epochs_completed: int,
) -> None:
    """After loading a checkpoint, switch the schedule to a new peak LR or run length.

    The rule: the schedule is the one a fresh run with the new settings would follow,
    taken from the position reached. ``build()`` makes a scheduler for the new settings
    (from the optimizer's ``lr``, which is set to ``new_lr`` first in every param group
    that followed ``old_lr``; a group with a peak of its own keeps it); it is stepped
    ``optimizer_steps`` times (step clock) or ``epochs_completed`` times (epoch clock),
    and replaces ``handler``'s scheduler. A plateau schedule has no position to replay:
    the LR it reached is scaled by ``new_lr / old_lr``.
    """
    check_number("old_lr", old_lr, 0, bounds="()")
    check_number("new_lr", new_lr, 0, bounds="()")
    optimizer = handler.scheduler.optimizer
    if handler.clock == "metric":
        for group in optimizer.param_groups:
            group["lr"] *= new_lr / old_lr
        return
    # The groups that start where the first does follow lr; a group with a peak of its own
    # (a Muon group's) keeps it, as a fresh run with only a new lr would. initial_lr is
    # where each schedule started (below the peak for onecycle): popped, else the new
    # scheduler would keep the old one.
    first = optimizer.param_groups[0].get("initial_lr", optimizer.param_groups[0]["lr"])
    start_to_peak = old_lr / first
    for group in optimizer.param_groups:
        start = group.pop("initial_lr", group["lr"])
        group["lr"] = new_lr if start == first else start * start_to_peak
    fresh = build()
    if fresh.scheduler.optimizer is not optimizer or fresh.clock != handler.clock:
        raise ValueError("build() must make the same kind of schedule on the same optimizer")
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": intended
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(optimizer_steps if fresh.clock == "step" else epochs_completed):
            fresh.scheduler.step()
    handler.scheduler = fresh.scheduler


def set_new_peak_lr(optimizer: Optimizer, *, old_lr: float, new_lr: float) -> None:
    """Without a schedule, after loading a checkpoint: the param groups that followed
    ``old_lr`` (those at the first group's LR) take ``new_lr``; a group with a peak of its
    own (a Muon group's) keeps it, as a fresh run with only a new lr would. Nothing changes
    when ``new_lr`` is ``old_lr`` (only the run's length changed)."""
    check_number("old_lr", old_lr, 0, bounds="()")
    check_number("new_lr", new_lr, 0, bounds="()")
    if new_lr == old_lr:
        return
    first = optimizer.param_groups[0]["lr"]
    for group in optimizer.param_groups:
        if group["lr"] == first:
            group["lr"] = new_lr


def _plain(value: Any) -> Any:
    """Drop callables (LR lambdas, scale functions), recursively, so the state loads with
    ``torch.load(weights_only=True)``; a callable in a list becomes None to keep positions.
    Loading keeps the callables the scheduler was built with."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items() if not callable(item)}
    if isinstance(value, list | tuple):
        items = [None if callable(item) else _plain(item) for item in value]
        return tuple(items) if isinstance(value, tuple) else items
    return value


def optimizer_steps_per_epoch(batches: int, accum_steps: int) -> int:
    """Optimizer steps in an epoch of ``batches`` micro-batches: the last window may be short."""
    check_int("batches", batches, 1)
    check_int("accum_steps", accum_steps, 1)
    return math.ceil(batches / accum_steps)


@dataclass(frozen=True)
class RunLength:
    steps_per_epoch: int  # optimizer steps
    epochs: int
    warmup_epochs: float

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.epochs

    @property
    def warmup_steps(self) -> int:
        return int(self.warmup_epochs * self.steps_per_epoch)  # floor: always < total_steps


class WarmupCosine:
    """LR factor after ``step`` optimizer steps: linear from ``start_factor`` to 1 over
    ``warmup_steps``, then a half cosine from 1 down to ``min_lr_ratio`` at ``total_steps``
    (held there after). A callable object, so ``LambdaLR`` saves its settings."""

    def __init__(
        self, warmup_steps: int, total_steps: int, start_factor: float, min_lr_ratio: float
    ) -> None:
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        self.start_factor, self.min_lr_ratio = start_factor, min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.start_factor + (1.0 - self.start_factor) * step / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))  # 1 -> 0
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine


class StepwiseLambdaLR(lr_scheduler.LambdaLR):
    """``LambdaLR`` for a schedule stepped at every optimizer step, where torch's ``step()``
    costs as much as the rest of a small model's step's bookkeeping (~22k instructions:
    call-order checks, a context manager, a warning guard, three list builds). From the
    second step on, ``step()`` sets every group's LR to ``base_lr * lr_lambda(step)``
    directly, as ``LambdaLR`` computes it (the same floats; a tensor LR is filled in
    place), and keeps ``last_epoch``, ``_step_count`` and ``get_last_lr()`` as torch does;
    the first goes through torch's own, which keeps its warning about calling it before
    ``optimizer.step()``. Its ``state_dict`` is ``LambdaLR``'s."""

    def step(self, epoch: int | None = None) -> None:
        if epoch is not None or self._step_count == 1:
            super().step(epoch)
            return
        self._step_count += 1
        self.last_epoch += 1
        step = self.last_epoch
        last_lr = []
        # LambdaLR checked at construction that the three have one length (strict costs).
        for group, factor, base_lr in zip(self.optimizer.param_groups, self.lr_lambdas,
                                          self.base_lrs, strict=False):
            lr = base_lr * factor(step)
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
                lr = group["lr"].clone()
            else:
                group["lr"] = lr
            last_lr.append(lr)
        self._last_lr = last_lr


Built = tuple[lr_scheduler.LRScheduler, str]  # (scheduler, its clock)


def _step(optimizer: Optimizer, run: RunLength, *, step_size: int | None = None,
          gamma: float = 0.1) -> Built:
    """StepLR: multiply by ``gamma`` every ``step_size`` epochs (default: a third of the run)."""
    step_size = max(1, run.epochs // 3) if step_size is None else step_size
    check_int("step_size", step_size, 1, "epochs")
    return lr_scheduler.StepLR(optimizer, step_size, gamma), "epoch"


def _cosine(optimizer: Optimizer, run: RunLength, *, eta_min: float = 0.0) -> Built:
    """CosineAnnealingLR over every optimizer step of the run, down to ``eta_min`` (an LR)."""
    return lr_scheduler.CosineAnnealingLR(optimizer, run.total_steps, eta_min), "step"


def _onecycle(optimizer: Optimizer, run: RunLength, *, pct_start: float = 0.3,
              div_factor: float = 25.0, final_div_factor: float = 1e4) -> Built:
    """OneCycleLR peaking at the optimizer's LR, over every optimizer step of the run."""
    peak_lrs = [group["lr"] for group in optimizer.param_groups]
    scheduler = lr_scheduler.OneCycleLR(
        optimizer, peak_lrs, total_steps=run.total_steps, pct_start=pct_start,
        div_factor=div_factor, final_div_factor=final_div_factor,
    )
    return scheduler, "step"


def _plateau(optimizer: Optimizer, run: RunLength, *, metric: str | None = None,
             mode: str = "min", factor: float = 0.1, patience: int = 10) -> Built:
    """ReduceLROnPlateau on an evaluator metric; ``patience`` counts evaluations."""
    if not isinstance(metric, str) or not metric:
        raise ValueError(f"scheduler 'plateau' needs metric=<an evaluator metric>, got {metric!r}")
    return lr_scheduler.ReduceLROnPlateau(optimizer, mode, factor, patience), "metric"


def _cosine_restarts(optimizer: Optimizer, run: RunLength, *, T_0: int | None = None,
                     T_mult: int = 1, eta_min: float = 0.0) -> Built:
    """CosineAnnealingWarmRestarts in epochs; first period ``T_0`` (default: a third of the run)."""
    T_0 = max(1, run.epochs // 3) if T_0 is None else T_0
    return lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0, T_mult, eta_min), "epoch"


def _warmup_cosine(optimizer: Optimizer, run: RunLength, *, warmup_start_factor: float = 0.01,
                   min_lr_ratio: float = 0.0) -> Built:
    """Linear warmup over ``warmup_epochs`` to the optimizer's LR, then cosine down to
    ``min_lr_ratio`` times it, per optimizer step (see ``WarmupCosine``)."""
    if not 0.0 < warmup_start_factor <= 1.0:
        raise ValueError(f"warmup_start_factor must be in (0, 1], got {warmup_start_factor!r}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}")
    factor = WarmupCosine(run.warmup_steps, run.total_steps, warmup_start_factor, min_lr_ratio)
    return StepwiseLambdaLR(optimizer, factor), "step"


_BUILDERS = {
    "step": _step,
    "cosine": _cosine,
    "onecycle": _onecycle,
    "plateau": _plateau,
    "cosine_restarts": _cosine_restarts,
    "warmup_cosine": _warmup_cosine,
}
SCHEDULER_NAMES = ("none", *_BUILDERS)


def build_scheduler(
    name: str,
    optimizer: Optimizer,
    *,
    steps_per_epoch: int,
    epochs: int,
    warmup_epochs: float = 0.0,
    **options: Any,
) -> LRSchedulerHandler | None:
    """Build a named schedule on its clock; ``"none"`` gives None.

    ``steps_per_epoch`` counts optimizer steps (``optimizer_steps_per_epoch``).
    ``warmup_epochs`` (may be fractional) only applies to ``warmup_cosine``.
    Options per name (their defaults are in the builders above):
    ``step``: step_size (epochs), gamma; ``cosine``: eta_min;
    ``onecycle``: pct_start, div_factor, final_div_factor;
    ``plateau``: metric (required), mode, factor, patience (evaluations);
    ``cosine_restarts``: T_0 (epochs), T_mult, eta_min;
    ``warmup_cosine``: warmup_start_factor, min_lr_ratio.
    Build it before loading a checkpoint into the optimizer, then load both.

    Example::

        sched = build_scheduler("warmup_cosine", optimizer, steps_per_epoch=
            optimizer_steps_per_epoch(len(loader), accum_steps=4), epochs=30, warmup_epochs=2)
        sched.attach(trainer, evaluator)
    """
    check_choice("scheduler", name, SCHEDULER_NAMES)
    check_int("steps_per_epoch", steps_per_epoch, 1)
    check_int("epochs", epochs, 1)
    check_number("warmup_epochs", warmup_epochs, 0, epochs, "[)")
    if warmup_epochs and name != "warmup_cosine":
        raise ValueError(f"warmup_epochs only applies to 'warmup_cosine', not {name!r}: use 0")
    if name == "none":
        if options:
            raise ValueError(f"scheduler 'none' takes no options, got {sorted(options)}")
        return None
    builder = _BUILDERS[name]
    allowed = builder.__kwdefaults__
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"scheduler {name!r} has no option {unknown}; allowed: {sorted(allowed)}")
    run = RunLength(steps_per_epoch, epochs, warmup_epochs)
    scheduler, clock = builder(optimizer, run, **options)
    return LRSchedulerHandler(scheduler, clock, options.get("metric"))  # only 'plateau' has one
