"""The handlers every run gets, attached in their one correct order.

Order matters where two handlers share an event: the recipe's own handlers come first
(``Parts.attach_extra``: a checkpoint then holds their work of the same step), then
telemetry, history, early stopping and the LR schedule, the evaluation at the end of an
epoch, TensorBoard (before the saves: a checkpoint taken at an evaluation holds its best
values), the best and last checkpoints, progress and the graceful stop on signals.
Ignite's ``setup_common_training_handlers`` is the precedent for wiring them in one call;
ours adds the run's resume-safe state (``to_save``) and rank-0-only writes.
"""

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ignite.engine import Engine, Events
from torch import nn

from engine import RngState, Trainer, TrainEvents
from handlers import (
    Checkpointer,
    EarlyStopping,
    GradientTelemetry,
    LRSchedulerHandler,
    Progress,
    TensorBoardLogger,
    build_scheduler,
)
from handlers.graceful_stop import GracefulStop
from handlers.history import RunHistory
from handlers.spike_guard import SpikeAction, SpikeGuard
from handlers.startup_checks import StartupChecks
from handlers.weight_averaging import WeightAveraging
from recipes.runner.api import RunPlan
from recipes.runner.config import ConfigError
from recipes.runner.launch import RankZeroSave
from recipes.runner.run_config import RunConfig


@dataclass
class StandardHandlers:
    """The attached handlers, for the run's resume, exit code and summary."""

    telemetry: GradientTelemetry
    history: RunHistory
    scheduler: LRSchedulerHandler | None
    early_stopping: EarlyStopping | None
    checkpointer: Checkpointer
    stop: GracefulStop
    make_scheduler: Callable[[], LRSchedulerHandler | None]
    evaluate: Callable[[Engine], None]  # on the trainer's EPOCH_COMPLETED
    spike_guard: SpikeGuard | None = None
    tensorboard: TensorBoardLogger | None = None  # rank 0's


def make_scheduler_factory(config: RunConfig, trainer: Trainer, plan: RunPlan
                           ) -> Callable[[], LRSchedulerHandler | None]:
    """Builds the configured LR schedule; called again when a resume changes lr or epochs."""
    def make() -> LRSchedulerHandler | None:
        options: dict[str, Any] = {}
        if config.scheduler == "warmup_cosine":
            options = {"warmup_epochs": config.warmup(),
                       "warmup_start_factor": config.warmup_start_factor,
                       "min_lr_ratio": config.min_lr_ratio}
        elif config.scheduler == "plateau":
            options = {"metric": "loss"}
        return build_scheduler(config.scheduler, trainer.optimizer,
                               steps_per_epoch=plan.steps_per_epoch, epochs=config.epochs,
                               **options)
    return make


def attach_weight_averaging(config: RunConfig, model: nn.Module, trainer: Trainer,
                            evaluator: Engine, bn_batches: Callable[[], Iterable[Any]] | None,
                            bn_input: Callable[[Any], Any]) -> WeightAveraging:
    """``--averaging ema|swa``: the average is updated on its clock, swapped into the model
    for every evaluation (so early stopping, the best checkpoint and TensorBoard rank the
    averaged weights) and swapped out before the evaluator's other handlers run, so a
    checkpoint's ``model`` stays the trained weights and ``averaging`` holds the average.
    Attach it before the standard handlers."""
    if config.averaging == "ema":
        averaging = WeightAveraging(model, "ema", decay=config.ema_decay)
    else:
        has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        if has_bn and bn_batches is None:
            raise ConfigError("--averaging swa: this model has BatchNorm, whose statistics "
                              "must be recomputed for the average, but the recipe's training "
                              "batches cannot be replayed (no epoch_batches); use ema")
        averaging = WeightAveraging(
            model, "swa", start_epoch=max(1, math.ceil(config.swa_start * config.epochs)),
            **({"bn_batches": bn_batches, "bn_input": bn_input} if has_bn else {}))
    averaging.attach(trainer)
    swap = ExitStack()

    def swap_in_average() -> None:
        swap.enter_context(averaging.swapped_in())

    def swap_out_average() -> None:
        swap.close()

    evaluator.add_event_handler(Events.STARTED, swap_in_average)
    evaluator.add_event_handler(Events.COMPLETED, swap_out_average)  # after the metrics'
    return averaging


# The entry of to_save that holds the training data's own position (a stateful loader's
# sampler and workers), when the recipe's train_batches have one.
TRAIN_DATA = "train_data"
# Entries of to_save a spike guard's rollback leaves alone: the trainer and the training
# data (the guard moves both forward itself: the batches after a spike are skipped, never
# replayed), the guard, and the records of what happened.
NOT_ROLLED_BACK = ("trainer", TRAIN_DATA, "spike_guard", "telemetry", "history",
                   "tensorboard", "early_stopping")


def attach_standard_handlers(
    trainer: Trainer,
    evaluator: Engine,
    config: RunConfig,
    *,
    modes: Mapping[str, str],
    best: str,
    plan: RunPlan,
    run_dir: Path,
    run_id: str,
    val_batches: Iterable[Any],
    rank: int = 0,
    model: nn.Module | None = None,
    checkpoint_meta: Mapping[str, Any] | None = None,
    extra_state: Mapping[str, Any] | None = None,
    before_evaluation: Callable[[bool], None] | None = None,
    num_classes: int | None = None,
    progress_stream: TextIO | None = None,
) -> StandardHandlers:
    """Attach telemetry, history, early stopping, the LR schedule, evaluation, TensorBoard,
    checkpoints, progress and the graceful stop to ``trainer`` and ``evaluator``.

    ``modes`` gives each validation metric's direction; ``best`` ranks the best checkpoint
    and early stopping. Only rank 0 writes (TensorBoard, checkpoint files, progress), but
    every rank takes part in each save. ``model`` is the module whose weights are saved
    (default: ``trainer.model``; give the unwrapped one when the trainer runs a DDP or
    compiled wrapper). ``checkpoint_meta`` is stored in every checkpoint.
    """
    if config.checks == "on":
        StartupChecks(num_classes).attach(trainer)
    make_scheduler = make_scheduler_factory(config, trainer, plan)
    scheduler = make_scheduler()
    telemetry = GradientTelemetry(log_every=config.log_every, layer_every=config.log_every * 10)
    telemetry.attach(trainer)
    history = RunHistory(batch_size=config.batch_size, modes=modes)
    history.attach(trainer, telemetry, evaluator)
    early_stopping = None
    if config.patience is not None:
        early_stopping = EarlyStopping(best, config.patience, trainer=trainer, mode=modes[best])
        evaluator.add_event_handler(Events.COMPLETED, early_stopping)
    if scheduler is not None:
        scheduler.attach(trainer, evaluator)

    def evaluate(engine: Engine) -> None:
        """Every ``eval_every`` epochs and after the last one."""
        final = engine.state.epoch == config.epochs
        if engine.state.epoch % config.eval_every == 0 or final:
            if before_evaluation is not None:
                before_evaluation(final)
            evaluator.run(val_batches)

    trainer.add_event_handler(Events.EPOCH_COMPLETED, evaluate)
    to_save = {"model": model if model is not None else trainer.model,
               "optimizer": trainer.optimizer, "scaler": trainer.scaler, "trainer": trainer,
               "telemetry": telemetry, "history": history, "rng": RngState(),
               **(extra_state or {})}
    to_save |= {"scheduler": scheduler} if scheduler is not None else {}
    to_save |= {"early_stopping": early_stopping} if early_stopping is not None else {}
    spike_guard = None
    if config.spike_guard:
        spike_guard = SpikeGuard(**config.spike_guard_options(), quiet=rank != 0)
        to_save["spike_guard"] = spike_guard
    if rank == 0:  # only rank 0 writes; every rank loads the same checkpoint
        tensorboard = TensorBoardLogger(run_dir, hparams=dataclasses.asdict(config),
                                        batch_size=config.batch_size, modes=modes)
        to_save["tensorboard"] = tensorboard
    checkpointer = Checkpointer(run_dir / "checkpoints", to_save, run_id=run_id,
                                config={**dataclasses.asdict(config), **(checkpoint_meta or {})},
                                keep_last=config.keep_last, metric=best, mode=modes[best])
    if spike_guard is not None:  # after the schedule and averaging, before the saves
        spike_guard.attach(trainer, {name: obj for name, obj in to_save.items()
                                     if name not in NOT_ROLLED_BACK})
        if rank == 0:
            spike_guard.add_listener(lambda action: _log_spike_action(tensorboard, action))
    if rank == 0:  # before the saves: a checkpoint taken at an evaluation holds its best
        tensorboard.attach(trainer, telemetry, evaluator)
    # Only rank 0 writes, but every rank takes part in each save (RankZeroSave): a failed
    # save stops all of them.
    save_last = RankZeroSave(checkpointer.save_last)
    evaluator.add_event_handler(Events.COMPLETED, RankZeroSave(checkpointer.save_best))
    # Not at an epoch's last iteration: that one is saved at EPOCH_COMPLETED, after
    # validation, so that a resumed run never skips an epoch's evaluation.
    trainer.add_event_handler(TrainEvents.OPTIMIZER_STEP,
                              _every_steps(config.checkpoint_every, save_last))
    trainer.add_event_handler(Events.EPOCH_COMPLETED, save_last)
    if rank == 0:
        Progress(mode=config.progress, stream=progress_stream).attach(trainer, telemetry)
    # Every rank stops at a signal (all of them receive Ctrl-C) and saves together.
    stop = GracefulStop(save_last)
    stop.attach(trainer)
    return StandardHandlers(telemetry, history, scheduler, early_stopping, checkpointer, stop,
                            make_scheduler, evaluate, spike_guard,
                            tensorboard if rank == 0 else None)


def _every_steps(every: int, save: Callable[[Engine], None]) -> Callable[[Engine], None]:
    """``save`` at every ``every``-th optimizer step except at an epoch's last iteration.
    A plain test rather than an Ignite event filter, whose wrapper costs about three
    times as much at every step."""
    def save_on_cadence(engine: Engine) -> None:
        state = engine.state
        if state.optimizer_step % every == 0 and state.iteration % state.epoch_length != 0:
            save(engine)
    return save_on_cadence


def _log_spike_action(tensorboard: TensorBoardLogger, action: SpikeAction) -> None:
    """``health/spikes_skipped``, ``health/rollbacks`` and ``health/lr_scale`` at each action."""
    tensorboard.log_now({f"health/{name}": value for name, value in action.counts.items()},
                        action.step)
