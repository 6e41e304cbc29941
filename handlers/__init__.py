"""Event handlers: one concern per module, each attached as
``handler.attach(trainer, evaluator=None)`` (``handlers.handler``)."""

from handlers.checkpoint.checkpointer import Checkpointer, ResumeInfo
from handlers.checkpoint.files import CheckpointError
from handlers.checkpoint.formats import read_checkpoint
from handlers.early_stopping import EarlyStopping
from handlers.goal import Goal
from handlers.grad_telemetry import GradientTelemetry, TelemetryReport
from handlers.handler import Handler
from handlers.lookahead import Lookahead
from handlers.lr_finder import LRFinderResult, find_lr, plot_lr_find
from handlers.lr_scheduling import (
    CLOCKS,
    SCHEDULER_NAMES,
    LRSchedulerHandler,
    build_scheduler,
    continue_with_new_settings,
    optimizer_steps_per_epoch,
)
from handlers.progress import Progress
from handlers.run_logger import RunLogger
from handlers.weight_averaging import WeightAveraging

__all__ = [
    "CLOCKS",
    "SCHEDULER_NAMES",
    "CheckpointError",
    "Checkpointer",
    "EarlyStopping",
    "Goal",
    "GradientTelemetry",
    "Handler",
    "LRFinderResult",
    "LRSchedulerHandler",
    "Lookahead",
    "Progress",
    "ResumeInfo",
    "RunLogger",
    "TelemetryReport",
    "WeightAveraging",
    "build_scheduler",
    "continue_with_new_settings",
    "find_lr",
    "optimizer_steps_per_epoch",
    "plot_lr_find",
    "read_checkpoint",
]
