"""The process function against a hand-written loop, and its clock, output and host syncs."""

import collections
import types
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ignite.engine import Events
from torch import nn
from torch.nn.utils import clip_grad_norm_, get_total_norm

from engine.batch import move_to_device
from engine.events import TrainEvents
from engine.muon import Muon
from engine.step import window_position
from engine.trainer import create_trainer

AUTOCAST_DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
def muon(model: nn.Sequential) -> Muon:
    """Muon for the hidden Linear's weight, SGD-Nesterov for the biases and the head."""
    return Muon([{"params": [model[0].weight], "use_muon": True, "lr": 0.05, "momentum": 0.6},
                 {"params": [model[0].bias, model[2].weight, model[2].bias]}],
                lr=0.1, momentum=0.85, nesterov=True)


OPTIMIZERS = {
    "sgd_momentum": lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
    "adamw": lambda model: torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
    "muon": muon,
}
CLIP_NORM = 0.5  # below most pre-clip norms of the tiny MLP (0.45-0.8), so clipping bites
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def record(trainer, event, attribute: str = "iteration") -> list[int]:
    """The values of ``trainer.state.<attribute>`` each time ``event`` fires."""
    seen: list[int] = []
    trainer.add_event_handler(event, lambda engine: seen.append(getattr(engine.state, attribute)))
    return seen


def assert_same_weights(actual: nn.Module, expected: nn.Module) -> None:
    expected_weights = expected.state_dict()
    for name, got in actual.state_dict().items():
        assert torch.equal(got, expected_weights[name]), f"{name} differs"


def reference_loop(model, optimizer, data, precision, accum_steps, max_grad_norm, epochs,
                   device="cpu"):
    """The canonical order, written out by hand; returns the pre-clip norm of every window."""
    dtype = AUTOCAST_DTYPES[precision]
    scaler = torch.amp.GradScaler(device, enabled=precision == "fp16")
    norms = []
    for _ in range(epochs):
        for start in range(0, len(data), accum_steps):
            window = data[start : start + accum_steps]  # an epoch's last window may be shorter
            for x, y in window:
                model.train()
                with torch.autocast(device, dtype=dtype) if dtype else nullcontext():
                    loss = F.cross_entropy(model(x), y)
                scaler.scale(loss / len(window)).backward()
            scaler.unscale_(optimizer)
            if max_grad_norm is None:
                norms.append(get_total_norm([p.grad for p in model.parameters()]))
            else:
                norms.append(clip_grad_norm_(model.parameters(), max_grad_norm))
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    return norms


@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
@pytest.mark.parametrize("max_grad_norm", [None, CLIP_NORM], ids=["no_clip", "clip"])
@pytest.mark.parametrize("accum_steps", [1, 3])
@pytest.mark.parametrize("precision", AUTOCAST_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_trainer_matches_the_hand_written_loop_bit_for_bit(
    device, precision, accum_steps, max_grad_norm, optimizer_name, gate, make_mlp, make_batches
):
    # 10 micro-batches: with accum_steps=3 the windows are 3, 3, 3, 1
    data = [(x.to(device), y.to(device)) for x, y in make_batches(10)]
    make_optimizer = OPTIMIZERS[optimizer_name]
    model, reference = make_mlp().to(device), make_mlp().to(device)
    trainer = create_trainer(
        model,
        make_optimizer(model),
        F.cross_entropy,
        device=device,
        precision=precision,
        accum_steps=accum_steps,
        max_grad_norm=max_grad_norm,
    )
    engine_norms = []
    trainer.add_event_handler(
        TrainEvents.OPTIMIZER_STEP, lambda e: engine_norms.append(e.state.output["grad_norm"])
    )
    trainer.run(data, max_epochs=2)

    reference_norms = reference_loop(
        reference,
        make_optimizer(reference),
        data,
        precision,
        accum_steps,
        max_grad_norm,
        epochs=2,
        device=device,
    )
    # Same ops in the same order, on the CPU or one GPU: bit-identical in fp16 and bf16 too,
    # so no tolerance is needed anywhere.
    assert_same_weights(model, reference)
    assert len(engine_norms) == len(reference_norms) == 2 * len(range(0, 10, accum_steps))
    assert all(torch.equal(a, b) for a, b in zip(engine_norms, reference_norms, strict=True))
    assert not torch.equal(model[0].weight, make_mlp().to(device)[0].weight)  # it did train
    if max_grad_norm is not None:
        assert any(norm > max_grad_norm for norm in reference_norms)  # clipping did bite


class WithSpareParameter(nn.Module):
    """An MLP and a parameter its forward never uses: it has no gradient in any window."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp, self.spare = mlp, nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def test_a_parameter_without_a_gradient_is_left_out_of_the_norm_and_the_step(
    gate, make_mlp, make_batches
):
    data = make_batches(6)
    model, reference = WithSpareParameter(make_mlp()), WithSpareParameter(make_mlp())
    optimizer = sgd(model)
    trainer = create_trainer(model, optimizer, F.cross_entropy, max_grad_norm=CLIP_NORM)
    norms = record(trainer, TrainEvents.OPTIMIZER_STEP, "output")
    trainer.run(data, max_epochs=1)

    reference_norms = reference_loop(reference, sgd(reference), data, "fp32", 1, CLIP_NORM, 1)
    assert_same_weights(model, reference)
    assert [output["grad_norm"] for output in norms] == reference_norms
    assert model.spare.grad is None and model.spare not in optimizer.state
    assert trainer.state.optimizer_step == 6


def test_accumulated_micro_batches_match_one_large_batch(make_mlp, make_batches):
    micro = make_batches(10, batch_size=2)  # accum_steps=4: windows of 4, 4 and 2 micro-batches
    model, reference = make_mlp(), make_mlp()
    create_trainer(model, sgd(model), F.cross_entropy, accum_steps=4).run(micro, max_epochs=2)

    optimizer = sgd(reference)
    large = [
        (torch.cat([x for x, _ in micro[s : s + 4]]), torch.cat([y for _, y in micro[s : s + 4]]))
        for s in (0, 4, 8)
    ]  # batches of 8, 8 and 4 samples
    for _ in range(2):
        for x, y in large:
            F.cross_entropy(reference(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_optimizer_step_clock_closes_every_epochs_last_window(make_mlp, make_batches):
    model = make_mlp()
    trainer = create_trainer(model, sgd(model), F.cross_entropy, accum_steps=4)
    step_iterations = record(trainer, TrainEvents.OPTIMIZER_STEP)
    every_second = record(trainer, TrainEvents.OPTIMIZER_STEP(every=2), "optimizer_step")
    skipped = record(trainer, TrainEvents.STEP_SKIPPED)
    trainer.run(make_batches(10), max_epochs=2)

    assert step_iterations == [4, 8, 10, 14, 18, 20]  # windows 4, 4, 2 in each epoch
    assert trainer.state.optimizer_step == 6
    assert every_second == [2, 4, 6]  # event filters count optimizer steps, not iterations
    assert skipped == [] and trainer.state.skipped_steps == 0


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_inf_gradient_skips_its_step_and_fires_step_skipped(
    device, gate, make_mlp, make_batches
):
    model = make_mlp().to(device)
    trainer = create_trainer(model, sgd(model), F.cross_entropy, device=device,
                             precision="fp16", accum_steps=4)
    model[0].weight.register_hook(
        lambda grad: grad * float("inf") if trainer.state.iteration == 6 else grad
    )
    step_iterations = record(trainer, TrainEvents.OPTIMIZER_STEP)
    skipped_iterations = record(trainer, TrainEvents.STEP_SKIPPED)
    trainer.run(make_batches(10), max_epochs=2)

    assert step_iterations == [4, 10, 14, 18, 20]  # the window of iterations 5-8 is skipped
    assert skipped_iterations == [8]
    assert trainer.state.optimizer_step == 5
    assert trainer.state.skipped_steps == 1
    assert trainer.scaler.get_scale() == 2.0**16 / 2  # backed off once from its initial 2**16


@pytest.mark.parametrize("precision", AUTOCAST_DTYPES)
def test_output_is_detached_scalars_with_window_keys_at_window_end(
    precision, make_mlp, make_batches
):
    model = make_mlp()
    trainer = create_trainer(
        model, sgd(model), F.cross_entropy, precision=precision, accum_steps=2, max_grad_norm=1e-3
    )
    outputs = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: outputs.append(e.state.output))
    trainer.run(make_batches(4), max_epochs=1)

    window_keys = {"loss", "grad_norm", "scale"} if precision == "fp16" else {"loss", "grad_norm"}
    assert [set(output) for output in outputs] == [{"loss"}, window_keys] * 2
    for value in (value for output in outputs for value in output.values()):
        assert isinstance(value, torch.Tensor) and value.dim() == 0
        assert not value.requires_grad
    assert all(window_end["grad_norm"] > 1e-3 for window_end in outputs[1::2])  # pre-clip


def test_output_loss_is_the_micro_batch_loss_not_divided_by_the_window(make_mlp, make_batches):
    data = make_batches(2)
    model = make_mlp()
    expected = F.cross_entropy(make_mlp()(data[0][0]), data[0][1]).detach()
    trainer = create_trainer(model, sgd(model), F.cross_entropy, accum_steps=2)
    losses = []
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: losses.append(e.state.output["loss"])
    )
    trainer.run(data, max_epochs=1)
    assert torch.equal(losses[0], expected)


@pytest.mark.parametrize("precision", AUTOCAST_DTYPES)
def test_no_host_sync_in_the_step(precision, gate, monkeypatch, make_mlp, make_batches):
    model = make_mlp()
    # SGD, not Adam: Adam reads its step counter with .item(), which is the optimizer's wait.
    trainer = create_trainer(
        model, sgd(model), F.cross_entropy, precision=precision, accum_steps=3, max_grad_norm=1.0
    )
    sync_iterations = []

    def counted(original):
        def method(self, *args, **kwargs):
            sync_iterations.append(trainer.state.iteration)
            return original(self, *args, **kwargs)

        return method

    with monkeypatch.context() as patch:  # counts only calls made during the run
        for name in ("item", "__bool__", "tolist", "cpu", "numpy", "__float__", "__int__"):
            patch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
        trainer.run(make_batches(12), max_epochs=1)
    assert sync_iterations == []  # the first steps too: they create the momentum buffers
    assert trainer.state.optimizer_step == 4


def test_forward_hook_trains_dict_batches_through_the_same_step(make_mlp, make_batches):
    data = make_batches(5)
    tuple_model, dict_model = make_mlp(), make_mlp()
    create_trainer(tuple_model, sgd(tuple_model), F.cross_entropy, accum_steps=2).run(data)

    def dict_forward(model: nn.Module, batch: dict) -> torch.Tensor:
        return F.cross_entropy(model(batch["x"]), batch["y"])

    trainer = create_trainer(dict_model, sgd(dict_model), forward=dict_forward, accum_steps=2)
    trainer.run([{"x": x, "y": y} for x, y in data])
    assert_same_weights(dict_model, tuple_model)
    assert trainer.state.optimizer_step == 3


def test_every_micro_batch_trains_in_train_mode(make_mlp, make_batches):
    modes = []

    def forward(model: nn.Module, batch) -> torch.Tensor:
        modes.append(model.training)
        return F.cross_entropy(model(batch[0]), batch[1])

    model = make_mlp()
    trainer = create_trainer(model, sgd(model), forward=forward, accum_steps=2)
    # As a mid-epoch evaluation would: the next micro-batch must switch back.
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: e.model.eval())
    model.eval()
    trainer.run(make_batches(4))
    assert modes == [True] * 4


def test_custom_prepare_batch_is_called_once_per_micro_batch(make_mlp, make_batches):
    calls = []

    def prepare_batch(batch, device, non_blocking):
        calls.append((device, non_blocking))
        return move_to_device(batch, device, non_blocking)

    model = make_mlp()
    trainer = create_trainer(model, sgd(model), F.cross_entropy, prepare_batch=prepare_batch)
    trainer.run(make_batches(3))
    assert calls == [(torch.device("cpu"), True)] * 3


def test_default_prepare_batch_moves_nested_dicts_tuples_and_lists():
    tensor = torch.ones(2)
    batch = {"image": tensor, "pair": (tensor, [tensor, "label"]), "count": 3}
    moved = move_to_device(batch, torch.device("meta"))
    assert moved["image"].is_meta
    assert isinstance(moved["pair"], tuple) and moved["pair"][0].is_meta
    assert isinstance(moved["pair"][1], list) and moved["pair"][1][0].is_meta
    assert moved["pair"][1][1] == "label" and moved["count"] == 3


def test_default_prepare_batch_passes_a_batch_already_on_the_device_as_it_is():
    meta = torch.device("meta")
    on_meta = torch.zeros(2, device=meta)
    batch = (on_meta, torch.ones(2, device=meta))
    assert move_to_device(batch, meta) is batch
    mixed = [on_meta, torch.ones(2)]
    moved = move_to_device(mixed, meta)
    assert moved is not mixed and isinstance(moved, list)
    assert moved[0] is on_meta and moved[1].is_meta


def test_default_prepare_batch_keeps_named_tuples():
    Sample = collections.namedtuple("Sample", ["x", "y"])
    moved = move_to_device(Sample(torch.ones(2), torch.zeros(2)), torch.device("meta"))
    assert isinstance(moved, Sample) and moved.x.is_meta and moved.y.is_meta


class Pair(tuple):
    """A tuple subclass without ``_fields``: built from one iterable, as tuple is."""


@pytest.mark.parametrize("sequence_type", [Pair, collections.UserList])
def test_default_prepare_batch_keeps_other_sequence_types(sequence_type):
    batch = sequence_type([torch.ones(2), [torch.zeros(3)], "label"])
    moved = move_to_device(batch, torch.device("meta"))
    assert type(moved) is sequence_type and len(moved) == 3
    assert moved[0].is_meta and moved[0].shape == (2,)
    assert isinstance(moved[1], list) and moved[1][0].is_meta and moved[1][0].shape == (3,)
    assert moved[2] == "label"


def test_a_steps_event_follows_at_the_next_micro_batch_or_on_settle(make_mlp, make_batches):
    model = make_mlp()
    trainer = create_trainer(model, sgd(model), F.cross_entropy, accum_steps=2)
    seen = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED,
                              lambda e: seen.append(("completed", e.state.optimizer_step)))
    trainer.add_event_handler(Events.GET_BATCH_STARTED,
                              lambda e: seen.append(("next batch", e.state.optimizer_step)))
    trainer.add_event_handler(TrainEvents.OPTIMIZER_STEP,
                              lambda e: seen.append(("step", e.state.iteration)))
    trainer.run(make_batches(4))
    # The step of iterations 1-2 is settled when iteration 3 starts, before any other
    # handler of that event; the last one at EPOCH_COMPLETED.
    assert seen == [("next batch", 0), ("completed", 0), ("next batch", 0), ("completed", 0),
                    ("step", 2), ("next batch", 1), ("completed", 1),
                    ("next batch", 1), ("completed", 1), ("step", 4)]

    settled = []
    trainer = create_trainer(model, sgd(model), F.cross_entropy)

    @trainer.on(Events.ITERATION_COMPLETED)
    def save(engine) -> None:  # as a checkpoint taken at the step's own micro-batch would
        engine.settle()
        settled.append(engine.state.optimizer_step)

    trainer.run(make_batches(3))
    assert settled == [1, 2, 3] and trainer.state.optimizer_step == 3


def test_train_mode_is_set_only_when_something_left_it(make_mlp, make_batches, monkeypatch):
    model = make_mlp()
    trainer = create_trainer(model, sgd(model), F.cross_entropy)
    calls = []
    original = nn.Module.train
    monkeypatch.setattr(nn.Sequential, "train",
                        lambda self, mode=True: calls.append(mode) or original(self, mode))
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=2), lambda e: e.model.eval())
    trainer.run(make_batches(4))
    assert calls == [False, True]  # the eval() above, then one train() at iteration 3


@pytest.mark.parametrize(("accum_steps", "expected"), [
    (1, [(1, True)] * 7),
    (3, [(3, False), (3, False), (3, True), (3, False), (3, False), (3, True), (1, True)]),
])
def test_window_position_gives_each_micro_batchs_window_length_and_whether_it_closes_it(
        accum_steps, expected):
    """Windows restart with every epoch (7 micro-batches here); the last one may be shorter."""
    for epoch in (1, 2):
        positions = [window_position(types.SimpleNamespace(iteration=(epoch - 1) * 7 + i,
                                                           epoch_length=7), accum_steps)
                     for i in range(1, 8)]
        assert positions == expected


def test_a_parameter_used_only_in_the_first_window_is_not_stepped_after_it(
    gate, make_mlp, make_batches
):
    """The step releases the gradients (None, not zeros), so a parameter without a gradient
    in a later window stays out of its step: momentum does not move it on."""

    def forward(model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        return loss + model.spare.sum() if trainer.state.iteration == 1 else loss

    model = WithSpareParameter(make_mlp())
    trainer = create_trainer(model, sgd(model), forward=forward)
    spares = []
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED, lambda _: spares.append(model.spare.detach().clone())
    )
    trainer.run(make_batches(3), max_epochs=1)

    assert not torch.equal(spares[0], torch.ones(3))  # the first window stepped it
    assert all(torch.equal(spare, spares[0]) for spare in spares[1:])
    assert all(p.grad is None for p in model.parameters())


def test_ddp_reduces_the_gradients_once_per_window(gate, make_mlp, make_batches):
    """In a one-process gloo world: the window's earlier backwards run under ``no_sync``."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.parallel.DistributedDataParallel(make_mlp())
        reductions = []

        def allreduce_counted(state, bucket):
            reductions.append(bucket.index())
            future = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future

        model.register_comm_hook(None, allreduce_counted)
        trainer = create_trainer(model, sgd(model), F.cross_entropy, accum_steps=2)
        trainer.run(make_batches(4), max_epochs=1)
    finally:
        dist.destroy_process_group()
    assert reductions == [0, 0]  # one bucket, two windows
