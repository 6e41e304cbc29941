import inspect

import pytest

from handlers import (
    Checkpointer,
    EarlyStopping,
    GradientTelemetry,
    Lookahead,
    LRSchedulerHandler,
    Progress,
    RunLogger,
    WeightAveraging,
)
from handlers.first_step_checks import FirstStepChecks
from handlers.graceful_stop import GracefulStop
from handlers.history import RunHistory
from handlers.spike_guard import SpikeGuard

HANDLERS = [Checkpointer, EarlyStopping, GracefulStop, GradientTelemetry, Lookahead,
            LRSchedulerHandler, Progress, RunHistory, RunLogger, SpikeGuard, FirstStepChecks,
            WeightAveraging]


@pytest.mark.parametrize("handler", HANDLERS, ids=lambda handler: handler.__name__)
def test_every_handler_attaches_to_the_trainer_and_optionally_the_evaluator(handler):
    parameters = list(inspect.signature(handler.attach).parameters.values())
    assert [parameter.name for parameter in parameters] == ["self", "trainer", "evaluator"]
    assert parameters[2].default is None
