"""Factories for the training and evaluation engines."""

import logging
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from ignite.engine import Engine, Events
from ignite.metrics import Metric
from torch import nn

from engine.batch import (
    Forward,
    Predict,
    PrepareBatch,
    move_to_device,
    supervised_forward,
    supervised_predict,
)
from engine.events import EVENT_TO_ATTR, TrainEvents
from engine.nonfinite import NonFiniteGuard
from engine.precision import Precision, resolve_precision
from engine.step import make_train_step
from engine.update_gate import make_gate

# Engine state that a checkpoint must carry besides epoch and iteration.
TRAINER_STATE_KEYS = ("optimizer_step", "skipped_steps", "consecutive_skips")


class Trainer(Engine):
    """An Ignite ``Engine`` that also holds what its step trains with.

    Handlers (checkpointing, telemetry) read ``model``, ``optimizer``,
    ``scaler`` and ``precision`` from here instead of being handed each one.

    A window's step is queued on the device without the host reading its outcome; the
    counters (``optimizer_step``, ``skipped_steps``, ``consecutive_skips``) and the step's
    event (``OPTIMIZER_STEP`` or ``STEP_SKIPPED``) follow at the next micro-batch's
    ``GET_BATCH_STARTED``, before its forward, or first thing at ``EPOCH_COMPLETED``,
    ``COMPLETED`` and ``TERMINATE``. So ``ITERATION_COMPLETED`` handlers of a window's
    last micro-batch run before its step's event; one that reads the counters or saves
    the run there calls ``settle()`` first.
    """

    def __init__(
        self,
        process_function,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        precision: Precision,
        accum_steps: int,
        max_grad_norm: float | None,
        guard: NonFiniteGuard | None = None,
    ) -> None:
        super().__init__(process_function)
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.precision = precision
        self.accum_steps, self.max_grad_norm = accum_steps, max_grad_norm
        self._guard = guard
        self.register_events(*TrainEvents, event_to_attr=EVENT_TO_ATTR)
        for key in TRAINER_STATE_KEYS:
            setattr(self.state, key, 0)
            self.state_dict_user_keys.append(key)
        self.add_event_handler(Events.STARTED, _start_counters)
        if accum_steps > 1:
            self.add_event_handler(Events.STARTED, _require_epoch_length)
        if guard is None:  # a process function that fires the step events itself
            return
        # Registered before any other handler, so every handler of these events sees the
        # previous step settled.
        for event in (Events.GET_BATCH_STARTED, Events.EPOCH_COMPLETED, Events.COMPLETED,
                      Events.TERMINATE):
            self.add_event_handler(event, guard.settle)

    def settle(self) -> None:
        """Read the last step's outcome now (the host waits for the device if it must) and
        fire its event; a no-op when nothing is pending."""
        if self._guard is not None:
            self._guard.settle(self)

    def _fire_event(self, event_name: Any, *event_args: Any, **event_kwargs: Any) -> None:
        # Ignite's own formats a debug message for every event, logged or not: ~1-2 us
        # each, several times per micro-batch. The same loop, formatting only when logged.
        if self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug(f"{self.state.epoch} | {self.state.iteration}, "
                              f"Firing handlers for event {event_name}")
        self.last_event_name = event_name
        for func, args, kwargs in self._event_handlers[event_name]:
            kwargs.update(event_kwargs)
            if args and isinstance(args[0], weakref.ref):
                engine = args[0]()
                if engine is None:
                    raise RuntimeError("Engine reference not resolved: cannot run the handler")
                func(engine, *event_args, *args[1:], **kwargs)
            else:
                func(*event_args, *args, **kwargs)


def _start_counters(engine: Engine) -> None:
    """A run from scratch (Ignite reset iteration to 0) restarts the step counters too;
    a resumed one (iteration > 0 after load_state_dict) keeps them."""
    if engine.state.iteration == 0:
        for key in TRAINER_STATE_KEYS:
            setattr(engine.state, key, 0)


def _require_epoch_length(engine: Engine) -> None:
    if engine.state.epoch_length is None:
        raise ValueError(
            "accum_steps > 1 needs a known epoch length to close each epoch's last window: "
            "pass a sized loader or run(..., epoch_length=N)"
        )


def create_trainer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn=None,
    *,
    device: str | torch.device = "cpu",
    precision: str = "fp32",
    accum_steps: int = 1,
    max_grad_norm: float | None = None,
    non_finite: str = "skip",
    max_consecutive_skips: int = 3,
    prepare_batch: PrepareBatch = move_to_device,
    forward: Forward | None = None,
    compile: bool = False,
) -> Trainer:
    """Build the training engine.

    Batches are ``(x, y)`` and the loss is ``loss_fn(model(x), y)`` unless
    ``forward(model, batch) -> loss`` is given. ``max_grad_norm=None`` measures
    the gradient norm without clipping. The model is moved to the device; build the
    optimizer before or after, its parameters are the same tensors.

    ``compile=True`` compiles the model's forward in place (``nn.Module.compile``, so an
    evaluator on the same model runs it compiled too): the module, its parameters and its
    ``state_dict`` keys stay the same objects and names, so checkpoints move freely between
    compiled and eager runs. Compiled numerics differ from eager in the last bits.
    """
    resolved = resolve_precision(precision, device)
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"accum_steps must be an int >= 1, got {accum_steps!r}")
    if max_grad_norm is not None and (
        isinstance(max_grad_norm, bool)
        or not isinstance(max_grad_norm, int | float)
        or not max_grad_norm > 0
        or max_grad_norm == float("inf")
    ):
        raise ValueError(
            f"max_grad_norm must be a finite number > 0 or None, got {max_grad_norm!r}"
        )
    if not isinstance(compile, bool):
        raise ValueError(f"compile must be True or False, got {compile!r}")
    if forward is None:
        if loss_fn is None:
            raise ValueError("loss_fn is required unless forward(model, batch) -> loss is given")
        forward = supervised_forward(loss_fn)
    names = {p: name for name, p in getattr(model, "module", model).named_parameters()}
    guard = NonFiniteGuard(
        make_gate(optimizer, resolved.device), names, non_finite, max_consecutive_skips
    )
    model.to(resolved.device)
    if compile:
        model.compile()
    scaler = resolved.make_scaler()
    step = make_train_step(
        model, optimizer, scaler, resolved, forward, prepare_batch,
        accum_steps, max_grad_norm, guard,
    )
    return Trainer(step, model, optimizer, scaler, resolved, accum_steps, max_grad_norm, guard)


def create_evaluator(
    model: nn.Module,
    metrics: Mapping[str, Metric],
    *,
    device: str | torch.device = "cpu",
    precision: str = "fp32",
    prepare_batch: PrepareBatch = move_to_device,
    predict: Predict = supervised_predict,
) -> Engine:
    """Build an evaluation engine: ``model.eval()``, ``torch.inference_mode()``, the
    trainer's autocast, and ``ignite.metrics`` fed ``(y_pred, y)`` from ``predict``."""
    resolved = resolve_precision(precision, device)
    model.to(resolved.device)

    def eval_step(engine: Engine, batch) -> tuple[torch.Tensor, torch.Tensor]:
        model.eval()
        with torch.inference_mode(), resolved.autocast():
            return predict(model, prepare_batch(batch, resolved.device, True))

    evaluator = Engine(eval_step)
    for name, metric in metrics.items():
        metric.attach(evaluator, name)
    return evaluator
