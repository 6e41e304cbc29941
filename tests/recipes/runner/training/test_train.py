"""The run's training call (``recipes.runner.training.train``): a run stopped by non-finite
numbers or loss spikes first commits the save written behind training (``--async-checkpoint``),
as a run's end does at ``Events.COMPLETED``, and raises what the disk said instead when that
save failed."""

from types import SimpleNamespace

import pytest

from engine.nonfinite import NonFiniteGradientError
from handlers.checkpoint.files import CheckpointError
from handlers.spike_guard import LossSpikeError
from recipes.runner.training.train import _run_to_the_end


class StoppingTrainer:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def run(self, batches, max_epochs: int) -> None:
        raise self.error


@pytest.mark.parametrize("error", [NonFiniteGradientError("gradients"), LossSpikeError("spikes")])
def test_a_run_stopped_by_bad_numbers_waits_for_the_save_in_flight(error):
    waited = []
    trainer = StoppingTrainer(error)
    handlers = SimpleNamespace(checkpointer=SimpleNamespace(wait_handler=waited.append))
    with pytest.raises(type(error)):
        _run_to_the_end(trainer, [], 1, handlers)
    assert waited == [trainer]


def test_a_failed_save_in_flight_outranks_the_bad_numbers():
    def failed_save(engine) -> None:
        raise CheckpointError("checkpoints/step-00000012.pt", "could not save: [Errno 28] ...")

    handlers = SimpleNamespace(checkpointer=SimpleNamespace(wait_handler=failed_save))
    with pytest.raises(CheckpointError, match="step-00000012.pt: could not save"):
        _run_to_the_end(StoppingTrainer(NonFiniteGradientError("gradients")), [], 1, handlers)
