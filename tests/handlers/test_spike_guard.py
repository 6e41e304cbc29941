import copy
import logging

import pytest
import torch
from ignite.engine import Events
from torch import nn

import engine.trainer
from engine.events import TrainEvents
from engine.run_state import RngState
from engine.trainer import create_trainer
from engine.update_gate import MaskedGate
from handlers.checkpoint.checkpointer import Checkpointer
from handlers.spike_guard import LossSpikeError, SpikeGuard
from tests.helpers import assert_bit_identical

EPOCH_LENGTH, EPOCHS = 16, 3
# Small enough for a run of 48 iterations: decisions from the 4th window on, two spikes
# within 5 windows roll back.
LADDER = {"window": 8, "min_history": 4, "repeat": 2, "repeat_window": 5,
          "snapshot_every": 3, "skip_batches": 3, "cooldown_steps": 4}


@pytest.fixture(params=["host_gate", "masked_gate"])
def gate(request, monkeypatch) -> str:
    """Every trainer of the test with the CPU's host gate, then the masked one CUDA uses."""
    if request.param == "masked_gate":
        monkeypatch.setattr(engine.trainer, "make_gate", MaskedGate)
    return request.param


class PositionedBatches:
    """Fixed batches; each epoch starts where ``trainer.state`` says, as the recipes' do."""

    def __init__(self, trainer, batches) -> None:
        self.trainer, self.batches = trainer, batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        state = self.trainer.state  # read at the first next(), after the epoch has started
        yield from self.batches[state.iteration - (state.epoch - 1) * len(self.batches):]


def make_run(spikes=(), accum_steps=1, guarded=True, **ladder):
    """(trainer, guard, data, state): a tiny regression whose loss is multiplied by 1e3 at
    the iterations in ``spikes``; ``guarded=False`` leaves the guard unattached."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(EPOCH_LENGTH):
        x = torch.randn(8, 4, generator=generator)
        batches.append((x, x.sum(dim=1, keepdim=True).sin()))
    trainer = None

    def forward(model, batch):
        x, y = batch
        loss = nn.functional.mse_loss(model(x), y)
        return loss * 1e3 if trainer.state.iteration in spikes else loss

    trainer = create_trainer(model, optimizer, forward=forward, accum_steps=accum_steps)
    guard = SpikeGuard(**{**LADDER, **ladder})
    state = {"model": model, "optimizer": optimizer, "rng": RngState()}
    if guarded:
        guard.rolls_back(state)
        guard.attach(trainer)
    return trainer, guard, PositionedBatches(trainer, batches), state


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def record(trainer, every=Events.ITERATION_COMPLETED):
    """Weights after each iteration's step settled, by iteration."""
    seen = {}

    @trainer.on(every)
    def keep(engine):
        engine.settle()
        seen[engine.state.iteration] = weights(engine.model)
    return seen


@pytest.mark.parametrize("bad", [
    {"factor": 1.0}, {"factor": True}, {"window": 0}, {"min_history": 0},
    {"window": 5, "min_history": 6}, {"watch": ""}, {"watch": ("loss",)},
    {"watch": "accuracy"}, {"repeat": 0}, {"repeat_window": 0}, {"snapshot_every": 0},
    {"skip_batches": -1}, {"cooldown_factor": 0.0}, {"cooldown_factor": 1.5},
    {"cooldown_steps": -1}, {"max_rollbacks": -1},
])
def test_bad_arguments_are_refused(bad):
    with pytest.raises(ValueError):
        SpikeGuard(**bad)


def test_the_rolled_back_state_excludes_the_trainer_and_objects_without_state():
    trainer, guard, _, _ = make_run(guarded=False)
    with pytest.raises(ValueError, match="no state_dict"):
        guard.rolls_back({"thing": object()})
    guard.rolls_back({"trainer": trainer})
    with pytest.raises(ValueError, match="trainer is not rolled back"):
        guard.attach(trainer)


def test_a_spike_is_skipped_like_a_non_finite_step(gate):
    trainer, guard, data, _ = make_run(spikes={10})
    seen = record(trainer)
    skipped, vetoed = [], []
    trainer.add_event_handler(TrainEvents.STEP_SKIPPED, lambda e: skipped.append(e.state.iteration))
    trainer.add_event_handler(TrainEvents.STEP_VETOED, lambda e: vetoed.append(e.state.iteration))
    momentum_before = {}

    @trainer.on(Events.ITERATION_STARTED(once=10))
    def keep_momentum(engine):
        momentum_before.update({id(p): s["momentum_buffer"].clone()
                                for p, s in engine.optimizer.state.items()})

    trainer.run(data, max_epochs=1)

    assert all(torch.equal(a, b) for a, b in zip(seen[9], seen[10], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(seen[10], seen[11], strict=True))
    state = trainer.state
    assert skipped == vetoed == [10]
    assert (state.optimizer_step, state.skipped_steps, state.consecutive_skips) == (15, 1, 0)
    assert guard.summary() == {"spikes_skipped": 1, "rollbacks": 0}
    assert trainer.optimizer.state  # the momentum of step 9 was not touched by step 10
    assert list(momentum_before) == [id(p) for p in trainer.optimizer.state]


def test_no_decision_before_min_history():
    trainer, guard, data, _ = make_run(spikes={2, 3})
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=4), lambda e: e.terminate())
    trainer.run(data, max_epochs=1)
    assert guard.summary()["spikes_skipped"] == 0  # windows 2 and 3 came before 4 were known
    assert (trainer.state.optimizer_step, trainer.state.skipped_steps) == (4, 0)


def test_the_ladder_rolls_back_skips_ahead_cools_down_then_stops(gate, caplog):
    caplog.set_level(logging.INFO, logger="handlers")
    trainer, guard, data, _ = make_run(spikes={10, 12, 30, 31})
    seen = record(trainer)
    actions, scales, iterations = [], {}, []
    guard.add_listener(actions.append)
    trainer.add_event_handler(Events.ITERATION_STARTED,
                              lambda e: iterations.append(e.state.iteration))

    @trainer.on(TrainEvents.OPTIMIZER_STEP)
    def keep_scale(engine):
        scales[engine.state.iteration] = engine._guard.gate.lr_scale

    with pytest.raises(LossSpikeError, match=r"loss spikes at step \d+ \(iteration 31\)"):
        trainer.run(data, max_epochs=EPOCHS)

    assert [a.kind for a in actions] == ["spike", "spike", "rollback", "cooldown_end", "spike",
                                         "spike", "stop"]
    # Snapshots at steps 1, 4, 7: the spike at 10 is within 5 windows of 12, and 9 = step 9
    # has no snapshot (every 3 steps from 1 on: 1, 4, 7), so the run goes back to step 7.
    rollback = actions[2]
    assert "rolled back to step 7 (iteration 7), skipped 3 batches to iteration 15" in (
        rollback.message)
    assert all(torch.equal(a, b) for a, b in zip(seen[7], seen[15], strict=True))
    assert 13 not in iterations and 14 not in iterations and 15 not in iterations
    assert rollback.step == 7 and rollback.counts == {"spikes_skipped": 2, "rollbacks": 1,
                                                      "lr_scale": 0.5}
    # Cooled for 4 optimizer steps after the rollback (iterations 16-19), then as scheduled;
    # the optimizer's own LR never changed.
    assert [scales[i] for i in range(16, 21)] == [0.5, 0.5, 0.5, 1.0, 1.0]
    assert trainer.optimizer.param_groups[0]["lr"] == 0.05
    assert guard.summary() == {"spikes_skipped": 4, "rollbacks": 1}
    said = [r for r in caplog.records if r.name == "handlers.spike_guard"]
    assert [r.getMessage() for r in said] == [action.message for action in actions]
    assert [r.levelname for r in said] == [
        "INFO" if action.kind == "cooldown_end" else "WARNING" for action in actions]


def test_a_rollback_at_the_end_of_an_epoch_skips_no_batch():
    trainer, guard, data, _ = make_run(spikes={14, 16})
    actions = []
    guard.add_listener(actions.append)
    trainer.run(data, max_epochs=2)
    rollback = next(a for a in actions if a.kind == "rollback")
    assert "skipped 0 batches to iteration 16" in rollback.message
    assert trainer.state.iteration == 2 * EPOCH_LENGTH


def test_a_skip_to_the_end_of_the_epoch_ends_it_and_the_next_one_is_whole():
    trainer, guard, data, _ = make_run(spikes={10, 12}, skip_batches=50)
    epochs = {}
    trainer.add_event_handler(Events.EPOCH_COMPLETED,
                              lambda e: epochs.setdefault(e.state.epoch, e.state.iteration))
    started = []
    trainer.add_event_handler(Events.ITERATION_STARTED, lambda e: started.append(e.state.iteration))
    trainer.run(data, max_epochs=2)
    assert epochs == {1: 16, 2: 32}
    assert started == [*range(1, 13), *range(17, 33)]


def test_accumulation_windows_stay_aligned_after_a_skip():
    trainer, guard, data, _ = make_run(spikes={9, 10, 11, 12}, accum_steps=2, skip_batches=1)
    actions = []
    guard.add_listener(actions.append)
    closing = []
    trainer.add_event_handler(TrainEvents.OPTIMIZER_STEP,
                              lambda e: closing.append(e.state.iteration))
    trainer.run(data, max_epochs=2)
    rollback = next(a for a in actions if a.kind == "rollback")
    assert "skipped 2 batches to iteration 14" in rollback.message  # 1, rounded up to a window
    assert all(iteration % 2 == 0 for iteration in closing)
    assert trainer.state.iteration == 2 * EPOCH_LENGTH


def final_loss(trainer, data) -> float:
    with torch.no_grad():
        return sum(nn.functional.mse_loss(trainer.model(x), y).item()
                   for x, y in data.batches) / len(data)


def test_one_spike_ends_within_a_small_tolerance_of_a_clean_run():
    epochs = 6
    clean, _, clean_data, _ = make_run()
    clean.run(clean_data, max_epochs=epochs)
    spiked, guard, spiked_data, _ = make_run(spikes={20})
    spiked.run(spiked_data, max_epochs=epochs)
    unguarded, _, unguarded_data, _ = make_run(spikes={20}, guarded=False)
    unguarded.run(unguarded_data, max_epochs=epochs)

    assert guard.summary() == {"spikes_skipped": 1, "rollbacks": 0}
    assert spiked.state.optimizer_step == clean.state.optimizer_step - 1
    clean_loss = final_loss(clean, clean_data)
    assert final_loss(spiked, spiked_data) == pytest.approx(clean_loss, rel=0.02)
    assert final_loss(unguarded, unguarded_data) > 100 * clean_loss  # the spike, let through


def test_state_dict_round_trip_is_weights_only_and_needs_an_attached_guard(tmp_path):
    trainer, guard, data, _ = make_run(spikes={10, 12})
    trainer.run(data, max_epochs=1)
    torch.save(guard.state_dict(), tmp_path / "guard.pt")
    loaded = torch.load(tmp_path / "guard.pt", weights_only=True)
    assert loaded["rollbacks"] == 1 and loaded["snapshot"]["optimizer_step"] > 0
    with pytest.raises(ValueError, match="attach"):
        SpikeGuard(**LADDER).load_state_dict(loaded)
    other_trainer, other, _, _ = make_run(window=9)
    with pytest.raises(ValueError, match="kept 8 windows"):
        other.load_state_dict(loaded)
    fresh_trainer, fresh, _, _ = make_run()
    fresh.load_state_dict(loaded)
    assert fresh.summary() == guard.summary()
    assert_bit_identical(fresh.state_dict(), guard.state_dict(), "guard")
    assert torch.isnan(fresh._ring[:, 0]).sum() == 2  # windows 10 and 12: spikes stay out


class Killed(Exception):
    """Stands in for kill -9: the run stops at once, saving nothing more."""


def checkpointed_run(folder, spikes, kill_at=None):
    trainer, guard, data, state = make_run(spikes=spikes)
    to_save = {**state, "trainer": trainer, "spike_guard": guard}
    checkpointer = Checkpointer(folder, to_save, run_id="spike-test")
    trainer.add_event_handler(TrainEvents.OPTIMIZER_STEP, checkpointer.save_last)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpointer.save_last)
    if kill_at is not None:
        @trainer.on(Events.ITERATION_STARTED(once=kill_at))
        def kill(engine):
            raise Killed
    info = checkpointer.resume("auto")
    if info is not None:
        trainer.state.max_epochs = EPOCHS
    return trainer, guard, data, to_save


SPIKES = {10, 12, 30}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    trainer, guard, data, to_save = checkpointed_run(tmp_path_factory.mktemp("reference"),
                                                     SPIKES)
    trainer.run(data, max_epochs=EPOCHS)
    assert guard.summary() == {"spikes_skipped": 3, "rollbacks": 1}
    return {name: copy.deepcopy(obj.state_dict()) for name, obj in to_save.items()}


# Before the first spike, between the spikes, right after the rollback (the snapshot came in
# the checkpoint), during the cool-down, after the last spike.
@pytest.mark.parametrize("kill_at", [6, 12, 17, 19, 40])
def test_a_run_killed_and_resumed_from_its_checkpoint_ends_bit_identical(
        kill_at, uninterrupted, tmp_path):
    trainer, _, data, _ = checkpointed_run(tmp_path, SPIKES, kill_at=kill_at)
    with pytest.raises(Killed):
        trainer.run(data, max_epochs=EPOCHS)
    trainer, guard, data, to_save = checkpointed_run(tmp_path, SPIKES)
    assert trainer.state.iteration > 0
    trainer.run(data, max_epochs=EPOCHS)
    resumed = {name: obj.state_dict() for name, obj in to_save.items()}
    assert_bit_identical(resumed, uninterrupted, "state")

