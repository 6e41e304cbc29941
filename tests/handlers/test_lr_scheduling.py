import math
import pickle
from types import SimpleNamespace

import pytest
import torch
from ignite.engine import Engine, Events
from torch import nn
from torch.optim import lr_scheduler

from engine.events import TrainEvents
from engine.trainer import create_trainer
from handlers.lr_scheduling import (
    SCHEDULER_NAMES,
    LRSchedulerHandler,
    StepwiseLambdaLR,
    WarmupCosine,
    build_scheduler,
    continue_with_new_settings,
    optimizer_steps_per_epoch,
    set_new_peak_lr,
)

LR = 0.1
EPOCHS = 4
BATCHES_PER_EPOCH = 10
PLATEAU_METRICS = [1.0, 0.5, 0.6, 0.7]  # two evaluations without improvement, then a cut

# name -> (build_scheduler options, the same schedule built from torch by hand, its clock)
SCHEDULES = {
    "step": (
        {"step_size": 1, "gamma": 0.5},
        lambda opt, total: lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        "epoch",
    ),
    "cosine": (
        {"eta_min": 0.001},
        lambda opt, total: lr_scheduler.CosineAnnealingLR(opt, T_max=total, eta_min=0.001),
        "step",
    ),
    "onecycle": (
        {},
        lambda opt, total: lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=total),
        "step",
    ),
    "plateau": (
        {"metric": "loss", "factor": 0.5, "patience": 1},
        lambda opt, total: lr_scheduler.ReduceLROnPlateau(opt, "min", factor=0.5, patience=1),
        "metric",
    ),
    "cosine_restarts": (
        {"T_0": 2},
        lambda opt, total: lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=2),
        "epoch",
    ),
}


def make_optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=LR, momentum=0.9)


def lrs_by_hand(scheduler, clock: str, steps_per_epoch: int) -> list[float]:
    """The LR after every optimizer step and at every epoch end, stepping torch by hand."""
    optimizer, lrs = scheduler.optimizer, []
    for epoch in range(EPOCHS):
        for _ in range(steps_per_epoch):
            optimizer.step()
            if clock == "step":
                scheduler.step()
            lrs.append(optimizer.param_groups[0]["lr"])
        if clock == "epoch":
            scheduler.step()
        elif clock == "metric":
            scheduler.step(PLATEAU_METRICS[epoch])
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def scripted_evaluator() -> Engine:
    """An evaluator whose metric 'loss' follows PLATEAU_METRICS, one value per run."""
    evaluator = Engine(lambda engine, batch: None)
    runs = []

    @evaluator.on(Events.COMPLETED)
    def set_metric(engine: Engine) -> None:
        engine.state.metrics["loss"] = PLATEAU_METRICS[len(runs)]
        runs.append(1)

    return evaluator


def lrs_from_trainer(name: str, options: dict, accum_steps: int, **build_args) -> list[float]:
    """The same LR record, from the handler driven by the real trainer on a tiny model."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    trainer = create_trainer(model, optimizer, nn.MSELoss(), accum_steps=accum_steps)
    steps = optimizer_steps_per_epoch(BATCHES_PER_EPOCH, accum_steps)
    handler = build_scheduler(
        name, optimizer, steps_per_epoch=steps, epochs=EPOCHS, **build_args, **options
    )
    evaluator = scripted_evaluator()
    handler.attach(trainer, evaluator)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: evaluator.run([0]))
    lrs: list[float] = []
    trainer.add_event_handler(TrainEvents.OPTIMIZER_STEP, lambda: lrs.append(handler.current_lr))
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: lrs.append(handler.current_lr))
    batches = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(BATCHES_PER_EPOCH)]
    trainer.run(batches, max_epochs=EPOCHS)
    assert trainer.state.optimizer_step == steps * EPOCHS
    return lrs


@pytest.mark.parametrize("accum_steps", [1, 4])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_trainer_driven_lrs_match_torch_stepped_by_hand(name, accum_steps):
    options, make_reference, clock = SCHEDULES[name]
    steps = optimizer_steps_per_epoch(BATCHES_PER_EPOCH, accum_steps)
    expected = lrs_by_hand(make_reference(make_optimizer(), steps * EPOCHS), clock, steps)
    assert lrs_from_trainer(name, options, accum_steps) == expected
    assert len(set(expected)) > 1  # the schedule actually moved


def warmup_cosine_formula(step: int, warmup: int, total: int, start: float, floor: float) -> float:
    if step < warmup:
        return LR * (start + (1 - start) * step / warmup)
    progress = (step - warmup) / (total - warmup)
    return LR * floor + (LR - LR * floor) * (1 + math.cos(math.pi * progress)) / 2


@pytest.mark.parametrize("accum_steps", [1, 4])
def test_warmup_cosine_follows_its_closed_form_under_the_trainer(accum_steps):
    options = {"warmup_start_factor": 0.1, "min_lr_ratio": 0.2}
    lrs = lrs_from_trainer("warmup_cosine", options, accum_steps, warmup_epochs=1.5)
    steps = optimizer_steps_per_epoch(BATCHES_PER_EPOCH, accum_steps)
    warmup, total = int(1.5 * steps), steps * EPOCHS
    step_lrs = [lr for i, lr in enumerate(lrs) if (i + 1) % (steps + 1) != 0]  # drop epoch ends
    expected = [warmup_cosine_formula(s, warmup, total, 0.1, 0.2) for s in range(1, total + 1)]
    assert step_lrs == pytest.approx(expected, rel=1e-12)
    assert max(step_lrs) == pytest.approx(LR)
    assert step_lrs[-1] == pytest.approx(0.2 * LR)  # the floor, reached at the last step


def test_warmup_cosine_starts_at_the_start_factor_and_peaks_after_warmup():
    optimizer = make_optimizer()
    handler = build_scheduler(
        "warmup_cosine", optimizer, steps_per_epoch=10, epochs=3, warmup_epochs=1,
        warmup_start_factor=0.01, min_lr_ratio=0.0,
    )
    lrs = [handler.current_lr]
    for _ in range(30):
        optimizer.step()
        handler(None)
        lrs.append(handler.current_lr)
    assert lrs[0] == pytest.approx(0.01 * LR)
    assert lrs[10] == pytest.approx(LR)
    assert lrs[:11] == sorted(lrs[:11]) and lrs[10:] == sorted(lrs[10:], reverse=True)
    assert lrs[30] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("tensor_lr", [False, True])
def test_stepwise_lambda_lr_steps_exactly_as_lambda_lr(tensor_lr):
    def make(kind):
        model = nn.Linear(3, 2)
        lr = torch.tensor(LR) if tensor_lr else LR
        optimizer = torch.optim.SGD([{"params": [model.weight]},
                                     {"params": [model.bias], "lr": 0.03}], lr=lr)
        return optimizer, kind(optimizer, [WarmupCosine(7, 40, 0.1, 0.05), lambda s: 0.9 ** s])

    (torch_opt, torch_sched), (our_opt, our_sched) = make(lr_scheduler.LambdaLR), make(
        StepwiseLambdaLR)
    for _ in range(45):
        for optimizer, scheduler in ((torch_opt, torch_sched), (our_opt, our_sched)):
            optimizer.step()
            scheduler.step()
        assert [g["lr"] for g in our_opt.param_groups] == [g["lr"] for g in torch_opt.param_groups]
        assert our_sched.get_last_lr() == torch_sched.get_last_lr()
        assert our_sched.state_dict() == torch_sched.state_dict()
    assert our_sched.last_epoch == 45 and our_sched._step_count == 46
    if tensor_lr:  # filled in place, and the last LRs are copies of it
        assert isinstance(our_opt.param_groups[0]["lr"], torch.Tensor)
        assert our_sched.get_last_lr()[0] is not our_opt.param_groups[0]["lr"]


def test_stepwise_lambda_lr_warns_like_torch_when_stepped_before_the_optimizer():
    optimizer = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=LR)
    scheduler = StepwiseLambdaLR(optimizer, lambda step: 0.5 ** step)
    with pytest.warns(UserWarning, match=r"lr_scheduler.step\(\)` before `optimizer.step\(\)"):
        scheduler.step()


def test_skipped_steps_do_not_advance_the_step_clock():
    poisoned = {3, 7}  # batches whose loss is NaN: their optimizer step is skipped

    def forward(model, batch):
        x, y, poison = batch
        return nn.functional.mse_loss(model(x), y) * poison

    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    trainer = create_trainer(model, optimizer, forward=forward, max_consecutive_skips=2)
    handler = build_scheduler("cosine", optimizer, steps_per_epoch=10, epochs=1)
    handler.attach(trainer)
    batches = [
        (torch.randn(4, 2), torch.randn(4, 1), torch.tensor(math.nan if i in poisoned else 1.0))
        for i in range(10)
    ]
    trainer.run(batches, max_epochs=1)

    assert trainer.state.skipped_steps == 2 and trainer.state.optimizer_step == 8
    assert handler.scheduler.last_epoch == 8
    reference = lr_scheduler.CosineAnnealingLR(make_optimizer(), T_max=10)
    for _ in range(8):
        reference.optimizer.step()
        reference.step()
    assert handler.current_lr == reference.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("name", [n for n in SCHEDULER_NAMES if n != "none"])
def test_state_roundtrip_through_weights_only_load_continues_identically(name, tmp_path):
    options = SCHEDULES[name][0] if name in SCHEDULES else {"min_lr_ratio": 0.1}
    build_args = {"warmup_epochs": 1} if name == "warmup_cosine" else {}

    def build():
        optimizer = make_optimizer()
        handler = build_scheduler(
            name, optimizer, steps_per_epoch=5, epochs=EPOCHS, **build_args, **options
        )
        return optimizer, handler

    def drive(optimizer, handler, epochs: range) -> list[float]:
        lrs = []
        for epoch in epochs:
            for _ in range(5):
                optimizer.step()
                if handler.clock == "step":
                    handler(None)
                lrs.append(handler.current_lr)
            if handler.clock != "step":
                metrics = {"loss": PLATEAU_METRICS[epoch]}
                handler(SimpleNamespace(state=SimpleNamespace(metrics=metrics)))
            lrs.append(handler.current_lr)
        return lrs

    optimizer, handler = build()
    drive(optimizer, handler, range(2))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": handler.state_dict()},
               tmp_path / "ckpt.pt")
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    restored_optimizer, restored = build()
    restored_optimizer.load_state_dict(checkpoint["optimizer"])
    restored.load_state_dict(checkpoint["scheduler"])

    assert restored.current_lr == handler.current_lr
    assert drive(restored_optimizer, restored, range(2, EPOCHS)) == drive(
        optimizer, handler, range(2, EPOCHS)
    )


class FactorWithHelper:
    """A callable LR factor holding a function: LambdaLR's own state_dict cannot be saved."""

    def __init__(self) -> None:
        self.decay = lambda step: 0.9**step
        self.calls = 0

    def __call__(self, step: int) -> float:
        self.calls += 1
        return self.decay(step)


def test_state_dict_drops_callables_so_it_saves_and_loads_weights_only(tmp_path):
    optimizer = make_optimizer()
    handler = LRSchedulerHandler(lr_scheduler.LambdaLR(optimizer, FactorWithHelper()), "step")
    with pytest.raises((AttributeError, pickle.PicklingError)):  # the lambda does not pickle
        torch.save(handler.scheduler.state_dict(), tmp_path / "raw.pt")
    for _ in range(3):
        optimizer.step()
        handler(None)
    torch.save(handler.state_dict(), tmp_path / "clean.pt")
    state = torch.load(tmp_path / "clean.pt", weights_only=True)
    assert state["lr_lambdas"] == [{"calls": 4}]

    fresh = LRSchedulerHandler(lr_scheduler.LambdaLR(make_optimizer(), FactorWithHelper()), "step")
    fresh.load_state_dict(state)
    assert fresh.scheduler.last_epoch == 3 and fresh.scheduler.lr_lambdas[0].calls == 4
    assert fresh.scheduler.lr_lambdas[0].decay(2) == pytest.approx(0.81)  # kept its own function


@pytest.mark.parametrize(
    ("make", "clock", "metric", "message"),
    [
        (lambda o: lr_scheduler.ReduceLROnPlateau(o), "epoch", None, "needs clock='metric'"),
        (lambda o: lr_scheduler.ReduceLROnPlateau(o), "step", None, "needs clock='metric'"),
        (lambda o: lr_scheduler.OneCycleLR(o, 0.1, total_steps=10), "epoch", None,
         "needs clock='step'"),
        (lambda o: lr_scheduler.StepLR(o, 1), "metric", "loss", "takes no metric"),
        (lambda o: lr_scheduler.StepLR(o, 1), "batch", None, "clock='batch' is not known"),
        (lambda o: lr_scheduler.ReduceLROnPlateau(o), "metric", None, "metric=<"),
        (lambda o: lr_scheduler.StepLR(o, 1), "step", "loss", "metric=<"),
    ],
)
def test_clock_mismatches_are_refused_naming_the_clock(make, clock, metric, message):
    with pytest.raises(ValueError, match=message):
        LRSchedulerHandler(make(make_optimizer()), clock, metric)


def test_metric_clock_needs_an_evaluator_to_attach_to():
    handler = LRSchedulerHandler(
        lr_scheduler.ReduceLROnPlateau(make_optimizer()), "metric", metric="loss"
    )
    with pytest.raises(ValueError, match="evaluator"):
        handler.attach(Engine(lambda e, b: None))


def test_step_clock_listens_to_optimizer_steps_not_iterations():
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    trainer = create_trainer(model, optimizer, nn.MSELoss(), accum_steps=4)
    handler = build_scheduler("cosine", optimizer, steps_per_epoch=3, epochs=1)
    handler.attach(trainer)
    trainer.run([(torch.randn(4, 2), torch.randn(4, 1))] * 10, max_epochs=1)
    assert trainer.state.iteration == 10 and handler.scheduler.last_epoch == 3


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("linear", {}, "scheduler='linear' is not known; allowed: 'none', 'step', 'cosine'"),
        ("cosine", {"steps_per_epoch": 0}, "steps_per_epoch"),
        ("cosine", {"epochs": 0}, "epochs"),
        ("warmup_cosine", {"warmup_epochs": EPOCHS}, "warmup_epochs"),
        ("warmup_cosine", {"warmup_epochs": -1}, "warmup_epochs"),
        ("cosine", {"warmup_epochs": 1}, "only applies to 'warmup_cosine'"),
        ("cosine", {"gamma": 0.5}, r"no option \['gamma'\]; allowed: \['eta_min'\]"),
        ("plateau", {}, "needs metric="),
        ("step", {"step_size": 0}, "step_size"),
        ("warmup_cosine", {"min_lr_ratio": 2.0}, "min_lr_ratio"),
        ("none", {"eta_min": 0.1}, "takes no options"),
    ],
)
def test_build_scheduler_rejects_bad_arguments_by_name(name, kwargs, message):
    args = {"steps_per_epoch": 10, "epochs": EPOCHS} | kwargs
    with pytest.raises(ValueError, match=message):
        build_scheduler(name, make_optimizer(), **args)


def test_none_builds_nothing_and_named_schedules_carry_their_clock():
    assert build_scheduler("none", make_optimizer(), steps_per_epoch=10, epochs=2) is None
    clocks = {
        name: build_scheduler(
            name, make_optimizer(), steps_per_epoch=10, epochs=2, **SCHEDULES[name][0]
        ).clock
        for name in SCHEDULES
    }
    assert clocks == {name: clock for name, (_, _, clock) in SCHEDULES.items()}


def test_optimizer_steps_per_epoch_counts_the_short_last_window():
    assert optimizer_steps_per_epoch(10, 4) == 3
    assert optimizer_steps_per_epoch(8, 4) == 2
    assert optimizer_steps_per_epoch(3, 1) == 3
    with pytest.raises(ValueError, match="accum_steps"):
        optimizer_steps_per_epoch(10, 0)


def _drive(optimizer, handler, epochs: range, steps_per_epoch: int = 5) -> list[float]:
    """Step the schedule by hand: the LR after each optimizer step and each epoch end."""
    lrs = []
    for epoch in epochs:
        for _ in range(steps_per_epoch):
            optimizer.step()
            if handler.clock == "step":
                handler(None)
            lrs.append(handler.current_lr)
        if handler.clock != "step":
            metrics = {"loss": 1.0 / (1 + epoch)}
            handler(SimpleNamespace(state=SimpleNamespace(metrics=metrics)))
        lrs.append(handler.current_lr)
    return lrs


@pytest.mark.parametrize("name", [name for name in SCHEDULER_NAMES
                                  if name not in ("none", "plateau")])
def test_new_lr_and_length_continue_as_a_fresh_run_with_them_would(name):
    options = {k: v for k, v in (SCHEDULES[name][0] if name in SCHEDULES else
                                 {"min_lr_ratio": 0.1}).items() if k != "step_size"}
    warmup = {"warmup_epochs": 1} if name == "warmup_cosine" else {}

    def build(optimizer, epochs):
        return build_scheduler(name, optimizer, steps_per_epoch=5, epochs=epochs, **warmup,
                               **options)

    optimizer = make_optimizer()
    handler = build(optimizer, 4)
    _drive(optimizer, handler, range(2))
    continue_with_new_settings(handler, lambda: build(optimizer, 9), old_lr=LR, new_lr=LR / 2,
                               optimizer_steps=10, epochs_completed=2)

    fresh_optimizer = make_optimizer()
    fresh_optimizer.param_groups[0]["lr"] = LR / 2
    fresh = build(fresh_optimizer, 9)
    expected = _drive(fresh_optimizer, fresh, range(9))[2 * 6:]
    assert _drive(optimizer, handler, range(2, 9)) == expected
    assert max(expected) <= LR / 2 + 1e-12


def test_plateau_scales_the_lr_it_reached():
    optimizer = make_optimizer()
    handler = build_scheduler("plateau", optimizer, steps_per_epoch=5, epochs=4, metric="loss",
                              factor=0.5, patience=0)
    for loss in (1.0, 2.0):  # the second evaluation cuts the LR to 0.05
        handler(SimpleNamespace(state=SimpleNamespace(metrics={"loss": loss})))
    continue_with_new_settings(handler, lambda: None, old_lr=LR, new_lr=LR * 3,
                               optimizer_steps=10, epochs_completed=2)
    assert handler.current_lr == pytest.approx(LR / 2 * 3)


def test_a_different_kind_of_schedule_is_refused():
    optimizer = make_optimizer()
    handler = build_scheduler("cosine", optimizer, steps_per_epoch=5, epochs=4)
    other = build_scheduler("step", make_optimizer(), steps_per_epoch=5, epochs=4)
    with pytest.raises(ValueError, match="same kind of schedule"):
        continue_with_new_settings(handler, lambda: other, old_lr=LR, new_lr=LR,
                                   optimizer_steps=10, epochs_completed=2)
    with pytest.raises(ValueError, match="new_lr must be a finite number > 0"):
        continue_with_new_settings(handler, lambda: other, old_lr=LR, new_lr=0,
                                   optimizer_steps=10, epochs_completed=2)


@pytest.mark.parametrize("name", ["cosine", "onecycle"])
def test_a_new_lr_moves_the_groups_that_had_it_and_keeps_a_group_with_its_own_peak(name):
    def two_peaks() -> torch.optim.Optimizer:  # an SGD group at LR and a Muon-like one
        return torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(1))]},
                                {"params": [nn.Parameter(torch.zeros(1))], "lr": 0.03}],
                               lr=LR, momentum=0.9)

    optimizer = two_peaks()
    handler = build_scheduler(name, optimizer, steps_per_epoch=5, epochs=4)
    _drive(optimizer, handler, range(2))
    continue_with_new_settings(handler, lambda: build_scheduler(
        name, optimizer, steps_per_epoch=5, epochs=4), old_lr=LR, new_lr=LR / 2,
        optimizer_steps=10, epochs_completed=2)

    fresh_optimizer = two_peaks()
    fresh_optimizer.param_groups[0]["lr"] = LR / 2
    fresh = build_scheduler(name, fresh_optimizer, steps_per_epoch=5, epochs=4)
    _drive(fresh_optimizer, fresh, range(2))
    assert ([group["lr"] for group in optimizer.param_groups]
            == pytest.approx([group["lr"] for group in fresh_optimizer.param_groups], rel=1e-12))
    assert optimizer.param_groups[1]["lr"] != optimizer.param_groups[0]["lr"]


def _two_peaks() -> torch.optim.Optimizer:
    """An SGD group at LR and a Muon-like group with a peak of its own."""
    return torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(1))]},
                            {"params": [nn.Parameter(torch.zeros(1))], "lr": 0.03}],
                           lr=LR, momentum=0.9)


def _group_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{key: value for key, value in group.items() if key != "params"}
            for group in optimizer.param_groups]


@pytest.mark.parametrize("name", [name for name in SCHEDULER_NAMES if name != "none"])
def test_a_new_length_gives_every_group_exactly_what_a_fresh_run_would_have(name):
    """Only --epochs changes: every setting of every param group (lr, initial_lr, a
    onecycle's max_lr and min_lr) must be bit-identical to a fresh run's at that step."""
    metric = {"metric": "loss"} if name == "plateau" else {}

    def build(optimizer, epochs):
        return build_scheduler(name, optimizer, steps_per_epoch=5, epochs=epochs, **metric)

    optimizer = _two_peaks()
    handler = build(optimizer, 4)
    _drive(optimizer, handler, range(2))
    continue_with_new_settings(handler, lambda: build(optimizer, 9), old_lr=LR, new_lr=LR,
                               optimizer_steps=10, epochs_completed=2)

    fresh_optimizer = _two_peaks()
    _drive(fresh_optimizer, build(fresh_optimizer, 9), range(2))
    assert _group_settings(optimizer) == _group_settings(fresh_optimizer)


def test_without_a_schedule_a_new_lr_moves_only_the_groups_that_had_it():
    optimizer = _two_peaks()
    set_new_peak_lr(optimizer, old_lr=LR, new_lr=LR)  # only --epochs changed
    assert [group["lr"] for group in optimizer.param_groups] == [LR, 0.03]
    set_new_peak_lr(optimizer, old_lr=LR, new_lr=LR / 2)
    assert [group["lr"] for group in optimizer.param_groups] == [LR / 2, 0.03]
