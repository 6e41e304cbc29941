"""airbench94's own training code (the ``airbench`` package, bench extra) as a benchmark arm,
fed our CIFAR-10 arrays.

airbench's ``CifarLoader(path)`` reads ``path/train.pt`` or ``path/test.pt`` (uint8 images
NHWC, int64 labels, class names) and downloads CIFAR-10 with torchvision into ``path`` when
the file is missing; its ``train`` opens the test split at the relative path ``cifar10``.
``write_airbench_data`` writes our arrays in that format, and every call into ``train``
runs from the folder above it: airbench trains and evaluates on the same bytes as our
recipe, and nothing is downloaded. Its network is built with ``.half().cuda()`` and timed
with CUDA events, so training needs a GPU; the loader alone runs on the CPU (``gpu="cpu"``).
"""

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import airbench
import torch
from airbench.lib_airbench94 import hyp

from benchmarks.harness.timing import WindowTimer
from recipes.cifar.data import CifarArrays

FOLDER = "cifar10"  # the relative path at which airbench's `train` opens the test split
TEST_BATCH = 2000  # the test loader's batch size in airbench's `train`
BATCH_SIZE, EPOCHS = hyp["opt"]["batch_size"], hyp["opt"]["train_epochs"]  # train94's


def write_airbench_data(arrays: CifarArrays, root: Path) -> Path:
    """Write ``arrays`` as ``root/cifar10/{train,test}.pt`` in airbench's format (images
    NHWC as torchvision's ``CIFAR10.data``, labels and classes in our order); returns the
    ``cifar10`` folder."""
    folder = root / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    splits = {"train.pt": (arrays.train_images, arrays.train_labels),
              "test.pt": (arrays.test_images, arrays.test_labels)}
    for name, (images, labels) in splits.items():
        torch.save({"images": images.permute(0, 2, 3, 1).contiguous(), "labels": labels,
                    "classes": list(arrays.classes)}, folder / name)
    return folder


def loader_options(batch_size: int) -> dict[str, Any]:
    """The training loader's arguments as ``train94`` gives them (translate by 2 pixels,
    flips alternating by epoch), at ``batch_size``."""
    return {"train": True, "batch_size": batch_size, "aug": hyp["aug"], "altflip": True}


class WindowLoader(airbench.CifarLoader):
    """airbench's training loader, unchanged, that reads a synchronised clock when
    ``train`` asks it for batch ``warmup`` and batch ``warmup + timed`` (0-based): asking
    for batch ``k`` means ``k`` steps are done, so the window holds steps ``warmup + 1 ..
    warmup + timed`` of the first epoch, and the loader's once-per-epoch augmentation of
    the whole set stays outside it."""

    def __init__(self, path: str, *, warmup: int, timed: int, **options: Any) -> None:
        super().__init__(path, **options)
        self.timer = WindowTimer(warmup, timed)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for done, batch in enumerate(super().__iter__()):
            if done in (self.timer.warmup, self.timer.warmup + self.timer.timed):
                torch.cuda.synchronize()  # only at the window's two ends
                self.timer.mark(done)
            yield batch


def epochs_for_steps(steps: int, batches_per_epoch: int) -> float:
    """The ``epochs`` for which airbench's ``train`` runs exactly ``steps`` steps: it runs
    ``ceil(batches_per_epoch * epochs)``; half a step below keeps float error from adding one."""
    return (steps - 0.5) / batches_per_epoch


def step_ms(folder: Path, batch_size: int, warmup: int, timed: int) -> float:
    """Milliseconds per iteration of ``train94``'s loop (forward, summed loss, backward,
    SGD step, LR scheduler step, Lookahead every 5 steps) at ``batch_size``, over steps
    ``warmup + 1 .. warmup + timed``."""
    loader = WindowLoader(str(folder), warmup=warmup, timed=timed, **loader_options(batch_size))
    steps = warmup + timed + 1  # asking for the batch after the window closes it
    if steps > len(loader):
        raise ValueError(f"{steps} steps of {batch_size} do not fit in one epoch of "
                         f"{len(loader)} batches")
    with contextlib.chdir(folder.parent):
        airbench.train94(loader, epochs=epochs_for_steps(steps, len(loader)), verbose=False)
    return 1e3 * loader.timer.seconds / timed


def full_run(folder: Path, epochs: float | None = None) -> tuple[float, float]:
    """One ``train94`` run as airbench runs it (batch 1024, 9.9 epochs unless ``epochs``,
    an evaluation after each epoch, its test-time augmentation at the end): wall seconds
    from building its loader to the trained model, and the test accuracy of airbench's
    ``evaluate`` with its TTA (mirror + translate), recomputed after the clock stops
    because ``train94`` prints the accuracy and returns only the model."""
    started = time.perf_counter()
    loader = airbench.CifarLoader(str(folder), **loader_options(BATCH_SIZE))
    # Its per-epoch table goes where our progress lines go, not into stdout.
    with contextlib.chdir(folder.parent), contextlib.redirect_stdout(sys.stderr):
        model = airbench.train94(loader, epochs=epochs or EPOCHS)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    test = airbench.CifarLoader(str(folder), train=False, batch_size=TEST_BATCH)
    return seconds, airbench.evaluate(model, test, tta_level=hyp["net"]["tta_level"])

