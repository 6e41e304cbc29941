"""The skip decision for a window whose gradient norm is not finite, settled one micro-batch
after the step so that the host never waits for it."""

import math
from typing import NamedTuple

import ignite.distributed as idist
import torch
from ignite.engine import Engine

from engine.events import TrainEvents
from engine.update_gate import HostGate, MaskedGate, StepVeto

NON_FINITE_MODES = ("skip", "raise")
# Looked up once: reading an enum member runs enum code (~1000 instructions).
_OPTIMIZER_STEP = TrainEvents.OPTIMIZER_STEP


class NonFiniteGradientError(RuntimeError):
    """Training stopped because gradients were not finite (NaN or inf)."""


class PendingStep(NamedTuple):
    """A window's step whose outcome the host has not read yet: what the events and the
    error message need, kept on the device. (A tuple: made every step, at a third of a
    dataclass's cost.)"""

    iteration: int
    output: dict[str, torch.Tensor]
    gradient_norms: torch.Tensor  # one per stepped parameter, in their order
    stepped: list[torch.Tensor]  # the parameters that had a gradient
    window_losses: list[torch.Tensor]


class NonFiniteGuard:
    """Settles each window's step: counts it, fires ``OPTIMIZER_STEP`` or ``STEP_SKIPPED``,
    and stops a run that keeps failing.

    The step (``engine.step``) hands over a ``PendingStep`` and the gate has already kept a
    non-finite update off the weights; ``settle`` reads the gate's flag and does the
    bookkeeping. The trainer calls it as the next micro-batch starts, before its
    ``GET_BATCH_STARTED`` (``state.iteration`` and ``state.output`` are still the step's), first at
    ``EPOCH_COMPLETED``, ``COMPLETED`` and ``TERMINATE``, and from ``Trainer.settle()``.

    Under fp16, a skip whose loss was finite while the scale was still above 1 is the
    GradScaler backing off from an overflow (its normal start-up behaviour); it is counted
    as skipped but does not count towards ``max_consecutive_skips`` and never raises. Every
    other skip (a NaN or inf loss, any bf16/fp32 skip, or fp16 with the scale already at or
    below 1) does.

    A step that ``veto`` held back (its norm was finite) is counted as skipped and fires
    ``STEP_SKIPPED`` then ``STEP_VETOED``; it neither counts towards nor resets
    ``consecutive_skips``: the veto's owner keeps its own ladder.
    """

    def __init__(
        self,
        gate: HostGate | MaskedGate,
        names: dict[torch.Tensor, str],
        mode: str,
        max_consecutive_skips: int,
    ) -> None:
        if mode not in NON_FINITE_MODES:
            raise ValueError(f"non_finite={mode!r} is not known; allowed: 'skip', 'raise'")
        if isinstance(max_consecutive_skips, bool) or not isinstance(max_consecutive_skips, int):
            raise ValueError(
                f"max_consecutive_skips must be an int >= 1, got {max_consecutive_skips!r}"
            )
        if max_consecutive_skips < 1:
            raise ValueError(f"max_consecutive_skips must be >= 1, got {max_consecutive_skips}")
        self.gate, self.names = gate, names
        self.mode = mode
        self.max_consecutive_skips = max_consecutive_skips
        self.first_failure = ""
        self.pending: PendingStep | None = None
        self.veto: StepVeto | None = None

    def settle(self, engine: Engine) -> None:
        pending, self.pending = self.pending, None  # first: the events below may settle again
        if pending is None:
            return
        engine.state.output = pending.output  # what handlers of the step's events read
        if self.gate.finite():
            engine.state.consecutive_skips = 0
            engine.state.optimizer_step += 1
            engine._fire_event(_OPTIMIZER_STEP)
            return
        engine.state.skipped_steps += 1
        if self.veto is not None and self.gate.vetoed():
            engine._fire_event(TrainEvents.STEP_SKIPPED)
            engine._fire_event(TrainEvents.STEP_VETOED)
            return
        if not self._is_scaler_backoff(pending):
            self._count_failure(engine, pending)
        engine._fire_event(TrainEvents.STEP_SKIPPED)

    def _is_scaler_backoff(self, pending: PendingStep) -> bool:
        scale = pending.output.get("scale")
        # The scaler backs off only when a gradient itself is not finite (its found_inf);
        # a finite set of gradients whose total norm overflowed is not its business.
        if scale is None or self._first_bad(pending) is None or not float(scale) > 1.0:
            return False
        loss_finite = math.isfinite(float(sum(pending.window_losses)))
        if idist.get_world_size() > 1:
            # Every rank settles this step together (DDP all-reduced the gradients, so the
            # norm agrees), but losses are per rank: agree on them, or the ranks would
            # disagree on the back-off and one would raise while the others wait.
            loss_finite = bool(idist.all_reduce(int(loss_finite), op="MIN"))
        return loss_finite

    def _count_failure(self, engine: Engine, pending: PendingStep) -> None:
        # A run resumed inside a streak (consecutive_skips > 0) has no first failure yet.
        if engine.state.consecutive_skips == 0 or not self.first_failure:
            where = self._first_bad(pending) or (
                "<none: every gradient is finite, their total norm overflowed>"
            )
            self.first_failure = (
                f"first non-finite gradient in parameter {where!r} "
                f"at iteration {pending.iteration}"
            )
        engine.state.consecutive_skips += 1
        if self.mode == "raise" or engine.state.consecutive_skips >= self.max_consecutive_skips:
            raise NonFiniteGradientError(
                f"{self.first_failure}; {engine.state.consecutive_skips} consecutive optimizer "
                f"step(s) skipped, stopping at iteration {pending.iteration} "
                f"(non_finite={self.mode!r}, max_consecutive_skips={self.max_consecutive_skips})"
            )

    def _first_bad(self, pending: PendingStep) -> str | None:
        """The first parameter whose gradient norm is not finite (read only after a skip)."""
        norms = pending.gradient_norms.tolist()
        return next((self.names[p] for p, norm in zip(pending.stepped, norms, strict=True)
                     if not math.isfinite(norm)), None)
