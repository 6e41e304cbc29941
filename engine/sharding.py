"""What the step meets under FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters,
gradients and optimizer state that are ``DTensor`` shards, each rank holding a slice.

The step works on each rank's local slices (``local_shards``): the clip's multiply, the
masked gate's ``torch.where`` and its backups are elementwise, so on the slices they are the
same ops as on whole tensors. Only the norms need the other ranks: ``whole_norms`` turns
the local slices' norms into each tensor's norm with one all-reduce of their squares
(queued on the device's stream like any collective: the host does not wait). DTensor's
own ``torch._foreach_norm`` would reduce once per tensor instead.
"""

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

# DCP's own loader slices whole tensors with it (torch.distributed._state_dict_utils).
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def shard_group(tensors: Iterable[torch.Tensor]) -> dist.ProcessGroup | None:
    """The process group over which FSDP2 sharded ``tensors`` (all sharded alike), or None
    when they are whole tensors."""
    first = next(iter(tensors), None)
    return first.device_mesh.get_group() if isinstance(first, DTensor) else None


def local_shards(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's slice of each tensor (the tensor itself when it is whole); writing into a
    slice writes into the sharded tensor."""
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def whole_norms(shard_norms: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Each tensor's 2-norm from the norms of every rank's slice of it (``shard_norms``, this
    rank's): the square root of the sum of their squares over ``group``. Unchanged when
    ``group`` is None or holds one rank."""
    if group is None or dist.get_world_size(group) == 1:
        return shard_norms
    squares = shard_norms.square()
    dist.all_reduce(squares, group=group)
    return squares.sqrt_()


def slice_like(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``whole`` as this rank's slice of a tensor sharded like ``like`` (a DTensor of the
    same shape), cut locally: no communication, every rank holds ``whole``. ``whole``
    itself when ``like`` is not sharded or ``whole`` already is."""
    if not isinstance(like, DTensor) or isinstance(whole, DTensor):
        return whole
    shape, offset = compute_local_shape_and_global_offset(whole.shape, like.device_mesh,
                                                          like.placements)
    local = whole[tuple(slice(start, start + size)
                        for size, start in zip(shape, offset, strict=True))]
    return DTensor.from_local(local.to(like.device, like.dtype).clone(), like.device_mesh,
                              like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def on_whole(fn: Callable[..., torch.Tensor], tensor: torch.Tensor, *args: Any
             ) -> torch.Tensor:
    """``fn(tensor, *args)`` for a function that needs the whole tensor (Muon's
    orthogonalisation of a weight matrix): a sharded one is all-gathered, every rank applies
    ``fn`` to the same whole matrix and keeps its own slice of the result."""
    if not isinstance(tensor, DTensor):
        return fn(tensor, *args)
    return slice_like(fn(tensor.full_tensor(), *args), tensor)


def window_no_sync(model: nn.Module) -> Callable[[], AbstractContextManager]:
    """The context that keeps a window's earlier micro-batches from reducing gradients across
    processes: DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)`` (its
    equivalent: gradients accumulate unsharded and are reduce-scattered in the window's last
    backward), or nothing in one whole-model process."""
    if isinstance(model, FSDPModule):
        return lambda: _fsdp_no_sync(model)
    return getattr(model, "no_sync", nullcontext)


@contextmanager
def _fsdp_no_sync(model: FSDPModule):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
