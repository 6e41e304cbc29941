"""The trainer and evaluator factories: argument checks, run state, unsized data, metrics."""

import pytest
import torch
import torch.nn.functional as F
from ignite.engine import State
from ignite.metrics import Accuracy, Loss
from torch import nn

from engine.batch import supervised_predict
from engine.events import TrainEvents
from engine.trainer import Trainer, create_evaluator, create_trainer

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


class Unsized:
    """An iterable without ``__len__``, like a streaming dataset."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        *[({"accum_steps": bad}, r"accum_steps must be an int >= 1") for bad in (0, -1, 1.5, True)],
        *[
            ({"max_grad_norm": bad}, r"max_grad_norm must be a finite number > 0 or None")
            for bad in (0, -1, float("inf"), float("nan"), True, "1.0")
        ],
        ({"precision": "fp8"}, r"precision='fp8'.*allowed: auto, fp32, fp16, bf16"),
        ({"device": "tpu"}, r"device='tpu'.*allowed: 'cpu', 'cuda'"),
        pytest.param({"device": "cuda"}, r"device='cuda'.*CUDA is not available", marks=no_cuda),
        ({"non_finite": "ignore"}, r"non_finite='ignore'.*allowed: 'skip', 'raise'"),
        ({"max_consecutive_skips": 0}, r"max_consecutive_skips must be >= 1"),
        ({"max_consecutive_skips": True}, r"max_consecutive_skips must be an int >= 1"),
        ({"loss_fn": None}, r"loss_fn is required unless forward\(model, batch\)"),
        ({"compile": "yes"}, r"compile must be True or False"),
    ],
)
def test_bad_arguments_name_the_argument_and_the_allowed_values(kwargs, message, make_mlp):
    model = make_mlp()
    arguments = {"loss_fn": F.cross_entropy, **kwargs}
    with pytest.raises(ValueError, match=message):
        create_trainer(model, sgd(model), **arguments)


def test_trainer_exposes_what_it_trains_with(make_mlp):
    model = make_mlp()
    optimizer = sgd(model)
    trainer = create_trainer(
        model, optimizer, F.cross_entropy, precision="fp16", accum_steps=2, max_grad_norm=1.0
    )
    assert isinstance(trainer, Trainer)
    assert (trainer.model, trainer.optimizer) == (model, optimizer)
    assert trainer.precision.name == "fp16" and trainer.scaler.is_enabled()
    assert (trainer.accum_steps, trainer.max_grad_norm) == (2, 1.0)


def test_step_counters_survive_a_weights_only_state_dict_round_trip(
    tmp_path, make_mlp, make_batches
):
    model = make_mlp()
    trainer = create_trainer(model, sgd(model), F.cross_entropy, accum_steps=2)
    trainer.run(make_batches(5))
    path = tmp_path / "trainer.pt"
    torch.save(trainer.state_dict(), path)

    fresh = create_trainer(model, sgd(model), F.cross_entropy, accum_steps=2)
    fresh.load_state_dict(torch.load(path, weights_only=True))
    assert (fresh.state.optimizer_step, fresh.state.skipped_steps) == (3, 0)
    assert fresh.state.consecutive_skips == 0
    assert (fresh.state.iteration, fresh.state.epoch) == (5, 1)


def test_compile_keeps_the_module_and_its_state_dict_keys(make_mlp):
    model = make_mlp()
    trainer = create_trainer(model, sgd(model), F.cross_entropy, compile=True)
    assert trainer.model is model
    assert list(model.state_dict()) == list(make_mlp().state_dict())  # no "_orig_mod." prefix


@pytest.mark.slow  # inductor compiles for tens of seconds on a small CPU
def test_checkpoints_move_between_compiled_and_eager_runs(make_mlp, make_batches):
    data = make_batches(4)
    compiled = make_mlp()
    trainer = create_trainer(compiled, sgd(compiled), F.cross_entropy, compile=True)
    trainer.run(data[:2])
    eager = make_mlp(seed=1)
    optimizer = sgd(eager)
    eager.load_state_dict(compiled.state_dict())  # strict: the same keys
    optimizer.load_state_dict(trainer.optimizer.state_dict())
    create_trainer(eager, optimizer, F.cross_entropy).run(data[2:])

    reference = make_mlp()
    create_trainer(reference, sgd(reference), F.cross_entropy).run(data)
    for got, want in zip(eager.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # compiled: last bits differ
    compiled.load_state_dict(eager.state_dict())


def test_accumulation_over_unsized_data_needs_an_epoch_length(make_mlp, make_batches):
    model = make_mlp()
    trainer = create_trainer(model, sgd(model), F.cross_entropy, accum_steps=2)
    with pytest.raises(ValueError, match=r"accum_steps > 1 needs a known epoch length"):
        trainer.run(Unsized(make_batches(4)))

    # A fresh trainer: Ignite 0.5.5 turns the first run() after an exception into a no-op.
    trainer = create_trainer(model, sgd(model), F.cross_entropy, accum_steps=2)
    trainer.run(Unsized(make_batches(4)), epoch_length=4)
    assert trainer.state.optimizer_step == 2


def test_unsized_data_without_accumulation_runs(make_mlp, make_batches):
    model = make_mlp()
    trainer = create_trainer(model, sgd(model), F.cross_entropy)
    trainer.run(Unsized(make_batches(3)))
    assert trainer.state.optimizer_step == 3


def evaluation_set(make_batches) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return make_batches(2, batch_size=8) + make_batches(1, batch_size=4, seed=2)  # 20 samples


def hand_metrics(model: nn.Module, batches) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) over all samples, in eval mode."""
    x = torch.cat([x for x, _ in batches])
    y = torch.cat([y for _, y in batches])
    model.eval()
    with torch.no_grad():
        logits = model(x)
    correct = (logits.argmax(dim=1) == y).sum().item()
    return correct / len(y), F.cross_entropy(logits, y).item()


def run_evaluator(model: nn.Module, batches, **kwargs) -> dict[str, float]:
    evaluator = create_evaluator(
        model, {"accuracy": Accuracy(), "loss": Loss(F.cross_entropy)}, **kwargs
    )
    return evaluator.run(batches).metrics


def test_evaluator_metrics_match_a_hand_computation(make_mlp, make_batches):
    batches = evaluation_set(make_batches)
    model = make_mlp()
    metrics = run_evaluator(model, batches)
    accuracy, loss = hand_metrics(model, batches)
    assert metrics["accuracy"] == accuracy
    assert metrics["loss"] == pytest.approx(loss, rel=1e-6)


def test_evaluator_runs_in_eval_and_inference_mode(make_batches):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 4))
    batches = evaluation_set(make_batches)
    seen_modes = []

    def predict(model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
        seen_modes.append((model.training, torch.is_inference_mode_enabled()))
        return supervised_predict(model, batch)

    model.train()
    first = run_evaluator(model, batches, predict=predict)
    model.train()
    second = run_evaluator(model, batches)
    assert seen_modes == [(False, True)] * len(batches)
    assert first == second  # dropout is off: deterministic
    accuracy, loss = hand_metrics(model, batches)
    assert first["loss"] == pytest.approx(loss, rel=1e-6)


def test_bf16_evaluator_produces_float_metrics(make_mlp, make_batches):
    batches = evaluation_set(make_batches)
    model = make_mlp()
    metrics = run_evaluator(model, batches, precision="bf16")
    _, loss = hand_metrics(model, batches)
    assert isinstance(metrics["accuracy"], float) and 0.0 <= metrics["accuracy"] <= 1.0
    assert isinstance(metrics["loss"], float)
    # bf16 keeps 8 significant bits (~0.4% per rounding), so only a loose match with fp32.
    assert metrics["loss"] == pytest.approx(loss, rel=0.05)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"precision": "fp8"}, r"precision='fp8'"), ({"device": "tpu"}, r"device='tpu'")],
)
def test_evaluator_rejects_bad_arguments(kwargs, message, make_mlp):
    with pytest.raises(ValueError, match=message):
        create_evaluator(make_mlp(), {"accuracy": Accuracy()}, **kwargs)


def test_a_second_run_from_scratch_restarts_the_step_counters(make_mlp, make_batches):
    """Ignite restarts a finished run from iteration 0; the optimizer-step counters follow."""
    model = make_mlp()
    trainer = create_trainer(model, sgd(model), F.cross_entropy)
    trainer.run(make_batches(3), max_epochs=1)
    trainer.run(make_batches(3), max_epochs=1)
    assert (trainer.state.iteration, trainer.state.optimizer_step) == (3, 3)


def test_a_trainer_saved_before_its_first_step_records_zero_steps(make_mlp):
    model = make_mlp()
    state = create_trainer(model, sgd(model), F.cross_entropy).state_dict()
    assert (state["optimizer_step"], state["skipped_steps"], state["consecutive_skips"]) == (
        0, 0, 0
    )


def test_step_events_can_be_filtered_by_their_step_count(make_mlp, make_batches, monkeypatch):
    """OPTIMIZER_STEP(every=2) fires at every second optimizer step. Ignite keeps the event ->
    counter table on the State class, for every engine of the process: it starts here without
    the trainer's entries, so that this trainer must register them itself."""
    monkeypatch.setattr(State, "event_to_attr", {
        event: attr for event, attr in State.event_to_attr.items()
        if event not in (TrainEvents.OPTIMIZER_STEP, TrainEvents.STEP_SKIPPED)})
    model = make_mlp()
    trainer = create_trainer(model, sgd(model), F.cross_entropy)
    seen = []
    trainer.add_event_handler(
        TrainEvents.OPTIMIZER_STEP(every=2), lambda e: seen.append(e.state.optimizer_step)
    )
    trainer.run(make_batches(5), max_epochs=1)
    assert seen == [2, 4]
