"""``RunBudget``: a clean stop (settled, saved, terminated) at a step count or a time."""

import pytest
import torch
from torch import nn

from engine.trainer import create_trainer
from handlers.run_budget import RunBudget

BATCHES_PER_EPOCH = 8  # with accum_steps=3 the windows are iterations 1-3, 4-6 and 7-8


def _trainer(make_mlp, accum_steps: int = 1):
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return create_trainer(model, optimizer, nn.CrossEntropyLoss(), accum_steps=accum_steps)


def _run(trainer, batches, **budget_args):
    """Two epochs under a RunBudget whose save records (iteration, settled optimizer step)."""
    saved = []
    budget = RunBudget(lambda engine: saved.append(
        (engine.state.iteration, engine.state.optimizer_step)), **budget_args)
    budget.attach(trainer)
    trainer.run(batches, max_epochs=2)
    return budget, saved


@pytest.mark.parametrize("accum_steps, max_steps, stop_at", [
    (1, 3, (3, 3)), (1, 8, (8, 8)), (1, 11, (11, 11)),
    (3, 2, (6, 2)),  # the window that makes step 2 ends at iteration 6
    (3, 3, (8, 3)),  # the epoch's short last window: at EPOCH_COMPLETED
])
def test_max_steps_saves_the_step_it_reaches_and_stops(make_mlp, make_batches, accum_steps,
                                                       max_steps, stop_at):
    trainer = _trainer(make_mlp, accum_steps)
    budget, saved = _run(trainer, make_batches(BATCHES_PER_EPOCH), max_steps=max_steps,
                         elapsed=lambda: 0.0)
    assert saved == [stop_at] and trainer.state.iteration == stop_at[0]
    assert budget.reason == f"--max-steps {max_steps}"


def test_a_budget_beyond_the_run_lets_it_complete(make_mlp, make_batches):
    trainer = _trainer(make_mlp)
    budget, saved = _run(trainer, make_batches(BATCHES_PER_EPOCH), max_steps=100,
                         max_seconds=1e9, elapsed=lambda: 0.0)
    assert saved == [] and budget.reason is None and trainer.state.iteration == 16


def test_max_time_stops_at_the_first_window_end_past_it(make_mlp, make_batches):
    """The clock: one second per reading; the run's earlier sessions had spent 10 s."""
    readings = iter(range(10, 1000))
    trainer = _trainer(make_mlp, accum_steps=3)
    budget, saved = _run(trainer, make_batches(BATCHES_PER_EPOCH), max_seconds=12,
                         elapsed=lambda: next(readings), time_label="12s")
    # Readings at STARTED (10), the window ends at iterations 3 (11) and 6 (12).
    assert saved == [(6, 2)] and budget.reason == "--max-time 12s"


def test_a_run_resumed_at_its_budget_trains_nothing_and_saves_nothing(make_mlp, make_batches):
    trainer = _trainer(make_mlp)
    trainer.state.iteration = trainer.state.optimizer_step = 5  # as a checkpoint leaves it
    trainer.state.epoch_length, trainer.state.max_epochs = BATCHES_PER_EPOCH, 2
    before = [parameter.clone() for parameter in trainer.model.parameters()]
    budget, saved = _run(trainer, make_batches(BATCHES_PER_EPOCH), max_steps=5,
                         elapsed=lambda: 0.0)
    assert saved == [] and trainer.state.iteration == 5 and budget.reason == "--max-steps 5"
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(),
                                                  strict=True))


def test_a_budget_needs_a_limit():
    with pytest.raises(ValueError, match="max_steps or max_seconds"):
        RunBudget(lambda engine: None, elapsed=lambda: 0.0)
