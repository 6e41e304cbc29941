"""The CIFAR recipe's handler set, attached to a trainer the way ``recipes/cifar.py`` does.

Kept in step with ``recipes/cifar.py`` ``train()`` by hand (that function also builds
data, model and folders, so it cannot be called on a benchmark's trainer). Differences,
each so that every arm trains the same weights or pays only engine costs:

- the LR schedule is the recipe's ``warmup_cosine`` made flat (start factor 1, end ratio
  1): it runs the same code per optimizer step, but the learning rate stays at ``lr``,
  like the arms without a scheduler;
- the evaluator gets its handlers (early stopping, best checkpoint, TensorBoard,
  history) but is not run: validation is model compute, not engine overhead;
- ``last`` is saved at every ``EPOCH_COMPLETED`` only, not every ``checkpoint_every``
  optimizer steps; the save's cost is measured as part of the run's end instead;
- progress is the real ``Progress`` in plain mode, printing to /dev/null;
- ``Lookahead`` is left out: it changes the weights, so the arms would no longer train
  the same; its cost is one in-place average of the weights every 20 optimizer steps
  at the recipe's batch size.
"""

import dataclasses
import os
from pathlib import Path

from ignite.engine import Events
from ignite.metrics import Accuracy

from engine import RngState, Trainer, create_evaluator, new_run_id
from handlers import (
    Checkpointer,
    EarlyStopping,
    GradientTelemetry,
    Progress,
    TensorBoardLogger,
    build_scheduler,
)
from handlers.graceful_stop import GracefulStop
from handlers.history import RunHistory
from recipes.cifar import Config


class RecipeHandlers:
    """Attaches the recipe's handlers to ``trainer``; ``close()`` after the run restores
    the signal handlers and closes /dev/null."""

    def __init__(self, trainer: Trainer, run_dir: Path, batch_size: int,
                 steps_per_epoch: int, config: Config | None = None) -> None:
        config = config or Config()
        self._devnull = open(os.devnull, "w")  # noqa: SIM115 - closed by close()
        evaluator = create_evaluator(trainer.model, {"accuracy": Accuracy()},
                                     device=trainer.precision.device)
        scheduler = build_scheduler(
            "warmup_cosine", trainer.optimizer, steps_per_epoch=steps_per_epoch, epochs=1,
            warmup_epochs=0.5, warmup_start_factor=1.0, min_lr_ratio=1.0)
        self.telemetry = GradientTelemetry(log_every=config.log_every,
                                           layer_every=config.log_every * 10)
        self.telemetry.attach(trainer)
        history = RunHistory(batch_size=batch_size)
        history.attach(trainer, self.telemetry, evaluator)
        early_stopping = EarlyStopping("accuracy", 3, trainer=trainer, mode="max")
        evaluator.add_event_handler(Events.COMPLETED, early_stopping)
        scheduler.attach(trainer, evaluator)
        tensorboard = TensorBoardLogger(run_dir, hparams=dataclasses.asdict(config),
                                        batch_size=batch_size)
        to_save = {"model": trainer.model, "optimizer": trainer.optimizer,
                   "scaler": trainer.scaler, "trainer": trainer, "telemetry": self.telemetry,
                   "history": history, "rng": RngState(), "scheduler": scheduler,
                   "early_stopping": early_stopping, "tensorboard": tensorboard}
        checkpointer = Checkpointer(run_dir / "checkpoints", to_save, run_id=new_run_id(),
                                    config=dataclasses.asdict(config),
                                    keep_last=config.keep_last, metric="accuracy", mode="max")
        tensorboard.attach(trainer, self.telemetry, evaluator)
        evaluator.add_event_handler(Events.COMPLETED, checkpointer.save_best)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpointer.save_last)
        Progress(mode="plain", stream=self._devnull).attach(trainer, self.telemetry)
        self._stop = GracefulStop(checkpointer.save_last)
        self._stop.attach(trainer)

    def close(self) -> None:
        self._stop.restore()
        self._devnull.close()
