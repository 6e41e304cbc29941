"""Which gate a device gets, the gates on FSDP2-sharded gradients in one process, and the
masked gate putting back a skipped step of an optimizer that keeps no state."""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from engine.update_gate import HostGate, MaskedGate, make_gate


@pytest.mark.parametrize(
    ("device", "gate_class"),
    [("cpu", HostGate), ("mps", MaskedGate), ("xpu", MaskedGate), ("meta", MaskedGate)],
)
def test_the_host_gets_the_host_gate_and_any_accelerator_the_masked_one(device, gate_class):
    optimizer = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    gate = make_gate(optimizer, torch.device(device))
    assert type(gate) is gate_class
    assert gate.optimizer is optimizer


def test_a_skipped_step_of_an_optimizer_without_state_leaves_no_state():
    """Plain SGD creates no state, so the masked gate has nothing to restore or remove."""
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    gate = MaskedGate(optimizer, torch.device("cpu"))
    gate.update([p.grad for p in model.parameters()], list(model.parameters()), None)
    assert gate.finite() is False
    assert not optimizer.state
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


@pytest.fixture
def sharded_linear():
    """An FSDP2-sharded layer with gradients, in a one-process gloo world."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        fully_shard(model)
        model(torch.randn(4, 3)).square().mean().backward()
        yield model
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("gate_class", [HostGate, MaskedGate])
def test_a_sharded_gradients_norm_is_summed_over_every_ranks_slice(
    sharded_linear, gate_class, monkeypatch
):
    """As if a second rank held a slice whose norms equal this rank's: each gradient's norm
    is sqrt(2) times this rank's slice's."""
    params = list(sharded_linear.parameters())
    local_norms = torch.stack([p.grad.to_local().norm() for p in params])
    optimizer = torch.optim.SGD(params, lr=0.1)
    gate = (HostGate(optimizer) if gate_class is HostGate
            else MaskedGate(optimizer, torch.device("cpu")))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, group=None: tensor.mul_(2))
    per_gradient, norm = gate.update([p.grad for p in params], params, None)
    assert gate.finite()
    torch.testing.assert_close(per_gradient, local_norms * 2**0.5)
    torch.testing.assert_close(norm, local_norms.norm() * 2**0.5)


@pytest.mark.parametrize("gate_class", [HostGate, MaskedGate])
def test_a_scheduler_made_after_the_gate_counts_its_steps(gate_class):
    """An LR scheduler wraps ``optimizer.step`` as it is made, usually after the trainer
    (and its gate): the gate must call that wrapper, or torch warns at every run that the
    scheduler stepped before the optimizer."""
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    gate = (HostGate(optimizer) if gate_class is HostGate
            else MaskedGate(optimizer, torch.device("cpu")))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    weight.grad = torch.ones(3)
    gate.update([weight.grad], [weight], None)
    assert getattr(optimizer, "_opt_called", False)  # what the scheduler's wrapper records
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheduler.step()
