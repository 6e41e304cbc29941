"""Early stopping on an evaluation metric, optionally ending the run with the best weights."""

import math
from typing import Any

import torch
from ignite.engine import Engine, Events
from torch import nn

from handlers.goal import check_mode, is_better


class EarlyStopping:
    """Stop training after ``patience`` evaluations in a row without improvement.

    Register it on the evaluator's ``Events.COMPLETED``; it reads
    ``evaluator.state.metrics[metric]``. (Ignite's ``EarlyStopping.attach(evaluator)``
    resets on every evaluation and never stops, hence the plain registration.)
    An evaluation improves when its score beats the best so far by more than
    ``min_delta`` (in the metric's units); a non-finite score never improves.
    On the ``patience``-th evaluation without improvement it calls
    ``trainer.terminate()`` and sets ``stopped_early``.

    With ``restore_best=True`` it keeps a CPU copy of the model's ``state_dict``
    at its best evaluation, and ``attach_restore()`` makes the run end with those
    weights whatever ends it: early stop, last epoch, ``terminate()`` (a time
    limit), an exception or Ctrl-C. Call ``attach_restore()`` after attaching every
    other trainer handler, so that a final checkpoint of the last weights is
    written before the restore and any other exception handler runs before it.

    Example::

        es = EarlyStopping("val_loss", patience=3, trainer=trainer, restore_best=True, model=model)
        evaluator.add_event_handler(Events.COMPLETED, es)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: evaluator.run(val_loader))
        es.attach_restore()
        trainer.run(train_loader, max_epochs=50)
    """

    def __init__(
        self,
        metric: str,
        patience: int,
        *,
        trainer: Engine,
        mode: str = "min",
        min_delta: float = 0.0,
        restore_best: bool = False,
        model: nn.Module | None = None,
    ) -> None:
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"metric must be the name of an evaluator metric, got {metric!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience must be an int >= 1 (evaluations), got {patience!r}")
        check_mode(mode)
        if (
            isinstance(min_delta, bool)
            or not isinstance(min_delta, int | float)
            or not 0 <= min_delta < math.inf
        ):
            raise ValueError(f"min_delta must be a finite number >= 0, got {min_delta!r}")
        if not isinstance(trainer, Engine):
            raise ValueError(f"trainer must be an ignite Engine, got {type(trainer).__name__}")
        if restore_best and not isinstance(model, nn.Module):
            raise ValueError("restore_best=True needs model=<the nn.Module being trained>")
        self.metric, self.patience, self.mode, self.min_delta = metric, patience, mode, min_delta
        self.trainer, self.restore_best, self.model = trainer, restore_best, model
        self.counter = 0  # evaluations since the last improvement
        self.stopped_early = False
        self._best_score: float | None = None
        self._best_weights: dict[str, torch.Tensor] | None = None
        self._restore_attached = False

    @property
    def best_score(self) -> float | None:
        """The best finite score seen so far; None before the first one."""
        return self._best_score

    def __call__(self, evaluator: Engine) -> None:
        if self.restore_best and not self._restore_attached:
            # Fail at the first evaluation rather than silently end with the last weights.
            raise RuntimeError("restore_best=True but attach_restore() was never called")
        if self.metric not in evaluator.state.metrics:
            raise KeyError(
                f"metric {self.metric!r} is not in evaluator.state.metrics; "
                f"available: {sorted(evaluator.state.metrics)}"
            )
        score = float(evaluator.state.metrics[self.metric])  # once per evaluation
        if self._improves(score):
            self._best_score, self.counter = score, 0
            if self.restore_best:
                self._best_weights = {
                    name: tensor.detach().to("cpu", copy=True)
                    for name, tensor in self.model.state_dict().items()
                }
            return
        self.counter += 1
        if self.counter >= self.patience:
            self.stopped_early = True
            self.trainer.terminate()

    def _improves(self, score: float) -> bool:
        return is_better(score, self._best_score, self.mode, self.min_delta)

    def attach_restore(self) -> None:
        """Restore the best weights when the trainer's run ends, however it ends.

        Listens to ``COMPLETED``, ``TERMINATE`` (which covers
        ``terminate(skip_completed=True)``) and ``EXCEPTION_RAISED``. Ignite
        swallows an exception once any handler listens to ``EXCEPTION_RAISED``, so
        this one re-raises it: a crashed run must not look like a finished one.
        """
        if not self.restore_best:
            raise ValueError("attach_restore() needs restore_best=True")
        self.trainer.add_event_handler(Events.COMPLETED, self.restore_best_weights)
        self.trainer.add_event_handler(Events.TERMINATE, self.restore_best_weights)
        self.trainer.add_event_handler(Events.EXCEPTION_RAISED, self._restore_and_reraise)
        self._restore_attached = True

    def restore_best_weights(self) -> None:
        """Load the best weights into the model; a no-op before the first finite score."""
        if self._best_weights is not None:
            self.model.load_state_dict(self._best_weights)

    def _restore_and_reraise(self, engine: Engine, error: BaseException) -> None:
        self.restore_best_weights()
        raise error

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "best_score": self._best_score,
            "counter": self.counter,
            "stopped_early": self.stopped_early,
        }
        if self.restore_best:
            state["best_weights"] = self._best_weights
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._best_score = state["best_score"]
        self.counter = state["counter"]
        self.stopped_early = state["stopped_early"]
        if self.restore_best:
            self._best_weights = state["best_weights"]
