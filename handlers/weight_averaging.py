"""Weight averaging: an exponential (EMA) or equal (SWA) average of the model's weights.

The average lives in a separate module, ``averaged_model``, and never feeds back into
training (``Lookahead`` is the handler that writes an average back). Evaluate it directly,
or put it into the trained model for a while with ``swapped_in()``; its state is in
``state_dict()``, so it goes into every checkpoint and a resumed run continues exactly.

- ``mode="ema"``: after every ``every_steps``-th optimizer step,
  ``average = decay_n * average + (1 - decay_n) * model``. With ``warmup`` the decay
  follows TensorFlow's ``ExponentialMovingAverage(num_updates=n)`` rule,
  ``decay_n = min(decay, (1 + n) / (10 + n))``, ``n`` the number of updates done so far,
  so the first updates forget the starting weights quickly instead of dragging them along
  for ~1 / (1 - decay) steps. Floating-point buffers (BatchNorm running statistics) are
  averaged the same way, so the averaged model can be evaluated at any moment without a
  pass over the data; they are then an average over the same window as the weights.
- ``mode="swa"``: an equal average of the weights taken at the end of every epoch from
  ``start_epoch`` on, or every ``every_steps`` optimizer steps from ``start_step`` on.
  Running statistics of the model's weights do not describe the averaged weights, so
  buffers are only copied from the model and BatchNorm statistics are recomputed over
  ``bn_batches`` when training completes (or whenever ``update_bn()`` is called).

The first update of either mode copies the model, so the average starts where the
averaging starts rather than at the weights the handler was built with.
"""

from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from copy import deepcopy
from typing import Any

import torch
from ignite.engine import Engine, Events
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim.swa_utils import update_bn

from engine.batch import move_to_device
from engine.events import TrainEvents
from engine.run_state import RngState
from engine.trainer import Trainer
from handlers.arguments import check_bool, check_choice, check_int, check_number

MODES = ("ema", "swa")

BnBatches = Iterable[Any] | Callable[[], Iterable[Any]]


def _only_for(name: str, value: Any, allowed: bool, where: str) -> None:
    if value is not None and not allowed:
        raise ValueError(f"{name} is only for {where}, got {name}={value!r}")


class WeightAveraging:
    """Keep an EMA or SWA copy of ``model`` in ``averaged_model``.

    Build it after ``create_trainer`` (which moves the model to its device): the copy
    is taken here, on the model's device. Pass the bare module, not a DDP wrapper.

    Arguments (``None`` means the default given here, and an argument of the other mode
    is refused rather than ignored):

    - ``decay`` (ema, default 0.999) in [0, 1); ``warmup`` (ema, default True): the
      decay rule above.
    - ``every_steps``: average after every N-th optimizer step. Default 1 for ema; for
      swa, unset means once per epoch.
    - ``start_step`` (step clock, default 0): average only at optimizer steps
      ``>= start_step``. ``start_epoch`` (swa per epoch, default 1): average at the end
      of epochs ``>= start_epoch``.
    - ``bn_batches`` (swa; required when the model has BatchNorm): the batches
      BatchNorm statistics are recomputed over, an iterable (a ``DataLoader``, a list)
      or a callable returning a fresh one (a one-shot iterator can be used only once).
      ``bn_input(batch)`` maps a batch to what ``averaged_model(...)`` is called with;
      by default the first element of an ``(x, y)`` batch, moved to the model's device.
      The pass runs without autocast and leaves the random generators as they were.

    Events: the trainer's ``TrainEvents.OPTIMIZER_STEP`` (step clock),
    ``Events.EPOCH_COMPLETED`` (swa per epoch) and ``Events.COMPLETED`` (swa BatchNorm
    recomputation); with an evaluator, its ``Events.STARTED`` and ``Events.COMPLETED``,
    between which the average is swapped into the model (so the evaluation ranks the
    averaged weights): attach it before the evaluator's other ``COMPLETED`` handlers, so
    that they, a checkpoint among them, see the trained weights again. Attach it before
    the handlers that evaluate or save on the same events, so they see this step's
    average (a checkpoint saved before the update would resume one update short).

    Example::

        ema = WeightAveraging(trainer.model, "ema", decay=0.999)
        ema.attach(trainer, evaluator)  # then checkpoints with {"ema": ema, ...} in to_save
        with ema.swapped_in():
            predictions = model(x)  # the model now holds the averaged weights

        swa = WeightAveraging(model, "swa", start_epoch=8, bn_batches=train_loader)
    """

    def __init__(
        self,
        model: nn.Module,
        mode: str = "ema",
        *,
        decay: float | None = None,
        warmup: bool | None = None,
        every_steps: int | None = None,
        start_step: int | None = None,
        start_epoch: int | None = None,
        bn_batches: BnBatches | None = None,
        bn_input: Callable[[Any], Any] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
        if not any(True for _ in model.parameters()):
            raise ValueError("model has no parameters to average")
        check_choice("mode", mode, MODES)
        ema = mode == "ema"
        _only_for("decay", decay, ema, "mode='ema'")
        _only_for("warmup", warmup, ema, "mode='ema'")
        _only_for("bn_batches", bn_batches, not ema, "mode='swa'")
        _only_for("bn_input", bn_input, bn_batches is not None, "use with bn_batches")
        if ema and every_steps is None:
            every_steps = 1
        step_clock = every_steps is not None
        _only_for("start_step", start_step, step_clock, "the step clock (every_steps)")
        _only_for("start_epoch", start_epoch, not step_clock, "mode='swa' without every_steps")
        decay = 0.999 if decay is None else decay
        check_number("decay", decay, 0, 1, "[)")
        warmup = True if warmup is None else warmup
        check_bool("warmup", warmup)
        if step_clock:
            check_int("every_steps", every_steps, 1)
        start_step = 0 if start_step is None else start_step
        check_int("start_step", start_step, 0)
        start_epoch = 1 if start_epoch is None else start_epoch
        check_int("start_epoch", start_epoch, 1)
        has_bn = any(isinstance(module, _BatchNorm) for module in model.modules())
        if not ema and has_bn and bn_batches is None:
            raise ValueError(
                "bn_batches is required for mode='swa' on a model with BatchNorm: the averaged "
                "weights need their own running statistics (pass the training loader)"
            )
        if bn_batches is not None and not (
            callable(bn_batches) or isinstance(bn_batches, Iterable)
        ):
            raise ValueError(
                f"bn_batches must be an iterable or a callable returning one, got {bn_batches!r}"
            )
        if bn_input is not None and not callable(bn_input):
            raise ValueError(f"bn_input must be callable, got {bn_input!r}")

        self.model, self.mode = model, mode
        self.decay, self.warmup = float(decay), warmup
        self.every_steps, self.start_step, self.start_epoch = every_steps, start_step, start_epoch
        self.bn_batches, self.bn_input = bn_batches, bn_input or self._first_element
        self.averaged_model = deepcopy(model).eval().requires_grad_(False)
        self.num_updates = 0
        self._swap = ExitStack()  # holds swapped_in() during an evaluation

    def attach(self, trainer: Trainer, evaluator: Engine | None = None) -> None:
        """Register on ``OPTIMIZER_STEP`` (step clock) or ``EPOCH_COMPLETED`` (swa per epoch),
        on ``COMPLETED`` when BatchNorm statistics are to be recomputed, and on the
        evaluator's ``STARTED``/``COMPLETED`` to evaluate the average."""
        model_device = next(self.model.parameters()).device
        average_device = next(self.averaged_model.parameters()).device
        if model_device != average_device:
            raise ValueError(
                f"the model moved to {model_device} after the average was copied on "
                f"{average_device}: build WeightAveraging after create_trainer"
            )
        if self.every_steps is not None:
            trainer.add_event_handler(TrainEvents.OPTIMIZER_STEP, self._on_step)
        else:
            trainer.add_event_handler(Events.EPOCH_COMPLETED, self._on_epoch)
        if self.bn_batches is not None:
            trainer.add_event_handler(Events.COMPLETED, lambda _: self.update_bn())
        if evaluator is not None:
            evaluator.add_event_handler(Events.STARTED, self._swap_in)
            evaluator.add_event_handler(Events.COMPLETED, self._swap_out)  # after the metrics'

    def _swap_in(self) -> None:
        self._swap.enter_context(self.swapped_in())

    def _swap_out(self) -> None:
        self._swap.close()

    def _on_step(self, trainer: Trainer) -> None:
        step = trainer.state.optimizer_step
        if step >= self.start_step and step % self.every_steps == 0:
            self.update()

    def _on_epoch(self, trainer: Trainer) -> None:
        if trainer.state.epoch >= self.start_epoch:
            self.update()

    def current_weight(self) -> float:
        """The weight the next update gives the model (1.0: the first update copies it)."""
        n = self.num_updates
        if n == 0:
            return 1.0
        if self.mode == "swa":
            return 1.0 / (n + 1)
        return 1.0 - (min(self.decay, (1 + n) / (10 + n)) if self.warmup else self.decay)

    def _split(self, module: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(tensors averaged, tensors copied), in the same order for the model and its copy."""
        params, buffers = list(module.parameters()), list(module.buffers())
        if self.mode == "swa":
            return params, buffers
        floats = [b for b in buffers if b.is_floating_point()]
        return params + floats, [b for b in buffers if not b.is_floating_point()]

    @torch.no_grad()
    def update(self) -> None:
        """Fold the model's current weights into the average (the handlers call this)."""
        averaged, copied = self._split(self.averaged_model)
        current, current_copied = self._split(self.model)
        weight = self.current_weight()
        if weight == 1.0:
            torch._foreach_copy_(averaged, current)
        else:
            # One fused kernel per dtype/device instead of one per tensor; the weight is a
            # Python number, so no value is read back from the device.
            torch._foreach_lerp_(averaged, current, weight)
        for target, source in zip(copied, current_copied, strict=True):
            target.copy_(source)
        self.num_updates += 1

    def update_bn(self) -> None:
        """Recompute the averaged model's BatchNorm statistics over ``bn_batches``.

        Dropout and other random layers draw from the global generators in train mode;
        they are restored afterwards, so calling this mid-run does not change training.
        """
        if self.bn_batches is None:
            raise ValueError("update_bn needs bn_batches (mode='swa')")
        batches = self.bn_batches() if callable(self.bn_batches) else self.bn_batches
        rng = RngState()
        saved = rng.state_dict()
        try:
            # update_bn calls the model on each item's first element: wrapping each input
            # in a 1-tuple passes it through untouched, whatever its type.
            update_bn(((self.bn_input(batch),) for batch in batches), self.averaged_model)
        finally:
            rng.load_state_dict(saved)

    def _first_element(self, batch: Any) -> Any:
        x = batch[0] if isinstance(batch, list | tuple) else batch
        return move_to_device(x, next(self.averaged_model.parameters()).device)

    def _all_tensors(self, module: nn.Module) -> list[torch.Tensor]:
        return [*module.parameters(), *module.buffers()]

    @contextmanager
    def swapped_in(self) -> Iterator[nn.Module]:
        """Put the averaged weights and buffers into ``model`` for the ``with`` block.

        The training weights are restored bit for bit afterwards, also after an
        exception; gradients and optimizer state are not touched. Before the first
        update there is no average yet and the model keeps its own weights.
        """
        if self.num_updates == 0:
            yield self.model
            return
        model_tensors = self._all_tensors(self.model)
        with torch.no_grad():
            saved = [tensor.clone() for tensor in model_tensors]
            torch._foreach_copy_(model_tensors, self._all_tensors(self.averaged_model))
        try:
            yield self.model
        finally:
            with torch.no_grad():
                torch._foreach_copy_(model_tensors, saved)

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only: loads with ``torch.load(weights_only=True)``."""
        return {
            "mode": self.mode,
            "num_updates": self.num_updates,
            "averaged_model": self.averaged_model.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("mode") != self.mode:
            raise ValueError(
                f"weight averaging state is for mode={state.get('mode')!r}, "
                f"this handler has mode={self.mode!r}"
            )
        try:
            self.averaged_model.load_state_dict(state["averaged_model"])
        except RuntimeError as err:
            raise ValueError(f"weight averaging state does not match the model: {err}") from err
        self.num_updates = int(state["num_updates"])
