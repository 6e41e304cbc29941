"""The loss-spike recovery ladder: skip a spike, roll back after repeated ones, stop after
repeats that survive a rollback.

Each window's loss (its micro-batches' mean) and pre-clip gradient norm are compared on the
device, inside the step, with ``factor`` times their median over the last ``window``
windows; a window above it on a watched value is a spike once ``min_history`` windows are
known. The comparison is the trainer's step veto (``Trainer.set_step_veto``): a spike is
kept off the weights and the optimizer state by the same gate as a non-finite step, so the
step still never waits for the host. Spikes and non-finite windows stay out of the median.

The ladder, read on the host when the step settles:

1. a spike is skipped (``STEP_SKIPPED``, then ``STEP_VETOED``) and counted;
2. ``repeat`` spikes within ``repeat_window`` settled windows roll the run back to the
   newest good snapshot (every object in ``state`` restored, ``optimizer_step`` with
   them), drop the ``skip_batches`` batches that follow (at most to the epoch's end: the
   epoch counter is never rolled back) and cool the LR by ``cooldown_factor`` for
   ``cooldown_steps`` optimizer steps (``Trainer.set_lr_scale``: schedules and
   checkpoints keep the scheduled LR);
3. a repeat after ``max_rollbacks`` rollbacks raises ``LossSpikeError`` naming the step.

A good snapshot is a deep copy of ``state``'s state dicts, taken at an optimizer step
when no spike is among the last ``repeat_window`` windows: at the first such step of each
epoch and then every ``snapshot_every`` steps. It lives in this handler's ``state_dict``,
so a checkpoint holds it and a run killed after a rollback resumes bit-identically; the
cost is a second copy of ``state`` in memory (on its device) and in every checkpoint. A
snapshot from an earlier epoch brings back epoch-clocked state (an epoch LR schedule) as it
was then.

Every action is one line of this module's ``logger``, a warning but for the cool-down's end
(the command line says it; ranks other than 0 keep theirs to themselves), and goes to the
listeners as a ``SpikeAction``; ``summary()`` gives the counts for ``summary.json``.

Events: ``TrainEvents.OPTIMIZER_STEP`` (count, cool-down, snapshot), ``STEP_SKIPPED``
(count), ``STEP_VETOED`` (the ladder). Attach it after every handler whose state is in
``state`` and changes on ``OPTIMIZER_STEP`` (LR schedule, weight averaging), so a snapshot
holds their work of the step, and before the checkpoint saves, so a checkpoint holds this
handler's view of the step.

Example::

    guard = SpikeGuard(factor=6.0, repeat=3, repeat_window=50, skip_batches=200)
    guard.rolls_back({"model": model, "optimizer": optimizer, "scaler": trainer.scaler,
                      "scheduler": scheduler, "rng": rng})
    guard.attach(trainer)
    to_save["spike_guard"] = guard  # the ladder and its snapshot in every checkpoint
"""

import copy
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events

from engine.events import TrainEvents
from engine.trainer import Trainer
from handlers.arguments import check_choice, check_int, check_number

logger = logging.getLogger(__name__)

WATCHABLE = ("loss", "grad_norm")
WATCH_CHOICES = ("both", *WATCHABLE)


class LossSpikeError(RuntimeError):
    """Training stopped because loss spikes came back after the allowed rollbacks."""


@dataclass(frozen=True)
class SpikeAction:
    """One rung of the ladder: ``kind`` is ``"spike"``, ``"rollback"``, ``"cooldown_end"``
    or ``"stop"``; ``step`` the optimizer step after it; ``counts`` the run's totals and
    the LR scale now in force (the values TensorBoard plots under ``health/``)."""

    kind: str
    step: int
    iteration: int
    message: str
    counts: dict[str, float]


class SpikeGuard:
    """Skip loss spikes, roll back after repeated ones, stop when they survive a rollback.

    Arguments: ``factor`` (> 1, default 6) times the median is the threshold; ``window``
    (default 100) windows make the median, none decided before ``min_history`` (default
    20, at most ``window``); ``watch`` names the values compared: ``"both"`` (the
    default), ``"loss"`` or ``"grad_norm"`` (meant for non-negative values, a median <= 0
    never flags). ``repeat`` (default 3) spikes within ``repeat_window`` (default 50)
    settled windows roll back; ``snapshot_every`` (default 100) optimizer steps between
    snapshots; ``skip_batches`` (default 200) batches dropped after a rollback;
    ``cooldown_factor`` (in (0, 1], default 0.5) for ``cooldown_steps`` (default 100)
    optimizer steps; ``max_rollbacks`` (default 1) before a repeat stops the run. Every
    argument is the run key ``--spike-<name>`` of the same meaning, so a run passes them
    through unchanged.
    """

    def __init__(
        self,
        *,
        factor: float = 6.0,
        window: int = 100,
        min_history: int = 20,
        watch: str = "both",
        repeat: int = 3,
        repeat_window: int = 50,
        snapshot_every: int = 100,
        skip_batches: int = 200,
        cooldown_factor: float = 0.5,
        cooldown_steps: int = 100,
        max_rollbacks: int = 1,
    ) -> None:
        check_number("factor", factor, 1.0, bounds="()")
        check_int("window", window, 1)
        check_int("min_history", min_history, 1)
        if min_history > window:
            raise ValueError(f"min_history ({min_history}) must be <= window ({window})")
        check_choice("watch", watch, WATCH_CHOICES)
        check_int("repeat", repeat, 1)
        check_int("repeat_window", repeat_window, 1)
        check_int("snapshot_every", snapshot_every, 1)
        check_int("skip_batches", skip_batches, 0)
        if cooldown_factor != 1.0:
            check_number("cooldown_factor", cooldown_factor, 0.0, 1.0, "()")
        check_int("cooldown_steps", cooldown_steps, 0)
        check_int("max_rollbacks", max_rollbacks, 0)
        self.factor, self.window, self.min_history = float(factor), window, min_history
        self.watch = WATCHABLE if watch == "both" else (watch,)  # the names compared
        self.repeat, self.repeat_window = repeat, repeat_window
        self.snapshot_every, self.skip_batches = snapshot_every, skip_batches
        self.cooldown_factor, self.cooldown_steps = float(cooldown_factor), cooldown_steps
        self.max_rollbacks = max_rollbacks
        self.spikes_skipped = self.rollbacks = 0
        self._windows = 0  # settled windows, never rolled back: the repeat clock
        self._spikes: list[int] = []  # the windows of the recent spikes
        self._cooldown_left = 0
        self._snapshot: dict[str, Any] | None = None
        self._position = 0  # the ring row the next window writes
        self._ring: torch.Tensor | None = None  # [window, 2]: loss, grad_norm; NaN = none
        self._watched: torch.Tensor | None = None
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # (values, median)
        self._trainer: Trainer | None = None
        self._state: dict[str, Any] = {}
        self._listeners: list[Callable[[SpikeAction], None]] = []

    def rolls_back(self, state: Mapping[str, Any]) -> None:
        """What a rollback restores: ``state`` maps names to objects with
        ``state_dict``/``load_state_dict`` (the model, optimizer, scaler, LR schedule, RNG
        and handlers whose state follows the weights; not the trainer, this guard, or
        records of what happened such as telemetry and history). Call before ``attach``."""
        for name, obj in state.items():
            if obj is self:
                raise ValueError(f"state[{name!r}]: the guard is not rolled back")
            if not (callable(getattr(obj, "state_dict", None))
                    and callable(getattr(obj, "load_state_dict", None))):
                raise ValueError(f"state[{name!r}] has no state_dict()/load_state_dict()")
        self._state = dict(state)

    def attach(self, trainer: Trainer, evaluator: Engine | None = None) -> None:
        """Veto spikes in ``trainer``'s step (``Trainer.set_step_veto``) and listen to its
        ``TrainEvents.OPTIMIZER_STEP``, ``STEP_SKIPPED``, ``STEP_VETOED`` and
        ``Events.STARTED``; evaluations are not watched. ``rolls_back`` names the state a
        rollback restores."""
        if not isinstance(trainer, Trainer):
            raise ValueError(f"trainer must be the Trainer from create_trainer, got "
                             f"{type(trainer).__name__}")
        for name, obj in self._state.items():
            if obj is trainer:
                raise ValueError(f"state[{name!r}]: the trainer is not rolled back (the guard "
                                 "moves the trainer's position itself)")
        self._trainer = trainer
        device = trainer.precision.device
        self._ring = torch.full((self.window, 2), math.nan, device=device)
        self._watched = torch.tensor([name in self.watch for name in WATCHABLE], device=device)
        trainer.set_step_veto(self._is_spike)
        trainer.add_event_handler(TrainEvents.OPTIMIZER_STEP, self._on_step)
        trainer.add_event_handler(TrainEvents.STEP_SKIPPED, self._on_skip)
        trainer.add_event_handler(TrainEvents.STEP_VETOED, self._on_spike)
        trainer.add_event_handler(Events.STARTED, _require_epoch_length)

    def add_listener(self, listener: Callable[[SpikeAction], None]) -> None:
        self._listeners.append(listener)

    def summary(self) -> dict[str, int]:
        """The counts for ``summary.json``."""
        return {"spikes_skipped": self.spikes_skipped, "rollbacks": self.rollbacks}

    @torch.no_grad()
    def _is_spike(self, window_losses: list[torch.Tensor], norm: torch.Tensor) -> torch.Tensor:
        """The step veto, on the device: compare, then remember the window if it is sound."""
        loss = window_losses[0] if len(window_losses) == 1 else torch.stack(window_losses).mean()
        loss = loss.float()
        if idist.get_world_size() > 1:
            # Losses are per rank, the norm is not: every rank must make the same decision.
            loss = idist.all_reduce(loss.clone()) / idist.get_world_size()
        values = torch.stack((loss, norm.float()))
        median = torch.nanmedian(self._ring, dim=0).values  # NaN while a column is empty
        known = self._ring.shape[0] - torch.isnan(self._ring[:, 0]).sum()
        over = (values > median * self.factor) & (median > 0) & self._watched
        spike = over.any() & (known >= self.min_history)
        sound = torch.isfinite(values).all() & ~spike
        self._ring[self._position] = torch.where(sound, values, math.nan)
        self._position = (self._position + 1) % self.window
        self._last = (values, median)
        return spike

    def _on_step(self, trainer: Trainer) -> None:
        self._windows += 1
        if self._cooldown_left:
            self._cooldown_left -= 1
            if not self._cooldown_left:
                trainer.set_lr_scale(1.0)
                self._emit("cooldown_end", "spike guard: LR cool-down over at step "
                           f"{trainer.state.optimizer_step}")
        state = trainer.state
        calm = not self._recent_spikes()
        due = self._snapshot is None or self._snapshot["epoch"] != state.epoch or (
            state.optimizer_step - self._snapshot["optimizer_step"] >= self.snapshot_every)
        if calm and due:
            self._snapshot = {
                "state": {name: copy.deepcopy(obj.state_dict())
                          for name, obj in self._state.items()},
                "optimizer_step": state.optimizer_step, "iteration": state.iteration,
                "epoch": state.epoch,
            }

    def _on_skip(self, trainer: Trainer) -> None:
        self._windows += 1

    def _on_spike(self, trainer: Trainer) -> None:
        self.spikes_skipped += 1
        self._spikes = [*self._recent_spikes(), self._windows]
        state = trainer.state
        values, median = (tensor.tolist() for tensor in self._last)
        over = ", ".join(f"{name} {values[i]:.4g} > {self.factor:g} x median {median[i]:.4g}"
                         for i, name in enumerate(WATCHABLE)
                         if name in self.watch and values[i] > self.factor * median[i] > 0)
        where = f"step {state.optimizer_step + 1} (iteration {state.iteration})"
        self._emit("spike", f"spike guard: skipped the update of {where}: {over} "
                            f"({len(self._spikes)} within {self.repeat_window} steps)")
        if len(self._spikes) < self.repeat:
            return
        if self.rollbacks >= self.max_rollbacks:
            message = (f"loss spikes at {where}: {self.repeat} within {self.repeat_window} "
                       f"steps after {self.rollbacks} rollback(s); stopping")
            self._emit("stop", f"spike guard: {message}")
            raise LossSpikeError(message)
        self._roll_back(trainer)

    def _roll_back(self, trainer: Trainer) -> None:
        snapshot = self._snapshot  # one exists: a spike needs known windows, whose steps took it
        for name, obj in self._state.items():
            # A copy: load_state_dict may keep the tensors it is given (the optimizer's state).
            obj.load_state_dict(copy.deepcopy(snapshot["state"][name]))
        state = trainer.state
        state.optimizer_step, state.consecutive_skips = snapshot["optimizer_step"], 0
        self.rollbacks += 1
        self._spikes = []
        self._cooldown_left = self.cooldown_steps
        if self._cooldown_left:
            trainer.set_lr_scale(self.cooldown_factor)
        dropped = trainer.skip_batches(self.skip_batches)
        self._emit("rollback", (
            f"spike guard: {self.repeat} spikes within {self.repeat_window} steps: rolled back to "
            f"step {snapshot['optimizer_step']} (iteration {snapshot['iteration']}), skipped "
            f"{dropped} batches to iteration {state.iteration}, LR x{self.cooldown_factor:g} "
            f"for {self.cooldown_steps} steps"))

    def _recent_spikes(self) -> list[int]:
        return [window for window in self._spikes if self._windows - window < self.repeat_window]

    def _emit(self, kind: str, message: str) -> None:
        state = self._trainer.state
        counts = {**self.summary(),
                  "lr_scale": self.cooldown_factor if self._cooldown_left else 1.0}
        action = SpikeAction(kind, state.optimizer_step, state.iteration, message, counts)
        logger.log(logging.INFO if kind == "cooldown_end" else logging.WARNING, message)
        for listener in self._listeners:
            listener(action)

    def state_dict(self) -> dict[str, Any]:
        return {"spikes_skipped": self.spikes_skipped, "rollbacks": self.rollbacks,
                "windows": self._windows, "spikes": list(self._spikes),
                "cooldown_left": self._cooldown_left, "position": self._position,
                # Finite in the file: checkpoint comparisons and checks treat NaN as damage.
                "ring": self._ring.nan_to_num(0.0), "ring_known": ~self._ring.isnan(),
                "snapshot": self._snapshot}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._trainer is None:
            raise ValueError("attach the guard to its trainer before loading its state")
        self.spikes_skipped, self.rollbacks = state["spikes_skipped"], state["rollbacks"]
        self._windows, self._spikes = state["windows"], list(state["spikes"])
        self._cooldown_left, self._position = state["cooldown_left"], state["position"]
        if tuple(state["ring"].shape) != tuple(self._ring.shape):
            raise ValueError(f"the saved guard kept {state['ring'].shape[0]} windows of history, "
                             f"this one keeps {self.window}")
        self._ring.copy_(torch.where(state["ring_known"], state["ring"], math.nan))
        self._snapshot = state["snapshot"]  # never changed in place: replaced or copied from
        self._trainer.set_lr_scale(self.cooldown_factor if self._cooldown_left else 1.0)


def _require_epoch_length(trainer: Trainer) -> None:
    if trainer.state.epoch_length is None:
        raise ValueError("the spike guard skips batches after a rollback: it needs a known "
                         "epoch length (a sized loader or run(..., epoch_length=N))")
