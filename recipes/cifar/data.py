"""CIFAR-10 as uint8 tensors: from image folders or the official python batches, or synthetic.

Everything here returns a ``CifarArrays`` held in memory (60k images are 184 MB
as uint8); ``recipes.cifar.batches`` turns it into batches on the device.

Decoding 60k JPEGs takes seconds on every start, so image folders are decoded once
and cached (see ``decoded_cache_path``); a cache that no longer matches the files,
or fails its checksum, is decoded again and replaced.

>>> arrays = make_synthetic(n_train=100, n_test=20, seed=0)
>>> arrays.train_images.shape, arrays.train_images.dtype
(torch.Size([100, 3, 32, 32]), torch.uint8)
>>> small = subset(arrays, train_subset=50, val_subset=None)
>>> len(small.train_labels), len(holdout_validation(arrays, 0.1).test_labels)
(50, 10)
"""

import hashlib
import logging
import os
import shutil
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
import torchvision
from torchvision.io import ImageReadMode, decode_image, decode_jpeg

from handlers.arguments import check_int, check_number
from handlers.atomic_write import write_atomically
from recipes.common.image_files import class_names, list_class_folder, read_image
from recipes.common.paths import cache_root, data_dir_candidates, places_looked_in
from recipes.runner.config.command_line import DataError

IMAGE_SHAPE = (3, 32, 32)
PYTHON_BATCHES_FOLDER = "cifar-10-batches-py"  # torchvision's layout under data_dir
DECODE_CHUNK = 1024  # JPEGs decoded per batched decode_jpeg call (batched is ~3x faster)
CACHE_FORMAT = 1  # bump when decoding or the cached layout changes: older caches then miss

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CifarArrays:
    """Images uint8 [N,3,32,32], labels int64 [N]; ``classes[label]`` is the class name.
    ``test_*`` is the evaluation split; ``held_test`` the official test set's images and
    labels when that split is held out of train instead (``holdout_validation``)."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    classes: list[str]
    held_test: tuple[torch.Tensor, torch.Tensor] | None = None


def load_cifar10(data_dir: Path, download: bool = True) -> CifarArrays:
    """Load CIFAR-10 from ``data_dir``, which holds either image folders
    ``train/<class>/<image>`` and ``test/<class>/<image>`` (any of
    ``recipes.common.image_files.IMAGE_SUFFIXES``; other files are ignored) or torchvision's
    ``cifar-10-batches-py/``. With neither, and ``download`` (the fallback of ``--data-dir
    auto``), fetch the python batches into ``data_dir``. Raises ``DataError`` naming what is
    missing or broken; after a failed download it names every place ``auto`` looks in.

    Image folders are read in round-robin class order (the first image of every
    class, then the second, ...), so any prefix or suffix of the training set
    is class-balanced: see ``subset`` and ``holdout_validation``.
    """
    data_dir = Path(data_dir)
    if (data_dir / PYTHON_BATCHES_FOLDER).is_dir():
        return _load_python_batches(data_dir)
    if (data_dir / "train").is_dir() and (data_dir / "test").is_dir():
        return _load_image_folders(data_dir)
    expected = (f"expected image folders train/<class>/*.jpg and test/<class>/*.jpg, or the "
                f"official python batches {PYTHON_BATCHES_FOLDER}/")
    if not download:
        raise DataError(f"no CIFAR-10 found in {places_looked_in([data_dir])}: {expected}; "
                        "name the folder that holds them with --data-dir")
    # Folders the download creates; on failure they go again (nothing in them is ours).
    created = [folder for folder in (data_dir, *data_dir.parents) if not folder.exists()]
    looked_in = places_looked_in([*data_dir_candidates("cifar10"), data_dir])
    try:
        download_python_batches(data_dir)
    except Exception as error:  # any failure to fetch means the same thing to the user
        if created:
            shutil.rmtree(created[-1], ignore_errors=True)
        raise DataError(f"no CIFAR-10 found in {looked_in}, and the download into {data_dir} "
                        f"failed ({type(error).__name__}: {error}): {expected} in one of "
                        "them, or name the folder that holds them with --data-dir") from error
    return _load_python_batches(data_dir)


def download_python_batches(data_dir: Path) -> None:
    """Fetch and unpack the official python batches into ``data_dir`` (needs network)."""
    torchvision.datasets.CIFAR10(root=str(data_dir), train=True, download=True)


def _load_python_batches(data_dir: Path) -> CifarArrays:
    def split(train: bool) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        try:
            dataset = torchvision.datasets.CIFAR10(root=str(data_dir), train=train, download=False)
        except Exception as error:  # torchvision raises RuntimeError or unpickling errors
            raise DataError(f"unreadable CIFAR-10 python batches in "
                            f"{data_dir / PYTHON_BATCHES_FOLDER}: {error}") from error
        images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).contiguous()  # NHWC -> NCHW
        return images, torch.tensor(dataset.targets, dtype=torch.int64), list(dataset.classes)

    train_images, train_labels, classes = split(train=True)
    test_images, test_labels, _ = split(train=False)
    return CifarArrays(train_images, train_labels, test_images, test_labels, classes)


def _load_image_folders(data_dir: Path) -> CifarArrays:
    train_files, classes = _list_split(data_dir / "train")
    test_files, test_classes = _list_split(data_dir / "test")
    if test_classes != classes:
        raise DataError(
            f"class folders differ between {data_dir / 'train'} and {data_dir / 'test'}: "
            f"only in train {sorted(set(classes) - set(test_classes))}, "
            f"only in test {sorted(set(test_classes) - set(classes))}"
        )
    listing = _listing_digest([path for path, _ in train_files + test_files])
    cache_path = decoded_cache_path(data_dir)
    cached = _read_cache(cache_path, listing)
    if cached is not None:
        return cached
    arrays = CifarArrays(
        _decode_files([path for path, _ in train_files]),
        torch.tensor([label for _, label in train_files], dtype=torch.int64),
        _decode_files([path for path, _ in test_files]),
        torch.tensor([label for _, label in test_files], dtype=torch.int64),
        classes,
    )
    _write_cache(cache_path, listing, arrays)
    return arrays


def decoded_cache_path(data_dir: Path) -> Path:
    """Where the decoded arrays of the image folders under ``data_dir`` are cached:
    ``$IGNITE_ENGINE_CACHE`` if set, else ``$XDG_CACHE_HOME`` (or ``~/.cache``)
    ``/ignite-engine``, then ``cifar10/<hash of data_dir's absolute path>.pt``.
    Not inside ``data_dir``, which may be a read-only shared folder."""
    source = hashlib.sha256(str(Path(data_dir).resolve()).encode()).hexdigest()[:16]
    return cache_root() / "cifar10" / f"{source}.pt"


def _listing_digest(paths: list[str]) -> str:
    """sha256 of every file's ``<split>/<class>/<name>``, size and mtime, in load order:
    any file touched, added, removed or renamed changes it (stat is ~100x cheaper than a
    decode; an edit that keeps both size and mtime is the one change it cannot see)."""
    digest = hashlib.sha256(f"format {CACHE_FORMAT}\n".encode())
    for path in paths:
        try:
            stat = os.stat(path)
        except OSError as error:
            raise DataError(f"cannot read image {path}: {error}") from error
        relative = "/".join(path.rsplit(os.sep, 3)[-3:])  # Path.relative_to is ~4x slower
        digest.update(f"{relative}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _arrays_checksum(arrays: CifarArrays) -> str:
    """sha256 over every tensor's dtype, shape and bytes, and the class names (~0.1 s for
    CIFAR-10): a cache file that loads but was damaged or edited is never trusted."""
    digest = hashlib.sha256()
    for field in fields(CifarArrays):
        value = getattr(arrays, field.name)
        if isinstance(value, torch.Tensor):
            digest.update(f"{field.name} {value.dtype} {tuple(value.shape)}\n".encode())
            digest.update(value.contiguous().numpy())
        else:
            digest.update(f"{field.name} {value!r}\n".encode())
    return digest.hexdigest()


def _read_cache(cache_path: Path, listing: str) -> CifarArrays | None:
    """The cached arrays if the cache exists, matches ``listing`` and its checksum, else None."""
    if not cache_path.exists():
        return None
    try:
        payload = torch.load(cache_path, weights_only=True)
        if payload.get("listing") != listing:
            logger.info("decoded-image cache %s is stale: decoding again", cache_path)
            return None
        arrays = CifarArrays(**{field.name: payload[field.name] for field in fields(CifarArrays)})
        if _arrays_checksum(arrays) != payload["checksum"]:
            raise ValueError("checksum mismatch")
    except Exception as error:  # unreadable, truncated or edited: all mean "decode again"
        logger.warning("decoded-image cache %s is corrupt (%s: %s): decoding again",
                       cache_path, type(error).__name__, error)
        return None
    return arrays


def _write_cache(cache_path: Path, listing: str, arrays: CifarArrays) -> None:
    """Save atomically (``write_atomically``), so a reader never sees half a cache; on
    failure (read-only, disk full) only warn: the cache only saves time."""
    payload = {"listing": listing, "checksum": _arrays_checksum(arrays)}
    payload.update({field.name: getattr(arrays, field.name) for field in fields(CifarArrays)})
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(cache_path, lambda file: torch.save(payload, file))
    except (OSError, RuntimeError) as error:  # torch.save reports write errors as RuntimeError
        logger.warning("could not write the decoded-image cache %s (%s): the next start "
                       "decodes the images again", cache_path, error)


def _list_split(split_dir: Path) -> tuple[list[tuple[str, int]], list[str]]:
    """(file, label) pairs in round-robin class order, and the sorted class names; files
    that are not images are ignored."""
    classes = class_names(split_dir)
    if not classes:
        raise DataError(f"no class folders in {split_dir}: expected {split_dir}/<class>/*.jpg")
    per_class = [list_class_folder(os.path.join(split_dir, name))[0] for name in classes]
    ordered = [
        (files[k], label)
        for k in range(max(len(files) for files in per_class))
        for label, files in enumerate(per_class)
        if k < len(files)
    ]
    return ordered, classes


def _decode_files(paths: list[str]) -> torch.Tensor:
    """Decode image files into one uint8 [N,3,32,32] tensor, JPEGs in batches."""
    images = torch.empty((len(paths), *IMAGE_SHAPE), dtype=torch.uint8)
    for start in range(0, len(paths), DECODE_CHUNK):
        chunk = paths[start:start + DECODE_CHUNK]
        encoded = [_read_bytes(path) for path in chunk]
        is_jpeg = [data[:2].tolist() == [0xFF, 0xD8] for data in encoded]
        try:  # fast path: one batched call; on any error fall back to per-file to name the file
            if not all(is_jpeg):
                raise ValueError("not all JPEG")
            decoded = decode_jpeg(encoded, mode=ImageReadMode.RGB)
        except (RuntimeError, ValueError):
            decoded = [_decode_one(path, data) for path, data in zip(chunk, encoded, strict=True)]
        for offset, (path, image) in enumerate(zip(chunk, decoded, strict=True)):
            if tuple(image.shape) != IMAGE_SHAPE:
                raise DataError(
                    f"image {path} has shape {tuple(image.shape)}, expected {IMAGE_SHAPE}"
                )
            images[start + offset] = image
    return images


def _read_bytes(path: str) -> torch.Tensor:
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as error:
        raise DataError(f"cannot read image {path}: {error}") from error
    if not data:
        raise DataError(f"image {path} is empty")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _decode_one(path: str, data: torch.Tensor) -> torch.Tensor:
    try:
        return decode_image(data, mode=ImageReadMode.RGB)
    except RuntimeError:  # torchvision decodes no BMP or TIFF: Pillow reads every listed kind
        return read_image(path)


def make_synthetic(n_train: int, n_test: int, seed: int, num_classes: int = 10) -> CifarArrays:
    """Learnable stand-in for CIFAR-10, a pure function of ``seed``: each class has its own
    mean colour and a smooth pattern (4x4 upsampled, so it survives crops and flips
    roughly), and every image is its class mean plus pixel noise. Classes are balanced."""
    for name, value in (("n_train", n_train), ("n_test", n_test), ("num_classes", num_classes)):
        check_int(name, value, 1)
    generator = torch.Generator().manual_seed(seed)
    colours = torch.rand(num_classes, 3, 1, 1, generator=generator)
    patterns = torch.rand(num_classes, 3, 4, 4, generator=generator)
    patterns = torch.nn.functional.interpolate(patterns, size=IMAGE_SHAPE[1:], mode="bilinear")
    class_means = 255 * (0.25 + 0.3 * colours + 0.2 * patterns)  # in [64, 191]: room for noise

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = (torch.arange(n) % num_classes)[torch.randperm(n, generator=generator)]
        noise = 40 * torch.randn(n, *IMAGE_SHAPE, generator=generator)  # pixel std, 0-255 scale
        images = (class_means[labels] + noise).round().clamp(0, 255).to(torch.uint8)
        return images, labels

    train_images, train_labels = draw(n_train)
    test_images, test_labels = draw(n_test)
    classes = [f"class{label}" for label in range(num_classes)]
    return CifarArrays(train_images, train_labels, test_images, test_labels, classes)


def subset(arrays: CifarArrays, train_subset: int | None, val_subset: int | None) -> CifarArrays:
    """The first ``train_subset`` training and first ``val_subset`` evaluation (test_*)
    samples; ``None`` keeps a split whole."""
    for name, value in (("train_subset", train_subset), ("val_subset", val_subset)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
    train_end = len(arrays.train_labels) if train_subset is None else train_subset
    test_end = len(arrays.test_labels) if val_subset is None else val_subset
    return replace(
        arrays,
        train_images=arrays.train_images[:train_end],
        train_labels=arrays.train_labels[:train_end],
        test_images=arrays.test_images[:test_end],
        test_labels=arrays.test_labels[:test_end],
    )


def holdout_validation(arrays: CifarArrays, val_fraction: float) -> CifarArrays:
    """Hold out the last ``val_fraction`` of the training set as the evaluation split
    (returned in test_*), so tuning never sees the test set; the real test set is kept aside
    in ``held_test`` for a final ``evaluate --split test``."""
    check_number("val_fraction", val_fraction, 0, 1, "()")
    n_train = len(arrays.train_labels)
    n_val = round(n_train * val_fraction)
    if not 1 <= n_val < n_train:
        raise ValueError(
            f"val_fraction {val_fraction} of {n_train} training samples leaves {n_val} for "
            "validation: need at least 1 and fewer than all"
        )
    cut = n_train - n_val
    return replace(
        arrays,
        train_images=arrays.train_images[:cut],
        train_labels=arrays.train_labels[:cut],
        test_images=arrays.train_images[cut:],
        test_labels=arrays.train_labels[cut:],
        held_test=(arrays.test_images, arrays.test_labels),
    )
