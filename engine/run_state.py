"""Run identity and the random-number state a checkpoint must carry for an exact resume.

Sample order and augmentation are seeded from ``(seed, epoch, index)`` by the
recipe; what remains is model-side randomness (dropout), drawn from torch's
global generators, and anything that uses Python's ``random``. NumPy's global
generator is deliberately not captured: its state does not load under
``torch.load(..., weights_only=True)``, so code that must resume exactly avoids it.
"""

import logging
import random
import secrets
import time
from typing import Any

import torch

logger = logging.getLogger(__name__)


class RngState:
    """The torch CPU, every CUDA device's and Python's ``random`` generator state.

    Put it in a checkpoint's ``to_save`` next to the model; the state dict holds
    only tensors and plain containers, so it loads with ``weights_only=True``::

        rng = RngState()
        saved = rng.state_dict()
        torch.rand(1)  # draws move the generators on
        rng.load_state_dict(saved)  # ... and this moves them back
    """

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss_next = random.getstate()
        return {
            "torch_cpu": torch.get_rng_state(),
            # One ByteTensor per visible device; empty on CPU-only machines.
            "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"torch_cpu", "torch_cuda", "python"} - state.keys()
        if missing:
            raise ValueError(f"RNG state is missing {sorted(missing)}")
        torch.set_rng_state(state["torch_cpu"])
        self._load_cuda(state["torch_cuda"])
        python = state["python"]
        random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))

    @staticmethod
    def _load_cuda(states: list[torch.Tensor]) -> None:
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if len(states) != available:
            # A resume on other hardware cannot replay the GPU's dropout masks anyway.
            logger.warning(
                "checkpoint holds RNG state for %d CUDA device(s), this machine has %d; "
                "restoring the first %d, the resume is not bit-exact on the others",
                len(states), available, min(len(states), available),
            )
        for index, device_state in enumerate(states[:available]):
            torch.cuda.set_rng_state(device_state, index)


def new_run_id() -> str:
    """A fresh id such as ``20250101-120000-3fa9c2d1``: start time (local) and 32 random bits.

    Drawn from ``secrets``, so creating an id does not move any seeded generator.
    """
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}"
