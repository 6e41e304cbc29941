"""Early stopping on an evaluation metric, optionally ending the run with the best weights."""

from typing import Any

import torch
from ignite.engine import Engine, Events
from torch import nn

from handlers.arguments import check_bool, check_int, check_number
from handlers.goal import Goal


class EarlyStopping:
    """Stop training after ``patience`` evaluations in a row without improvement.

    ``attach(trainer, evaluator)`` listens to the evaluator's ``Events.COMPLETED``,
    reads ``evaluator.state.metrics[goal.metric]`` and calls ``trainer.terminate()``. It
    never resets between evaluations (Ignite's ``EarlyStopping.attach(evaluator)`` resets
    at each one and so never stops): the count runs across the whole run, and a resume
    continues it through ``state_dict``. An evaluation improves when its score beats the
    best so far by more than ``min_delta`` (in the metric's units, the direction is the
    ``goal``'s); a non-finite score never improves. On the ``patience``-th evaluation
    without improvement it sets ``stopped_early`` and terminates the trainer.

    With ``restore_best=True`` it keeps a CPU copy of the model's ``state_dict`` at its
    best evaluation, and ``attach`` also listens to the trainer's ``COMPLETED``,
    ``TERMINATE`` and ``EXCEPTION_RAISED`` to end the run with those weights whatever ends
    it: early stop, last epoch, ``terminate()`` (a time limit), an exception or Ctrl-C.
    Attach it after every other trainer handler then, so that a final checkpoint of the
    last weights is written before the restore and any other exception handler runs
    before it.

    Example::

        es = EarlyStopping(Goal("loss", "min"), patience=3, restore_best=True, model=model)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: evaluator.run(val_loader))
        es.attach(trainer, evaluator)
        trainer.run(train_loader, max_epochs=50)
    """

    def __init__(
        self,
        goal: Goal,
        patience: int,
        *,
        min_delta: float = 0.0,
        restore_best: bool = False,
        model: nn.Module | None = None,
    ) -> None:
        if not isinstance(goal, Goal):
            raise ValueError(f"goal must be a Goal(metric, mode), got {goal!r}")
        check_int("patience", patience, 1, "evaluations")
        check_number("min_delta", min_delta, 0)
        check_bool("restore_best", restore_best)
        if restore_best and not isinstance(model, nn.Module):
            raise ValueError("restore_best=True needs model=<the nn.Module being trained>")
        self.goal, self.patience, self.min_delta = goal, patience, min_delta
        self.restore_best, self.model = restore_best, model
        self.trainer: Engine | None = None
        self.counter = 0  # evaluations since the last improvement
        self.stopped_early = False
        self._best_score: float | None = None
        self._best_weights: dict[str, torch.Tensor] | None = None

    @property
    def best_score(self) -> float | None:
        """The best finite score seen so far; None before the first one."""
        return self._best_score

    def attach(self, trainer: Engine, evaluator: Engine | None = None) -> None:
        """Count ``evaluator``'s evaluations and stop ``trainer``; see the class docstring.

        Ignite swallows an exception once any handler listens to ``EXCEPTION_RAISED``, so
        the restore re-raises it: a crashed run must not look like a finished one.
        """
        if not isinstance(trainer, Engine):
            raise ValueError(f"trainer must be an ignite Engine, got {type(trainer).__name__}")
        if not isinstance(evaluator, Engine):
            raise ValueError("EarlyStopping listens to evaluations: attach(trainer, evaluator)")
        self.trainer = trainer
        evaluator.add_event_handler(Events.COMPLETED, self._on_evaluation)
        if self.restore_best:
            trainer.add_event_handler(Events.COMPLETED, self.restore_best_weights)
            trainer.add_event_handler(Events.TERMINATE, self.restore_best_weights)
            trainer.add_event_handler(Events.EXCEPTION_RAISED, self._restore_and_reraise)

    def _on_evaluation(self, evaluator: Engine) -> None:
        score = self.goal.score(evaluator)
        if self.goal.is_better(score, self._best_score, self.min_delta):
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
