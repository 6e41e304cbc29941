import io

import pytest
import torch
import torch.nn.functional as F
from ignite.engine import Engine, Events
from torch import nn

from engine.events import TrainEvents
from engine.run_state import RngState
from engine.trainer import create_trainer
from handlers.weight_averaging import WeightAveraging

BATCHES_PER_EPOCH = 5


def make_model(seed: int = 0) -> nn.Sequential:
    """BatchNorm (running statistics) and Dropout (random draws in train mode)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4)
    )


def make_trainer(model: nn.Module):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return create_trainer(model, optimizer, F.cross_entropy)


def floats(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if v.is_floating_point()}


def record(trainer, event, model) -> list[dict[str, torch.Tensor]]:
    """The model's float state at every ``event``; attach before the averaging handler."""
    snapshots: list[dict[str, torch.Tensor]] = []
    trainer.add_event_handler(event, lambda _: snapshots.append(floats(model)))
    return snapshots


def assert_state_close(actual: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = actual.state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("warmup", [True, False])
def test_ema_follows_the_decay_rule(make_batches, warmup):
    model = make_model()
    trainer = make_trainer(model)
    snapshots = record(trainer, TrainEvents.OPTIMIZER_STEP, model)
    ema = WeightAveraging(model, "ema", decay=0.6, warmup=warmup)
    ema.attach(trainer)
    trainer.run(make_batches(10), max_epochs=1)

    expected = snapshots[0]
    for n, snapshot in enumerate(snapshots[1:], start=1):
        decay = min(0.6, (1 + n) / (10 + n)) if warmup else 0.6
        expected = {k: decay * expected[k] + (1 - decay) * snapshot[k] for k in expected}
    assert ema.num_updates == 10
    assert_state_close(ema.averaged_model, expected)  # weights and BatchNorm statistics
    assert ema.averaged_model[1].num_batches_tracked == model[1].num_batches_tracked == 10


def test_ema_every_and_start_step(make_batches):
    model = make_model()
    trainer = make_trainer(model)
    snapshots = record(trainer, TrainEvents.OPTIMIZER_STEP, model)
    ema = WeightAveraging(model, "ema", decay=0.9, every_steps=3, start_step=4)
    ema.attach(trainer)
    trainer.run(make_batches(10), max_epochs=1)

    assert ema.num_updates == 2  # steps 6 and 9
    decay = min(0.9, 2 / 11)
    step6, step9 = snapshots[5], snapshots[8]
    assert_state_close(ema.averaged_model,
                       {k: decay * step6[k] + (1 - decay) * step9[k] for k in step6})


def test_swa_averages_epoch_ends_and_recomputes_batchnorm(make_batches):
    model = make_model()
    trainer = make_trainer(model)
    snapshots = record(trainer, Events.EPOCH_COMPLETED, model)
    bn_batches = make_batches(3, batch_size=16, seed=7)
    swa = WeightAveraging(model, "swa", start_epoch=2, bn_batches=lambda: iter(bn_batches))
    swa.attach(trainer)
    trainer.run(make_batches(BATCHES_PER_EPOCH), max_epochs=4)

    assert swa.num_updates == 3
    averaged = swa.averaged_model
    for name, _ in averaged.named_parameters():
        mean = sum(s[name] for s in snapshots[1:]) / 3
        torch.testing.assert_close(averaged.state_dict()[name], mean, rtol=0, atol=1e-6)
    # momentum=None statistics: the plain mean of the per-batch statistics of the averaged net.
    with torch.no_grad():
        hidden = [averaged[0](x) for x, _ in bn_batches]
    torch.testing.assert_close(averaged[1].running_mean,
                               torch.stack([h.mean(0) for h in hidden]).mean(0))
    torch.testing.assert_close(averaged[1].running_var,
                               torch.stack([h.var(0) for h in hidden]).mean(0))
    assert averaged[1].num_batches_tracked == 3
    assert not averaged.training and all(not p.requires_grad for p in averaged.parameters())


def test_recomputing_batchnorm_leaves_the_random_generators_alone(make_batches):
    batches = make_batches(2)
    swa = WeightAveraging(make_model(), "swa", bn_batches=batches)
    swa.update()
    before = RngState().state_dict()
    swa.update_bn()  # Dropout draws in train mode
    after = RngState().state_dict()
    assert torch.equal(before["torch_cpu"], after["torch_cpu"])
    assert before["python"] == after["python"]


def test_swa_on_the_step_clock(make_mlp, make_batches):
    model = make_mlp()
    trainer = make_trainer(model)
    snapshots = record(trainer, TrainEvents.OPTIMIZER_STEP, model)
    swa = WeightAveraging(model, "swa", every_steps=2, start_step=3)
    swa.attach(trainer)
    trainer.run(make_batches(8), max_epochs=1)

    assert swa.num_updates == 3  # steps 4, 6, 8
    expected = {k: (snapshots[3][k] + snapshots[5][k] + snapshots[7][k]) / 3 for k in snapshots[0]}
    assert_state_close(swa.averaged_model, expected)


def test_swapped_in_puts_the_average_in_and_restores_bit_exactly(make_batches):
    model = make_model()
    trainer = make_trainer(model)
    ema = WeightAveraging(model, "ema", decay=0.5)
    ema.attach(trainer)
    trainer.run(make_batches(6), max_epochs=1)
    training = {k: v.clone() for k, v in model.state_dict().items()}
    x = make_batches(1)[0][0]

    with ema.swapped_in() as swapped:
        assert swapped is model
        for name, value in ema.averaged_model.state_dict().items():
            assert torch.equal(model.state_dict()[name], value), name
        model.eval()
        torch.testing.assert_close(model(x), ema.averaged_model(x), rtol=0, atol=0)
    for name, value in training.items():
        assert torch.equal(model.state_dict()[name], value), name

    with pytest.raises(RuntimeError, match="inside"), ema.swapped_in():
        raise RuntimeError("inside")
    for name, value in training.items():
        assert torch.equal(model.state_dict()[name], value), name


def test_swapped_in_before_the_first_update_keeps_the_training_weights():
    model = make_model()
    ema = WeightAveraging(model, "ema")
    with torch.no_grad():
        model[0].weight.add_(1.0)  # the copy taken at construction is now stale
    before = model[0].weight.clone()
    with ema.swapped_in():
        assert torch.equal(model[0].weight, before)


def save_and_load(objects: dict) -> dict:
    buffer = io.BytesIO()
    torch.save({name: obj.state_dict() for name, obj in objects.items()}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("options", [
    {"mode": "ema", "decay": 0.8},
    {"mode": "ema", "decay": 0.8, "every_steps": 3, "start_step": 4},
    {"mode": "swa", "start_epoch": 2},
    {"mode": "swa", "every_steps": 2, "start_step": 3},
], ids=["ema", "ema-every", "swa-epoch", "swa-step"])
def test_a_resumed_run_continues_bit_identically(make_batches, options):
    batches = make_batches(BATCHES_PER_EPOCH)

    def setup(seed: int):
        model = make_model(seed)
        trainer = make_trainer(model)
        extra = {"bn_batches": batches} if options["mode"] == "swa" else {}
        averaging = WeightAveraging(model, **options, **extra)
        return model, trainer, averaging

    model, trainer, whole = setup(0)
    whole.attach(trainer)
    torch.manual_seed(123)
    trainer.run(batches, max_epochs=4)

    model, trainer, first = setup(0)
    first.attach(trainer)
    torch.manual_seed(123)
    trainer.run(batches, max_epochs=2)
    saved = save_and_load({"model": model, "optimizer": trainer.optimizer, "trainer": trainer,
                           "averaging": first, "rng": RngState()})

    model, trainer, resumed = setup(seed=1)  # different weights, all overwritten by the load
    model.load_state_dict(saved["model"])
    trainer.optimizer.load_state_dict(saved["optimizer"])
    trainer.load_state_dict(saved["trainer"])
    resumed.load_state_dict(saved["averaging"])
    RngState().load_state_dict(saved["rng"])
    resumed.attach(trainer)
    trainer.run(batches, max_epochs=4)

    assert resumed.num_updates == whole.num_updates > 0
    for name, value in whole.averaged_model.state_dict().items():
        assert torch.equal(resumed.averaged_model.state_dict()[name], value), name


def test_state_of_another_mode_or_model_is_refused(make_mlp):
    ema = WeightAveraging(make_model(), "ema")
    with pytest.raises(ValueError, match="mode='ema'"):
        WeightAveraging(make_mlp(), "swa").load_state_dict(ema.state_dict())
    with pytest.raises(ValueError, match="does not match the model"):
        WeightAveraging(make_mlp(), "ema").load_state_dict(ema.state_dict())


def test_a_model_moved_after_construction_is_refused():
    model = make_model()
    averaging = WeightAveraging(model, "ema")
    trainer = make_trainer(model)
    model.to("meta")
    with pytest.raises(ValueError, match="build WeightAveraging after create_trainer"):
        averaging.attach(trainer)


@pytest.mark.parametrize("options, message", [
    ({"model": "net"}, "model"),
    ({"mode": "mean"}, "mode"),
    ({"decay": 1.0}, "decay"),
    ({"decay": True}, "decay"),
    ({"mode": "swa", "decay": 0.9, "bn_batches": []}, "decay"),
    ({"warmup": "yes"}, "warmup"),
    ({"every_steps": 0}, "every_steps"),
    ({"start_step": -1}, "start_step"),
    ({"start_epoch": 2}, "start_epoch"),
    ({"mode": "swa", "start_step": 2, "bn_batches": []}, "start_step"),
    ({"mode": "swa", "start_epoch": 0, "bn_batches": []}, "start_epoch"),
    ({"mode": "swa"}, "bn_batches"),
    ({"mode": "swa", "bn_batches": 3}, "bn_batches"),
    ({"bn_batches": []}, "bn_batches"),
    ({"mode": "swa", "bn_batches": [], "bn_input": "x"}, "bn_input"),
    ({"bn_input": lambda batch: batch}, "bn_input"),
])
def test_bad_arguments_are_named(options, message):
    arguments = {"model": make_model()} | options
    with pytest.raises(ValueError, match=message):
        WeightAveraging(**arguments)


def test_attached_to_an_evaluator_it_evaluates_the_average_then_trains_on(make_batches):
    model = make_model()
    trainer = make_trainer(model)
    ema = WeightAveraging(model, "ema", decay=0.5)
    evaluator = Engine(lambda engine, batch: floats(model))  # what an evaluation sees
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: evaluator.run([0]))
    ema.attach(trainer, evaluator)
    trained = record(trainer, Events.COMPLETED, model)
    trainer.run(make_batches(6), max_epochs=1)
    assert_state_close(ema.averaged_model, evaluator.state.output)
    assert any(not torch.equal(trained[0][name], value)
               for name, value in evaluator.state.output.items())
    assert all(torch.equal(model.state_dict()[name], value) for name, value in trained[0].items())
