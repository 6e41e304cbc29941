"""Event handlers: one concern per module, attached by the recipe."""

from handlers.checkpoint import Checkpointer, CheckpointError, ResumeInfo, read_checkpoint
from handlers.early_stopping import EarlyStopping
from handlers.grad_telemetry import GradientTelemetry, TelemetryReport
from handlers.lookahead import Lookahead
from handlers.lr_scheduling import (
    CLOCKS,
    SCHEDULER_NAMES,
    LRSchedulerHandler,
    build_scheduler,
    continue_with_new_settings,
    optimizer_steps_per_epoch,
)
from handlers.progress import Progress
from handlers.tensorboard import TensorBoardLogger

__all__ = [
    "CLOCKS",
    "SCHEDULER_NAMES",
    "CheckpointError",
    "Checkpointer",
    "EarlyStopping",
    "GradientTelemetry",
    "LRSchedulerHandler",
    "Lookahead",
    "Progress",
    "ResumeInfo",
    "TelemetryReport",
    "TensorBoardLogger",
    "build_scheduler",
    "continue_with_new_settings",
    "optimizer_steps_per_epoch",
    "read_checkpoint",
]
