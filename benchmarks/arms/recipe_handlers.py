"""The recipes' standard handler set on a benchmark's trainer, attached by the run layer's
own ``attach_standard_handlers`` (no copy of the wiring). Differences from a real run,
each so that every arm trains the same weights or pays only engine costs:

- the LR schedule is ``warmup_cosine`` made flat (start factor 1, end ratio 1): it runs
  the same code per optimizer step, but the learning rate stays at ``lr``, like the arms
  without a scheduler;
- the evaluator gets its handlers (early stopping, best checkpoint, TensorBoard,
  history) but is not run: validation is model compute, not engine overhead;
- ``last`` is saved at every ``EPOCH_COMPLETED`` only (``checkpoint_every`` is beyond
  the run); the save's cost is measured as part of the run's end instead;
- progress is the real ``Progress`` in plain mode, printing to /dev/null;
- CIFAR's ``Lookahead`` (a recipe extra) is left out: it changes the weights, so the arms
  would no longer train the same; its cost is one in-place average of the weights every
  20 optimizer steps at the recipe's batch size;
- with ``tracker="mlflow"`` the MLflow run (in ``mlruns/`` of the run folder) is opened
  before the run and finished by ``close()``, as the run layer does around training.
"""

import dataclasses
import os
from pathlib import Path

from ignite.engine import Events
from ignite.metrics import Accuracy

from engine.run_state import new_run_id
from engine.trainer import Trainer, create_evaluator
from recipes.cifar.recipe import Config
from recipes.runner.api import RunPlan
from recipes.runner.training.standard_handlers import Evaluation, RunSite, attach_standard_handlers
from recipes.runner.training.train import open_tracker, tracker_sinks


class RecipeHandlers:
    """Attaches the standard handlers to ``trainer``; ``close()`` after the run restores
    the signal handlers and closes /dev/null."""

    def __init__(self, trainer: Trainer, run_dir: Path, batch_size: int,
                 steps_per_epoch: int, config: Config | None = None,
                 tracker: str = "none") -> None:
        config = dataclasses.replace(
            config or Config(), epochs=1, batch_size=batch_size, scheduler="warmup_cosine",
            warmup_epochs=0.5, warmup_start_factor=1.0, min_lr_ratio=1.0, patience=3,
            checkpoint_every=10**9, progress="plain", tracker=tracker,
            tracker_uri=str(run_dir / "mlruns"))
        self.tracker = open_tracker("cifar", config, run_dir, new_run_id())
        self._devnull = open(os.devnull, "w")  # noqa: SIM115 - closed by close()
        evaluator = create_evaluator(trainer.model, {"accuracy": Accuracy()},
                                     device=trainer.precision.device)
        site = RunSite(run_dir, new_run_id(), {"accuracy": "max"}, "accuracy",
                       RunPlan(steps_per_epoch, 1), progress_stream=self._devnull,
                       sinks=tracker_sinks(self.tracker))
        evaluation = Evaluation([], config.eval_every, config.epochs)
        self.handlers = attach_standard_handlers(trainer, evaluator, config, site, evaluation)
        trainer.remove_event_handler(evaluation.run_if_due, Events.EPOCH_COMPLETED)
        self.telemetry = self.handlers.telemetry

    def close(self) -> None:
        self.handlers.stop.restore()
        self._devnull.close()
        if self.tracker is not None:
            self.tracker.finish("completed", {})
