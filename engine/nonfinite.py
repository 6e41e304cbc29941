"""The skip decision for a window whose gradient norm is not finite."""

import ignite.distributed as idist
import torch
from ignite.engine import Engine
from torch import nn

NON_FINITE_MODES = ("skip", "raise")


class NonFiniteGradientError(RuntimeError):
    """Training stopped because gradients were not finite (NaN or inf)."""


class NonFiniteGuard:
    """Decides whether a window's update is applied, and stops a run that keeps failing.

    ``allows_step`` reads one boolean from the device: the only wait of an
    optimizer step. A skipped step is counted in ``engine.state.skipped_steps``.

    Under fp16, a skip whose loss was finite while the scale was still above 1 is
    the GradScaler backing off from an overflow (its normal start-up behaviour);
    it is counted as skipped but does not count towards ``max_consecutive_skips``
    and never raises. Every other skip (a NaN or inf loss, any bf16/fp32 skip, or
    fp16 with the scale already at or below 1) does.
    """

    def __init__(self, model: nn.Module, mode: str, max_consecutive_skips: int) -> None:
        if mode not in NON_FINITE_MODES:
            raise ValueError(f"non_finite={mode!r} is not known; allowed: 'skip', 'raise'")
        if isinstance(max_consecutive_skips, bool) or not isinstance(max_consecutive_skips, int):
            raise ValueError(
                f"max_consecutive_skips must be an int >= 1, got {max_consecutive_skips!r}"
            )
        if max_consecutive_skips < 1:
            raise ValueError(f"max_consecutive_skips must be >= 1, got {max_consecutive_skips}")
        self.model = model
        self.mode = mode
        self.max_consecutive_skips = max_consecutive_skips
        self.first_failure = ""

    def allows_step(
        self,
        engine: Engine,
        grad_norm: torch.Tensor,
        window_loss: torch.Tensor,
        scale: torch.Tensor | None,
    ) -> bool:
        if bool(torch.isfinite(grad_norm)):  # the one device wait of an optimizer step
            engine.state.consecutive_skips = 0
            return True
        engine.state.skipped_steps += 1
        bad_parameter = self._first_bad_parameter()
        # The scaler backs off only when a gradient itself is not finite (its found_inf);
        # a finite set of gradients whose total norm overflowed is not its business.
        loss_finite = bool(torch.isfinite(window_loss))
        if idist.get_world_size() > 1:
            # Every rank is in this branch together (DDP all-reduced the gradients, so the
            # norm agrees), but losses are per rank: agree on them, or the ranks would
            # disagree on the back-off and one would raise while the others wait.
            loss_finite = bool(idist.all_reduce(int(loss_finite), op="MIN"))
        is_scaler_backoff = (
            scale is not None and bad_parameter is not None and loss_finite and float(scale) > 1.0
        )
        if is_scaler_backoff:
            return False
        if engine.state.consecutive_skips == 0:
            where = bad_parameter or "<none: every gradient is finite, their total norm overflowed>"
            self.first_failure = (
                f"first non-finite gradient in parameter {where!r} "
                f"at iteration {engine.state.iteration}"
            )
        engine.state.consecutive_skips += 1
        if self.mode == "raise" or engine.state.consecutive_skips >= self.max_consecutive_skips:
            raise NonFiniteGradientError(
                f"{self.first_failure}; {engine.state.consecutive_skips} consecutive optimizer "
                f"step(s) skipped, stopping at iteration {engine.state.iteration} "
                f"(non_finite={self.mode!r}, max_consecutive_skips={self.max_consecutive_skips})"
            )
        return False

    def _first_bad_parameter(self) -> str | None:
        model = getattr(self.model, "module", self.model)  # DDP's names without "module."
        for name, param in model.named_parameters():
            if param.grad is not None and not bool(torch.isfinite(param.grad).all()):
                return name
        return None
