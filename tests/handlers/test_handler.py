import inspect

import pytest

from handlers.checkpoint.checkpointer import Checkpointer
from handlers.early_stopping import EarlyStopping
from handlers.first_step_checks import FirstStepChecks
from handlers.graceful_stop import GracefulStop
from handlers.grad_telemetry import GradientTelemetry
from handlers.history import RunHistory
from handlers.lookahead import Lookahead
from handlers.lr_scheduling import LRSchedulerHandler
from handlers.progress import Progress
from handlers.run_logger import RunLogger
from handlers.spike_guard import SpikeGuard
from handlers.weight_averaging import WeightAveraging

HANDLERS = [Checkpointer, EarlyStopping, GracefulStop, GradientTelemetry, Lookahead,
            LRSchedulerHandler, Progress, RunHistory, RunLogger, SpikeGuard, FirstStepChecks,
            WeightAveraging]


@pytest.mark.parametrize("handler", HANDLERS, ids=lambda handler: handler.__name__)
def test_every_handler_attaches_to_the_trainer_and_optionally_the_evaluator(handler):
    parameters = list(inspect.signature(handler.attach).parameters.values())
    assert [parameter.name for parameter in parameters] == ["self", "trainer", "evaluator"]
    assert parameters[2].default is None
