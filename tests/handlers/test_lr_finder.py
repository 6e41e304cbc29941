import copy
import math
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from ignite.engine import Events
from torch import nn

from engine.events import TrainEvents
from engine.run_state import RngState
from engine.trainer import create_trainer
from handlers.lr_finder import RULE, LRFinderResult, find_lr, plot_lr_find


def regression_batches(n: int = 150, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """y = x @ w + small noise, x standard normal: SGD learns it between ~1e-2 and ~1."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 1, generator=generator) / 8**0.5
    batches = []
    for _ in range(n):
        x = torch.randn(64, 8, generator=generator)
        batches.append((x, x @ w + 0.05 * torch.randn(64, 1, generator=generator)))
    return batches


def regression_trainer(**options):
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    return create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), F.mse_loss,
                          **options)


def test_the_curve_falls_then_diverges_and_the_suggestion_is_on_the_descent():
    result = find_lr(regression_trainer(), regression_batches(), start_lr=1e-5, end_lr=10.0,
                     num_steps=100)

    assert result.stop_reason == "diverged" and len(result.lrs) < 100
    ratios = [b / a for a, b in zip(result.lrs, result.lrs[1:], strict=False)]
    assert all(math.isclose(r, 10 ** (6 / 99)) for r in ratios)  # exponential, start to end
    assert result.lrs[0] == pytest.approx(1e-5)
    lowest = min(result.losses)
    assert lowest < 0.6 * result.losses[0]  # it learned...
    assert result.losses[-1] > 4 * lowest  # ...and then diverged past the threshold
    assert result.rule == RULE
    assert 1e-5 <= result.suggestion <= result.lrs[-1]
    assert 1e-3 < result.suggestion < result.min_loss_lr  # on the descent, before the minimum
    i = result.lrs.index(result.suggestion)
    assert result.losses[i + 1] < result.losses[i - 1]
    assert f"{result.suggestion:.3g}" in result.summary()


def test_without_a_divergence_factor_the_sweep_runs_on():
    batches = regression_batches()
    stopped = find_lr(regression_trainer(), batches, start_lr=1e-5, end_lr=10.0, num_steps=100)
    on = find_lr(regression_trainer(), batches, start_lr=1e-5, end_lr=10.0, num_steps=100,
                 diverge_factor=None)
    assert len(on.lrs) > len(stopped.lrs)
    assert on.stop_reason in ("num_steps", "non-finite loss")


def test_steps_take_one_lr_per_accumulation_window_and_record_the_window_mean():
    micro_losses: list[float] = []

    def forward(model, batch):
        x, y = batch
        loss = F.mse_loss(model(x), y)
        micro_losses.append(loss.item())
        return loss

    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = create_trainer(model, optimizer, forward=forward, accum_steps=3)
    stepped_lrs: list[float] = []
    hook = optimizer.register_step_post_hook(
        lambda opt, args, kwargs: stepped_lrs.append(opt.param_groups[0]["lr"]))
    result = find_lr(trainer, regression_batches(17), start_lr=1e-4, end_lr=1e-2, num_steps=5,
                     smoothing=0.0)
    hook.remove()

    assert result.stop_reason == "num_steps"
    assert len(micro_losses) == 15  # the two batches left over make no whole window
    schedule = [1e-4 * 100 ** (i / 4) for i in range(5)]
    assert stepped_lrs == pytest.approx(schedule) and list(result.lrs) == stepped_lrs
    window_means = [sum(micro_losses[i:i + 3]) / 3 for i in range(0, 15, 3)]
    assert list(result.raw_losses) == pytest.approx(window_means, rel=1e-6)
    assert result.losses == result.raw_losses  # smoothing=0: no average
    assert optimizer.param_groups[0]["lr"] == 0.01


def test_a_group_with_its_own_lr_is_swept_at_its_ratio_to_the_first():
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD([{"params": [model.weight]},
                                 {"params": [model.bias], "lr": 0.04}], lr=0.01)
    trainer = create_trainer(model, optimizer, F.mse_loss)
    stepped: list[list[float]] = []
    hook = optimizer.register_step_post_hook(
        lambda opt, args, kwargs: stepped.append([group["lr"] for group in opt.param_groups]))
    find_lr(trainer, regression_batches(5), start_lr=1e-4, end_lr=1e-2, num_steps=5)
    hook.remove()
    schedule = [1e-4 * 100 ** (i / 4) for i in range(5)]
    assert [first for first, _ in stepped] == pytest.approx(schedule)
    assert [second for _, second in stepped] == pytest.approx([4 * lr for lr in schedule])
    assert [group["lr"] for group in optimizer.param_groups] == [0.01, 0.04]  # restored


def test_running_out_of_batches_ends_the_sweep_quietly():
    trainer = regression_trainer(accum_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = find_lr(trainer, iter(regression_batches(7)), num_steps=10)
    assert result.stop_reason == "out of batches"
    assert len(result.lrs) == 3


@pytest.mark.parametrize("mode, reason", [("skip", "non-finite loss"),
                                          ("raise", "non-finite gradients")])
def test_a_non_finite_step_ends_the_sweep_and_training_goes_on(mode, reason):
    trainer = regression_trainer(non_finite=mode)
    before = copy.deepcopy(trainer.model.state_dict())
    result = find_lr(trainer, regression_batches(), start_lr=1e-2, end_lr=1e12, num_steps=100,
                     diverge_factor=None)
    assert result.stop_reason == reason
    for name, value in before.items():
        assert torch.equal(trainer.model.state_dict()[name], value), name
    trainer.run(regression_batches(4), max_epochs=1)  # nothing left over from the sweep
    assert trainer.state.optimizer_step == 4


class CallCounter:
    """Stateful: counts the model's forward calls (a forward hook), restored by find_lr."""

    def __init__(self, model: nn.Module) -> None:
        self.calls = 0
        model.register_forward_hook(lambda *_: setattr(self, "calls", self.calls + 1))

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = state["calls"]


def classification_setup(make_batches):
    """fp16 (GradScaler), accumulation, clipping, momentum, BatchNorm, Dropout, a scheduler,
    a stateful counter; trained for one epoch so every piece of state is non-trivial."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                                weight_decay=1e-4)
    trainer = create_trainer(model, optimizer, F.cross_entropy, precision="fp16",
                             accum_steps=2, max_grad_norm=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    counter = CallCounter(model)
    trainer.run(make_batches(6), max_epochs=1)
    scheduler.step()
    model.eval()  # a mode the sweep must put back
    model[0].weight.grad = torch.full_like(model[0].weight, 0.5)  # a gradient it must keep
    random.seed(5)
    return model, optimizer, trainer, scheduler, counter


def tensors_equal(a, b) -> bool:
    """Nested containers equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(map(tensors_equal, a, b))
    return a == b


def test_everything_is_restored_bit_for_bit(make_batches):
    model, optimizer, trainer, scheduler, counter = classification_setup(make_batches)
    before = {
        "tensors": copy.deepcopy({**dict(model.named_parameters()), **dict(model.named_buffers())}),
        "grads": {n: p.grad.clone() if p.grad is not None else None
                  for n, p in model.named_parameters()},
        "modes": [m.training for m in model.modules()],
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "scaler": trainer.scaler.state_dict(),
        "scale": trainer.scaler._scale.clone(),
        "scheduler": copy.deepcopy(scheduler.state_dict()),
        "counter": counter.calls,
        "rng": RngState().state_dict(),
        "trainer_state": trainer.state_dict(),
        "state_attributes": dict(vars(trainer.state)),
        "engine_attributes": dict(vars(trainer)),
    }
    state_object = trainer.state
    assert before["optimizer"]["state"]  # momentum buffers exist

    def batches():  # draws from Python's random, as a sampler might
        for batch in make_batches(200, seed=3):
            random.random()
            yield batch

    result = find_lr(trainer, batches(), start_lr=1e-4, end_lr=1e4, num_steps=60,
                     restore=[scheduler, counter])
    assert result.stop_reason in ("diverged", "non-finite loss") and len(result.lrs) > 5

    assert tensors_equal({**dict(model.named_parameters()), **dict(model.named_buffers())},
                         before["tensors"])
    assert tensors_equal({n: p.grad for n, p in model.named_parameters()}, before["grads"])
    assert [m.training for m in model.modules()] == before["modes"]
    assert tensors_equal(optimizer.state_dict(), before["optimizer"])
    assert trainer.scaler.state_dict() == before["scaler"]
    assert torch.equal(trainer.scaler._scale, before["scale"])
    assert scheduler.state_dict() == before["scheduler"]
    assert counter.calls == before["counter"]
    assert tensors_equal(RngState().state_dict(), before["rng"])
    assert trainer.state is state_object
    assert trainer.state_dict() == before["trainer_state"]
    assert vars(trainer.state) == before["state_attributes"]
    assert vars(trainer) == before["engine_attributes"]


def test_training_after_the_sweep_is_identical_to_training_without_it(make_batches):
    swept, plain = classification_setup(make_batches), classification_setup(make_batches)
    rng = RngState().state_dict()  # the generators are global: both twins start from here
    find_lr(swept[2], make_batches(100, seed=3), end_lr=1e3, num_steps=40,
            restore=[swept[3], swept[4]])
    for model, _, trainer, _, _ in (swept, plain):
        if model is plain[0]:
            RngState().load_state_dict(rng)  # the swept twin runs on what find_lr left
        model.train()
        trainer.run(make_batches(6), max_epochs=2)  # the second epoch
    assert swept[2].state.optimizer_step == plain[2].state.optimizer_step == 6
    for (name, value), other in zip(swept[0].state_dict().items(),
                                    plain[0].state_dict().values(), strict=True):
        assert torch.equal(value, other), name


def test_a_trainer_with_handlers_is_refused():
    trainer = regression_trainer(accum_steps=2)
    trainer.add_event_handler(TrainEvents.OPTIMIZER_STEP, lambda _: None)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: None)
    with pytest.raises(ValueError, match="handlers attached") as error:
        find_lr(trainer, regression_batches(4))
    assert "OPTIMIZER_STEP" in str(error.value) and "EPOCH_COMPLETED" in str(error.value)


def test_plot_is_a_png(tmp_path):
    result = find_lr(regression_trainer(), regression_batches(), start_lr=1e-5, end_lr=10.0,
                     num_steps=100)
    path = plot_lr_find(result, tmp_path / "lr_find.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    flat = LRFinderResult((1e-3, 1e-2), (1.0, 1.0), (1.0, 1.0), None, 1e-3, RULE, "num_steps")
    assert plot_lr_find(flat, tmp_path / "flat.png").stat().st_size > 0
    empty = LRFinderResult((), (), (), None, None, RULE, "out of batches")
    with pytest.raises(ValueError, match="no recorded steps"):
        plot_lr_find(empty, tmp_path / "empty.png")


@pytest.mark.parametrize("options, message", [
    ({"trainer": "trainer"}, "trainer"),
    ({"batches": 3}, "batches"),
    ({"start_lr": 0.0}, "start_lr"),
    ({"start_lr": True}, "start_lr"),
    ({"end_lr": float("inf")}, "end_lr"),
    ({"start_lr": 1.0, "end_lr": 0.5}, "end_lr"),
    ({"num_steps": 1}, "num_steps"),
    ({"num_steps": 10.0}, "num_steps"),
    ({"smoothing": 1.0}, "smoothing"),
    ({"diverge_factor": 1.0}, "diverge_factor"),
    ({"diverge_factor": float("nan")}, "diverge_factor"),
    ({"restore": [object()]}, "restore"),
])
def test_bad_arguments_are_named(options, message):
    arguments = {"trainer": regression_trainer(), "batches": regression_batches(2)} | options
    with pytest.raises(ValueError, match=message):
        find_lr(**arguments)
