"""Section 3: images/s of the recipe's in-memory batched augmentation against torchvision's
per-sample PIL pipeline, and how much of a training iteration goes to fetching its batch."""

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

from benchmarks.harness.report import table
from benchmarks.harness.timing import Stats, interleaved_order, number
from recipes.cifar.batches import CIFAR10_MEAN, CIFAR10_STD, TrainBatches

CROP_PADDING = 4  # pixels, both pipelines (torchvision pads with zeros, TrainBatches reflects)
TORCHVISION_WORKERS = (0, 2)
OURS = "TrainBatches (ours)"


class PilImages(Dataset):
    """Decoded PIL images held in memory, transformed one sample at a time."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor,
                 transform: Callable[[Image.Image], torch.Tensor]) -> None:
        self.images = [Image.fromarray(image.permute(1, 2, 0).numpy()) for image in images]
        self.labels = labels.tolist()
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.images[index]), self.labels[index]


def torchvision_transform() -> transforms.Compose:
    return transforms.Compose([
        transforms.RandomCrop(32, padding=CROP_PADDING),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD),
    ])


def steady_images_per_second(batches: Iterator, timed: int) -> float:
    """Images/s over ``timed`` batches after the first, whose cost (worker start-up, the
    epoch's permutation) is left out."""
    next(batches)
    images, start = 0, time.perf_counter()
    for _ in range(timed):
        x, _ = next(batches)
        images += x.shape[0]
    return images / (time.perf_counter() - start)


@dataclass
class DataResult:
    batch_size: int
    timed: int
    images_per_second: dict[str, list[float]]  # arm -> one value per repeat


def measure(images: torch.Tensor, labels: torch.Tensor, batch_size: int, timed: int,
            repeats: int, log: Callable[[str], None]) -> DataResult:
    """``images`` uint8 [N,3,32,32] with N >= batch_size * (timed + 1)."""
    ours = TrainBatches(images, labels, batch_size, seed=0, crop_padding=CROP_PADDING,
                        channels_last=True)
    dataset = PilImages(images, labels, torchvision_transform())
    arms: dict[str, Callable[[int], Iterator]] = {
        OURS: lambda repeat: ours.epoch_batches(repeat + 1),
    }
    for workers in TORCHVISION_WORKERS:
        arms[f"torchvision, {workers} workers"] = lambda repeat, workers=workers: iter(
            DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
                       drop_last=True))
    results: dict[str, list[float]] = {arm: [] for arm in arms}
    for repeat, arm in interleaved_order(list(arms), repeats):
        results[arm].append(steady_images_per_second(arms[arm](repeat), timed))
        log(f"  data repeat {repeat + 1}/{repeats} {arm}: {results[arm][-1]:.0f} images/s")
    return DataResult(batch_size, timed, results)


@dataclass(frozen=True)
class FetchShare:
    """From the epoch runs (section 4): time in ``GET_BATCH_STARTED`` ->
    ``GET_BATCH_COMPLETED`` per iteration, and its share of the iteration."""

    label: str
    fetch_seconds: list[float]  # per repeat, mean per iteration
    iteration_seconds: list[float]


def render(result: DataResult, fetch: list[FetchShare], threads: int) -> str:
    ours = Stats.of(result.images_per_second[OURS]).median
    rows = [[arm, Stats.of(values).format(4), f"{number(ours / Stats.of(values).median)}×"]
            for arm, values in result.images_per_second.items()]
    fetch_rows = [
        [share.label, Stats.of(share.fetch_seconds).format(3, 1e3),
         Stats.of(share.iteration_seconds).format(4, 1e3),
         Stats.of([f / i for f, i in zip(share.fetch_seconds, share.iteration_seconds,
                                          strict=True)]).format(2, 100)]
        for share in fetch
    ]
    return f"""## 3. Data

Batch {result.batch_size}; {result.timed} timed batches per repeat after a first one left out
(worker start-up, the epoch's permutation). Ours: `TrainBatches`, uint8 images in memory,
crop (reflect padding) and flip as one batched gather, normalised to float, channels_last,
{threads} torch threads. torchvision: `RandomCrop(32, padding={CROP_PADDING})`,
`RandomHorizontalFlip`, `ToTensor`, `Normalize` per sample over decoded PIL images in memory,
`DataLoader(shuffle=True, drop_last=True)`; its workers run one thread each and compete with
the main process for the same cores.

{table(["pipeline", "images/s", "ours is faster by (medians)"], rows)}

**Does the training loop wait for data?** Measured in the epoch runs of section 4 (our
trainer, recipe handler set, `TrainBatches` feeding it): the time between Ignite's
`GET_BATCH_STARTED` and `GET_BATCH_COMPLETED` against the whole iteration, in the timed
window. On a CPU the batch is made synchronously in the loop (there is nothing to overlap
with), so this is the share of each iteration spent making batches; on a GPU the same ops
would be queued asynchronously ahead of the step.

{table(["run", "fetch, ms / iteration", "iteration, ms", "fetch, % of iteration"],
       fetch_rows)}"""
