"""A trial's pruning: every evaluation of its run is reported to the Optuna trial, and when
the study's pruner says so, the run ends there cleanly.

Optuna's own ``PyTorchIgnitePruningHandler`` raises ``TrialPruned`` out of the evaluator: the
run would end in an exception, write no summary, and a resumed trial would train on. This one
ends the run the way a finished one ends (``trainer.terminate()`` at the evaluation, so the
checkpoint of that epoch's end is still saved, then the summary), and its state is in every
checkpoint: a pruned trial started again (its worker killed before the study heard of it)
ends at once instead of training on.
"""

import dataclasses
import functools
import warnings
from typing import Any

from ignite.engine import Engine, Events

from engine.trainer import Trainer
from recipes.runner.api import Context, Parts, Recipe, RunPlan

STATE_NAME = "sweep_pruning"  # its entry in the run's checkpoints


class TrialPruning:
    """Reports the evaluator's ``metric`` at each evaluation, at the trainer's optimizer
    step, to ``trial`` (an ``optuna.Trial``) and ends the run when ``trial.should_prune()``.
    ``stop_status`` then says so (the run layer's status for the run: ``Parts.attach_extra``).
    """

    def __init__(self, trial: Any, metric: str) -> None:
        self.trial, self.metric = trial, metric
        self.pruned_at: int | None = None

    @property
    def stop_status(self) -> str | None:
        return None if self.pruned_at is None else f"pruned at step {self.pruned_at}"

    def attach(self, trainer: Trainer, evaluator: Engine) -> None:
        evaluator.add_event_handler(Events.COMPLETED, self._on_evaluation, trainer)
        trainer.add_event_handler(Events.STARTED, self._on_started)

    def _on_evaluation(self, evaluator: Engine, trainer: Trainer) -> None:
        step = trainer.state.optimizer_step
        with warnings.catch_warnings():  # a resumed trial reports its replayed steps again
            warnings.filterwarnings("ignore", message=".*already reported")
            self.trial.report(float(evaluator.state.metrics[self.metric]), step)
        if self.pruned_at is None and self.trial.should_prune():
            self.pruned_at = step
            trainer.terminate()  # after this event's handlers: the epoch's save comes first

    def _on_started(self, trainer: Trainer) -> None:
        if self.pruned_at is not None:  # resumed from the checkpoint saved as it was pruned
            trainer.terminate()

    def state_dict(self) -> dict[str, Any]:
        return {"pruned_at": self.pruned_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pruned_at = state["pruned_at"]


def with_pruning(recipe: Recipe, pruning: TrialPruning) -> Recipe:
    """``recipe`` whose runs also attach ``pruning`` (with the recipe's own handlers, whose
    state every checkpoint holds): the run layer's extension point, so a trial is trained by
    the same ``run`` as any run. ``build`` wraps the recipe's own and says so
    (``functools.wraps``): the recipe is still found by its module, as the commands a trial's
    closing lines print name it."""
    @functools.wraps(recipe.build)
    def build(config: Any, data: Any, ctx: Context) -> Parts:
        parts = recipe.build(config, data, ctx)
        own = parts.attach_extra

        def attach_extra(trainer: Trainer, evaluator: Engine, plan: RunPlan) -> dict[str, Any]:
            extra = dict(own(trainer, evaluator, plan)) if own is not None else {}
            pruning.attach(trainer, evaluator)
            return {**extra, STATE_NAME: pruning}

        return dataclasses.replace(parts, attach_extra=attach_extra)

    return dataclasses.replace(recipe, build=build)
