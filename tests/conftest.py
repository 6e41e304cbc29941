"""Shared fixtures: a tiny model and a few batches, small enough for bf16 on a 2-core CPU."""

import os
from collections.abc import Callable

import pytest
import torch
from torch import nn

IN_FEATURES, HIDDEN, CLASSES = 8, 16, 4

Batches = list[tuple[torch.Tensor, torch.Tensor]]

# The test models are tiny and the machine's 2 cores are shared: a second intra-op thread only
# spin-waits, which made the engine tests 2-7x slower under load.
torch.set_num_threads(1)


def tiny_mlp(seed: int = 0) -> nn.Sequential:
    """Linear(8, 16) - ReLU - Linear(16, 4), the same weights for the same seed; no BatchNorm."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def random_batches(n_batches: int = 10, batch_size: int = 8, seed: int = 1) -> Batches:
    """``n_batches`` classification batches ``(x[batch_size, 8], y[batch_size])``, 4 classes."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch_size, IN_FEATURES, generator=generator),
            torch.randint(0, CLASSES, (batch_size,), generator=generator),
        )
        for _ in range(n_batches)
    ]


@pytest.fixture
def make_mlp() -> Callable[..., nn.Sequential]:
    return tiny_mlp


@pytest.fixture
def make_batches() -> Callable[..., Batches]:
    return random_batches


@pytest.fixture(scope="session", autouse=True)
def decoded_image_cache(tmp_path_factory):
    """Decoded-image caches go to a temporary folder, not the user's ~/.cache (child
    processes inherit the variable)."""
    os.environ["IGNITE_ENGINE_CACHE"] = str(tmp_path_factory.mktemp("decoded-cache"))
