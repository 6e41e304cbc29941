"""How big each benchmark is: the full run (``make bench``) and a smoke run (``--quick``).

The full plan is sized for about 10-15 minutes on a quiet 2-core CPU, where one training
iteration of the CIFAR default model (batch 256, fp32) takes about 1.5-2 s (the recipe's own
run logged 1.9 s per iteration on a loaded machine): section 1 trains 5 arms x 5 repeats x
10 iterations of it (about 7 min), section 4 2 layouts x 3 repeats x 8 plus a slice of
evaluation (about 2 min); the tiny model, the sync counts and the data pipelines take
about 2 min together.

Section 5 runs only on a CUDA machine (``python -m benchmarks --only gpu`` runs it alone):
3 arms x 2 batch sizes x 3 repeats of 25 steps, each compiled arm compiling anew, then one
whole run each of airbench94 and of the recipe's 4 runs (2 settings, eager and compiled).
Its window of 5 + 20 steps (and the one after it) must fit in one epoch of airbench's
loader at batch 1024 (48 batches).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    name: str
    # Section 1, tiny model
    tiny_warmup: int
    tiny_timed: int
    tiny_repeats: int
    tiny_block: int  # iterations per block run side by side (benchmarks.harness.lockstep)
    # Section 1, CIFAR default model
    cifar_batch: int
    cifar_warmup: int
    cifar_timed: int
    cifar_repeats: int
    cifar_block: int
    # Section 3
    data_batch: int
    data_timed: int
    data_repeats: int
    # Section 4
    epoch_batch: int
    epoch_warmup: int
    epoch_timed: int
    epoch_repeats: int
    epoch_eval_images: int
    epoch_train_images: int
    # Section 5 (CUDA only): the step, then whole runs (None: each arm's own epoch count)
    gpu_warmup: int
    gpu_timed: int
    gpu_repeats: int
    gpu_run_repeats: int
    gpu_run_epochs: int | None


FULL = Plan(
    name="full",
    tiny_warmup=50, tiny_timed=2000, tiny_repeats=7, tiny_block=10,
    cifar_batch=256, cifar_warmup=2, cifar_timed=8, cifar_repeats=5, cifar_block=1,
    data_batch=256, data_timed=16, data_repeats=5,
    epoch_batch=256, epoch_warmup=2, epoch_timed=6, epoch_repeats=3, epoch_eval_images=256,
    epoch_train_images=50_000,
    gpu_warmup=5, gpu_timed=20, gpu_repeats=3, gpu_run_repeats=1, gpu_run_epochs=None,
)

# Proves every code path runs, in seconds; its numbers mean nothing.
QUICK = Plan(
    name="quick",
    tiny_warmup=3, tiny_timed=10, tiny_repeats=2, tiny_block=5,
    cifar_batch=8, cifar_warmup=1, cifar_timed=1, cifar_repeats=1, cifar_block=1,
    data_batch=32, data_timed=2, data_repeats=1,
    epoch_batch=8, epoch_warmup=1, epoch_timed=1, epoch_repeats=1, epoch_eval_images=8,
    epoch_train_images=512,
    gpu_warmup=1, gpu_timed=2, gpu_repeats=1, gpu_run_repeats=1, gpu_run_epochs=1,
)
