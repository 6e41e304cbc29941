"""Data-set fingerprints: small dicts to store in a checkpoint, so a resume can refuse data
that changed since the run started, and say what changed.

A fingerprint is a flat dict of str and int (JSON and ``torch.load(weights_only=True)``
safe): a ``kind``, the sample count, one ``count:<class>`` per class and sha256 digests.

>>> import torch
>>> before = fingerprint_arrays(torch.tensor([0, 1, 1]), None, ["cat", "dog"])
>>> after = fingerprint_arrays(torch.tensor([0, 1, 1, 0]), None, ["cat", "dog"])
>>> describe_change(before, after, "training")
"training samples 3 -> 4; class 'cat' 1 -> 2 samples"
>>> describe_change(before, before) is None
True
"""

import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

Fingerprint = dict[str, str | int]

VERSION = 1  # bump when what is hashed changes: fingerprints of another version never match
COUNT_PREFIX = "count:"
MAX_CLASSES_NAMED = 3  # a change line names at most this many classes, then "and N more"


def fingerprint_arrays(
    labels: torch.Tensor, images: torch.Tensor | None, classes: Sequence[str]
) -> Fingerprint:
    """Fingerprint of in-memory data: sample count, per-class counts, and the sha256 of the
    labels (as little-endian int64) and of the image bytes with their shape and dtype.
    ``images=None`` fingerprints the labels only. Every byte is hashed: sha256 runs at
    ~2 GB/s here (0.08 s for CIFAR-10's 150 MB of uint8 training images), too cheap to
    sample. Raises ``ValueError`` for labels outside ``range(len(classes))``."""
    labels = labels.detach().cpu().to(torch.int64).flatten()
    if len(labels) and not 0 <= int(labels.min()) <= int(labels.max()) < len(classes):
        raise ValueError(f"labels must lie in [0, {len(classes)}) for {len(classes)} classes, "
                         f"got [{int(labels.min())}, {int(labels.max())}]")
    counts = torch.bincount(labels, minlength=len(classes)).tolist()
    fingerprint: Fingerprint = {"version": VERSION, "kind": "arrays", "samples": len(labels)}
    fingerprint.update(_count_keys(classes, counts))
    fingerprint["labels_sha256"] = hashlib.sha256(labels.numpy().astype("<i8")).hexdigest()
    if images is not None:
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        images = images.detach().cpu().contiguous()
        fingerprint["images_shape"] = "x".join(str(size) for size in images.shape)
        fingerprint["images_dtype"] = str(images.dtype).removeprefix("torch.")
        # Bytes through a uint8 view: numpy has no bfloat16, and the bytes are what matter.
        image_bytes = images.flatten().view(torch.uint8).numpy()
        fingerprint["images_sha256"] = hashlib.sha256(image_bytes).hexdigest()
    return fingerprint


def fingerprint_files(
    files: Iterable[tuple[Path, int]], root: Path, classes: Sequence[str]
) -> Fingerprint:
    """Fingerprint of a data set on disk without reading it: file count, per-class counts,
    and the sha256 of the sorted (name relative to ``root``, size, label) lines. Cheap (one
    stat per file) and unchanged by copying the files elsewhere (no mtimes); an edit that
    keeps a file's size goes unseen. Raises ``OSError`` for a file that cannot be stat'ed."""
    counts = [0] * len(classes)
    lines = []
    prefix = os.path.join(os.fspath(root), "")  # with a trailing separator
    for path, label in files:
        if not 0 <= label < len(classes):
            raise ValueError(f"label {label} of {path} is outside [0, {len(classes)})")
        name = os.fspath(path)
        if name.startswith(prefix):  # the common case, ~4x faster than Path.relative_to
            relative = name[len(prefix):]
        else:  # e.g. root "." (no prefix); raises ValueError for a file outside root
            relative = Path(path).relative_to(root).as_posix()
        counts[label] += 1
        lines.append(f"{relative}\t{os.stat(name).st_size}\t{label}\n")
    digest = hashlib.sha256()
    for line in sorted(lines):
        digest.update(line.encode())
    fingerprint: Fingerprint = {"version": VERSION, "kind": "files", "samples": len(lines)}
    fingerprint.update(_count_keys(classes, counts))
    fingerprint["files_sha256"] = digest.hexdigest()
    return fingerprint


def describe_change(old: Fingerprint, new: Fingerprint, name: str = "data") -> str | None:
    """None when ``old`` and ``new`` are equal, else one line naming what changed, with
    ``name`` saying which data, e.g. "training samples 50000 -> 50001; class 'cat'
    5000 -> 5001 samples" or "validation labels differ"."""
    if old == new:
        return None
    if (old.get("kind"), old.get("version")) != (new.get("kind"), new.get("version")):
        return (f"{name} fingerprint is of another kind ({old.get('kind')} v{old.get('version')}"
                f" -> {new.get('kind')} v{new.get('version')}): cannot compare")
    unit = "files" if new["kind"] == "files" else "samples"
    changes = []
    if old.get("samples") != new.get("samples"):
        changes.append(f"{name} {unit} {old.get('samples')} -> {new.get('samples')}")
    old_counts, new_counts = _counts(old), _counts(new)
    if removed := sorted(old_counts.keys() - new_counts.keys()):
        changes.append(f"{name} classes removed {removed}")
    if added := sorted(new_counts.keys() - old_counts.keys()):
        changes.append(f"{name} classes added {added}")
    recounted = sorted(c for c in old_counts.keys() & new_counts.keys()
                       if old_counts[c] != new_counts[c])
    changes += [f"class {c!r} {old_counts[c]} -> {new_counts[c]} {unit}"
                for c in recounted[:MAX_CLASSES_NAMED]]
    if len(recounted) > MAX_CLASSES_NAMED:
        changes.append(f"and {len(recounted) - MAX_CLASSES_NAMED} more classes")
    if not changes:  # same counts: something finer changed
        for key, what in (("labels_sha256", "labels"),
                          ("files_sha256", "file names, sizes or labels"),
                          ("images_shape", "image shapes"), ("images_dtype", "image dtypes")):
            if old.get(key) != new.get(key):
                changes.append(f"{name} {what} differ")
        if not changes and old.get("images_sha256") != new.get("images_sha256"):
            changes.append(f"{name} images differ")
    if not changes:
        differing = sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))
        changes.append(f"{name} fingerprint differs in {', '.join(differing)}")
    return "; ".join(changes)


def _count_keys(classes: Sequence[str], counts: list[int]) -> Fingerprint:
    return {f"{COUNT_PREFIX}{name}": count for name, count in zip(classes, counts, strict=True)}


def _counts(fingerprint: Fingerprint) -> dict[str, str | int]:
    return {key.removeprefix(COUNT_PREFIX): value for key, value in fingerprint.items()
            if key.startswith(COUNT_PREFIX)}
