"""LR range test: an exponential learning-rate sweep through the trainer's own step.

``find_lr`` runs the trainer itself (so accumulation, precision, gradient clipping and the
non-finite guard apply as configured) over the given batches, raising the learning rate
exponentially from ``start_lr`` to ``end_lr`` over ``num_steps`` optimizer steps. It
records each step's loss, stops early once the smoothed loss has diverged, suggests a
peak LR, and then puts back everything the sweep changed: the model's weights, buffers,
gradients and train/eval modes, the optimizer, the GradScaler, the trainer's engine state,
the random generators and any other object passed in ``restore`` (schedulers, say).

Because the trainer runs, handlers attached to it would see the sweep (a checkpoint would
save its weights, a scheduler would fight it), so ``find_lr`` refuses a trainer that has
any: call it right after ``create_trainer``, or on a second trainer built the same way.

The suggestion rule (``LRFinderResult.rule``) is the steepest descent of the smoothed loss
against log(LR), as Lightning's ``Tuner.lr_find`` suggests: the LR at which raising the
rate further bought the largest drop in loss. ``min_loss_lr`` (the LR of the lowest
smoothed loss) is reported too; a tenth of it is fastai's older, more conservative rule.
"""

import math
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from copy import deepcopy
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from ignite.engine import Engine, Events, State
from torch import nn

from engine.events import TrainEvents
from engine.nonfinite import NonFiniteGradientError
from engine.run_state import RngState
from engine.trainer import TRAINER_STATE_KEYS, Trainer, create_trainer
from handlers.arguments import check_int, check_number

RULE = (
    "steepest descent: the LR where the smoothed loss falls fastest against log10(LR) "
    "(central differences), from 10% into the sweep up to the loss minimum"
)
STOP_REASONS = ("num_steps", "out of batches", "diverged", "non-finite loss",
                "non-finite gradients")


@dataclass(frozen=True)
class LRFinderResult:
    """The sweep, one entry per recorded optimizer step.

    ``lrs`` are the learning rates each step was taken with, ``raw_losses`` the mean loss
    of its micro-batches (computed before the update), ``losses`` their exponential moving
    average, bias-corrected. ``suggestion`` is ``None`` when the curve is too short or
    never falls (see ``rule``). ``stop_reason`` is one of ``STOP_REASONS``.
    """

    lrs: tuple[float, ...]
    losses: tuple[float, ...]
    raw_losses: tuple[float, ...]
    suggestion: float | None
    min_loss_lr: float | None
    rule: str
    stop_reason: str

    def summary(self) -> str:
        """One line for a log or the console."""
        if not self.lrs:
            return f"LR range test: no step recorded (stopped: {self.stop_reason})"
        swept = (f"swept {self.lrs[0]:.3g} .. {self.lrs[-1]:.3g} over {len(self.lrs)} steps, "
                 f"stopped: {self.stop_reason}")
        if self.suggestion is None:
            return f"LR range test: no suggestion (the smoothed loss did not fall); {swept}"
        return (f"LR range test: suggested peak LR {self.suggestion:.3g} (steepest descent), "
                f"lowest loss at {self.min_loss_lr:.3g}; {swept}")


def _validate(trainer: Any, batches: Any, start_lr: Any, end_lr: Any, num_steps: Any,
              smoothing: Any, diverge_factor: Any, restore: Sequence[Any]) -> None:
    if not isinstance(trainer, Trainer):
        raise ValueError(f"trainer must be a Trainer from create_trainer, got "
                         f"{type(trainer).__name__}")
    if not isinstance(batches, Iterable):
        raise ValueError(f"batches must be an iterable of batches, got {type(batches).__name__}")
    check_number("start_lr", start_lr, 0, bounds="()")
    check_number("end_lr", end_lr, 0, bounds="()")
    if not end_lr > start_lr:
        raise ValueError(f"end_lr must be greater than start_lr, got {end_lr!r} <= {start_lr!r}")
    check_int("num_steps", num_steps, 2)
    check_number("smoothing", smoothing, 0, 1, "[)")
    if diverge_factor is not None:
        check_number("diverge_factor", diverge_factor, 0, bounds="()")
        if not diverge_factor > 1:
            raise ValueError(f"diverge_factor must be > 1 or None, got {diverge_factor!r}")
    for obj in restore:
        if not (callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))):
            raise ValueError(
                f"restore must hold objects with state_dict() and load_state_dict(), "
                f"got {type(obj).__name__}"
            )
    attached = _attached_handlers(trainer)
    if attached:
        raise ValueError(
            f"trainer has handlers attached ({', '.join(attached)}): find_lr runs the trainer, "
            "so they would see the sweep. Call find_lr before attaching them, or on a second "
            "trainer from create_trainer with the same model, optimizer and settings"
        )


def _attached_handlers(trainer: Trainer) -> list[str]:
    """``EVENT: handler`` for each handler beyond those a Trainer registers on itself (in
    its constructor, so first): counted on a throwaway trainer with the same settings."""
    weight = nn.Parameter(torch.zeros(1))  # not nn.Linear: its init would draw from the RNG
    bare = create_trainer(nn.ParameterList([weight]), torch.optim.SGD([weight], lr=0.1),
                          nn.functional.mse_loss, accum_steps=trainer.accum_steps)
    return [
        f"{getattr(event, 'name', event)}: "
        f"{getattr(handler, '__qualname__', type(handler).__name__)}"
        for event, handlers in trainer._event_handlers.items()
        for handler, _, _ in handlers[len(bare._event_handlers.get(event, ())):]
    ]


class _Snapshot:
    """Copies of everything the sweep can change; ``restore`` puts them back bit for bit."""

    def __init__(self, trainer: Trainer, extra: Sequence[Any]) -> None:
        model = trainer.model
        self.trainer = trainer
        # Parameters and every buffer (non-persistent ones too, which state_dict leaves out),
        # copied back in place so nothing holding these tensors sees a new object.
        self.tensors = [(t, t.detach().clone()) for t in [*model.parameters(), *model.buffers()]]
        self.grads = [(p, None if p.grad is None else p.grad.clone()) for p in model.parameters()]
        self.modes = [(module, module.training) for module in model.modules()]
        # state_dict() returns the live state tensors: deep copies, or the sweep moves them.
        self.optimizer = deepcopy(trainer.optimizer.state_dict())
        self.scaler = deepcopy(trainer.scaler.state_dict())
        self.extra = [(obj, deepcopy(obj.state_dict())) for obj in extra]
        self.rng = RngState().state_dict()
        # The engine's attributes as bound now: its State object (the sweep runs on a fresh
        # one) and Ignite's run flags (should_terminate, the data iterator...), which a later
        # run() reads to decide how to resume.
        self.engine_attributes = dict(vars(trainer))

    def restore(self) -> None:
        with torch.no_grad():
            for tensor, saved in self.tensors:
                tensor.copy_(saved)
        for param, grad in self.grads:
            param.grad = grad
        for module, training in self.modes:
            module.training = training
        self.trainer.optimizer.load_state_dict(self.optimizer)
        self.trainer.scaler.load_state_dict(self.scaler)
        for obj, state in self.extra:
            obj.load_state_dict(state)
        RngState().load_state_dict(self.rng)
        for name in set(vars(self.trainer)) - set(self.engine_attributes):
            delattr(self.trainer, name)
        vars(self.trainer).update(self.engine_attributes)


def _whole_windows(batches: Iterable[Any], size: int) -> Iterator[Any]:
    """The batches, cut before a last accumulation window that would be incomplete: a
    half-fed window would leave its gradients behind."""
    iterator = iter(batches)
    while len(window := list(islice(iterator, size))) == size:
        yield from window


class _Sweep:
    """Sets each window's LR, records each settled step and stops the run on divergence.

    A step's outcome is read on ``OPTIMIZER_STEP`` / ``STEP_SKIPPED``, which may fire after
    the window's last ``ITERATION_COMPLETED`` (the trainer settles a step at the next
    micro-batch); ``state.iteration`` and ``state.output`` are then still the step's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: list[float],
                 accum_steps: int, smoothing: float, diverge_factor: float | None) -> None:
        self.optimizer, self.schedule, self.accum_steps = optimizer, schedule, accum_steps
        # The swept LR is the first group's; a group with another LR (a Muon group's) keeps
        # its ratio to it, so the sweep scales the optimizer's LRs together.
        first = optimizer.param_groups[0]["lr"]
        self.ratios = [1.0 if group["lr"] == first else group["lr"] / first
                       for group in optimizer.param_groups]
        self.smoothing, self.diverge_factor = smoothing, diverge_factor
        self.lrs: list[float] = []
        self.raw: list[float] = []
        self.smoothed: list[float] = []
        self.settled = 0
        self.stop_reason: str | None = None
        self._window_sum: torch.Tensor | None = None  # the window's losses before its last
        self._average, self._best = 0.0, math.inf

    def _start_micro_batch(self, engine: Engine) -> None:
        if (engine.state.iteration - 1) % self.accum_steps == 0:
            lr = self.schedule[(engine.state.iteration - 1) // self.accum_steps]
            for group, ratio in zip(self.optimizer.param_groups, self.ratios, strict=True):
                group["lr"] = lr * ratio

    def _end_micro_batch(self, engine: Engine) -> None:
        if engine.state.iteration % self.accum_steps:  # the closing one is read on settling
            loss = engine.state.output["loss"].detach().float()
            self._window_sum = loss if self._window_sum is None else self._window_sum + loss

    def _on_applied(self, engine: Engine) -> None:
        self._settle(engine, applied=True)

    def _on_skipped(self, engine: Engine) -> None:
        self._settle(engine, applied=False)

    def _settle(self, engine: Engine, applied: bool) -> None:
        total = engine.state.output["loss"].detach().float()
        if self._window_sum is not None:
            total = total + self._window_sum
        self._window_sum = None
        self.settled += 1
        loss = float(total) / self.accum_steps  # one device wait per window
        if not math.isfinite(loss):
            self._stop(engine, "non-finite loss")
        elif applied:  # a skipped finite step is an fp16 scaler back-off: nothing learned
            self._record(engine, loss)

    def _record(self, engine: Engine, loss: float) -> None:
        self.lrs.append(self.schedule[(engine.state.iteration - 1) // self.accum_steps])
        self.raw.append(loss)
        self._average = self.smoothing * self._average + (1 - self.smoothing) * loss
        smoothed = self._average / (1 - self.smoothing ** len(self.raw))
        self.smoothed.append(smoothed)
        self._best = min(self._best, smoothed)
        if self.diverge_factor is not None and smoothed > self.diverge_factor * self._best:
            self._stop(engine, "diverged")

    def _stop(self, engine: Engine, reason: str) -> None:
        self.stop_reason = reason
        engine.terminate()

    def run(self, trainer: Trainer, batches: Iterable[Any]) -> str:
        """Sweep; returns the stop reason."""
        handlers = [
            (Events.ITERATION_STARTED, self._start_micro_batch),
            (Events.ITERATION_COMPLETED, self._end_micro_batch),
            (TrainEvents.OPTIMIZER_STEP, self._on_applied),
            (TrainEvents.STEP_SKIPPED, self._on_skipped),
        ]
        trainer.state = State()
        for key in TRAINER_STATE_KEYS:
            setattr(trainer.state, key, 0)
        for event, handler in handlers:
            trainer.add_event_handler(event, handler)
        try:
            with warnings.catch_warnings():
                # Running out of batches is a documented way for the sweep to end.
                warnings.filterwarnings("ignore", message="Data iterator can not provide data")
                # One epoch of whole windows, so every window is accum_steps long.
                trainer.run(_whole_windows(batches, self.accum_steps), max_epochs=1,
                            epoch_length=len(self.schedule) * self.accum_steps)
        except NonFiniteGradientError:  # non_finite="raise", or too many skips in a row
            self.stop_reason = "non-finite gradients"
        finally:
            for event, handler in handlers:
                trainer.remove_event_handler(handler, event)
        if self.stop_reason is None:
            complete = self.settled == len(self.schedule)
            self.stop_reason = "num_steps" if complete else "out of batches"
        return self.stop_reason


def _suggest(lrs: Sequence[float], losses: Sequence[float], skip: int) -> float | None:
    """The rule in ``RULE``; None when no interior point lies before the minimum."""
    lowest = min(range(len(losses)), key=losses.__getitem__)
    x = [math.log10(lr) for lr in lrs]
    candidates = range(max(skip, 1), min(lowest, len(losses) - 2) + 1)
    if not candidates:
        return None
    # Skipped windows leave gaps in the LR grid, hence the division by the real spacing.
    steepest = min(candidates,
                   key=lambda i: (losses[i + 1] - losses[i - 1]) / (x[i + 1] - x[i - 1]))
    return lrs[steepest]


def find_lr(
    trainer: Trainer,
    batches: Iterable[Any],
    *,
    start_lr: float = 1e-7,
    end_lr: float = 10.0,
    num_steps: int = 100,
    smoothing: float = 0.98,
    diverge_factor: float | None = 4.0,
    restore: Sequence[Any] = (),
) -> LRFinderResult:
    """Run an LR range test with ``trainer``'s step and return the curve and a suggestion.

    - ``trainer``: from ``create_trainer``, with no handlers attached (refused otherwise,
      see the module docstring) and not running; it runs the sweep on a fresh engine
      state and gets its own back afterwards.
    - ``batches``: micro-batches as the trainer's step takes them (the training loader);
      each optimizer step takes ``trainer.accum_steps`` of them, and the sweep ends early
      when they run out (an incomplete last window is not used). Pass enough for
      ``num_steps * accum_steps``; a shuffling loader is fine.
    - Step ``i`` (0-based) is taken with ``start_lr * (end_lr / start_lr) ** (i / (num_steps
      - 1))``, set on the first parameter group; a group whose LR differs from the first's
      (a Muon group) is set to that LR times their ratio.
    - ``smoothing``: the weight of the loss's exponential moving average (bias-corrected,
      0 = no smoothing). The sweep stops once the smoothed loss exceeds ``diverge_factor``
      times its minimum (``None``: never), or on a non-finite loss. The rule assumes a
      positive loss.
    - ``restore``: further objects with ``state_dict``/``load_state_dict`` to put back,
      such as LR schedulers. The sweep steps no scheduler (it sets the LR itself), so they
      should not move; passing them makes that a guarantee rather than an assumption.

    Model (weights, buffers, gradients, train/eval modes), optimizer (state and
    hyperparameters), GradScaler, the trainer's engine state, the torch CPU/CUDA and
    Python ``random`` generators and ``restore`` are restored bit for bit afterwards, also
    when the sweep raises. A non-finite step ends the sweep; with ``non_finite="raise"``
    Ignite logs the ``NonFiniteGradientError`` before ``find_lr`` catches it.

    Example::

        result = find_lr(trainer, train_loader, end_lr=1.0, restore=[scheduler])
        print(result.summary())
        plot_lr_find(result, run_dir / "lr_find.png")
    """
    restore = list(restore)
    _validate(trainer, batches, start_lr, end_lr, num_steps, smoothing, diverge_factor,
              restore)
    ratio = end_lr / start_lr
    schedule = [start_lr * ratio ** (i / (num_steps - 1)) for i in range(num_steps)]
    sweep = _Sweep(trainer.optimizer, schedule, trainer.accum_steps, smoothing, diverge_factor)
    snapshot = _Snapshot(trainer, restore)
    try:
        stop_reason = sweep.run(trainer, batches)
    finally:
        snapshot.restore()

    if not sweep.lrs:
        return LRFinderResult((), (), (), None, None, RULE, stop_reason)
    lowest = min(range(len(sweep.smoothed)), key=sweep.smoothed.__getitem__)
    return LRFinderResult(
        lrs=tuple(sweep.lrs),
        losses=tuple(sweep.smoothed),
        raw_losses=tuple(sweep.raw),
        suggestion=_suggest(sweep.lrs, sweep.smoothed, skip=num_steps // 10),
        min_loss_lr=sweep.lrs[lowest],
        rule=RULE,
        stop_reason=stop_reason,
    )


def plot_lr_find(result: LRFinderResult, path: str | os.PathLike[str]) -> Path:
    """Write the curve as a PNG: loss against LR on a log axis, the suggestion marked.

    Returns the path written. Uses matplotlib's Agg renderer through a bare ``Figure``, so
    no window opens and pyplot's global state is left alone.
    """
    if not result.lrs:
        raise ValueError(f"result has no recorded steps to plot (stopped: {result.stop_reason})")
    # Imported here: matplotlib takes about a second to import and only the plot needs it.
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 4.2), dpi=100, layout="constrained")
    axes = figure.subplots()
    axes.plot(result.lrs, result.raw_losses, color="0.75", linewidth=0.8, label="loss")
    axes.plot(result.lrs, result.losses, color="C0", linewidth=1.6, label="smoothed loss")
    if result.suggestion is not None:
        loss = result.losses[result.lrs.index(result.suggestion)]
        axes.axvline(result.suggestion, color="C3", linestyle="--", linewidth=1)
        axes.plot([result.suggestion], [loss], "o", color="C3",
                  label=f"suggested {result.suggestion:.2g} (steepest descent)")
    # Scaled to the curve up to its minimum: the diverged tail can be orders of magnitude
    # higher and would flatten the part that matters; it still shows, leaving the top.
    lowest = result.losses.index(min(result.losses))
    low = min(*result.losses, *result.raw_losses)
    high = max(result.losses[: lowest + 1])
    span = (high - low) or abs(high) or 1.0
    axes.set_ylim(low - 0.05 * span, high + 0.3 * span)
    axes.set_xscale("log")
    axes.set_xlabel("learning rate (log scale)")
    axes.set_ylabel("training loss")
    axes.set_title(f"LR range test ({len(result.lrs)} steps, stopped: {result.stop_reason})")
    axes.legend(loc="best")
    axes.grid(True, which="both", alpha=0.3)
    path = Path(path)
    figure.savefig(path)
    return path
