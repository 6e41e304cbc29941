"""Image-folder data: listing and checking a ``<split>/<class>/<file>`` tree, decoding and
augmenting one file per sample in DataLoader workers, and training batches that resume
exactly mid-epoch with any number of workers.

Exactness comes from two rules. The order is ``recipes.common.data_order``'s: a permutation per
``(seed, epoch)``, each rank taking its slice of every global batch. And a sample's
augmentation is a pure function of ``(seed, epoch, index)``: the batch sampler yields keys
``(epoch, index)`` and the dataset seeds the transform from them, so it does not matter
which worker process draws a sample, or whether it was prefetched before a crash. The
sampler's position is then the whole state of the data; ``torchdata``'s
``StatefulDataLoader`` carries it (and its workers' bookkeeping) into every checkpoint.
"""

import hashlib
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from ignite.engine import Engine
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Subset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchvision.transforms import v2

from engine.batch import move_to_device
from handlers.arguments import check_int
from recipes.common.data_order import check_rank, epoch_order, mix_seed
from recipes.common.image_files import IMAGE_SUFFIXES, class_names, list_class_folder, read_image
from recipes.images.config import SMALL_IMAGE_MAX
from recipes.runner.config.command_line import DataError

logger = logging.getLogger(__name__)

VAL_SPLITS = ("val", "test")  # the first of these that exists is the validation split
EVAL_CROP_FRACTION = 0.875  # large images: resize to side / 0.875, then centre-crop the side
STATS_IMAGES = 256  # training images whose pixels give the normalisation statistics
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

Sample = tuple[str, int]  # (file path, label)

# torchdata 0.11 calls torch.set_vital, which torch 2.14 deprecates: a warning at every run.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


@dataclass(frozen=True)
class ImageFolders:
    """The listed tree: sorted class names, (path, label) samples per split, where the
    validation samples come from, and the files skipped as not images."""

    root: Path
    classes: list[str]
    train: list[Sample]
    val: list[Sample]
    val_source: str
    skipped: list[str]


@dataclass(frozen=True)
class ImageData:
    """The listed tree, the side its images are brought to and their normalisation."""

    folders: ImageFolders
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    pretrained: dict | None = None  # --weights: torchvision's state_dict for --model


def list_image_folders(root: Path, val_fraction: float | None = None) -> ImageFolders:
    """List ``root/train/<class>/*`` and ``root/val/<class>/*`` (or ``test/``); with
    ``val_fraction``, hold that fraction of each training class out for validation
    instead (the same files every time; see ``hold_out``). Reads no image. ``DataError``
    for a missing split, a tree without classes, an empty class folder, or a validation
    class that training lacks."""
    root = Path(root)
    layout = (f"expected {root}/train/<class>/<image> and {root}/val/<class>/<image> "
              f"(or test/), or only train/ with --val-fraction")
    if not (root / "train").is_dir():
        raise DataError(f"no train/ folder in {root}: {layout}")
    classes = class_names(root / "train")
    if not classes:
        raise DataError(f"no class folders in {root / 'train'}: {layout}")
    skipped: list[str] = []
    train = _list_split(root / "train", classes, classes, skipped)
    if val_fraction is not None:
        train, val = hold_out(train, val_fraction, root)
        return ImageFolders(root, classes, train, val, f"train ({val_fraction:g} held out)",
                            skipped)
    split = next((name for name in VAL_SPLITS if (root / name).is_dir()), None)
    if split is None:
        raise DataError(f"no val/ or test/ folder in {root}: {layout}")
    val_classes = class_names(root / split)
    if unknown := sorted(set(val_classes) - set(classes)):
        raise DataError(f"class folders in {root / split} that train/ lacks: {unknown}")
    val = _list_split(root / split, val_classes, classes, skipped)
    return ImageFolders(root, classes, train, val, split, skipped)


def _list_split(split_dir: Path, names: list[str], classes: list[str],
                skipped: list[str]) -> list[Sample]:
    """Samples of the class folders ``names`` (labels from ``classes``), sorted by class
    and file name; non-image entries go to ``skipped``, hidden ones are ignored."""
    samples = []
    for name in names:
        images, others = list_class_folder(os.path.join(split_dir, name))
        skipped += others
        label = classes.index(name)
        samples += [(path, label) for path in images]
    return samples


def hold_out(train: list[Sample], fraction: float, root: Path
             ) -> tuple[list[Sample], list[Sample]]:
    """Split ``train`` into (train, val): from each class, the ``fraction`` of its files
    whose sha256 of the path under ``root`` is lowest. Random-like, yet the same files
    every time, and a file keeps its side when others are added; every class keeps at
    least one training file."""
    prefix = len(os.path.join(os.fspath(root), ""))
    by_class: dict[int, list[Sample]] = {}
    for sample in train:
        by_class.setdefault(sample[1], []).append(sample)
    kept, held = [], []
    for samples in by_class.values():
        ranked = sorted(samples, key=lambda s: hashlib.sha256(s[0][prefix:].encode()).digest())
        n_val = min(round(len(samples) * fraction), len(samples) - 1)
        held += ranked[:n_val]
        kept += ranked[n_val:]
    if not held:
        raise DataError(f"--val-fraction {fraction:g} of {len(train)} training images holds "
                        "out none: give a larger fraction or a val/ folder")
    return sorted(kept, key=lambda s: (s[1], s[0])), sorted(held, key=lambda s: (s[1], s[0]))


def report_skipped(skipped: list[str], root: Path) -> None:
    """One warning: how many files were skipped as not images, naming a few."""
    if skipped:
        names = ", ".join(os.path.relpath(path, root) for path in skipped[:3])
        more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
        files = "file that is not an image" if len(skipped) == 1 else "files that are not images"
        logger.warning("skipped %d %s (%s): %s%s", len(skipped), files, " ".join(IMAGE_SUFFIXES),
                       names, more)


def shorter_side(path: str) -> int:
    """The shorter side of an image in pixels, from its header alone."""
    try:
        with Image.open(path) as image:
            return min(image.size)
    except (OSError, ValueError) as error:
        raise DataError(f"cannot read image {path}: {error}") from None


def train_transform(size: int) -> v2.Transform:
    """Small images (side <= 64): reflect-pad by size/8 and crop back (a random translate),
    as for CIFAR; larger ones: a random resized crop. Then a random horizontal flip.
    uint8 in, uint8 out (normalised on the device)."""
    if size <= SMALL_IMAGE_MAX:
        crop = [v2.Resize(size, antialias=True), v2.CenterCrop(size),
                v2.RandomCrop(size, padding=max(1, size // 8), padding_mode="reflect")]
    else:
        crop = [v2.RandomResizedCrop(size, antialias=True)]
    return v2.Compose([*crop, v2.RandomHorizontalFlip()])


def eval_transform(size: int) -> v2.Transform:
    """The deterministic view: resize (small images to the side, large ones to side/0.875)
    and centre-crop a square of the side."""
    resized = size if size <= SMALL_IMAGE_MAX else round(size / EVAL_CROP_FRACTION)
    return v2.Compose([v2.Resize(resized, antialias=True), v2.CenterCrop(size)])


def channel_stats(samples: Sequence[Sample], size: int, count: int = STATS_IMAGES
                  ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std (0-1 scale) of up to ``count`` evenly spaced samples, as
    the evaluation transform shows them."""
    step = max(1, len(samples) // count)
    view = eval_transform(size)
    pixels = torch.stack([view(read_image(path)) for path, _ in samples[::step][:count]])
    pixels = pixels.to(torch.float64).div(255).transpose(0, 1).flatten(1)
    return tuple(pixels.mean(1).tolist()), tuple(pixels.std(1).tolist())


def leave_process_group(worker_id: int) -> None:
    """``worker_init_fn``: the worker moves to a process group of its own. Ctrl-C and
    ``timeout`` signal the whole group of the training process, which then finishes its
    step, saves and stops, still drawing batches: its workers must not die of the same
    signal. Ending them by process id (``terminate()``) still works."""
    os.setpgrp()


class ImageFiles(Dataset):
    """Decodes and transforms one file per item, in whichever process asks.

    Without ``seed``, keys are indices and ``transform`` must be deterministic. With it,
    keys are ``(epoch, index)`` and ``transform`` draws its randomness from a generator
    seeded with ``mix_seed(seed, epoch, index)``. torchvision's v2 transforms draw from
    torch's default CPU generator, so it is reseeded for the call inside ``fork_rng``,
    which restores it afterwards: with ``num_workers=0`` this runs in the training
    process, whose own random stream (dropout, say) must not depend on the data.
    """

    def __init__(self, samples: Sequence[Sample], transform: v2.Transform,
                 seed: int | None = None) -> None:
        self.samples, self.transform, self.seed = samples, transform, seed

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, int]:
        if self.seed is None:
            path, label = self.samples[key]
            return self.transform(read_image(path)), label
        epoch, index = key
        path, label = self.samples[index]
        image = read_image(path)
        with torch.random.fork_rng(devices=[]):
            # The CPU generator only: torch.manual_seed would reseed the GPUs' too.
            torch.default_generator.manual_seed(mix_seed(self.seed, epoch, index))
            return self.transform(image), label


class EpochBatchSampler:
    """This rank's training batches as lists of keys ``(epoch, index)``, in the order of
    ``recipes.common.data_order.epoch_order`` (the last partial batch dropped; ``batch_size``
    is global, rank ``r`` takes the ``r``-th slice of each batch).

    Its state is ``(epoch, next_batch)``: the epoch being drawn and how many of its
    batches were drawn. Each ``iter()`` continues that epoch, or starts the next one
    when it is complete (or none has started), so after ``load_state_dict`` the next
    ``iter()`` picks up exactly where the saved run was.
    """

    def __init__(self, n_samples: int, batch_size: int, *, seed: int, rank: int = 0,
                 world_size: int = 1) -> None:
        check_int("batch_size", batch_size, 1)
        check_rank(rank, world_size)
        if batch_size % world_size or batch_size > n_samples:
            raise ValueError(f"batch_size {batch_size} must be divisible by world_size "
                             f"{world_size} and at most the {n_samples} samples")
        self.n_samples, self.batch_size, self.seed = n_samples, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.epoch, self.next_batch = 0, 0

    def __len__(self) -> int:
        return self.n_samples // self.batch_size

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        # A generator: the body runs at the first next(), so the DataLoader's extra iter()
        # calls (one per iterator it makes) change nothing until batches are drawn.
        if self.epoch == 0 or self.next_batch >= len(self):
            self.epoch, self.next_batch = self.epoch + 1, 0
        epoch = self.epoch
        order = epoch_order(self.n_samples, self.seed, epoch).tolist()
        local = self.batch_size // self.world_size
        while self.next_batch < len(self):
            first = self.next_batch * self.batch_size + self.rank * local
            self.next_batch += 1  # before the yield: the state counts the batch as drawn
            yield [(epoch, index) for index in order[first:first + local]]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "next_batch": self.next_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.next_batch = int(state["epoch"]), int(state["next_batch"])


class OneLineDataErrors:
    """Iterates ``loader``, turning a ``DataError`` raised in a worker process (which
    arrives wrapped in the worker's traceback) back into its own one-line message."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from self.loader
        except DataError as error:
            lines = str(error).strip().splitlines()
            raise DataError(lines[-1].partition(": ")[2] if len(lines) > 1 else lines[0]
                            ) from None


class TrainLoader(OneLineDataErrors):
    """Training batches ``(uint8 images, labels)``: a ``StatefulDataLoader`` over an
    ``EpochBatchSampler``; ``state_dict``/``load_state_dict`` are the loader's (tensors
    and plain containers only, so a ``weights_only`` checkpoint load accepts them).

    The worker count is part of that state (a resume must keep it). Ignite's ``run``
    calls ``iter()`` once when it resumes mid-epoch and counts the epoch's remaining
    iterations from ``state.iteration``: the restored loader yields exactly those.
    Bound to the engine (``bind``), each pass also starts where ``engine.state`` is, so
    an epoch the engine ends early (``terminate_epoch``) is not continued in the next."""

    def __init__(self, dataset: ImageFiles, sampler: EpochBatchSampler, *, num_workers: int,
                 pin_memory: bool = False) -> None:
        # Its own generator: the base seed each new iterator draws must not come from the
        # global stream (checkpointed; a resume would draw it at another moment).
        loader = StatefulDataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                    pin_memory=pin_memory, persistent_workers=num_workers > 0,
                                    worker_init_fn=leave_process_group,
                                    generator=torch.Generator().manual_seed(sampler.seed))
        super().__init__(loader)
        self.sampler, self.engine = sampler, None

    def bind(self, engine: Engine) -> "TrainLoader":
        self.engine = engine
        return self

    def __iter__(self) -> Iterator[Any]:
        # A generator: this runs at the first next(), once Ignite has counted the new epoch.
        if self.engine is not None:
            state = self.engine.state
            position = state.iteration - (state.epoch - 1) * state.epoch_length
            self.sampler.load_state_dict({"epoch": state.epoch, "next_batch": position})
            if position == 0:
                # An epoch starts afresh, as in an uninterrupted run: a loader state loaded
                # at an epoch's end would carry its step counters on into this one, and
                # each new iterator draws the same base seed (with 0 workers every epoch
                # makes one; persistent workers keep theirs).
                self.loader.next_iter_state = None
                self.loader.generator.manual_seed(self.sampler.seed)
        yield from super().__iter__()

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


class NormaliseOnDevice:
    """``prepare_batch``: (uint8 images, labels) to the device, then ``(x/255 - mean)/std``
    there; workers send uint8, a quarter of the bytes of float32."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        std_column = torch.tensor(std).view(1, -1, 1, 1)
        self.scale = 1 / (255 * std_column)
        self.shift = -torch.tensor(mean).view(1, -1, 1, 1) / std_column

    def __call__(self, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device,
                 non_blocking: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = move_to_device(batch, device, non_blocking)
        return torch.addcmul(self.shift.to(device), images.float(), self.scale.to(device)), labels


def eval_loader(dataset: ImageFiles, batch_size: int, *, num_workers: int, rank: int = 0,
                world_size: int = 1, pin_memory: bool = False) -> OneLineDataErrors:
    """Evaluation batches in file order; rank ``r`` takes the ``r``-th contiguous block of
    the samples, so each sample is evaluated once."""
    check_rank(rank, world_size)
    n = len(dataset)
    block = Subset(dataset, range(rank * n // world_size, (rank + 1) * n // world_size))
    # Its own generator, as for training: each new iterator draws a base seed from it.
    return OneLineDataErrors(DataLoader(block, batch_size=batch_size, num_workers=num_workers,
                                        pin_memory=pin_memory,
                                        persistent_workers=num_workers > 0,
                                        worker_init_fn=leave_process_group,
                                        generator=torch.Generator().manual_seed(0)))
