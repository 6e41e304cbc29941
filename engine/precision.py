"""Device and precision policy: one object answers "where, in which dtype, with which scaler"."""

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

PRECISIONS = ("auto", "fp32", "fp16", "bf16")  # in the order --help lists them
_DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    """A resolved (device, precision) pair.

    ``name`` is one of ``fp32``, ``fp16``, ``bf16`` (never ``auto``). fp16 always
    runs with a GradScaler on its own device (the CPU included); bf16 and fp32
    get a disabled scaler, whose methods are no-ops, so one step serves all three.
    """

    device: torch.device
    name: str

    @property
    def dtype(self) -> torch.dtype | None:
        return _DTYPES[self.name]

    @property
    def uses_scaler(self) -> bool:
        return self.name == "fp16"

    def autocast(self) -> AbstractContextManager:
        return torch.autocast(
            device_type=self.device.type,
            dtype=self.dtype or torch.float32,
            enabled=self.dtype is not None,
        )

    def make_scaler(self) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(self.device.type, enabled=self.uses_scaler)


def resolve_device(device: str | torch.device) -> torch.device:
    """``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"`` (CUDA when present, else CPU)."""
    allowed = "allowed: 'cpu', 'cuda', 'cuda:N', 'auto'"
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device={device!r} is not a device name; {allowed}") from err
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise ValueError(f"device={device!r} is not supported; {allowed}")
    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here; use 'cpu' or 'auto'")
    if resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ValueError(
            f"device={device!r} but only {torch.cuda.device_count()} CUDA device(s) exist "
            f"(cuda:0 .. cuda:{torch.cuda.device_count() - 1})"
        )
    return resolved


def resolve_precision(precision: str, device: str | torch.device = "cpu") -> Precision:
    """Resolve ``precision`` for ``device``.

    ``auto`` means bf16 on GPUs that support it, fp16 (with a scaler) on older
    GPUs, and fp32 on the CPU, where bf16 autocast is 13-24x slower than fp32 on
    the machines we measured.
    """
    resolved_device = resolve_device(device)
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not known; allowed: {', '.join(PRECISIONS)}")
    on_cuda = resolved_device.type == "cuda"
    bf16_ok = not on_cuda or torch.cuda.is_bf16_supported(including_emulation=False)
    if precision == "auto":
        if not on_cuda:
            return Precision(resolved_device, "fp32")
        return Precision(resolved_device, "bf16" if bf16_ok else "fp16")
    if precision == "bf16" and not bf16_ok:
        raise ValueError(
            f"precision='bf16' but {torch.cuda.get_device_name(resolved_device)} has no bf16 "
            "support; allowed here: 'fp32', 'fp16', 'auto'"
        )
    return Precision(resolved_device, precision)
