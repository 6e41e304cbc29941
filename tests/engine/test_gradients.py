"""The host's clip coefficient is the device's, bit for bit, below, at and above the clip."""

import pytest
import torch

from engine.gradients import clip_on_device, host_clip_coefficient


@pytest.mark.parametrize("norm", [0.0, 0.5, 0.999, 1.0, 1.5, 1e6])
def test_the_host_clip_coefficient_is_the_one_clip_on_device_multiplies_by(norm):
    grad = torch.ones(3)
    clip_on_device([grad], torch.tensor(norm), max_grad_norm=1.0)
    assert host_clip_coefficient(norm, 1.0) == grad[0].item()
