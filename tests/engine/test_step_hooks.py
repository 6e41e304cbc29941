"""The trainer's hooks for a step's owner: a veto, an LR scale inside the step, a skip ahead."""

import copy

import pytest
import torch
from ignite.engine import Events
from torch import nn

from engine.events import TrainEvents
from engine.trainer import create_trainer

BATCHES = [(torch.full((2, 3), float(i)), torch.ones(2, 1)) for i in range(8)]


def make_trainer(optimizer_class=torch.optim.Adam, **options):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = optimizer_class(model.parameters(), lr=0.1)
    return create_trainer(model, optimizer, nn.functional.mse_loss, **options)


def snapshot(trainer):
    return ([p.detach().clone() for p in trainer.model.parameters()],
            {k: v.clone() for s in trainer.optimizer.state.values() for k, v in s.items()})


def test_a_vetoed_step_leaves_weights_and_optimizer_state_and_fires_its_events(gate):
    trainer = make_trainer()
    seen, events = {}, []
    trainer.set_step_veto(lambda losses, norm: torch.tensor(trainer.state.iteration == 4))
    for event in (TrainEvents.OPTIMIZER_STEP, TrainEvents.STEP_SKIPPED, TrainEvents.STEP_VETOED):
        trainer.add_event_handler(event, lambda e, name=event.name: events.append(
            (e.state.iteration, name)))

    @trainer.on(Events.ITERATION_COMPLETED)
    def keep(engine):
        engine.settle()
        seen[engine.state.iteration] = snapshot(engine)

    trainer.run(BATCHES, max_epochs=1)
    (weights3, state3), (weights4, state4) = seen[3], seen[4]
    assert all(torch.equal(a, b) for a, b in zip(weights3, weights4, strict=True))
    assert state3.keys() == state4.keys()
    assert all(torch.equal(state3[k], state4[k]) for k in state3)
    assert [name for it, name in events if it == 4] == ["STEP_SKIPPED", "STEP_VETOED"]
    state = trainer.state
    assert (state.optimizer_step, state.skipped_steps, state.consecutive_skips) == (7, 1, 0)


def test_the_veto_is_given_the_windows_losses_and_its_pre_clip_gradient_norm(gate):
    trainer = make_trainer(torch.optim.SGD, accum_steps=2, max_grad_norm=1e-3)
    before = copy.deepcopy(trainer.model)
    given = []

    def veto(losses, norm):  # records what it is given, vetoes nothing
        given.append(([loss.item() for loss in losses], norm.item()))
        return torch.tensor(False)

    trainer.set_step_veto(veto)
    trainer.run(BATCHES[:2], max_epochs=1)
    losses = [nn.functional.mse_loss(before(x), y) for x, y in BATCHES[:2]]
    (sum(losses) / 2).backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in before.parameters()]))
    assert len(given) == 1
    assert given[0][0] == pytest.approx([loss.item() for loss in losses])
    assert given[0][1] == pytest.approx(norm.item())


def test_a_non_finite_step_is_not_reported_as_vetoed(gate):
    trainer = make_trainer(max_consecutive_skips=5)
    trainer.set_step_veto(lambda losses, norm: torch.tensor(False))
    vetoed = []
    trainer.add_event_handler(TrainEvents.STEP_VETOED, lambda e: vetoed.append(1))
    batches = [*BATCHES[:2], (torch.full((2, 3), float("nan")), torch.ones(2, 1))]
    trainer.run(batches, max_epochs=1)
    assert vetoed == [] and trainer.state.consecutive_skips == 1


@pytest.mark.parametrize("scale", [0.5, 2.0])  # below and above 1: no value is a shortcut
def test_the_lr_scale_acts_inside_the_step_only(gate, scale):
    plain, scaled = make_trainer(torch.optim.SGD), make_trainer(torch.optim.SGD)
    scaled.set_lr_scale(scale)
    start = [p.detach().clone() for p in plain.model.parameters()]
    plain.run(BATCHES[:1], max_epochs=1)
    scaled.run(BATCHES[:1], max_epochs=1)
    for before, full, half in zip(start, plain.model.parameters(), scaled.model.parameters(),
                                  strict=True):
        torch.testing.assert_close(half - before, (full - before) * scale)
    assert scaled.optimizer.param_groups[0]["lr"] == 0.1
    with pytest.raises(ValueError, match="lr_scale"):
        scaled.set_lr_scale(0)


@pytest.mark.parametrize(("count", "accum_steps", "expected"), [
    (2, 1, [1, 2, 3, 6, 7, 8]),  # mid-epoch: the epoch ends at its last batch
    (1, 2, [1, 2, 5, 6, 7, 8]),  # rounded up to the start of a window
    (9, 1, [1, 2, 3]),  # to the end: the epoch ends now
    (1, 1, [1, 2, 3, 5, 6, 7, 8]),  # one
    (0, 1, [1, 2, 3, 4, 5, 6, 7, 8]),  # none: nothing dropped
])
def test_skip_batches_drops_the_next_batches_of_the_epoch(count, accum_steps, expected):
    trainer = make_trainer(accum_steps=accum_steps)
    started, fed, completed = [], [], []
    trainer.add_event_handler(Events.ITERATION_STARTED,
                              lambda e: (started.append(e.state.iteration),
                                         fed.append(int(e.state.batch[0][0, 0]))))
    trainer.add_event_handler(Events.EPOCH_COMPLETED,
                              lambda e: completed.append(e.state.iteration))
    at = 2 if accum_steps == 2 else 3
    returned = []
    trainer.add_event_handler(Events.GET_BATCH_STARTED(once=at),
                              lambda e: returned.append(e.skip_batches(count)))
    trainer.run(BATCHES, max_epochs=2)
    assert returned == [8 - len(expected)]  # how many it dropped
    assert started[:len(expected)] == expected
    assert fed[:len(expected)] == [i - 1 for i in expected]  # batch i-1 at iteration i
    assert started[len(expected):] == list(range(9, 17))  # the next epoch is whole
    assert completed == [8, 16]


def test_skip_batches_in_a_later_epoch_counts_from_that_epochs_start():
    trainer = make_trainer()
    started = []
    trainer.add_event_handler(Events.ITERATION_STARTED,
                              lambda e: started.append(e.state.iteration))
    # Once iteration 10, the second of epoch 2, is done: drops iterations 11 and 12.
    trainer.add_event_handler(Events.GET_BATCH_STARTED(once=10),
                              lambda e: e.skip_batches(2))
    trainer.run(BATCHES, max_epochs=2)
    assert started == [*range(1, 9), 9, 10, 13, 14, 15, 16]


@pytest.mark.parametrize("bad", [-1, True, 1.0, "2"])
def test_skip_batches_refuses_a_count_that_is_not_an_int_of_at_least_0(bad):
    with pytest.raises(ValueError, match="count must be an int >= 0"):
        make_trainer().skip_batches(bad)


@pytest.mark.parametrize("bad", [0, -0.5, float("inf"), float("nan"), True, "0.5"])
def test_the_lr_scale_must_be_a_finite_number_above_0(bad):
    with pytest.raises(ValueError, match="lr_scale must be a finite number > 0"):
        make_trainer().set_lr_scale(bad)
