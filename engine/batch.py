"""Default batch hooks: how a batch reaches the device and becomes a loss.

Override them to train anything that is not ``(x, y)`` through the same step:
``prepare_batch(batch, device, non_blocking) -> batch`` and
``forward(model, batch) -> loss`` for training,
``predict(model, batch) -> (y_pred, y)`` for evaluation.
"""

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

PrepareBatch = Callable[[Any, torch.device, bool], Any]
Forward = Callable[[nn.Module, Any], torch.Tensor]
Predict = Callable[[nn.Module, Any], tuple[torch.Tensor, torch.Tensor]]


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """Move every tensor in a (nested) tuple, list or dict to ``device``; one already there
    is passed on as it is (comparing devices costs a fifth of a no-op ``to``), and so is a
    tuple or list of such tensors."""
    if type(batch) in (tuple, list):  # the usual (x, y) first, before the ABC checks below
        for value in batch:
            if type(value) is not torch.Tensor or value.device != device:
                return type(batch)([move_to_device(value, device, non_blocking)
                                    for value in batch])
        return batch  # tensors already on the device: the same container, not a copy
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {key: move_to_device(value, device, non_blocking) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple: positional fields
        return type(batch)(*(move_to_device(value, device, non_blocking) for value in batch))
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return type(batch)(move_to_device(value, device, non_blocking) for value in batch)
    return batch


def supervised_forward(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Forward:
    """The forward hook for ``(x, y)`` batches: ``loss_fn(model(x), y)``."""

    def forward(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return loss_fn(model(x), y)

    return forward


def supervised_predict(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The evaluation hook for ``(x, y)`` batches; predictions in fp32 for the metrics."""
    x, y = batch
    return model(x).float(), y
