"""Clipping a window's gradients and applying its optimizer step only when their norm is
finite, without making the host wait for the device.

Under FSDP2 each rank works on its slices of the gradients, parameters and optimizer state
(``engine.sharding``); the norm is the whole gradient's, the same on every rank, so every
rank clips by the same coefficient and takes the same decision."""

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from engine.gradients import (
    NEVER_CLIPPED_BELOW,
    clip_on_device,
    gradient_norms,
    host_clip_coefficient,
)
from engine.sharding import local_shards, shard_group, whole_norms

# (the window's micro-batch losses, its pre-clip gradient norm) -> a 0-d bool tensor on the
# norm's device, True to hold this window's update back. Called once per window before its
# step: on the host gate only when the norm is finite, on the masked gate always.
StepVeto = Callable[[list[torch.Tensor], torch.Tensor], torch.Tensor]


def step_with_lr_scale(optimizer: torch.optim.Optimizer, lr_scale: float,
                       step: Callable[[], object] | None = None) -> None:
    """``step()`` (default ``optimizer.step``) with every group's LR times ``lr_scale`` for
    this call only, so no handler, schedule or checkpoint ever sees the scaled LR."""
    step = optimizer.step if step is None else step
    if lr_scale == 1.0:
        step()
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr * lr_scale
    try:
        step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr


class HostGate:
    """For a device that is the host (the CPU): the norm is in host memory as soon as it is
    computed, so the clip is decided on the host (a multiply only when it bites) and the
    step is not called when the norm is not finite. The norm is read through a NumPy view of
    a buffer it is copied to, which waits for nothing (and is no tensor method that would
    sync on a GPU)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._group = _shard_group_of(optimizer)
        self._norm = torch.empty(())
        self._norm_view = self._norm.numpy()
        self._applied = True
        self._vetoed = False
        self.lr_scale = 1.0  # see step_with_lr_scale
        # --compile puts its compiled update here; None: ``optimizer.step`` looked up at each
        # call, so the wrapper an LR scheduler puts on it later counts the step.
        self.step: Callable[[], object] | None = None

    def update(
        self, grads: list[torch.Tensor], stepped: list[torch.Tensor], max_grad_norm: float | None,
        veto: StepVeto | None = None, window_losses: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-gradient norms, global pre-clip norm) of a window, after its update."""
        if self._group is not None:
            grads = local_shards(grads)
        per_gradient = whole_norms(gradient_norms(grads), self._group)
        norm_tensor = torch.linalg.vector_norm(per_gradient)
        self._norm.copy_(norm_tensor)  # cheaper than computing into it and cloning it out
        norm = self._norm_view.item()
        finite = math.isfinite(norm)
        self._vetoed = finite and veto is not None and bool(veto(window_losses, norm_tensor))
        self._applied = finite and not self._vetoed
        if self._applied:
            # Tested before calling out: most steps are far from the clip.
            if max_grad_norm is not None and norm >= NEVER_CLIPPED_BELOW * max_grad_norm:
                coef = host_clip_coefficient(norm, max_grad_norm)
                if coef < 1.0:
                    torch._foreach_mul_(grads, coef)
            if self.lr_scale == 1.0:
                (self.step or self.optimizer.step)()
            else:
                step_with_lr_scale(self.optimizer, self.lr_scale, self.step)
        return per_gradient, norm_tensor

    def finite(self) -> bool:
        """Whether the last ``update`` stepped: its norm was finite and no veto held it back."""
        return self._applied

    def vetoed(self) -> bool:
        """Whether the veto held the last ``update`` back (its norm was finite)."""
        return self._vetoed


class MaskedGate:
    """For an accelerator: the clip and the step always run, and on the device every tensor
    the step changed in place (the parameters and their optimizer state) is put back with
    ``torch.where`` when the norm was not finite, so no host decision comes between the
    backward and the update. The flag is copied to pinned host memory without blocking;
    ``finite()`` reads it at the next micro-batch, by when the device has normally
    finished the step. A veto is decided on the device as well and joins the flag.

    What ``torch.where`` cannot put back on the device is put back by ``finite()``, before
    the next forward and the next step: optimizer state on the host (Adam's ``step``
    counters unless ``capturable``/``fused``) from a host snapshot, and state the step
    created (a parameter's first step) or replaced instead of updating in place, by
    restoring each parameter's state dict as it was. Until then, such state may hold
    the skipped step's values; the weights never do.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.optimizer = optimizer
        self._group = _shard_group_of(optimizer)
        on_cuda = device.type == "cuda"
        # (applied, vetoed); the second is written only by an update with a veto.
        self._flags = torch.zeros(2, dtype=torch.bool, pin_memory=on_cuda)
        self._flags_view = self._flags.numpy()
        self._copied = torch.cuda.Event() if on_cuda else None
        self._saved_state: list[tuple[torch.Tensor, dict | None]] = []
        self._host_snapshots: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.lr_scale = 1.0  # see step_with_lr_scale
        # --compile puts its compiled update here; None: ``optimizer.step`` looked up at each
        # call, so the wrapper an LR scheduler puts on it later counts the step.
        self.step: Callable[[], object] | None = None

    @torch.no_grad()
    def update(
        self, grads: list[torch.Tensor], stepped: list[torch.Tensor], max_grad_norm: float | None,
        veto: StepVeto | None = None, window_losses: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-gradient norms, global pre-clip norm) of a window, after its update."""
        if self._group is not None:
            grads = local_shards(grads)
        per_gradient = whole_norms(gradient_norms(grads), self._group)
        norm = torch.linalg.vector_norm(per_gradient)
        if max_grad_norm is not None:
            clip_on_device(grads, norm, max_grad_norm)
        applied = torch.isfinite(norm)
        if veto is not None:
            vetoed = applied & veto(window_losses, norm)
            applied = applied & ~vetoed
            self._flags[1].copy_(vetoed, non_blocking=True)
        state = self.optimizer.state
        self._saved_state = [(p, dict(state[p]) if p in state else None) for p in stepped]
        on_device, on_host = list(stepped), []
        for _, saved in self._saved_state:
            for value in (saved or {}).values():
                if isinstance(value, torch.Tensor):
                    (on_device if value.device == norm.device else on_host).append(value)
        on_device, on_host = local_shards(on_device), local_shards(on_host)
        backups = [t.clone() for t in on_device]
        self._host_snapshots = [(t, t.clone()) for t in on_host]
        step_with_lr_scale(self.optimizer, self.lr_scale, self.step)
        for live, backup in zip(on_device, backups, strict=True):
            torch.where(applied, live, backup, out=live)
        self._flags[0].copy_(applied, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return per_gradient, norm

    def finite(self) -> bool:
        """Whether the last ``update`` was applied; puts back what the device could not."""
        if self._copied is not None:
            self._copied.synchronize()  # normally done already: the step was queued earlier
        applied = bool(self._flags_view[0])
        if not applied:
            for live, snapshot in self._host_snapshots:
                live.copy_(snapshot)
            for p, saved in self._saved_state:
                if saved is None:
                    self.optimizer.state.pop(p, None)
                else:
                    self.optimizer.state[p] = saved
        self._saved_state, self._host_snapshots = [], []
        return applied

    def vetoed(self) -> bool:
        """Whether the veto held the last ``update`` back; read after ``finite()``."""
        return bool(self._flags_view[1])


def _shard_group_of(optimizer: torch.optim.Optimizer) -> dist.ProcessGroup | None:
    return shard_group(p for group in optimizer.param_groups for p in group["params"])


def make_gate(optimizer: torch.optim.Optimizer, device: torch.device) -> HostGate | MaskedGate:
    return HostGate(optimizer) if device.type == "cpu" else MaskedGate(optimizer, device)
