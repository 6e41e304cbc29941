"""First-step checks: cheap looks at a run's first batch and first loss, one line each.

The mistakes they catch are the classic first-hour ones: NaN or Inf in the inputs, labels
outside the classes (cross-entropy would fail with an opaque index error), and a first loss
far from ln(number of classes), which an untrained classifier gives whatever its data (a
double softmax, wrong labels or a bad initialisation give something else).
"""

import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
from ignite.engine import Engine, Events

from engine.trainer import Trainer
from handlers.arguments import check_int, check_number

logger = logging.getLogger(__name__)


class FirstStepCheckError(ValueError):
    """A first batch that cannot train (labels outside the classes); the message says why."""


class FirstStepChecks:
    """Check the first batch of each session (at ``GET_BATCH_COMPLETED``) and, on a fresh
    run, the first micro-batch's loss (at ``ITERATION_COMPLETED``); print one ``check:``
    ``check:`` line per finding to this module's ``logger``: a problem as a warning, a
    first loss that looks right at INFO (the command line says both). The two checks are attached at
    each ``STARTED`` and detach themselves after their one run: a handler that only
    returns costs at every iteration (Ignite fires from the list it started with, so
    detaching inside an event skips no other handler).

    - every floating-point tensor of the batch must be finite: a warning names the
      tensor's place in the batch and how many values are not;
    - with ``num_classes``, integer labels (the second element of an ``(x, y)`` batch)
      must lie in ``[0, num_classes)``: ``FirstStepCheckError`` otherwise, before the
      forward pass would fail on them;
    - with ``num_classes``, the first loss of a fresh run should be within
      ``loss_tolerance`` (relative) of ln(num_classes); a warning otherwise. A resumed run
      starts from trained weights, so its first loss is not checked. A fresh run with
      ``trained_weights`` (a fine-tune) is expected below ln(num_classes): its line says
      so, and warns only when the loss is far above it (classes in another order?).

    The checks read the device once each, at the first iteration only.
    """

    def __init__(self, num_classes: int | None = None, loss_tolerance: float = 0.5,
                 *, trained_weights: bool = False) -> None:
        if num_classes is not None:
            check_int("num_classes", num_classes, 2)
        check_number("loss_tolerance", loss_tolerance, 0, 1, "()")
        self.num_classes, self.loss_tolerance = num_classes, loss_tolerance
        self.trained_weights = trained_weights
        self.findings: list[str] = []
        self._fresh = True

    def attach(self, trainer: Trainer, evaluator: Engine | None = None) -> None:
        """Listen to the trainer's ``STARTED``; evaluations are not checked."""
        trainer.add_event_handler(Events.STARTED, self._on_started)

    def _on_started(self, trainer: Engine) -> None:
        self._fresh = trainer.state.iteration == 0
        for event, check in ((Events.GET_BATCH_COMPLETED, self._check_batch),
                             (Events.ITERATION_COMPLETED, self._check_loss)):
            if not trainer.has_event_handler(check, event):  # a run that ended before it
                trainer.add_event_handler(event, check)

    def _say(self, line: str, level: int = logging.WARNING) -> None:
        self.findings.append(line)
        logger.log(level, "check: %s", line)

    def _check_batch(self, trainer: Engine) -> None:
        trainer.remove_event_handler(self._check_batch, Events.GET_BATCH_COMPLETED)
        batch = trainer.state.batch
        for place, tensor in _tensors(batch):
            if tensor.is_floating_point():
                bad = int((~torch.isfinite(tensor)).sum())
                if bad:
                    self._say(f"the first batch holds {bad} NaN/Inf value(s) in {place} "
                              f"{tuple(tensor.shape)}: every step on it would be skipped")
        labels = _labels(batch)
        if self.num_classes is not None and labels is not None and labels.numel():
            low, high = int(labels.min()), int(labels.max())
            if low < 0 or high >= self.num_classes:
                raise FirstStepCheckError(
                    f"labels of the first batch range over [{low}, {high}] but the model has "
                    f"{self.num_classes} classes: labels must lie in [0, {self.num_classes})")

    def _check_loss(self, trainer: Engine) -> None:
        trainer.remove_event_handler(self._check_loss, Events.ITERATION_COMPLETED)
        if self.num_classes is None or not self._fresh:
            return
        loss = float(trainer.state.output["loss"])
        expected = math.log(self.num_classes)
        untrained = f"ln({self.num_classes}) = {expected:.3f}"
        if not math.isfinite(loss):
            self._say(f"the first loss is {loss}: the model or the data produce NaN/Inf")
        elif self.trained_weights and loss / expected - 1 > self.loss_tolerance:
            self._say(f"the first loss {loss:.3f} from trained weights is far above {untrained}"
                      ", what an untrained classifier gives: do the classes match the "
                      "weights' run?")
        elif self.trained_weights:
            self._say(f"first loss {loss:.3f} from trained weights (untrained: {untrained}): "
                      "ok", logging.INFO)
        elif abs(loss / expected - 1) > self.loss_tolerance:
            self._say(f"the first loss {loss:.3f} is far from ln({self.num_classes}) = "
                      f"{expected:.3f}, what an untrained classifier gives: a softmax applied "
                      "twice, wrong labels or a large initialisation?")
        else:
            self._say(f"first loss {loss:.3f}, near ln({self.num_classes}) = {expected:.3f}: ok",
                      logging.INFO)


def _tensors(batch: Any, place: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(batch, torch.Tensor):
        yield place, batch
    elif isinstance(batch, list | tuple):
        for index, item in enumerate(batch):
            yield from _tensors(item, f"{place}[{index}]")
    elif isinstance(batch, dict):
        for key, item in batch.items():
            yield from _tensors(item, f"{place}[{key!r}]")


def _labels(batch: Any) -> torch.Tensor | None:
    """The integer ``y`` of an ``(x, y)`` batch, else None."""
    if isinstance(batch, list | tuple) and len(batch) == 2 and isinstance(batch[1], torch.Tensor):
        labels = batch[1]
        return None if labels.is_floating_point() else labels
    return None
