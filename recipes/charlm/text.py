"""Text for a language model: the bytes of a file or of a folder's files, split into
training and validation by file, the same way on every machine.

``"stdlib"`` names the Python standard library's own ``.py`` sources (every machine with
Python has them), without its test suites and installed packages.
"""

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from recipes.charlm.config import STDLIB
from recipes.runner.config.command_line import DataError

# Not the standard library's own code: installed packages and test suites.
SKIPPED_STDLIB_FOLDERS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


def list_files(text: str) -> tuple[Path, list[Path]]:
    """The folder that paths are relative to, and the files of ``text`` (a file, a folder
    read recursively, or ``"stdlib"``), sorted; hidden files and folders are left out."""
    stdlib = text == STDLIB
    root = Path(sysconfig.get_paths()["stdlib"] if stdlib else text)
    files = [root] if root.is_file() else []
    for folder, subfolders, names in os.walk(root):  # nothing for a file or a missing path
        subfolders[:] = [name for name in subfolders if not name.startswith(".")
                         and not (stdlib and name in SKIPPED_STDLIB_FOLDERS)]
        files += [Path(folder, name) for name in names
                  if not name.startswith(".") and (name.endswith(".py") or not stdlib)]
    if not files:
        raise DataError(f"--text {text}: " + ("the folder holds no files" if root.is_dir()
                                              else "no such file or folder"))
    return (root.parent if root.is_file() else root), sorted(files)


def split_files(root: Path, files: list[Path], val_fraction: float
                ) -> tuple[list[Path], list[Path]]:
    """(train, val), neither empty (given two files or more): validation holds the files
    whose path relative to ``root`` hashes below ``val_fraction``. Both are in hash order,
    so that the first bytes of each (a capped text) come from across the folder rather
    than from its first files by name."""
    def unit_hash(path: Path) -> float:  # sha256, not hash(): the same in every process
        digest = hashlib.sha256(path.relative_to(root).as_posix().encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64

    by_hash = sorted(files, key=unit_hash)
    n_val = min(max(1, sum(unit_hash(path) < val_fraction for path in files)), len(files) - 1)
    return by_hash[n_val:], by_hash[:n_val]


@dataclass(frozen=True)
class Segment:
    """``length`` bytes of ``path`` from byte ``start``."""

    path: Path
    start: int
    length: int


@dataclass(frozen=True)
class TextParts:
    """Where the training and validation bytes of a text lie, in the order they are read,
    and how many files the text has. Found with one ``stat`` per file, without reading."""

    train: list[Segment]
    val: list[Segment]
    files: int


def split_text(text: str, val_fraction: float) -> TextParts:
    """The parts of ``text``: each part's files whole, in the order of ``split_files``. A
    single file keeps its last ``val_fraction`` for validation, as nanoGPT splits one text.
    ``DataError`` names a missing or unreadable path."""
    root, files = list_files(text)
    try:
        sizes = [path.stat().st_size for path in files]
    except OSError as error:
        raise DataError(f"--text: cannot read {error.filename}: {error.strerror}") from None
    if len(files) > 1:
        size_of = dict(zip(files, sizes, strict=True))
        train, val = ([Segment(path, 0, size_of[path]) for path in part]
                      for part in split_files(root, files, val_fraction))
        return TextParts(train, val, len(files))
    size = sizes[0]
    cut = max(0, size - max(1, int(size * val_fraction)))  # an empty file: both empty
    return TextParts([Segment(files[0], 0, cut)], [Segment(files[0], cut, size - cut)], 1)


def cap(segments: list[Segment], limit: int) -> list[Segment]:
    """The first ``limit`` bytes of ``segments`` (all of them when they hold fewer)."""
    capped = []
    for segment in segments:
        if limit <= 0:
            break
        capped.append(Segment(segment.path, segment.start, min(segment.length, limit)))
        limit -= capped[-1].length
    return capped
