"""The training engine: one process function, on an Ignite ``Engine``."""

from engine.events import TrainEvents
from engine.muon import Muon
from engine.nonfinite import NonFiniteGradientError
from engine.precision import Precision, resolve_device, resolve_precision
from engine.run_state import RngState, new_run_id
from engine.trainer import Trainer, create_evaluator, create_trainer

__all__ = [
    "Muon",
    "NonFiniteGradientError",
    "Precision",
    "RngState",
    "TrainEvents",
    "Trainer",
    "create_evaluator",
    "create_trainer",
    "new_run_id",
    "resolve_device",
    "resolve_precision",
]
