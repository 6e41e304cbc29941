"""The process function: one micro-batch in, one optimizer step queued at a window's end."""

from collections.abc import Callable
from typing import Any

import torch
from ignite.engine import Engine, State
from torch import nn

from engine.batch import Forward, PrepareBatch
from engine.nonfinite import NonFiniteGuard, PendingStep
from engine.precision import Precision
from engine.sharding import window_no_sync


def window_position(state: State, accum_steps: int) -> tuple[int, bool]:
    """(length of the current accumulation window, whether this micro-batch closes it).

    Windows restart at every epoch, and the epoch's last micro-batch closes the
    last window, which may be shorter than ``accum_steps``.
    """
    if accum_steps == 1:
        return 1, True
    index = (state.iteration - 1) % state.epoch_length  # 0-based position in the epoch
    window_start = index - index % accum_steps
    window_len = min(accum_steps, state.epoch_length - window_start)
    return window_len, index == window_start + window_len - 1


def make_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    precision: Precision,
    forward: Forward,
    prepare_batch: PrepareBatch,
    accum_steps: int,
    max_grad_norm: float | None,
    guard: NonFiniteGuard,
) -> Callable[[Engine, Any], dict[str, torch.Tensor]]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    # Each of these does nothing in some setting; skipping it there saves its Python call
    # (a `with` of a context that does nothing costs about as much as a tensor op).
    no_sync = window_no_sync(model)  # DDP's or FSDP2's; inside a window only
    uses_scaler = precision.uses_scaler
    window_losses: list[torch.Tensor] = []  # read only to classify a skipped step

    def forward_in_precision(model: nn.Module, batch: Any) -> torch.Tensor:
        with precision.autocast():
            return forward(model, batch)

    run_forward = forward if precision.dtype is None else forward_in_precision

    def forward_backward(batch: Any, window_len: int) -> torch.Tensor:
        loss = run_forward(model, batch)
        window_share = loss / window_len if window_len > 1 else loss
        (scaler.scale(window_share) if uses_scaler else window_share).backward()
        return loss

    def train_step(engine: Engine, batch: Any) -> dict[str, torch.Tensor]:
        # 1-3: forward under autocast, loss divided by the real window length, scaled backward.
        if not model.training:  # an evaluation in between switched it to eval()
            model.train()
        window_len, closes_window = (1, True) if accum_steps == 1 else window_position(
            engine.state, accum_steps)
        batch = prepare_batch(batch, precision.device, True)
        if closes_window:
            loss = forward_backward(batch, window_len)
        else:  # DDP and FSDP2 reduce the gradients in the window's last backward only
            with no_sync():
                loss = forward_backward(batch, window_len)
        output = {"loss": loss.detach()}
        window_losses.append(output["loss"])
        if not closes_window:
            return output

        # 4-5: unscale, then (in the gate) one global pre-clip norm and the clip.
        if uses_scaler:
            scaler.unscale_(optimizer)
            # The scale this window was scaled with; cloned because update() changes it in place.
            output["scale"] = scaler._get_scale_async().detach().clone()
        # 6-7: the step, kept off the weights if the norm is not finite or a veto (the spike
        # guard) holds it back (see update_gate);
        # the scale update (fp16) backs off after an overflow, on the device.
        stepped = [p for p in params if p.grad is not None]
        gradient_norms, output["grad_norm"] = guard.gate.update(
            [p.grad for p in stepped], stepped, max_grad_norm, guard.veto, window_losses
        )
        if uses_scaler:
            scaler.update()
        optimizer.zero_grad(set_to_none=True)

        # 8: its outcome is read at the next micro-batch, which fires the step's event.
        guard.pending = PendingStep(
            engine.state.iteration, output, gradient_norms, stepped, window_losses.copy()
        )
        window_losses.clear()
        return output

    return train_step
