"""The handlers every run gets, attached in their one correct order.

``attach_standard_handlers`` builds them and attaches them as one ordered list, as Ignite's
``setup_common_training_handlers`` wires its set in one call; ours adds the run's
resume-safe state (``to_save``) and rank-0-only writes. Every handler is attached the same
way, ``handler.attach(trainer, evaluator)``, so the list's order is the order in which
handlers sharing an event run; the reason for each position is next to it.
"""

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

from ignite.engine import Engine, Events
from torch import nn

from engine.events import TrainEvents
from engine.run_state import RngState
from engine.trainer import Trainer
from handlers.checkpoint.checkpointer import Checkpointer
from handlers.checkpoint.formats import format_for
from handlers.cost import CostMeter
from handlers.early_stopping import EarlyStopping
from handlers.first_step_checks import FirstStepChecks
from handlers.goal import Goal
from handlers.graceful_stop import GracefulStop
from handlers.grad_telemetry import GradientTelemetry
from handlers.handler import Handler
from handlers.history import RunHistory
from handlers.jsonl_sink import JsonLinesSink
from handlers.lr_scheduling import LRSchedulerHandler, build_scheduler
from handlers.progress import Evaluations, Progress
from handlers.run_budget import RunBudget
from handlers.run_logger import RunLogger
from handlers.spike_guard import SpikeAction, SpikeGuard
from handlers.tensorboard import TensorBoardSink
from handlers.time_left import EvaluationSchedule
from handlers.weight_averaging import WeightAveraging
from recipes.runner.api import RunPlan
from recipes.runner.config.command_line import ConfigError, group_values
from recipes.runner.config.run_keys import RunConfig, max_time_seconds
from recipes.runner.training.strategy import save_wrapper


@dataclass(frozen=True)
class RunSite:
    """What the standard handlers need to know about the run beyond its config."""

    run_dir: Path
    run_id: str
    modes: Mapping[str, str]  # each validation metric's direction
    best: str  # the metric that ranks the best checkpoint and early stopping
    plan: RunPlan
    rank: int = 0  # only rank 0 writes (TensorBoard, checkpoint files, progress)
    # The module whose weights are saved (default: the trainer's; give the unwrapped one
    # when the trainer runs a DDP or compiled wrapper).
    model: nn.Module | None = None
    checkpoint_meta: Mapping[str, Any] | None = None  # stored in every checkpoint
    num_classes: int | None = None  # for the start-up checks
    progress_stream: TextIO | None = None
    cost: CostMeter | None = None  # throughput, MFU and peak memory per epoch
    # Scalar sinks besides TensorBoard's and metrics.jsonl (an experiment tracker's), by name.
    sinks: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Evaluation:
    """Runs the evaluator on ``val_batches`` at the trainer's ``Events.EPOCH_COMPLETED``,
    every ``every`` epochs and after the last of ``epochs``, and with ``every_steps`` also at
    every that many optimizer steps inside an epoch (an epoch's last step is its epoch-end
    evaluation's); ``before(final)`` runs first (a recipe's hook, e.g. switching on
    test-time augmentation for the final one); ``forwards(final)``, the forwards per sample
    that hook makes, scales the time left (which counts the epoch-end evaluations only).

    Attached before the checkpointer, so that a save at the same step comes after the
    evaluation and a resume never skips one."""

    def __init__(self, val_batches: Iterable[Any], every: int, epochs: int,
                 before: Callable[[bool], None] | None = None,
                 forwards: Callable[[bool], float] | None = None,
                 every_steps: int | None = None) -> None:
        self.val_batches, self.every, self.epochs, self.before = (
            val_batches, every, epochs, before)
        self.every_steps = every_steps
        self.forwards = forwards or (lambda final: 1.0)
        self._evaluator: Engine | None = None

    def attach(self, trainer: Trainer, evaluator: Engine | None = None) -> None:
        if evaluator is None:
            raise ValueError("Evaluation runs the evaluator: attach(trainer, evaluator)")
        self._evaluator = evaluator
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self.run_if_due)
        if self.every_steps is not None:
            trainer.add_event_handler(TrainEvents.OPTIMIZER_STEP, self._run_if_step_due)

    def _run_if_step_due(self, trainer: Engine) -> None:
        state = trainer.state
        if state.optimizer_step % self.every_steps == 0 and (
                state.iteration % state.epoch_length != 0):
            if self.before is not None:
                self.before(False)
            self._evaluator.run(self.val_batches)

    def due(self, epoch: int) -> bool:
        return epoch % self.every == 0 or epoch == self.epochs

    def run_if_due(self, trainer: Engine) -> None:
        if self.due(trainer.state.epoch):
            if self.before is not None:
                self.before(trainer.state.epoch == self.epochs)
            self._evaluator.run(self.val_batches)


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
    evaluation: Evaluation
    spike_guard: SpikeGuard | None = None
    logger: RunLogger | None = None  # rank 0's
    progress: Progress | None = None  # rank 0's
    cost: CostMeter | None = None
    budget: RunBudget | None = None  # --max-steps, --max-time
    # The recipe's own handlers whose state is checkpointed (``Parts.attach_extra``), by name.
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def end_again(self, trainer: Trainer) -> None:
        """A finished run started again trains nothing, but its end is written again: the
        telemetry's last partial interval and the logger's closing records come after the
        final checkpoint, so metrics.jsonl (cut back to that checkpoint) ends as the run
        did even when a kill came between the two."""
        self.telemetry.end(trainer)
        if self.logger is not None:
            self.logger.end(trainer)


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
    """``--averaging ema|swa``: the average is updated on its clock and swapped into the
    model for every evaluation (so early stopping, the best checkpoint and TensorBoard rank
    the averaged weights), a checkpoint's ``model`` staying the trained weights and
    ``averaging`` holding the average. Attach it before the standard handlers."""
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
    averaging.attach(trainer, evaluator)
    return averaging


# The entry of to_save that holds the training data's own position (a stateful loader's
# sampler and workers), when the recipe's train_batches have one.
TRAIN_DATA = "train_data"
# Entries of to_save a spike guard's rollback leaves alone: the trainer and the training
# data (the guard moves both forward itself: the batches after a spike are skipped, never
# replayed), the guard, and the records of what happened.
NOT_ROLLED_BACK = ("trainer", TRAIN_DATA, "spike_guard", "telemetry", "history",
                   "logger", "early_stopping")
METRICS_FILE = "metrics.jsonl"  # every logged record, one JSON object a line


def attach_standard_handlers(trainer: Trainer, evaluator: Engine, config: RunConfig,
                             site: RunSite, evaluation: Evaluation,
                             extra_state: Mapping[str, Any] | None = None) -> StandardHandlers:
    """Build the standard handlers and attach them to ``trainer`` and ``evaluator`` in
    order. The recipe's own handlers are attached before (``Parts.attach_extra``: a
    checkpoint then holds their work of the same step) and their state is in
    ``extra_state``. Only rank 0 writes, but every rank takes part in each save."""
    goal = Goal(site.best, site.modes[site.best])  # early stopping and the best checkpoint
    make_scheduler = make_scheduler_factory(config, trainer, site.plan)
    scheduler = make_scheduler()
    telemetry = GradientTelemetry(log_every=config.log_every, layer_every=config.log_every * 10)
    history = RunHistory(batch_size=config.batch_size, modes=site.modes, telemetry=telemetry)
    early_stopping = None if config.patience is None else EarlyStopping(goal, config.patience)
    to_save = {"model": site.model if site.model is not None else trainer.model,
               "optimizer": trainer.optimizer, "scaler": trainer.scaler, "trainer": trainer,
               "telemetry": telemetry, "history": history, "rng": RngState(),
               **(extra_state or {})}
    to_save |= {"scheduler": scheduler} if scheduler is not None else {}
    to_save |= {"early_stopping": early_stopping} if early_stopping is not None else {}
    spike_guard = None
    if config.spike_guard:
        spike_guard = SpikeGuard(**group_values(config, "spike"))
        spike_guard.rolls_back({name: obj for name, obj in to_save.items()
                                if name not in NOT_ROLLED_BACK})
        to_save["spike_guard"] = spike_guard
    logger = progress = None
    if site.rank == 0:  # only rank 0 writes; every rank loads the same checkpoint
        sinks = {"tensorboard": TensorBoardSink(site.run_dir),
                 "metrics": JsonLinesSink(site.run_dir / METRICS_FILE), **site.sinks}
        logger = RunLogger(sinks, hparams=dataclasses.asdict(config),
                           batch_size=config.batch_size, modes=site.modes, telemetry=telemetry,
                           cost=site.cost)
        to_save["logger"] = logger
        schedule = EvaluationSchedule(evaluation.due, evaluation.forwards)
        progress = Progress(mode=config.progress, stream=site.progress_stream,
                            telemetry=telemetry, evaluations=Evaluations(
                                history, goal, site.plan.steps_per_epoch, schedule),
                            cost=site.cost)
        if spike_guard is not None:
            spike_guard.add_listener(lambda action: _log_spike_action(logger, action))
    # Every rank takes part in each save (rank 0 writes a .pt, or each rank its shards of a
    # .dcp folder), so a failed save stops them all.
    checkpointer = Checkpointer(
        site.run_dir / "checkpoints", to_save, run_id=site.run_id,
        config={**dataclasses.asdict(config), **(site.checkpoint_meta or {})},
        keep_last=config.keep_last, keep_best=config.keep_best, best=goal,
        save_every=config.checkpoint_every,
        wrap_save=save_wrapper(config.strategy),
        checkpoint_format=format_for(config.strategy, timedelta(seconds=config.collective_timeout)),
        asynchronous=config.async_checkpoint)
    stop = GracefulStop(checkpointer.last_handler)  # every rank gets the signal, all save
    max_seconds = max_time_seconds(config.max_time)
    budget = None if config.max_steps is None and max_seconds is None else RunBudget(
        checkpointer.last_handler, max_steps=config.max_steps, max_seconds=max_seconds,
        elapsed=history.wall_time, time_label=config.max_time)
    in_order: list[Handler | None] = [
        # A fresh run from --init-from starts on trained weights (a resume is not checked).
        FirstStepChecks(site.num_classes, trained_weights=bool(config.init_from))
        if config.checks == "on" else None,
        telemetry,  # the step's numbers, before anything that reports them
        history,
        site.cost,  # at EPOCH_COMPLETED, before the evaluation line and the logger show it
        early_stopping,
        scheduler,  # after the step's telemetry, which logs the LR the step used
        # Before the evaluation at EPOCH_COMPLETED, whose best checkpoint is the epoch's
        # only save when it is the newest: that save holds the epoch's perf record and its
        # val record (the logger's evaluator handler runs before the checkpointer's).
        logger,
        evaluation,  # at EPOCH_COMPLETED, before the saves: a resume never skips it
        spike_guard,  # after the schedule and averaging, before the saves
        checkpointer,
        progress,
        stop,  # last at EPOCH_COMPLETED: after the epoch's evaluation and save
        budget,  # the same, and a signal's stop first
    ]
    for handler in in_order:
        if handler is not None:
            handler.attach(trainer, evaluator)
    return StandardHandlers(telemetry, history, scheduler, early_stopping, checkpointer, stop,
                            make_scheduler, evaluation, spike_guard, logger, progress,
                            site.cost, budget, dict(extra_state or {}))


def _log_spike_action(logger: RunLogger, action: SpikeAction) -> None:
    """``health/spikes_skipped``, ``health/rollbacks`` and ``health/lr_scale`` at each action."""
    logger.log_now({f"health/{name}": value for name, value in action.counts.items()},
                        action.step)
