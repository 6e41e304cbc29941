"""The text of a run encoded once to one file of bytes, read through a memory map.

As nanoGPT's ``train.bin``: the training bytes then the validation bytes (each part capped,
its files in the order of ``recipes.charlm.text``), stored in
``<cache root>/charlm/<key>.bin`` with a JSON sidecar. The run maps the file
(``torch.from_file``): the data order reads its windows from the page cache, which the kernel
fills on demand and may drop again, so a text larger than memory trains as a small one does.
The bytes, and so every window and batch, are those of the files read whole.

The key is the sha256 of the text's resolved path and the split keys (``--text``,
``--val-fraction``, ``--max-train-bytes``, ``--max-val-bytes``); the sidecar holds the
listing (each file's path, size and modification time, and the byte range taken) and the
sha256 of the encoded bytes. A listing that differs (a file added, removed, edited) or a file
whose sha256 does not match (damaged) is encoded again and replaced, atomically
(``write_atomically``): a process that has the old file mapped keeps reading it. Every start
hashes the file (streamed, about 1 GB/s): that checks it and gives the data fingerprint.
"""

import hashlib
import json
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from handlers.atomic_write import write_atomically, write_json_atomic
from recipes.charlm.config import STDLIB
from recipes.charlm.text import Segment
from recipes.common.paths import CACHE_ENV, cache_root
from recipes.runner.config.command_line import DataError

FORMAT = 1  # bump when the encoding or the listing changes: older files are then encoded again
CHUNK = 16 * 2**20  # bytes copied or hashed at a time: memory stays flat for any text size


@dataclass(frozen=True)
class EncodedText:
    """The training and validation bytes (uint8 views of one mapped file) and their sha256."""

    train: torch.Tensor
    val: torch.Tensor
    sha256: str


def encoded_path(text: str, val_fraction: float, max_train_bytes: int, max_val_bytes: int
                 ) -> Path:
    """Where the encoded text of these split keys is kept."""
    source = sysconfig.get_paths()["stdlib"] if text == STDLIB else str(Path(text).resolve())
    # stdlib takes fewer files of its folder than the folder itself does
    key = json.dumps([FORMAT, text == STDLIB, source, val_fraction, max_train_bytes,
                      max_val_bytes])
    return cache_root() / "charlm" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.bin"


def load_encoded(path: Path, train: list[Segment], val: list[Segment]) -> EncodedText:
    """The bytes of the ``train`` and ``val`` segments, mapped from ``path``: encoded there
    first when it is missing, stale or damaged. ``DataError`` names a text file that cannot
    be read or a cache folder that cannot be written."""
    listing = _listing(train + val)
    n_train, n_val = (sum(segment.length for segment in part) for part in (train, val))
    sha256 = _verified_sha256(path, listing, n_train + n_val)
    if sha256 is None:
        sha256 = _encode(path, listing, train + val)
    whole = torch.from_file(str(path), shared=False, size=n_train + n_val, dtype=torch.uint8)
    return EncodedText(whole[:n_train], whole[n_train:], sha256)


def _listing(segments: list[Segment]) -> list[list]:
    """Each segment's file, its size and modification time, and the range taken: any file
    touched changes it (an edit that keeps both size and mtime is the one change unseen)."""
    listing = []
    for segment in segments:
        try:
            stat = segment.path.stat()
        except OSError as error:
            raise DataError(f"--text: cannot read {error.filename}: {error.strerror}") from None
        listing.append([str(segment.path), stat.st_size, stat.st_mtime_ns, segment.start,
                        segment.length])
    return listing


def _verified_sha256(path: Path, listing: list[list], size: int) -> str | None:
    """The sha256 of the encoded file when its sidecar has this listing, its size is
    ``size`` and its bytes hash to the sidecar's sha256; else None (encode it again)."""
    try:
        sidecar = json.loads(path.with_suffix(".json").read_text())
        if sidecar.get("listing") != listing or path.stat().st_size != size:
            return None
        with open(path, "rb") as file:
            sha256 = hashlib.file_digest(file, "sha256").hexdigest()
    except (OSError, ValueError, AttributeError):  # missing, unreadable, not a JSON object
        return None
    return sha256 if sha256 == sidecar.get("sha256") else None


def _encode(path: Path, listing: list[list], segments: list[Segment]) -> str:
    """Copy the segments into ``path`` (then its sidecar), both atomically; their sha256."""
    digest = hashlib.sha256()

    def write(file: BinaryIO) -> None:
        for segment in segments:
            for chunk in _chunks(segment):
                file.write(chunk)
                digest.update(chunk)

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, write, file_mode=0o644)
        write_json_atomic(path.with_suffix(".json"),
                          {"listing": listing, "sha256": digest.hexdigest()})
    except OSError as error:
        raise DataError(f"cannot write the encoded text {path}: {error.strerror or error}; "
                        f"set {CACHE_ENV} to a writable folder") from None
    return digest.hexdigest()


def _chunks(segment: Segment) -> Iterator[bytes]:
    """``segment``'s bytes, ``CHUNK`` at a time; ``DataError`` when its file cannot be read
    or got shorter since it was listed."""
    left = segment.length
    try:
        with open(segment.path, "rb") as source:
            source.seek(segment.start)
            while left:
                chunk = source.read(min(CHUNK, left))
                if not chunk:
                    break
                left -= len(chunk)
                yield chunk
    except OSError as error:
        raise DataError(f"--text: cannot read {segment.path}: {error.strerror}") from None
    if left:
        raise DataError(f"--text: {segment.path} got shorter while it was read")
