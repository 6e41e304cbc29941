"""``--profile START:STOP``: the window checked against the run's length before anything is
written, and the profiler attached on rank 0 (``handlers.profiler.StepProfiler``)."""

import math
from pathlib import Path

import torch

from engine.trainer import Trainer
from handlers.profiler import StepProfiler
from recipes.runner.config.command_line import ConfigError
from recipes.runner.config.run_keys import RunConfig, profile_window

TRACES = "profile"  # in the run folder: trace-steps-FIRST-LAST.json.gz


def check_profile_window(config: RunConfig, train_samples: int) -> None:
    """Refuse a window that ends after the run's last optimizer step. The steps are counted
    from the training samples as ``ceil(samples / batch size)`` micro-batches an epoch: a
    recipe whose batches drop a short last one has up to one step fewer an epoch, and a
    window reaching into those closes with the run."""
    window = profile_window(config.profile)
    if window is None:
        return
    micro_batches = math.ceil(train_samples / config.batch_size)
    steps = math.ceil(micro_batches / config.accum_steps) * config.epochs
    if window[1] > steps:
        epochs = f"{config.epochs} epoch{'s' * (config.epochs != 1)}"
        raise ConfigError(f"--profile {config.profile}: the run has {steps} optimizer steps "
                          f"({epochs}); the window must end by step {steps}")


def attach_profiler(config: RunConfig, trainer: Trainer, run_dir: Path,
                    device: torch.device) -> StepProfiler | None:
    """The profiler of ``--profile``, attached after every other handler (its window closes
    once the step's handlers ran); None when the key is off."""
    window = profile_window(config.profile)
    if window is None:
        return None
    profiler = StepProfiler(*window, run_dir / TRACES, cuda=device.type == "cuda")
    profiler.attach(trainer)
    return profiler
