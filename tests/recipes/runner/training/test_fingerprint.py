import io
import json
from pathlib import Path

import pytest
import torch

from recipes.runner.training.fingerprint import (
    describe_change,
    fingerprint_arrays,
    fingerprint_files,
)

CLASSES = ["cat", "dog", "frog"]


def labels_and_images(n=30):
    """Labels 0, 1, 2, 0, ... and random 3x4x4 uint8 images, the same every call."""
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(n) % 3
    images = torch.randint(0, 256, (n, 3, 4, 4), dtype=torch.uint8, generator=generator)
    return labels, images


def write_files(root, per_class=(3, 2, 2)):
    files = []
    for label, (name, count) in enumerate(zip(CLASSES, per_class, strict=True)):
        (root / name).mkdir(parents=True, exist_ok=True)
        for k in range(count):
            path = root / name / f"{k}.jpg"
            path.write_bytes(b"x" * (10 + k))
            files.append((path, label))
    return files


def assert_plain(fingerprint):
    assert all(isinstance(key, str) and type(value) in (str, int)
               for key, value in fingerprint.items())
    assert json.loads(json.dumps(fingerprint)) == fingerprint
    buffer = io.BytesIO()
    torch.save(fingerprint, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == fingerprint


def test_arrays_fingerprint_is_plain_deterministic_and_counts_classes():
    labels, images = labels_and_images()
    fingerprint = fingerprint_arrays(labels, images, CLASSES)
    assert_plain(fingerprint)
    assert fingerprint == fingerprint_arrays(labels.clone(), images.clone(), CLASSES)
    assert fingerprint["samples"] == 30
    assert [fingerprint[f"count:{name}"] for name in CLASSES] == [10, 10, 10]
    assert fingerprint["images_shape"] == "30x3x4x4" and fingerprint["images_dtype"] == "uint8"
    # The label dtype does not matter, their values do.
    assert fingerprint == fingerprint_arrays(labels.to(torch.int32), images, CLASSES)
    assert "images_sha256" not in fingerprint_arrays(labels, None, CLASSES)


def test_arrays_fingerprint_takes_any_image_dtype():
    labels, images = labels_and_images()
    half = fingerprint_arrays(labels, images.to(torch.bfloat16), CLASSES)
    assert half["images_dtype"] == "bfloat16"
    assert half["images_sha256"] != fingerprint_arrays(labels, images, CLASSES)["images_sha256"]


def test_arrays_fingerprint_rejects_labels_outside_the_classes_and_length_mismatch():
    labels, images = labels_and_images()
    with pytest.raises(ValueError, match="labels must lie in \\[0, 2\\)"):
        fingerprint_arrays(labels, images, CLASSES[:2])
    with pytest.raises(ValueError, match="29 images but 30 labels"):
        fingerprint_arrays(labels, images[1:], CLASSES)


def test_equal_fingerprints_describe_no_change():
    labels, images = labels_and_images()
    assert describe_change(fingerprint_arrays(labels, images, CLASSES),
                           fingerprint_arrays(labels, images, CLASSES)) is None


def test_an_added_sample_names_the_count_and_its_class():
    labels, images = labels_and_images(n=31)
    old = fingerprint_arrays(labels[:30], images[:30], CLASSES)
    new = fingerprint_arrays(labels, images, CLASSES)
    assert describe_change(old, new, "training") == (
        "training samples 30 -> 31; class 'cat' 10 -> 11 samples"
    )


def test_shuffled_labels_with_the_same_counts_say_labels_differ():
    labels, images = labels_and_images()
    old = fingerprint_arrays(labels, images, CLASSES)
    assert describe_change(old, fingerprint_arrays(labels.roll(1), images, CLASSES),
                           "validation") == "validation labels differ"


def test_one_changed_pixel_says_images_differ():
    labels, images = labels_and_images()
    old = fingerprint_arrays(labels, images, CLASSES)
    images[7, 1, 2, 3] ^= 1
    assert describe_change(old, fingerprint_arrays(labels, images, CLASSES),
                           "training") == "training images differ"
    assert describe_change(old, fingerprint_arrays(labels, images[:, :, :2], CLASSES),
                           "training") == "training image shapes differ"


def test_renamed_classes_are_named():
    labels, images = labels_and_images()
    old = fingerprint_arrays(labels, images, CLASSES)
    new = fingerprint_arrays(labels, images, ["cat", "dog", "toad"])
    assert describe_change(old, new) == "data classes removed ['frog']; data classes added ['toad']"


def test_many_recounted_classes_are_cut_short():
    classes = [f"c{k}" for k in range(6)]
    old = fingerprint_arrays(torch.arange(60) % 6, None, classes)
    new = fingerprint_arrays(torch.arange(60) % 6 // 2 * 2, None, classes)  # odd -> even
    assert describe_change(old, new) == (
        "class 'c0' 10 -> 20 samples; class 'c1' 10 -> 0 samples; class 'c2' 10 -> 20 samples; "
        "and 3 more classes"
    )


def test_files_fingerprint_counts_and_hashes_names_sizes_and_labels(tmp_path, monkeypatch):
    files = write_files(tmp_path / "data")
    fingerprint = fingerprint_files(files, tmp_path / "data", CLASSES)
    assert_plain(fingerprint)
    assert fingerprint["samples"] == 7
    assert [fingerprint[f"count:{name}"] for name in CLASSES] == [3, 2, 2]
    # Order-free, and unchanged by copying elsewhere (no absolute paths, no mtimes).
    assert fingerprint == fingerprint_files(reversed(files), tmp_path / "data", CLASSES)
    (tmp_path / "data").rename(tmp_path / "moved")
    moved = [(tmp_path / "moved" / path.relative_to(tmp_path / "data"), label)
             for path, label in files]
    assert fingerprint == fingerprint_files(moved, tmp_path / "moved", CLASSES)
    with pytest.raises(ValueError, match="is not in the subpath of"):
        fingerprint_files(moved, tmp_path / "data", CLASSES)
    monkeypatch.chdir(tmp_path / "moved")  # relative names under root "."
    relative = [(path.relative_to(tmp_path / "moved"), label) for path, label in moved]
    assert fingerprint == fingerprint_files(relative, Path("."), CLASSES)


def test_files_changes_are_described(tmp_path):
    root = tmp_path / "data"
    files = write_files(root)
    old = fingerprint_files(files, root, CLASSES)
    added = write_files(root, per_class=(4, 2, 2))
    assert describe_change(old, fingerprint_files(added, root, CLASSES), "training") == (
        "training files 7 -> 8; class 'cat' 3 -> 4 files"
    )
    (root / "cat/3.jpg").unlink()
    (root / "dog/0.jpg").write_bytes(b"longer than before")
    assert describe_change(old, fingerprint_files(files, root, CLASSES), "training") == (
        "training file names, sizes or labels differ"
    )


def test_fingerprints_of_another_kind_are_not_compared(tmp_path):
    files = write_files(tmp_path)
    labels = torch.tensor([label for _, label in files])
    message = describe_change(fingerprint_files(files, tmp_path, CLASSES),
                              fingerprint_arrays(labels, None, CLASSES))
    assert message == "data fingerprint is of another kind (files v1 -> arrays v1): cannot compare"


def _counts_of(fingerprint):
    return {key: value for key, value in fingerprint.items() if key.startswith("count:")}


def test_files_fingerprint_sees_two_labels_swapped_with_names_sizes_and_counts_kept(tmp_path):
    """Two files trade labels: every name, size and per-class count stays, only the labels
    the files train with differ, and the fingerprint must say so."""
    root = tmp_path / "data"
    files = write_files(root, per_class=(2, 2, 2))
    (cat_path, cat), (dog_path, dog) = files[0], files[2]
    assert (cat, dog) == (0, 1) and cat_path.stat().st_size == dog_path.stat().st_size
    swapped = [(cat_path, dog), files[1], (dog_path, cat), *files[3:]]
    old, new = (fingerprint_files(listed, root, CLASSES) for listed in (files, swapped))
    assert _counts_of(old) == _counts_of(new) and old["samples"] == new["samples"]
    assert old != new
    assert describe_change(old, new, "training") == "training file names, sizes or labels differ"
