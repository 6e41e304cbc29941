import pytest
import torch
from torch import nn

from engine.events import TrainEvents
from engine.precision import resolve_precision
from engine.trainer import Trainer
from handlers.lookahead import Lookahead

EPOCH_LENGTH = 3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))


def scripted_trainer(model: nn.Module, skip_iterations=()):
    """Each iteration adds 1 to every weight and 0.5 to the BatchNorm running mean, then
    fires OPTIMIZER_STEP, except at ``skip_iterations`` (a skipped step changes nothing)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(engine, batch):
        if engine.state.iteration in skip_iterations:
            engine.state.skipped_steps += 1
            return {}
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)
            model[1].running_mean.add_(0.5)
            model[1].num_batches_tracked.add_(1)
        engine.state.optimizer_step += 1
        engine.fire_event(TrainEvents.OPTIMIZER_STEP)
        return {}

    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return Trainer(step, model, optimizer, scaler, resolve_precision("fp32"), 1, None)


def reference(model: nn.Module, iterations: int, *, total, every, base, power, start, skip=()):
    """The scheme written out by hand on a copy of the float state."""
    state = {k: v.clone() for k, v in model.state_dict().items() if v.is_floating_point()}
    average, step = None, 0
    for iteration in range(1, iterations + 1):
        if iteration in skip:
            if iteration % EPOCH_LENGTH == 0 and average is not None:
                state = {k: v.clone() for k, v in average.items()}
            continue
        for name in state:
            if name != "1.running_var":
                state[name] += 0.5 if name == "1.running_mean" else 1.0
        step += 1
        if step >= start and step % every == 0:
            if average is None:
                average = {k: v.clone() for k, v in state.items()}
            else:
                decay = base * (step / total) ** power
                for name in state:
                    average[name] = decay * average[name] + (1 - decay) * state[name]
                    state[name] = average[name].clone()
        if iteration % EPOCH_LENGTH == 0 and average is not None:
            state = {k: v.clone() for k, v in average.items()}
    return state


OPTIONS = {"total_steps": 12, "every": 2, "decay_base": 0.5, "decay_power": 1.0, "start_step": 2}


def run(model, epochs, lookahead=None, trainer=None):
    trainer = trainer or scripted_trainer(model)
    lookahead = lookahead or Lookahead(model, **OPTIONS)
    lookahead.attach(trainer)
    trainer.run([0] * EPOCH_LENGTH, max_epochs=epochs)
    return trainer, lookahead


def test_weights_follow_the_hand_written_scheme():
    model = make_model()
    expected = reference(model, 12, total=12, every=2, base=0.5, power=1.0, start=2)
    run(model, epochs=4)
    for name, value in expected.items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=1e-6)
    assert model[1].num_batches_tracked.item() == 12  # integer counters are not averaged


def test_the_model_is_pulled_back_towards_the_average():
    model, plain = make_model(), make_model()
    run(model, epochs=4)
    run(plain, epochs=4, lookahead=Lookahead(plain, **OPTIONS | {"start_step": 100}))
    torch.testing.assert_close(plain[0].bias, make_model()[0].bias + 12)  # never started
    assert (model[0].bias < plain[0].bias - 1).all()  # the average lags the raw weights


def test_skipped_steps_do_not_count():
    model = make_model()
    expected = reference(model, 12, total=12, every=2, base=0.5, power=1.0, start=2,
                         skip={2, 5})
    trainer = scripted_trainer(model, skip_iterations={2, 5})
    run(model, epochs=4, trainer=trainer)
    assert trainer.state.optimizer_step == 10
    for name, value in expected.items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=1e-6)


def test_resume_continues_exactly():
    whole = make_model()
    run(whole, epochs=4)

    first = make_model()
    trainer, lookahead = run(first, epochs=2)
    saved = {"trainer": trainer.state_dict(), "model": first.state_dict(),
             "lookahead": lookahead.state_dict()}
    resumed = make_model()
    resumed.load_state_dict(saved["model"])
    trainer = scripted_trainer(resumed)
    trainer.load_state_dict(saved["trainer"])
    lookahead = Lookahead(resumed, **OPTIONS)
    lookahead.load_state_dict(saved["lookahead"])
    run(resumed, epochs=4, lookahead=lookahead, trainer=trainer)
    for name, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


def test_state_of_another_model_is_refused():
    _, lookahead = run(make_model(), epochs=2)
    other = Lookahead(nn.Linear(2, 2), **OPTIONS)
    with pytest.raises(ValueError, match="entries differ"):
        other.load_state_dict(lookahead.state_dict())


@pytest.mark.parametrize("options, message", [
    ({"total_steps": 0}, "total_steps"),
    ({"every": 1.5}, "every"),
    ({"start_step": -1}, "start_step"),
    ({"decay_base": 1.5}, "decay_base"),
    ({"decay_power": True}, "decay_power"),
])
def test_bad_arguments_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        Lookahead(make_model(), **(OPTIONS | options))
