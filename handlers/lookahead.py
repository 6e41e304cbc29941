"""Lookahead weight averaging: the model is pulled back to a slow average of itself.

The scheme of hlb-cifar10 and airbench94 (our own code): every ``every`` optimizer
steps an exponential average of the model's floating-point state (weights and
BatchNorm statistics) moves towards the model, and the model is then set to the
average. The average's decay grows over the run,
``decay(step) = decay_base * (step / total_steps) ** decay_power``, so it hardly
averages early, when the weights move fast, and averages strongly near the end.
At every epoch's end the model is set to the average once more, so evaluation and
the epoch's checkpoint see the averaged weights.

torch has ``torch.optim.swa_utils.AveragedModel``, but it keeps a separate model
and never writes back into the trained one: here the write-back is the point.
"""

from typing import Any

import torch
from ignite.engine import Engine, Events
from torch import nn

from engine.events import TrainEvents
from engine.trainer import Trainer
from handlers.arguments import check_int, check_number


class Lookahead:
    """Average the weights every ``every`` optimizer steps from ``start_step`` on.

    The first update after ``start_step`` only takes a copy; each later one does
    ``average = lerp(average, model, 1 - decay(step))`` and copies the average into
    the model. Only floating-point entries of ``model.state_dict()`` are averaged
    (BatchNorm's step counters are left alone). ``state_dict`` holds the average,
    so a resumed run continues exactly.

    Example::

        lookahead = Lookahead(model, total_steps=epochs * steps_per_epoch, every=5)
        lookahead.attach(trainer)  # before the epoch's evaluation and checkpoint handlers
    """

    def __init__(
        self,
        model: nn.Module,
        total_steps: int,
        *,
        every: int = 5,
        decay_base: float = 0.95**5,
        decay_power: float = 3.0,
        start_step: int = 0,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
        check_int("total_steps", total_steps, 1)
        check_int("every", every, 1)
        check_int("start_step", start_step, 0)
        check_number("decay_base", decay_base, 0.0, 1.0, "[]")
        check_number("decay_power", decay_power, 0.0, 100.0, "[]")
        self.model, self.total_steps, self.every = model, total_steps, every
        self.decay_base, self.decay_power, self.start_step = decay_base, decay_power, start_step
        self.average: dict[str, torch.Tensor] | None = None

    def attach(self, trainer: Trainer, evaluator: Engine | None = None) -> None:
        """Average on the trainer's ``OPTIMIZER_STEP``; copy the average back at its
        ``EPOCH_COMPLETED`` (evaluations are not watched: they see the copied-back
        weights). Attach before the handlers that evaluate or save at the epoch's end."""
        trainer.add_event_handler(TrainEvents.OPTIMIZER_STEP, self._on_step)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self._on_epoch_completed)

    def decay(self, step: int) -> float:
        """The weight the average keeps at optimizer step ``step``."""
        return self.decay_base * min(step / self.total_steps, 1.0) ** self.decay_power

    def _floats(self) -> dict[str, torch.Tensor]:
        return {name: value for name, value in self.model.state_dict().items()
                if value.is_floating_point()}

    @torch.no_grad()
    def _on_step(self, trainer: Trainer) -> None:
        step = trainer.state.optimizer_step
        if step < self.start_step or step % self.every:
            return
        if self.average is None:
            self.average = {name: value.detach().clone() for name, value in self._floats().items()}
            return
        weight = 1.0 - self.decay(step)
        for name, value in self._floats().items():
            self.average[name].lerp_(value, weight)
            value.copy_(self.average[name])

    @torch.no_grad()
    def _on_epoch_completed(self, trainer: Trainer) -> None:
        if self.average is None:
            return
        for name, value in self._floats().items():
            value.copy_(self.average[name])

    def state_dict(self) -> dict[str, Any]:
        return {"average": self.average}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        average = state["average"]
        if average is not None:
            floats = self._floats()
            if set(average) != set(floats):
                raise ValueError("lookahead state does not match the model: entries differ "
                                 f"({sorted(set(average) ^ set(floats))[:3]} ...)")
            average = {name: tensor.to(floats[name]) for name, tensor in average.items()}
        self.average = average
