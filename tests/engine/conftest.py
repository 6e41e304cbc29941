"""Both update gates on the CPU: its default (the host's) and the masked one that CUDA uses."""

import pytest
import torch

import engine.trainer
from engine.update_gate import MaskedGate


def masked_gate(optimizer: torch.optim.Optimizer, device: torch.device) -> MaskedGate:
    return MaskedGate(optimizer, device)


@pytest.fixture(params=["default_gate", "masked_gate"])
def gate(request, monkeypatch) -> str:
    """Builds every trainer of the test with the device's default gate, then the masked one."""
    if request.param == "masked_gate":
        monkeypatch.setattr(engine.trainer, "make_gate", masked_gate)
    return request.param
