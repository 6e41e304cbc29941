"""Factories for the training and evaluation engines."""

from collections.abc import Mapping

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

# Engine state that a checkpoint must carry besides epoch and iteration.
TRAINER_STATE_KEYS = ("optimizer_step", "skipped_steps", "consecutive_skips")


class Trainer(Engine):
    """An Ignite ``Engine`` that also holds what its step trains with.

    Handlers (checkpointing, telemetry) read ``model``, ``optimizer``,
    ``scaler`` and ``precision`` from here instead of being handed each one.
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
    ) -> None:
        super().__init__(process_function)
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.precision = precision
        self.accum_steps, self.max_grad_norm = accum_steps, max_grad_norm
        self.register_events(*TrainEvents, event_to_attr=EVENT_TO_ATTR)
        for key in TRAINER_STATE_KEYS:
            setattr(self.state, key, 0)
            self.state_dict_user_keys.append(key)
        self.add_event_handler(Events.STARTED, _start_counters)
        if accum_steps > 1:
            self.add_event_handler(Events.STARTED, _require_epoch_length)


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
) -> Trainer:
    """Build the training engine.

    Batches are ``(x, y)`` and the loss is ``loss_fn(model(x), y)`` unless
    ``forward(model, batch) -> loss`` is given. ``max_grad_norm=None`` measures
    the gradient norm without clipping. See DESIGN.md, "The step, in order".
    The model is moved to the device; build the optimizer before or after, its
    parameters are the same tensors.
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
    if forward is None:
        if loss_fn is None:
            raise ValueError("loss_fn is required unless forward(model, batch) -> loss is given")
        forward = supervised_forward(loss_fn)
    guard = NonFiniteGuard(model, non_finite, max_consecutive_skips)
    model.to(resolved.device)
    scaler = resolved.make_scaler()
    step = make_train_step(
        model, optimizer, scaler, resolved, forward, prepare_batch,
        accum_steps, max_grad_norm, guard,
    )
    return Trainer(step, model, optimizer, scaler, resolved, accum_steps, max_grad_norm)


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
