"""Batches for an Ignite ``Engine`` from uint8 images held on the device.

The whole uint8 set moves to the device once; each epoch gathers it in the epoch's order
and augments it (random crop + horizontal flip as one batched gather) there, and each
batch is a slice of that, converted to float and normalised: no per-sample Python work
and no worker processes.

Order and augmentation are pure functions of ``(seed, epoch, index)`` (the augmentation
drawn for the whole epoch from ``(seed, epoch)``, by position in the epoch), as
``recipes.common.data_order`` describes: a resumed run skips straight to its batch, and
``world_size`` processes together see exactly the batches of one process.
"""

from collections.abc import Iterator

import torch
from ignite.engine import Engine

from handlers.arguments import check_int
from recipes.cifar.config import FLIPS
from recipes.common.data_order import EpochPosition, check_rank, epoch_order, mix_seed

# Per-channel statistics of the CIFAR-10 training set, on the 0-1 pixel scale.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

Batch = tuple[torch.Tensor, torch.Tensor]
# Images augmented per gather: its int64 index takes 8 bytes a pixel (64 MiB here).
AUGMENT_CHUNK = 8192


def _check_images(images: torch.Tensor, labels: torch.Tensor) -> None:
    if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(
            f"images must be uint8 [N,3,H,W], got {images.dtype} {tuple(images.shape)}"
        )
    if labels.shape != (images.shape[0],):
        raise ValueError(f"labels must have shape ({images.shape[0]},), got {tuple(labels.shape)}")


class _Normalise:
    """uint8 [B,3,H,W] -> float (x/255 - mean)/std, in the chosen memory format."""

    def __init__(self, mean, std, device: torch.device, channels_last: bool) -> None:
        std_t = torch.tensor(std, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        mean_t = torch.tensor(mean, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        self.scale, self.shift = 1 / (255 * std_t), -mean_t / std_t
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = torch.addcmul(self.shift, images.float(), self.scale)
        return x.contiguous(memory_format=self.memory_format)


class TrainBatches:
    """Shuffled, augmented training batches; ``len()`` is the batches per epoch.

    ``batch_size`` is the global batch: rank ``r`` of ``world_size`` yields the
    ``r``-th contiguous slice of each global batch (``batch_size / world_size``
    samples), augmented as drawn for its position in the whole epoch.
    Augmentation: a random crop of the image reflect-padded by ``crop_padding``
    pixels (a random translate by up to that many pixels; 0 disables it) and a
    horizontal flip. ``flip="random"`` flips each image with probability 1/2 in
    every epoch; ``flip="alternating"`` (airbench's) draws one flip per image for
    the odd epochs and uses its opposite in the even ones, so every image is seen
    both ways within two epochs.

    Bind it to the engine it feeds (``bind(engine)``) and each epoch reads its
    number and starting batch from ``engine.state``: after
    ``engine.load_state_dict`` to a mid-epoch iteration, ``run`` continues with
    exactly the batches the uninterrupted run would have seen next. Unbound,
    successive ``iter()`` calls give epochs 1, 2, 3, ...

    >>> images = torch.zeros(8, 3, 32, 32, dtype=torch.uint8)
    >>> batches = TrainBatches(images, torch.arange(8), 4, seed=0)
    >>> len(batches), [x.shape for x, y in batches]
    (2, [torch.Size([4, 3, 32, 32]), torch.Size([4, 3, 32, 32])])
    >>> trainer = Engine(lambda engine, batch: None)
    >>> _ = trainer.run(batches.bind(trainer), max_epochs=2)
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        batch_size: int,
        *,
        seed: int,
        device: str | torch.device = "cpu",
        augment: bool = True,
        crop_padding: int = 4,
        flip: str = "random",
        drop_last: bool = True,
        rank: int = 0,
        world_size: int = 1,
        channels_last: bool = False,
        mean: tuple[float, float, float] = CIFAR10_MEAN,
        std: tuple[float, float, float] = CIFAR10_STD,
    ) -> None:
        _check_images(images, labels)
        check_rank(rank, world_size)
        check_int("batch_size", batch_size, 1)
        if batch_size % world_size:
            raise ValueError(
                f"batch_size {batch_size} (global) must be divisible by world_size {world_size}"
            )
        if not drop_last and world_size > 1:
            raise ValueError(
                f"drop_last=False needs world_size 1, got world_size {world_size}: a short last "
                "global batch cannot be split evenly across ranks"
            )
        if drop_last and batch_size > len(labels):
            raise ValueError(
                f"batch_size {batch_size} exceeds the {len(labels)} samples: with drop_last "
                "an epoch would have no batch"
            )
        size = min(images.shape[2:])
        if isinstance(crop_padding, bool) or not isinstance(crop_padding, int) or not (
            0 <= crop_padding < size
        ):
            raise ValueError(f"crop_padding must be an int in [0, {size}), got {crop_padding!r}")
        if flip not in FLIPS:
            raise ValueError(f"flip must be one of {FLIPS}, got {flip!r}")
        self.device = torch.device(device)
        self.images = images.to(self.device)
        self.labels = labels.to(self.device, dtype=torch.int64)
        self.odd_epoch_flips = None
        if flip == "alternating":
            # One draw per sample, from a seed no epoch uses: epochs count from 1.
            generator = torch.Generator(self.device).manual_seed(mix_seed(seed, -1))
            self.odd_epoch_flips = torch.rand(len(labels), generator=generator,
                                              device=self.device) < 0.5
        self.batch_size, self.seed, self.augment = batch_size, seed, augment
        self.crop_padding, self.drop_last = crop_padding, drop_last
        self.rank, self.world_size = rank, world_size
        self.normalise = _Normalise(mean, std, self.device, channels_last)
        self.position = EpochPosition()

    def bind(self, engine: Engine) -> "TrainBatches":
        """Read epoch and position from ``engine.state`` at the start of each epoch."""
        self.position.bind(engine)
        return self

    def __len__(self) -> int:
        n = len(self.labels)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        # A generator: this body runs at the first next(), after Ignite has advanced
        # state.epoch (1-based) for the new epoch; state.iteration counts completed steps.
        epoch, start = self.position.start(len(self))
        yield from self.epoch_batches(epoch, start)

    def epoch_batches(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        """Batches ``start, start+1, ...`` of epoch ``epoch`` (1-based), this rank's slice.

        The epoch's images are gathered in its order and augmented all at once before its
        first batch (as airbench does): a batch is then two slices and the normalisation,
        a handful of ops instead of a few dozen (on a GPU, each op is a launch the host
        pays for)."""
        order = epoch_order(len(self.labels), self.seed, epoch, self.device)
        images = self._augmented(order, epoch) if self.augment else self.images[order]
        labels = self.labels[order]
        local = self.batch_size // self.world_size
        for index in range(start, len(self)):
            lo = index * self.batch_size + self.rank * local
            hi = min(lo + local, len(order))
            yield self.normalise(images[lo:hi]), labels[lo:hi]

    def _augmented(self, order: torch.Tensor, epoch: int) -> torch.Tensor:
        """The images in the epoch's order, each cropped and flipped by the draw for its
        position in the epoch: a pure function of ``(seed, epoch)``, the same on every rank
        (each slices its batches out of it) and after any resume."""
        n = len(order)
        # A seed no batch order uses: epoch_order's is (seed, epoch).
        generator = torch.Generator(self.device).manual_seed(mix_seed(self.seed, epoch, -1))
        shifts = torch.randint(0, 2 * self.crop_padding + 1, (n, 2), generator=generator,
                               device=self.device)
        if self.odd_epoch_flips is None:
            flips = torch.rand(n, generator=generator, device=self.device) < 0.5
        else:
            flips = self.odd_epoch_flips[order] ^ (epoch % 2 == 0)
        out = torch.empty_like(self.images)
        for lo in range(0, n, AUGMENT_CHUNK):  # bounds the gather's int64 index
            hi = lo + AUGMENT_CHUNK
            out[lo:hi] = _crop_and_flip(self.images[order[lo:hi]], shifts[lo:hi], flips[lo:hi],
                                        self.crop_padding)
        return out


def _crop_and_flip(images: torch.Tensor, shifts: torch.Tensor, flips: torch.Tensor,
                   p: int) -> torch.Tensor:
    """Crop and flip as one gather: output pixel (y, x) of image b reads source pixel
    (reflect(y + dy_b - p), reflect(x + dx_b - p)), with x mirrored when b flips."""
    n, c, h, w = images.shape
    device = images.device
    rows = _reflect(torch.arange(h, device=device) + shifts[:, :1] - p, h)  # [n,h]
    cols = torch.arange(w, device=device).expand(n, w)
    cols = _reflect(torch.where(flips[:, None], cols.flip(1), cols) + shifts[:, 1:] - p, w)
    source = (rows[:, :, None] * w + cols[:, None, :]).view(n, 1, h * w).expand(n, c, h * w)
    return images.reshape(n, c, h * w).gather(2, source).view(n, c, h, w)


def _reflect(index: torch.Tensor, size: int) -> torch.Tensor:
    """Reflect out-of-range pixel indices back into [0, size) (edge pixel not repeated)."""
    index = index.abs()
    return torch.where(index >= size, 2 * (size - 1) - index, index)


class EvalBatches:
    """Evaluation batches in data order, not augmented; each of ``world_size`` ranks takes
    a contiguous block of the samples (sizes differ by at most one), so every sample is
    evaluated exactly once with no padding. ``batch_size`` is per rank; the last batch
    may be smaller.

    >>> images = torch.zeros(10, 3, 32, 32, dtype=torch.uint8)
    >>> [len(y) for _, y in EvalBatches(images, torch.arange(10), 4)]
    [4, 4, 2]
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        batch_size: int,
        *,
        device: str | torch.device = "cpu",
        rank: int = 0,
        world_size: int = 1,
        channels_last: bool = False,
        mean: tuple[float, float, float] = CIFAR10_MEAN,
        std: tuple[float, float, float] = CIFAR10_STD,
    ) -> None:
        _check_images(images, labels)
        check_rank(rank, world_size)
        check_int("batch_size", batch_size, 1)
        n = len(labels)
        lo, hi = rank * n // world_size, (rank + 1) * n // world_size
        self.device = torch.device(device)
        self.images = images[lo:hi].to(self.device)
        self.labels = labels[lo:hi].to(self.device, dtype=torch.int64)
        self.batch_size = batch_size
        self.normalise = _Normalise(mean, std, self.device, channels_last)

    def __len__(self) -> int:
        return -(-len(self.labels) // self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        for start in range(0, len(self.labels), self.batch_size):
            end = start + self.batch_size
            yield self.normalise(self.images[start:end]), self.labels[start:end]
