"""The process function: one micro-batch in, one (possibly applied) optimizer step out."""

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from ignite.engine import Engine, State
from torch import nn
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from engine.batch import Forward, PrepareBatch
from engine.events import TrainEvents
from engine.nonfinite import NonFiniteGuard
from engine.precision import Precision


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
    not_clipped = torch.tensor(False, device=precision.device)
    window: dict[str, torch.Tensor | None] = {"loss": None}  # summed losses: NaN or overflow?

    def train_step(engine: Engine, batch: Any) -> dict[str, torch.Tensor]:
        # 1-3: forward under autocast, loss divided by the real window length, scaled backward.
        model.train()
        window_len, closes_window = window_position(engine.state, accum_steps)
        batch = prepare_batch(batch, precision.device, True)
        # DDP all-reduces at every backward; inside a window only the last one needs it.
        skip_sync = not closes_window and hasattr(model, "no_sync")
        with model.no_sync() if skip_sync else nullcontext():
            with precision.autocast():
                loss = forward(model, batch)
            scaler.scale(loss / window_len).backward()
        output = {"loss": loss.detach()}
        previous = window["loss"]
        window["loss"] = output["loss"] if previous is None else previous + output["loss"]
        if not closes_window:
            return output

        # 4-5: unscale, one global pre-clip norm on the device, clip with it.
        scaler.unscale_(optimizer)
        grad_norm = get_total_norm([p.grad for p in params if p.grad is not None])
        output["grad_norm"], output["grad_norm_clipped"], output["clipped"] = (
            grad_norm, grad_norm, not_clipped
        )
        if max_grad_norm is not None:
            clip_coef = torch.clamp(max_grad_norm / (grad_norm + 1e-6), max=1.0)
            clip_grads_with_norm_(params, max_grad_norm, grad_norm)
            output["grad_norm_clipped"], output["clipped"] = grad_norm * clip_coef, clip_coef < 1.0
        if precision.uses_scaler:
            # The scale this window was scaled with; cloned because update() changes it in place.
            output["scale"] = scaler._get_scale_async().detach().clone()

        # 6-7: the skip decision (the step's one device wait), then step and scale update.
        applied = guard.allows_step(engine, grad_norm, window["loss"], output.get("scale"))
        if applied:
            # The guard has already read the norm, which is non-finite whenever the scaler's
            # found_inf is set, so stepping directly saves scaler.step() a second wait.
            optimizer.step()
        scaler.update()  # no-op unless fp16; backs the scale off after an overflow

        # 8-9: clear the window, then tell the step-clocked handlers.
        optimizer.zero_grad(set_to_none=True)
        window["loss"] = None
        engine.state.output = output  # handlers on the events below read it
        if applied:
            engine.state.optimizer_step += 1
            engine.fire_event(TrainEvents.OPTIMIZER_STEP)
        else:
            engine.fire_event(TrainEvents.STEP_SKIPPED)
        return output

    return train_step
