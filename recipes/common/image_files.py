"""Image-folder trees (``<split>/<class>/<file>``): which entries are classes, which files are
images, and reading one. The CIFAR and image-folder recipes both list their trees here, so
a file counts as an image in one exactly when it does in the other.
"""

import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from recipes.runner.config.command_line import DataError

# Pillow reads all of them; compared in lower case, so "CAT.JPG" is an image too.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def has_image_suffix(name: str) -> bool:
    return name.lower().endswith(IMAGE_SUFFIXES)


def class_names(split_dir: Path) -> list[str]:
    """The sorted names of the folders in ``split_dir``; hidden ones (``.name``) are left out."""
    return sorted(entry.name for entry in os.scandir(split_dir)
                  if entry.is_dir() and not entry.name.startswith("."))


def list_class_folder(folder: str | os.PathLike) -> tuple[list[str], list[str]]:
    """(images, others): the paths in ``folder`` sorted by name, hidden entries left out.
    An image is a file with one of ``IMAGE_SUFFIXES`` in any case; everything else (a
    README, a folder) is in ``others``. ``DataError`` when there is no image, or when an
    image name leads to no file (a broken link): it would fail only later, mid-run."""
    # Strings and scandir, not Path objects: listing 50k files stays well under a second.
    entries = sorted((entry for entry in os.scandir(folder) if not entry.name.startswith(".")),
                     key=lambda entry: entry.name)
    images, others = [], []
    for entry in entries:
        if not has_image_suffix(entry.name) or entry.is_dir():
            others.append(entry.path)
        elif entry.is_file():
            images.append(entry.path)
        else:
            raise DataError(f"cannot read image {entry.path}: not a file (a broken link?)")
    if not images:
        raise DataError(f"no images ({' '.join(IMAGE_SUFFIXES)}) in the class folder {folder}")
    return images, others


def read_image(path: str | os.PathLike) -> torch.Tensor:
    """The file decoded to uint8 RGB [3,H,W]; ``DataError`` naming the file if it cannot be."""
    try:
        with Image.open(path) as image:
            array = np.asarray(image.convert("RGB"))
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise DataError(f"cannot read image {path}: {error}") from None
    return torch.from_numpy(array.copy()).permute(2, 0, 1)
