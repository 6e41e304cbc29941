"""``engine.sharding`` run in the test process itself, so that every helper is checked where
its result can be compared with plain tensor math (test_sharding.py runs the whole step on two
gloo processes, which mutation testing cannot attribute to these helpers).

Two in-process groups: torch's fake process group as rank 1 of three, which gives that rank's
real shard layout (rows 2 and 3 of a five-row weight) but whose collectives compute nothing,
and a one-process gloo group, whose collectives are real (and trivial)."""

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from engine.sharding import (
    local_shards,
    on_whole,
    shard_group,
    slice_like,
    whole_norms,
    window_no_sync,
)

RANK1_ROWS = slice(2, 4)  # rank 1's rows of 5 sharded over 3 ranks (2, 2 and 1 rows)


@pytest.fixture
def rank1_of_3() -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=3)
    yield
    dist.destroy_process_group()


@pytest.fixture
def one_process() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _sharded_linear() -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(3, 5)
    fully_shard(layer)
    return layer


def test_shard_group_is_the_group_fsdp_sharded_over(rank1_of_3):
    layer = _sharded_linear()
    group = shard_group(layer.parameters())
    assert group is layer.weight.device_mesh.get_group() and dist.get_world_size(group) == 3
    assert shard_group([torch.ones(2)]) is None
    assert shard_group([]) is None


def test_local_shards_are_this_ranks_rows_and_write_into_the_sharded_tensor(rank1_of_3):
    layer = _sharded_linear()
    plain = torch.ones(2)
    local, same = local_shards([layer.weight, plain])
    assert same is plain
    assert type(local) is torch.Tensor and local.shape == (2, 3)
    with torch.no_grad():
        local.fill_(7.0)
    assert torch.equal(layer.weight.to_local(), torch.full((2, 3), 7.0))


def test_whole_norms_are_the_shard_norms_without_a_group_or_on_one_rank(rank1_of_3):
    norms = torch.tensor([3.0, 4.0])
    assert whole_norms(norms, None) is norms
    # A one-rank group inside a three-rank world: nothing to reduce.
    assert whole_norms(norms, dist.new_group([1])) is norms


def test_whole_norms_sum_the_squares_over_the_group(rank1_of_3, monkeypatch):
    # The fake group's collectives compute nothing: this all_reduce stands in for rank 0,
    # the pair's other member, adding its squared norms.
    pair = dist.new_group([0, 1])
    rank0_norms = torch.tensor([4.0, 0.0, 2.0])
    reduced_over = []

    def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
        reduced_over.append(group)
        tensor += rank0_norms.square()

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    norms = whole_norms(torch.tensor([3.0, 2.0, 0.0]), pair)
    assert len(reduced_over) == 1 and reduced_over[0] is pair
    torch.testing.assert_close(norms, torch.tensor([5.0, 2.0, 2.0]), rtol=0, atol=0)


def test_slice_like_cuts_this_ranks_rows_locally(rank1_of_3):
    layer = _sharded_linear()
    for like in (layer.weight, layer.bias):
        whole = torch.arange(like.numel(), dtype=torch.float64).reshape(like.shape)
        with CommDebugMode() as comms:
            part = slice_like(whole, like)
        assert comms.get_total_counts() == 0
        assert isinstance(part, DTensor) and part.device_mesh is like.device_mesh
        assert part.placements == like.placements
        assert part.shape == like.shape and part.stride() == like.stride()
        assert part.dtype == torch.float32
        assert torch.equal(part.to_local(), whole[RANK1_ROWS].float())


def test_slice_like_leaves_whole_tensors_alone_and_sharded_ones_as_they_are(rank1_of_3):
    weight = _sharded_linear().weight
    whole = torch.ones(5, 3)
    assert slice_like(whole, torch.zeros(5, 3)) is whole
    assert slice_like(weight, weight) is weight


def _scaled_unit(matrix: torch.Tensor, scale: float) -> torch.Tensor:
    """Needs the whole matrix: its norm."""
    return scale * matrix / matrix.norm()


@torch.no_grad()
def test_on_whole_applies_fn_to_the_whole_tensor_and_keeps_it_sharded(one_process):
    weight = _sharded_linear().weight
    result = on_whole(_scaled_unit, weight, 2.0)
    assert isinstance(result, DTensor) and result.placements == weight.placements
    torch.testing.assert_close(result.full_tensor(), _scaled_unit(weight.full_tensor(), 2.0))
    plain = torch.randn(5, 3)
    torch.testing.assert_close(on_whole(_scaled_unit, plain, 2.0), _scaled_unit(plain, 2.0))


def test_window_no_sync_holds_fsdp_gradients_until_the_windows_last_backward(one_process):
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    sharded = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    sharded.load_state_dict(whole.state_dict())
    fully_shard(sharded)
    x = torch.randn(4, 3)
    no_sync = window_no_sync(sharded)
    with no_sync():
        sharded(x[:2]).square().sum().backward()
    assert all(p.grad is None for p in sharded.parameters())
    sharded(x[2:]).square().sum().backward()
    for part in x.chunk(2):
        whole(part).square().sum().backward()
    for p, expected in zip(sharded.parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), expected.grad)


def test_window_no_sync_is_ddps_no_sync_or_nothing(one_process):
    ddp = DistributedDataParallel(nn.Linear(3, 2))
    with window_no_sync(ddp)():
        assert not ddp.require_backward_grad_sync
    assert ddp.require_backward_grad_sync
    with window_no_sync(nn.Linear(3, 2))():
        pass
