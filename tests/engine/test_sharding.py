"""The step's gate on FSDP2's sharded gradients, on two gloo processes on the CPU: the norm
it clips by is the whole model's (each rank holds half of every gradient), the clip and the
update match those of the unsharded model, a non-finite gradient on one rank's slice skips
the step on both, and accumulation with ``window_no_sync`` reduces once per window."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

from engine.sharding import local_shards, shard_group, whole_norms, window_no_sync
from engine.update_gate import HostGate, MaskedGate
from recipes.runner.training.launch import exit_process


def _models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    sharded = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    sharded.load_state_dict(whole.state_dict())
    for block in (sharded[0], sharded[2]):
        fully_shard(block)
    fully_shard(sharded)
    return whole, sharded


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor() for name, p in model.named_parameters()}


def _check_gates(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for gate_class in (HostGate, MaskedGate):
            _check_gate(rank, gate_class)
    finally:
        dist.destroy_process_group()
    exit_process(0)  # passed: skip the interpreter's teardown (see its docstring)


def _check_gate(rank: int, gate_class: type) -> None:
    whole, sharded = _models()
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(1))
    # Accumulation: two micro-batches, the first without reducing. Every rank sees the
    # same data, so the reduced (averaged) gradient is the whole model's.
    no_sync = window_no_sync(sharded)
    with no_sync():
        (_loss(sharded, x[:4]) / 2).backward()
    (_loss(sharded, x[4:]) / 2).backward()
    for part in x.chunk(2):
        (_loss(whole, part) / 2).backward()
    params = list(sharded.parameters())
    assert shard_group(params) is not None and shard_group(whole.parameters()) is None

    whole_grads = [p.grad for p in whole.parameters()]
    expected = torch.nn.utils.get_total_norm(whole_grads)
    optimizer = torch.optim.SGD(params, lr=1.0)
    gate = (HostGate(optimizer) if gate_class is HostGate
            else MaskedGate(optimizer, torch.device("cpu")))
    per_gradient, norm = gate.update([p.grad for p in params], params, 0.1)
    assert gate.finite()
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(per_gradient,
                               torch.stack([g.norm() for g in whole_grads]), rtol=1e-6, atol=0)
    torch.nn.utils.clip_grad_norm_(whole.parameters(), 0.1)
    torch.optim.SGD(whole.parameters(), lr=1.0).step()
    for name, value in _full(sharded).items():
        torch.testing.assert_close(value, dict(whole.named_parameters())[name],
                                   rtol=0, atol=1e-7)

    # A NaN in rank 1's slice only: both ranks skip, the weights stay as they were.
    before = _full(sharded)
    for p in params:
        p.grad = torch.zeros_like(p)
    if rank == 1:
        local_shards([params[0].grad])[0].view(-1)[0] = float("nan")
    _, norm = gate.update([p.grad for p in params], params, 0.1)
    assert not gate.finite() and not torch.isfinite(norm)
    for name, value in _full(sharded).items():
        assert torch.equal(value, before[name]), name
    assert torch.equal(whole_norms(torch.tensor([3.0]), None), torch.tensor([3.0]))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_both_gates_clip_sharded_gradients_by_the_whole_models_norm():
    mp.spawn(_check_gates, args=(_free_port(),), nprocs=2)
