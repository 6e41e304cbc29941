"""The non-finite guard: bad steps are skipped and counted, persistent ones stop the run."""

import math
import re
from numbers import Number

import ignite.distributed as idist
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ignite.engine import Engine, Events
from torch import nn

from engine.events import TrainEvents
from engine.muon import Muon
from engine.nonfinite import NonFiniteGradientError, NonFiniteGuard, PendingStep
from engine.trainer import create_trainer

PRECISIONS = ("fp32", "fp16", "bf16")
pytestmark = pytest.mark.usefixtures("gate")  # every test with both update gates


def nan_loss_trainer(model: nn.Module, nan_iterations: set[int], **kwargs):
    """A trainer whose forward hook returns a NaN loss at the given engine iterations."""

    def forward(model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        return loss * float("nan") if trainer.state.iteration in nan_iterations else loss

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = create_trainer(model, optimizer, forward=forward, **kwargs)
    return trainer


def record_weights(trainer) -> list[list[torch.Tensor]]:
    """Weights at the start (index 0) and after every iteration (index i for iteration i)."""
    snapshots = [[p.detach().clone() for p in trainer.model.parameters()]]
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED,
        lambda e: snapshots.append([p.detach().clone() for p in e.model.parameters()]),
    )
    return snapshots


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def all_finite(model: nn.Module) -> bool:
    return all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_nan_loss_step_is_skipped_counted_and_training_continues(precision, make_mlp, make_batches):
    trainer = nan_loss_trainer(make_mlp(), {5}, precision=precision)
    weights = record_weights(trainer)
    skipped_at = []
    trainer.add_event_handler(
        TrainEvents.STEP_SKIPPED, lambda e: skipped_at.append(e.state.iteration)
    )
    trainer.run(make_batches(10))

    assert same(weights[5], weights[4])  # iteration 5 left the weights untouched
    assert not any(same(weights[i], weights[i - 1]) for i in (1, 2, 3, 4, 6, 7, 8, 9, 10))
    assert skipped_at == [5]
    assert trainer.state.skipped_steps == 1
    assert trainer.state.optimizer_step == 9
    assert trainer.state.consecutive_skips == 0  # the next applied step reset it
    assert all_finite(trainer.model)


def test_nan_micro_batch_skips_its_whole_window(make_mlp, make_batches):
    trainer = nan_loss_trainer(make_mlp(), {5}, accum_steps=3)
    weights = record_weights(trainer)
    trainer.run(make_batches(10))  # windows: iterations 1-3, 4-6, 7-9, 10

    assert same(weights[6], weights[3])
    assert not same(weights[9], weights[6]) and not same(weights[10], weights[9])
    assert (trainer.state.optimizer_step, trainer.state.skipped_steps) == (3, 1)
    assert all_finite(trainer.model)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_max_consecutive_skips_raises_naming_the_first_bad_parameter(
    precision, make_mlp, make_batches
):
    trainer = nan_loss_trainer(make_mlp(), {3, 4, 5}, precision=precision, max_consecutive_skips=3)
    weights = record_weights(trainer)
    with pytest.raises(NonFiniteGradientError, match=r"'0\.weight' at iteration 3") as error:
        trainer.run(make_batches(10))

    assert "3 consecutive" in str(error.value)
    assert trainer.state.iteration == 5
    assert trainer.state.skipped_steps == 3
    assert all(same(w, weights[2]) for w in weights[3:])  # iterations 3 and 4 stepped nothing
    assert same([p.detach() for p in trainer.model.parameters()], weights[2])
    assert all_finite(trainer.model)


def test_an_applied_step_resets_the_consecutive_count(make_mlp, make_batches):
    trainer = nan_loss_trainer(make_mlp(), {2, 3, 5, 6}, max_consecutive_skips=3)
    trainer.run(make_batches(10))  # never 3 in a row: no error

    assert trainer.state.skipped_steps == 4
    assert trainer.state.optimizer_step == 6
    assert all_finite(trainer.model)


def test_non_finite_raise_stops_at_the_first_bad_step(make_mlp, make_batches):
    trainer = nan_loss_trainer(make_mlp(), {5}, non_finite="raise")
    weights = record_weights(trainer)
    with pytest.raises(NonFiniteGradientError, match=r"'0\.weight' at iteration 5"):
        trainer.run(make_batches(10))

    assert trainer.state.iteration == 5
    assert same([p.detach() for p in trainer.model.parameters()], weights[4])
    assert all_finite(trainer.model)


def test_fp16_scaler_back_off_is_skipped_but_never_raises(make_mlp, make_batches):
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = create_trainer(
        model, optimizer, F.cross_entropy, precision="fp16", max_consecutive_skips=2
    )
    initial_scale = 2.0**30  # finite loss, but the scaled gradients overflow fp16 (max 65504)
    trainer.scaler.load_state_dict({**trainer.scaler.state_dict(), "scale": initial_scale})
    skipped_at, skipped_scales = [], []

    @trainer.on(TrainEvents.STEP_SKIPPED)
    def remember(engine) -> None:
        skipped_at.append(engine.state.iteration)
        skipped_scales.append(engine.state.output["scale"].clone())

    trainer.run(make_batches(10), max_epochs=2)

    skipped = trainer.state.skipped_steps
    assert skipped_at[:3] == [1, 2, 3]  # more than max_consecutive_skips in a row
    assert len(skipped_at) == skipped
    assert trainer.state.consecutive_skips == 0  # back-off skips do not count towards the limit
    assert [float(s) for s in skipped_scales] == [initial_scale / 2**i for i in range(skipped)]
    assert trainer.scaler.get_scale() < initial_scale
    assert trainer.state.optimizer_step == 20 - skipped > 0  # once the scale fits, steps apply
    assert all_finite(model)



@pytest.mark.parametrize(("initial_scale", "stopped_at"), [(1.0, 3), (4.0, 5)])
def test_fp16_skips_with_the_scale_at_or_below_1_stop_after_max_consecutive_skips(
    initial_scale, stopped_at, make_mlp, make_batches
):
    """A gradient that stays infinite while the loss is finite: the scaler halves its scale
    at each skip, and once that scale is at or below 1 a skip is no back-off any more but a
    failure, so the run stops after max_consecutive_skips instead of skipping on."""
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = create_trainer(
        model, optimizer, F.cross_entropy, precision="fp16", max_consecutive_skips=3
    )
    trainer.scaler.load_state_dict({**trainer.scaler.state_dict(), "scale": initial_scale})
    first_weight = next(model.parameters())
    first_weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    skipped_scales = []
    trainer.add_event_handler(
        TrainEvents.STEP_SKIPPED,
        lambda engine: skipped_scales.append(float(engine.state.output["scale"])))

    with pytest.raises(NonFiniteGradientError,
                       match=rf"'0\.weight' at iteration {stopped_at - 2}; 3 consecutive optimizer "
                             rf"step\(s\) skipped, stopping at iteration {stopped_at} "):
        trainer.run(make_batches(10))

    # Every step was skipped; the last one raised before its STEP_SKIPPED.
    assert skipped_scales == [initial_scale / 2**i for i in range(stopped_at - 1)]
    assert trainer.state.optimizer_step == 0 and trainer.state.skipped_steps == stopped_at
    assert trainer.state.consecutive_skips == 3


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, torch.Tensor]]:
    return {index: {key: value.clone() for key, value in state.items()}
            for index, state in optimizer.state_dict()["state"].items()}


@pytest.mark.parametrize("make_optimizer", [
    lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1),
    lambda params: torch.optim.AdamW(params, lr=1e-2),
    lambda params: Muon([{"params": params[:1], "use_muon": True}, {"params": params[1:]}],
                        lr=0.1, momentum=0.9),
], ids=["sgd_momentum", "adamw", "muon"])
@pytest.mark.parametrize("nan_iteration", [1, 3], ids=["first_step", "later_step"])
def test_a_skipped_step_leaves_weights_and_optimizer_state_untouched(
    make_optimizer, nan_iteration, make_mlp, make_batches
):
    model = make_mlp()

    def forward(model: nn.Module, batch) -> torch.Tensor:
        loss = F.cross_entropy(model(batch[0]), batch[1])
        return loss * float("nan") if trainer.state.iteration == nan_iteration else loss

    optimizer = make_optimizer(list(model.parameters()))
    trainer = create_trainer(model, optimizer, forward=forward)
    before = {}
    trainer.add_event_handler(
        Events.ITERATION_STARTED(once=nan_iteration),
        lambda e: before.update(weights=[p.detach().clone() for p in model.parameters()],
                                state=optimizer_state(optimizer)),
    )
    after = {}
    trainer.add_event_handler(
        TrainEvents.STEP_SKIPPED,
        lambda e: after.update(weights=[p.detach().clone() for p in model.parameters()],
                               state=optimizer_state(optimizer)),
    )
    trainer.run(make_batches(5))

    assert same(after["weights"], before["weights"])
    assert after["state"].keys() == before["state"].keys()  # none created at a first step
    for index, state in before["state"].items():
        assert after["state"][index].keys() == state.keys()
        assert all(torch.equal(after["state"][index][key], value) for key, value in state.items())
    assert trainer.state.optimizer_step == 4 and all_finite(model)


def test_a_skipped_step_never_advances_a_scheduler_on_the_step_clock(make_mlp, make_batches):
    trainer = nan_loss_trainer(make_mlp(), {3})
    lrs_used = []  # the lr each micro-batch's step will use
    trainer.add_event_handler(
        Events.ITERATION_STARTED,
        lambda e: lrs_used.append(e.optimizer.param_groups[0]["lr"]))

    @trainer.on(TrainEvents.OPTIMIZER_STEP)
    def schedule(engine) -> None:  # the learning rate of step k + 1 is 0.1 / (k + 1)
        engine.optimizer.param_groups[0]["lr"] = 0.1 / (engine.state.optimizer_step + 1)

    trainer.run(make_batches(6))
    # Iteration 3's step was skipped: iteration 4 runs with the same lr.
    assert lrs_used == pytest.approx([0.1, 0.1 / 2, 0.1 / 3, 0.1 / 3, 0.1 / 4, 0.1 / 5])
    assert trainer.state.optimizer_step == 5


class NeverFinite:
    """An update gate whose step was not finite and not vetoed."""

    def finite(self) -> bool:
        return False

    def vetoed(self) -> bool:
        return False


def test_a_skip_whose_every_gradient_is_finite_names_the_overflowed_total_norm():
    """Each parameter's gradient norm finite, their total not: no parameter to blame."""
    first, second = torch.zeros(2), torch.zeros(3)
    guard = NonFiniteGuard(NeverFinite(), {first: "a", second: "b"}, "raise", 3)
    guard.pending = PendingStep(7, {}, torch.tensor([1.0, 2.0]), [first, second],
                                [torch.tensor(0.5)])
    engine = Engine(lambda engine, batch: None)
    engine.state.skipped_steps = engine.state.consecutive_skips = 0
    with pytest.raises(NonFiniteGradientError) as error:
        guard.settle(engine)
    assert str(error.value).startswith(
        "first non-finite gradient in parameter '<none: every gradient is finite, their total "
        "norm overflowed>' at iteration 7; 1 consecutive optimizer step(s) skipped")


def fp16_skip_with_a_finite_local_loss() -> tuple[NonFiniteGuard, Engine]:
    """A guard settling an fp16 step skipped for an infinite gradient, the scale above 1 and
    this rank's loss finite: a back-off, unless another rank's loss was not finite."""
    weight = torch.zeros(2)
    guard = NonFiniteGuard(NeverFinite(), {weight: "w"}, "raise", 3)
    guard.pending = PendingStep(7, {"scale": torch.tensor(2.0**16)},
                                torch.tensor([float("inf")]), [weight], [torch.tensor(0.5)])
    engine = Engine(lambda engine, batch: None)
    engine.state.skipped_steps = engine.state.consecutive_skips = 0
    return guard, engine


def all_reduce_with_one_other_rank(other_rank_value: int):
    """``idist.all_reduce`` of a 2-process world whose other rank contributes
    ``other_rank_value``: the ops and argument types its native backend accepts."""
    reductions = {"SUM": sum, "PRODUCT": math.prod, "MIN": min, "MAX": max}

    def all_reduce(value, op: str = "SUM", group=None):
        if not isinstance(value, torch.Tensor | Number):
            raise TypeError(f"Unhandled input type {type(value)}")
        if op not in reductions:
            raise ValueError(f"Unsupported reduction operation: '{op}'")
        return reductions[op]([value, other_rank_value])

    return all_reduce


@pytest.mark.parametrize("other_loss_finite", [True, False])
def test_with_two_processes_an_fp16_skip_backs_off_only_if_every_ranks_loss_was_finite(
    monkeypatch, other_loss_finite
):
    monkeypatch.setattr(idist, "get_world_size", lambda: 2)
    monkeypatch.setattr(idist, "all_reduce", all_reduce_with_one_other_rank(int(other_loss_finite)))
    guard, engine = fp16_skip_with_a_finite_local_loss()
    if other_loss_finite:  # a back-off: counted as skipped, not towards the failures
        guard.settle(engine)
        assert (engine.state.skipped_steps, engine.state.consecutive_skips) == (1, 0)
    else:  # a failure, as on the rank whose loss was not finite (non_finite='raise')
        with pytest.raises(NonFiniteGradientError, match=r"^first non-finite gradient in "
                           r"parameter 'w' at iteration 7; 1 consecutive optimizer step"):
            guard.settle(engine)


def test_with_one_process_the_back_off_decision_runs_no_collective(monkeypatch):
    def all_reduce(*args, **kwargs):
        raise AssertionError("a one-process run called all_reduce")

    monkeypatch.setattr(idist, "all_reduce", all_reduce)
    guard, engine = fp16_skip_with_a_finite_local_loss()
    guard.settle(engine)
    assert (engine.state.skipped_steps, engine.state.consecutive_skips) == (1, 0)


def test_max_consecutive_skips_of_1_stops_at_the_first_skip(make_mlp, make_batches):
    trainer = nan_loss_trainer(make_mlp(), {2}, max_consecutive_skips=1)
    message = (
        "first non-finite gradient in parameter '0.weight' at iteration 2; 1 consecutive "
        "optimizer step(s) skipped, stopping at iteration 2 (non_finite='skip', "
        "max_consecutive_skips=1)"
    )
    with pytest.raises(NonFiniteGradientError, match=f"^{re.escape(message)}$"):
        trainer.run(make_batches(4))


def test_three_consecutive_skips_stop_the_run_by_default(make_mlp, make_batches):
    trainer = nan_loss_trainer(make_mlp(), {1, 2, 3})
    with pytest.raises(NonFiniteGradientError, match=r"max_consecutive_skips=3\)$"):
        trainer.run(make_batches(5))
    assert trainer.state.iteration == 3


def test_a_ddp_models_parameters_are_named_as_in_the_model_it_wraps(make_mlp, make_batches):
    """In a one-process gloo world; the name has no "module." prefix."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.parallel.DistributedDataParallel(make_mlp())
        trainer = nan_loss_trainer(model, {1}, non_finite="raise")
        with pytest.raises(NonFiniteGradientError, match=r"parameter '0\.weight' at iteration 1;"):
            trainer.run(make_batches(2))
    finally:
        dist.destroy_process_group()


def test_a_run_resumed_inside_a_streak_of_skips_names_its_first_bad_parameter(
    make_mlp, make_batches
):
    trainer = nan_loss_trainer(make_mlp(), {3})
    trainer.load_state_dict({"iteration": 2, "epoch_length": 4, "max_epochs": 1,
                             "optimizer_step": 0, "skipped_steps": 2, "consecutive_skips": 2})
    message = (
        "first non-finite gradient in parameter '0.weight' at iteration 3; 3 consecutive "
        "optimizer step(s) skipped, stopping at iteration 3"
    )
    with pytest.raises(NonFiniteGradientError, match=f"^{re.escape(message)} "):
        trainer.run(make_batches(4))
