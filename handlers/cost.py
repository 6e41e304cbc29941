"""What training costs: throughput per device, model FLOPs utilisation (MFU) and peak memory.

Per epoch, from counts the run already has (iterations, the global batch size, Ignite's epoch
time): nothing is read from the device during the epoch. MFU is the model's FLOPs per second
over the device's dense peak for the step's number format (PaLM's definition: recomputation by
activation checkpointing is not counted); it is ``None`` ("n/a") on the CPU and on accelerators
missing from ``PEAK_FLOPS``, never a guess.
"""

import re
import resource
import sys
from dataclasses import dataclass

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from engine.trainer import Trainer
from handlers.arguments import check_int

# Dense (no 2:4 sparsity) peak FLOP/s per number format, from NVIDIA's datasheets and
# architecture whitepapers. "fp16" is the tensor cores' rate with fp32 accumulation (what
# PyTorch's fp16 matmuls use); "fp32" is the CUDA cores' rate and "tf32" the tensor cores'
# for fp32 matmuls, used when PyTorch's fp32 matmul precision allows TF32 (``torch.
# set_float32_matmul_precision("high")``). Keys: a pattern of ``torch.cuda.get_device_name``
# in lower case. Variants whose figures differ (H100 NVL, H200 NVL, RTX 4090 D, AWS's A10G,
# which has no NVIDIA datasheet) are left out on purpose: their MFU is "n/a".
PEAK_FLOPS: dict[str, dict[str, float]] = {
    r"\ba100\b": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    r"\bh100\b.*\b(sxm|hbm3)\b": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12,
                                  "fp32": 66.9e12},
    r"\bh100 pcie\b": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12},
    r"\bh200\b(?!.*\bnvl\b)": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12,
                               "fp32": 66.9e12},
    r"\bl4\b": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    r"\ba10\b": {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
    r"\brtx 4090$": {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12},
}
NUMBER_FORMATS = ("bf16", "fp16", "fp32")
MB = 2**20


def peak_flops(device_name: str, number_format: str, tf32: bool = False) -> float | None:
    """The dense peak FLOP/s of the accelerator named ``device_name`` for matmuls in
    ``number_format`` (fp32 at the TF32 rate when ``tf32``); None for one not in the table."""
    if number_format not in NUMBER_FORMATS:
        raise ValueError(f"number_format must be one of {NUMBER_FORMATS}, got {number_format!r}")
    name = device_name.lower().strip()
    for pattern, peaks in PEAK_FLOPS.items():
        if re.search(pattern, name):
            return peaks["tf32" if number_format == "fp32" and tf32 else number_format]
    return None


def device_peak_flops(device: torch.device, number_format: str) -> float | None:
    """``peak_flops`` of a CUDA device (TF32 as PyTorch's matmul setting says); None on the
    CPU and any other device."""
    if device.type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(device), number_format,
                      tf32=torch.get_float32_matmul_precision() != "highest")


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what they measure): the CUDA caching allocator's peak of allocated tensors on
    a CUDA device; otherwise the process's peak resident set size (the OS's count: the
    interpreter, the libraries and the data included)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024), "process_peak_rss"  # Linux: KiB


def forward_flops(model: nn.Module, example: torch.Tensor) -> int:
    """FLOPs of one forward of ``model`` on ``example`` as ``torch.utils.flop_counter`` counts
    them (matmuls, convolutions, attention; 2 per multiply-add; norms and activations not
    counted). Runs in eval mode without gradients, so no statistics or weights change, and
    attention in its plain matmul form: the counter misses fused attention kernels on some
    devices (the CPU's scaled-dot-product kernel, ``nn.MultiheadAttention``'s fast path)."""
    training, fast_path = model.training, torch.backends.mha.get_fastpath_enabled()
    counter = FlopCounterMode(display=False)
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
            model.eval()(example)
    finally:
        model.train(training)
        torch.backends.mha.set_fastpath_enabled(fast_path)
    return counter.get_total_flops()


def training_flops(model: nn.Module, example: torch.Tensor) -> int:
    """Forward + backward FLOPs for ``example`` (one sample): 3 x the forward's, since the
    backward computes the gradients of both the inputs and the weights of each layer."""
    return 3 * forward_flops(model, example)


@dataclass(frozen=True)
class CostReport:
    """One epoch's (or the run's) cost, per device."""

    samples_per_sec: float
    tokens_per_sec: float | None
    flops_per_sec: float | None
    mfu: float | None
    peak_memory: list[int]  # bytes, one per process in rank order


class CostMeter:
    """Throughput per device, MFU and peak memory, measured per epoch on every process.

    ``attach(trainer, evaluator=None)`` listens to the trainer's ``Events.EPOCH_STARTED``
    and ``Events.EPOCH_COMPLETED`` (the iterations of the epoch, from a mid-epoch resume's
    iteration on, over Ignite's epoch time, validation excluded). Every process measures its
    own peak memory and, with several, all gather them at each epoch's end (one small
    collective an epoch): attach it on every rank, before handlers that read ``latest``.
    ``batch_size`` is the global one; the per-device rates divide by ``world_size``.
    ``flops_per_sample`` (forward + backward) and ``tokens_per_sample`` come from the recipe;
    ``peak_flops`` is the device's (``device_peak_flops``), None when unknown.
    """

    def __init__(self, batch_size: int, world_size: int, device: torch.device, *,
                 flops_per_sample: float | None = None, tokens_per_sample: int | None = None,
                 peak_flops: float | None = None) -> None:
        check_int("batch_size", batch_size, 1)
        check_int("world_size", world_size, 1)
        if tokens_per_sample is not None:
            check_int("tokens_per_sample", tokens_per_sample, 1)
        if flops_per_sample is not None and not flops_per_sample > 0:
            raise ValueError(f"flops_per_sample must be > 0 or None, got {flops_per_sample}")
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(f"peak_flops must be > 0 or None, got {peak_flops}")
        self.batch_size, self.world_size, self.device = batch_size, world_size, device
        self.flops_per_sample, self.tokens_per_sample = flops_per_sample, tokens_per_sample
        self.peak_flops = peak_flops
        self.memory_source = peak_memory(device)[1]
        self.latest: CostReport | None = None  # the last completed epoch's
        self._epoch_start_iteration = 0

    def attach(self, trainer: Trainer, evaluator: Engine | None = None) -> None:
        trainer.add_event_handler(Events.EPOCH_STARTED, self._on_epoch_started)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self._on_epoch_completed)

    def _on_epoch_started(self, trainer: Engine) -> None:
        self._epoch_start_iteration = trainer.state.iteration

    def _on_epoch_completed(self, trainer: Engine) -> None:
        iterations = trainer.state.iteration - self._epoch_start_iteration
        seconds = trainer.state.times["EPOCH_COMPLETED"]
        memory = peak_memory(self.device)[0]
        gathered = idist.all_gather(memory) if self.world_size > 1 else [memory]
        self.latest = self.report(iterations * self.batch_size / seconds if seconds else 0.0,
                                  [int(value) for value in gathered])

    def report(self, samples_per_sec: float, peak_memory_per_process: list[int]
               ) -> CostReport:
        """The cost at a global rate of ``samples_per_sec``, all processes together."""
        per_device = samples_per_sec / self.world_size
        flops = None if self.flops_per_sample is None else per_device * self.flops_per_sample
        return CostReport(
            samples_per_sec=per_device,
            tokens_per_sec=(None if self.tokens_per_sample is None
                            else per_device * self.tokens_per_sample),
            flops_per_sec=flops,
            mfu=None if flops is None or self.peak_flops is None else flops / self.peak_flops,
            peak_memory=peak_memory_per_process)

    def scalars(self) -> dict[str, float]:
        """The latest epoch's ``perf/*`` scalars (tag -> value); a value that is not known
        (no tokens, no FLOPs, MFU on an unknown device) is left out."""
        latest = self.latest
        if latest is None:
            return {}
        values = {"perf/samples_per_sec_per_device": latest.samples_per_sec,
                  "perf/tokens_per_sec_per_device": latest.tokens_per_sec,
                  "perf/model_flops_per_sec_per_device": latest.flops_per_sec,
                  "perf/mfu": latest.mfu,
                  "perf/peak_memory_mb": max(latest.peak_memory) / MB}
        return {tag: value for tag, value in values.items() if value is not None}

    def summary(self, samples_per_sec: float | None) -> dict[str, object]:
        """``summary.json``'s cost fields at the run's average rate ``samples_per_sec``
        (all processes; None before any training): this process's peak memory now, the
        others' at the last epoch's end (None before the first epoch ended)."""
        memory: list[int | None] = (list(self.latest.peak_memory) if self.latest
                                    else [None] * self.world_size)
        memory[idist.get_rank() if self.world_size > 1 else 0] = peak_memory(self.device)[0]
        report = self.report(samples_per_sec or 0.0, memory)
        rated = samples_per_sec is not None
        return {
            "samples_per_sec_per_device": round(report.samples_per_sec, 2) if rated else None,
            "tokens_per_sec_per_device": (round(report.tokens_per_sec, 1)
                                          if rated and report.tokens_per_sec is not None
                                          else None),
            "model_flops_per_sample": self.flops_per_sample,
            "mfu": round(report.mfu, 4) if rated and report.mfu is not None else None,
            "peak_flops_per_device": self.peak_flops,
            "peak_memory_bytes": max(size for size in memory if size is not None),
            "peak_memory_bytes_per_process": memory,
            "peak_memory_source": self.memory_source,
        }

    def line(self) -> str:
        """The latest epoch's cost for a console line, e.g. ``per device: 812 samples/s,
        104k tokens/s, MFU n/a, peak mem 1.2 GB``; empty before the first epoch ends."""
        latest = self.latest
        if latest is None:
            return ""
        parts = [f"{_count(latest.samples_per_sec)} samples/s"]
        if latest.tokens_per_sec is not None:
            parts.append(f"{_count(latest.tokens_per_sec)} tokens/s")
        if self.flops_per_sample is not None:
            parts.append("MFU " + ("n/a" if latest.mfu is None else f"{latest.mfu:.1%}"))
        parts.append(f"peak mem {_size(max(latest.peak_memory))}")
        return "per device: " + ", ".join(parts)


def _count(value: float) -> str:
    """``812``, ``10.4k``, ``1.2M``."""
    for limit, suffix in ((1e6, "M"), (1e3, "k")):
        if value >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.3g}"


def _size(size: int) -> str:
    """``512 MB``, ``1.2 GB``."""
    return f"{size / 2**30:.1f} GB" if size >= 2**30 else f"{size / MB:.0f} MB"

