import io
import math

import pytest
import torch
from ignite.engine import Engine, Events
from torch import nn

from engine.events import TrainEvents
from engine.precision import resolve_precision
from engine.trainer import Trainer
from handlers.grad_telemetry import GradientTelemetry
from handlers.history import RunHistory

NAN = math.nan
TELEMETRY = GradientTelemetry(log_every=1)  # for a history that is never attached
BATCH_SIZE = 16
STEPS_PER_EPOCH = 4
LR = 0.5
# Micro-batch losses, one optimizer step each; telemetry reports every 2 steps.
LOSSES = [4.0, 2.0, 3.0, 1.0, 2.0, 2.0, 1.5, 0.5, 1.0, 1.0, 0.8, 0.4, 0.5, 0.5, 0.3, 0.3]
# One evaluation per epoch: accuracy as a Python float, loss as a 0-d tensor (as Ignite gives).
ACCURACY = [0.5, 0.8, NAN, 0.7]
VAL_LOSS = [1.2, 0.6, NAN, 0.9]


def scripted_trainer() -> Trainer:
    """A Trainer whose step outputs ``LOSSES[iteration - 1]`` and applies one optimizer step."""
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def step(engine: Engine, batch) -> dict[str, torch.Tensor]:
        one = torch.tensor(1.0)
        engine.state.output = {"loss": torch.tensor(LOSSES[engine.state.iteration - 1]),
                               "grad_norm": one, "grad_norm_clipped": one,
                               "clipped": torch.tensor(False)}
        engine.state.optimizer_step += 1
        engine.fire_event(TrainEvents.OPTIMIZER_STEP)
        return engine.state.output

    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return Trainer(step, model, optimizer, scaler, resolve_precision("fp32"), 1, None)


def scripted_evaluator(trainer: Trainer) -> Engine:
    """Reports the scripted metrics of the trainer's epoch, plus a non-scalar one."""
    evaluator = Engine(lambda engine, batch: None)

    @evaluator.on(Events.EPOCH_COMPLETED)
    def report(engine: Engine) -> None:
        index = trainer.state.epoch - 1
        engine.state.metrics = {"accuracy": ACCURACY[index],
                                "loss": torch.tensor(VAL_LOSS[index]),
                                "confusion": torch.eye(2)}

    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: evaluator.run([0]))
    return evaluator


def build(state: dict | None = None) -> tuple[Trainer, RunHistory]:
    """A scripted run with a history, resumed from ``state`` when given."""
    trainer = scripted_trainer()
    telemetry = GradientTelemetry(log_every=2)
    telemetry.attach(trainer)
    history = RunHistory(batch_size=BATCH_SIZE, telemetry=telemetry)
    if state is not None:
        history.load_state_dict(state)
    history.attach(trainer, scripted_evaluator(trainer))
    return trainer, history


def run(epochs: int) -> tuple[Trainer, RunHistory]:
    trainer, history = build()
    trainer.run(range(STEPS_PER_EPOCH), max_epochs=epochs)
    return trainer, history


def test_summary_from_scripted_metrics():
    trainer, history = run(epochs=4)
    summary = history.summary(trainer)
    assert summary["best_val_accuracy"] == 0.8  # NaN is never the best
    assert math.isclose(summary["final_val_accuracy"], 0.7)
    assert math.isclose(summary["best_val_loss"], 0.6, rel_tol=1e-6)
    assert math.isclose(summary["final_val_loss"], 0.9, rel_tol=1e-6)
    assert summary["epochs_completed"] == 4
    assert summary["optimizer_steps"] == 4 * STEPS_PER_EPOCH and summary["skipped_steps"] == 0
    assert summary["stopped_early"] is False
    assert summary["train_time_sec"] == round(history.train_time_sec, 3)
    assert history.train_time_sec > 0  # unrounded: the loop can take under half a ms
    assert summary["samples_per_sec"] == round(
        4 * STEPS_PER_EPOCH * BATCH_SIZE / history.train_time_sec, 2)
    assert summary["wall_time_sec"] >= summary["train_time_sec"]


def test_curves_hold_the_telemetry_reports_and_every_scalar_metric():
    _, history = run(epochs=4)
    assert history.train["step"] == list(range(2, 17, 2))
    expected_loss = [(LOSSES[i] + LOSSES[i + 1]) / 2 for i in range(0, 16, 2)]
    assert history.train["loss"] == pytest.approx(expected_loss)
    assert history.train["lr"] == [LR] * 8
    assert history.val["step"] == [4, 8, 12, 16]
    assert history.val["accuracy"] == pytest.approx(ACCURACY, nan_ok=True)
    assert history.val["loss"] == pytest.approx(VAL_LOSS, nan_ok=True)
    assert all(type(value) is float for value in history.val["loss"])
    assert "confusion" not in history.val


def test_a_run_without_evaluations_has_no_metrics():
    trainer = scripted_trainer()
    telemetry = GradientTelemetry(log_every=2)
    telemetry.attach(trainer)
    history = RunHistory(batch_size=BATCH_SIZE, telemetry=telemetry)
    history.attach(trainer, Engine(lambda engine, batch: None))
    trainer.run(range(STEPS_PER_EPOCH), max_epochs=1)
    summary = history.summary(trainer)
    assert summary["best_val_accuracy"] is None and summary["final_val_accuracy"] is None
    assert summary["best_val_loss"] is None and summary["final_val_loss"] is None
    assert summary["epochs_completed"] == 1


def test_state_dict_roundtrip_through_torch_load_weights_only():
    trainer, history = run(epochs=2)
    history.stopped_early = True
    buffer = io.BytesIO()
    torch.save(history.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    restored = RunHistory(batch_size=BATCH_SIZE, telemetry=TELEMETRY)
    restored.load_state_dict(state)
    assert restored.train == history.train and restored.val == history.val
    assert restored.epochs_completed == 2 and restored.stopped_early is True
    assert restored.train_samples == history.train_samples == 2 * STEPS_PER_EPOCH * BATCH_SIZE
    before, after = history.summary(trainer), restored.summary(trainer)
    assert after["wall_time_sec"] >= state["wall_time_sec"] - 1e-3  # earlier sessions count
    before.pop("wall_time_sec"), after.pop("wall_time_sec")
    assert after == before


def test_a_resumed_run_has_the_same_summary_as_an_uninterrupted_one():
    full_trainer, full = run(epochs=4)

    first_trainer, first = run(epochs=2)
    trainer_state, history_state = first_trainer.state_dict(), first.state_dict()
    trainer, resumed = build(history_state)
    trainer.load_state_dict(trainer_state)
    trainer.run(range(STEPS_PER_EPOCH), max_epochs=4)

    assert resumed.train == full.train
    assert resumed.val["accuracy"] == pytest.approx(full.val["accuracy"], nan_ok=True)
    assert resumed.train_samples == full.train_samples
    summary, expected = resumed.summary(trainer), full.summary(full_trainer)
    assert summary["wall_time_sec"] >= history_state["wall_time_sec"]
    # Unrounded: the summary's 3 decimals can hide a fast resumed half.
    assert resumed.train_time_sec > history_state["train_time_sec"]
    for key in ("wall_time_sec", "train_time_sec", "samples_per_sec"):
        summary.pop(key), expected.pop(key)
    assert summary == expected


def test_a_checkpoint_taken_mid_epoch_carries_the_samples_trained_so_far():
    _, full = run(epochs=3)
    trainer, history = build()
    saved = {}

    @trainer.on(Events.ITERATION_COMPLETED(once=STEPS_PER_EPOCH + 2))
    def save_and_stop(engine: Trainer) -> None:
        saved.update(trainer=engine.state_dict(), history=history.state_dict())
        engine.terminate()

    trainer.run(range(STEPS_PER_EPOCH), max_epochs=3)
    assert saved["history"]["train_samples"] == (STEPS_PER_EPOCH + 2) * BATCH_SIZE
    trainer, resumed = build(saved["history"])
    trainer.load_state_dict(saved["trainer"])
    trainer.run(range(STEPS_PER_EPOCH), max_epochs=3)
    assert resumed.train_samples == full.train_samples == 3 * STEPS_PER_EPOCH * BATCH_SIZE
    assert resumed.summary(trainer)["epochs_completed"] == 3


@pytest.mark.parametrize("batch_size", [0, -1, 1.5, True, "64"])
def test_batch_size_must_be_a_positive_int(batch_size):
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        RunHistory(batch_size=batch_size, telemetry=TELEMETRY)
