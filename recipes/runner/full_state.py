"""An FSDP run's model and optimizer in the single-file checkpoint format: gathered whole.

Under ``--strategy fsdp`` each rank holds a slice of every parameter and of its optimizer
state. A checkpoint file holds them whole, exactly as a DDP run's does: the model's
``state_dict`` keys and the optimizer's ``state_dict`` (state by parameter index), so a
checkpoint of either strategy resumes under the other, on any number of processes, and
``export``, ``evaluate`` and ``--init-from`` read it as they read any other.

Gathering is a collective: every rank enters ``FullState.gathered()`` around each save
(``torch.distributed.checkpoint.state_dict.get_state_dict`` with ``full_state_dict`` and
``cpu_offload``: the whole tensors reach rank 0's host memory, the other ranks get none),
and rank 0's checkpointer reads them through the ``model`` and ``optimizer`` entries.
Outside a save the entries hand out the sharded state dicts (the spike guard's in-memory
snapshots, taken on every rank).

Loading is not a collective: rank 0 resumes before the others know which file it chose,
and every rank reads the whole file, so each cuts its own slice out of each whole tensor
(``set_state_dict`` would scatter from rank 0 instead, and wait for the others there). A
sharded state dict (a snapshot) loads as it is.
"""

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from engine.sharding import slice_like

GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)


class FullState:
    """The ``model`` and ``optimizer`` entries of an FSDP run's checkpoints."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self._gathered: tuple[dict, dict] | None = None
        self.entries = {"model": _ModelEntry(self), "optimizer": _OptimizerEntry(self)}

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every rank at once: the whole state on rank 0's host until the block ends."""
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer,
                                                      options=GATHER)
        # Only rank 0 receives them; the others' dicts are empty.
        self._gathered = model_state, _by_index(optimizer_state) if optimizer_state else {}
        try:
            yield
        finally:
            self._gathered = None


class _ModelEntry:
    def __init__(self, owner: FullState) -> None:
        self.owner = owner

    def state_dict(self) -> dict[str, Any]:
        gathered = self.owner._gathered
        return gathered[0] if gathered is not None else self.owner.model.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        live = self.owner.model.state_dict()
        self.owner.model.load_state_dict(
            {name: slice_like(value, live.get(name)) for name, value in state.items()})


class _OptimizerEntry:
    def __init__(self, owner: FullState) -> None:
        self.owner = owner

    def state_dict(self) -> dict[str, Any]:
        gathered = self.owner._gathered
        return gathered[1] if gathered is not None else self.owner.optimizer.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        params = [p for group in self.owner.optimizer.param_groups for p in group["params"]]
        per_parameter = {}
        for index, values in state["state"].items():
            param = params[index]
            # Moments (Adam's, momentum buffers) have the parameter's shape; counters not.
            per_parameter[index] = {
                key: slice_like(value, param) if getattr(value, "shape", None) == param.shape
                else value for key, value in values.items()}
        self.owner.optimizer.load_state_dict({**state, "state": per_parameter})


def _by_index(state: dict[str, Any]) -> dict[str, Any]:
    """``get_state_dict``'s optimizer state (keyed by parameter name) as
    ``Optimizer.state_dict()`` keys it: by the parameter's position in the param groups."""
    index: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        groups.append({**group, "params": [index.setdefault(name, len(index))
                                           for name in group["params"]]})
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": groups}
