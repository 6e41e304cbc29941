import logging
import os
from pathlib import Path

import pytest
import torch
from PIL import Image
from torchvision.io import encode_jpeg, encode_png, write_file

from recipes.cifar import data as cifar_data
from recipes.cifar.data import (
    DataError,
    holdout_validation,
    load_cifar10,
    make_synthetic,
    subset,
)
from recipes.common import paths
from recipes.common.paths import CACHE_ENV, SHARED_DATA

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")
REAL_CIFAR = SHARED_DATA / "cifar10"  # the real data set, where this machine has it


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch) -> Path:
    """Every test caches decoded images in its own folder, never in the user's cache."""
    folder = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv(CACHE_ENV, str(folder))
    return folder


@pytest.fixture
def count_decodes(monkeypatch) -> list[int]:
    """Wraps ``_decode_files``; the list grows by one per decoded split."""
    calls = []
    decode = cifar_data._decode_files

    def counting(paths):
        calls.append(len(paths))
        return decode(paths)

    monkeypatch.setattr(cifar_data, "_decode_files", counting)
    return calls


def assert_same_arrays(a, b) -> None:
    assert a.classes == b.classes
    for name in ("train_images", "train_labels", "test_images", "test_labels"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def write_tree(root: Path, classes=("cat", "dog", "frog"), per_class=4) -> dict[Path, torch.Tensor]:
    """Image folders with PNGs (exact pixels) in train/ and JPEGs in test/; returns PNG pixels."""
    generator = torch.Generator().manual_seed(0)
    pixels = {}
    for split, encode in (("train", encode_png), ("test", encode_jpeg)):
        for name in classes:
            folder = root / split / name
            folder.mkdir(parents=True)
            for k in range(per_class):
                image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=generator)
                suffix = ".png" if split == "train" else ".jpg"
                path = folder / f"{k:04d}{suffix}"
                write_file(str(path), encode(image))
                pixels[path] = image
    return pixels


def test_image_folders_load_in_round_robin_class_order_with_exact_png_pixels(tmp_path):
    pixels = write_tree(tmp_path)
    arrays = load_cifar10(tmp_path, download=False)
    assert arrays.classes == ["cat", "dog", "frog"]
    assert arrays.train_images.shape == (12, 3, 32, 32) and arrays.train_images.dtype == torch.uint8
    assert arrays.test_images.shape == (12, 3, 32, 32)
    assert arrays.train_labels.tolist() == [0, 1, 2] * 4
    assert arrays.test_labels.dtype == torch.int64
    # Sample 4 is the second image of class 'dog'.
    assert torch.equal(arrays.train_images[4], pixels[tmp_path / "train/dog/0001.png"])


def test_image_folders_read_every_listed_kind_of_image_in_any_case(tmp_path):
    write_tree(tmp_path)
    pixels = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(1))
    Image.fromarray(pixels.permute(1, 2, 0).numpy()).save(tmp_path / "train/cat/0004.BMP")
    (tmp_path / "train/cat/notes.txt").write_text("not an image: ignored")
    arrays = load_cifar10(tmp_path, download=False)
    assert len(arrays.train_labels) == 13
    # Round robin: cat's fifth image comes after every class's fourth.
    assert arrays.train_labels[12] == 0 and torch.equal(arrays.train_images[12], pixels)


def test_class_sets_must_match_between_train_and_test(tmp_path):
    write_tree(tmp_path)
    (tmp_path / "test/frog").rename(tmp_path / "test/toad")
    with pytest.raises(DataError, match="only in train \\['frog'\\], only in test \\['toad'\\]"):
        load_cifar10(tmp_path, download=False)


def test_corrupt_jpeg_raises_data_error_naming_the_file(tmp_path):
    write_tree(tmp_path)
    bad = tmp_path / "test/dog/0002.jpg"
    bad.write_bytes(b"\xff\xd8" + b"not really a jpeg" * 10)
    with pytest.raises(DataError, match=str(bad)):
        load_cifar10(tmp_path, download=False)


def test_missing_image_raises_data_error_naming_the_file(tmp_path):
    write_tree(tmp_path)
    dangling = tmp_path / "train/cat/0009.png"
    dangling.symlink_to(tmp_path / "nowhere.png")
    with pytest.raises(DataError, match=str(dangling)):
        load_cifar10(tmp_path, download=False)


def test_wrong_image_size_raises_data_error(tmp_path):
    write_tree(tmp_path)
    path = tmp_path / "train/cat/0000.png"
    write_file(str(path), encode_png(torch.zeros(3, 16, 16, dtype=torch.uint8)))
    with pytest.raises(DataError, match="0000.png has shape \\(3, 16, 16\\)"):
        load_cifar10(tmp_path, download=False)


def test_missing_data_and_failed_download_explain_where_and_how(tmp_path, monkeypatch):
    def offline(data_dir):
        (data_dir / "cifar-10-python.tar.gz").parent.mkdir(parents=True)  # as torchvision does
        raise OSError("network unreachable")

    monkeypatch.setattr(cifar_data, "download_python_batches", offline)
    with pytest.raises(DataError) as raised:
        load_cifar10(tmp_path / "data" / "nothing")
    message = str(raised.value)
    shared, local = paths.data_dir_candidates("cifar10")
    assert message.startswith(f"no CIFAR-10 found in {shared}") and f", {local}" in message
    assert str(tmp_path / "data" / "nothing") in message and "network unreachable" in message
    assert "train/<class>" in message and "cifar-10-batches-py" in message
    assert message.endswith("with --data-dir")
    assert list(tmp_path.iterdir()) == []  # the folder the failed download made is gone
    with pytest.raises(DataError) as raised:
        load_cifar10(tmp_path / "nothing", download=False)
    assert str(raised.value) == (
        f"no CIFAR-10 found in {tmp_path / 'nothing'} (no such folder): expected image folders "
        "train/<class>/*.jpg and test/<class>/*.jpg, or the official python batches "
        "cifar-10-batches-py/; name the folder that holds them with --data-dir")


def test_python_batches_are_read_in_torchvision_layout(tmp_path, monkeypatch):
    class FakeCIFAR10:  # stands in for torchvision's reader: NHWC uint8 numpy + targets
        def __init__(self, root, train, download):
            assert not download and Path(root) == tmp_path
            n = 5 if train else 3
            self.data = torch.arange(n * 32 * 32 * 3).remainder(256).to(torch.uint8)
            self.data = self.data.view(n, 32, 32, 3).numpy()
            self.targets = list(range(n))
            self.classes = [f"c{k}" for k in range(10)]

    (tmp_path / "cifar-10-batches-py").mkdir()
    monkeypatch.setattr(cifar_data.torchvision.datasets, "CIFAR10", FakeCIFAR10)
    arrays = load_cifar10(tmp_path, download=False)
    assert arrays.train_images.shape == (5, 3, 32, 32)
    assert arrays.test_images.shape == (3, 3, 32, 32)
    assert arrays.train_images[0, 2, 0, 1] == 5  # NHWC element (0, 0, 1, 2): (0*32 + 1)*3 + 2
    assert arrays.train_labels.tolist() == [0, 1, 2, 3, 4]


def test_synthetic_is_a_pure_function_of_the_seed():
    a, b = make_synthetic(50, 20, seed=3), make_synthetic(50, 20, seed=3)
    c = make_synthetic(50, 20, seed=4)
    assert torch.equal(a.train_images, b.train_images) and torch.equal(a.test_labels, b.test_labels)
    assert not torch.equal(a.train_images, c.train_images)
    assert a.train_images.shape == (50, 3, 32, 32) and a.train_images.dtype == torch.uint8
    assert a.train_labels.dtype == torch.int64 and len(a.classes) == 10
    assert torch.bincount(a.train_labels, minlength=10).tolist() == [5] * 10


def test_synthetic_classes_are_separable_by_their_means():
    arrays = make_synthetic(2000, 500, seed=0)
    train = arrays.train_images.float()
    means = torch.stack([train[arrays.train_labels == k].mean(0) for k in range(10)])
    # Nearest class mean on the test split: far above the 10% of chance.
    distances = torch.cdist(arrays.test_images.float().flatten(1), means.flatten(1))
    accuracy = (distances.argmin(1) == arrays.test_labels).float().mean()
    assert accuracy > 0.9


def test_subset_takes_the_first_samples_and_none_keeps_all():
    arrays = make_synthetic(30, 20, seed=0)
    small = subset(arrays, train_subset=10, val_subset=None)
    assert torch.equal(small.train_images, arrays.train_images[:10])
    assert torch.equal(small.test_labels, arrays.test_labels)
    assert len(subset(arrays, None, 5).test_labels) == 5
    with pytest.raises(ValueError, match="train_subset"):
        subset(arrays, 0, None)


def test_holdout_validation_moves_the_last_fraction_of_train_to_the_eval_split():
    arrays = make_synthetic(100, 20, seed=0)
    split = holdout_validation(arrays, 0.2)
    assert torch.equal(split.train_images, arrays.train_images[:80])
    assert torch.equal(split.test_images, arrays.train_images[80:])
    assert torch.equal(split.test_labels, arrays.train_labels[80:])
    for bad in (0, 1, 1.5, 0.001):
        with pytest.raises(ValueError, match="val_fraction"):
            holdout_validation(arrays, bad)


@pytest.mark.skipif(not REAL_CIFAR.is_dir(), reason="real CIFAR-10 folders not present")
def test_real_cifar_slice_loads_through_a_symlink_tree(tmp_path):
    for split in ("train", "test"):
        for name in ("airplane", "cat"):
            folder = tmp_path / split / name
            folder.mkdir(parents=True)
            for source in sorted((REAL_CIFAR / split / name).iterdir())[:20]:
                (folder / source.name).symlink_to(source)
    arrays = load_cifar10(tmp_path, download=False)
    assert arrays.classes == ["airplane", "cat"]
    assert arrays.train_images.shape == (40, 3, 32, 32)
    assert arrays.test_labels.tolist() == [0, 1] * 20
    # Real photos: pixel values spread over most of the 0-255 range.
    assert arrays.train_images.float().std() > 30


def test_second_load_comes_from_the_cache_and_equals_a_fresh_decode(tmp_path, count_decodes,
                                                                     cache_dir):
    write_tree(tmp_path / "data")
    first = load_cifar10(tmp_path / "data", download=False)
    assert count_decodes == [12, 12]  # train and test decoded once
    assert cifar_data.decoded_cache_path(tmp_path / "data").parent.parent == cache_dir
    second = load_cifar10(tmp_path / "data", download=False)
    assert count_decodes == [12, 12]
    assert_same_arrays(first, second)
    assert [p.name for p in cache_dir.rglob("*") if p.is_file()] == [
        cifar_data.decoded_cache_path(tmp_path / "data").name
    ]  # no temp file left behind


@pytest.mark.parametrize("change", ["touch", "add", "remove", "rewrite"])
def test_a_changed_file_listing_invalidates_the_cache(tmp_path, count_decodes, change):
    data = tmp_path / "data"
    pixels = write_tree(data)
    load_cifar10(data, download=False)
    path = data / "train/dog/0001.png"
    if change == "touch":  # same bytes, new mtime
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    elif change == "add":
        write_file(str(data / "train/dog/0099.png"), encode_png(pixels[path]))
    elif change == "remove":
        path.unlink()
    else:  # other pixels, whatever the size and mtime come out as
        write_file(str(path), encode_png(torch.zeros(3, 32, 32, dtype=torch.uint8)))
    count_decodes.clear()
    cached = load_cifar10(data, download=False)
    assert count_decodes == [len(cached.train_labels), 12]  # decoded again, both splits
    assert_same_arrays(cached, load_cifar10(data, download=False))
    assert len(count_decodes) == 2  # and the new state was cached


def test_the_cache_works_for_a_data_dir_given_as_dot(tmp_path, count_decodes, monkeypatch):
    write_tree(tmp_path / "data")
    monkeypatch.chdir(tmp_path / "data")
    first = load_cifar10(Path("."), download=False)
    assert_same_arrays(first, load_cifar10(tmp_path / "data", download=False))  # same cache
    assert count_decodes == [12, 12]


def test_default_cache_folder_is_the_users_cache_dir_not_the_data_folder(tmp_path,
                                                                          monkeypatch):
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = cifar_data.decoded_cache_path(tmp_path / "data")
    assert path.parent == tmp_path / "xdg" / "ignite-engine" / "cifar10"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cifar_data.decoded_cache_path(tmp_path / "data").parent == (
        tmp_path / "home" / ".cache" / "ignite-engine" / "cifar10"
    )
    # Another data folder gets its own cache file.
    assert cifar_data.decoded_cache_path(tmp_path / "other") != path


def garbage(cache: Path) -> None:
    cache.write_bytes(b"not a torch file")


def truncated(cache: Path) -> None:
    cache.write_bytes(cache.read_bytes()[: cache.stat().st_size // 2])


def edited_pixel(cache: Path) -> None:  # loads fine and the listing matches: only the checksum
    payload = torch.load(cache, weights_only=True)
    payload["train_images"][0, 0, 0, 0] ^= 1
    torch.save(payload, cache)


@pytest.mark.parametrize("damage", [garbage, truncated, edited_pixel])
def test_a_corrupt_cache_is_rebuilt_never_trusted(tmp_path, count_decodes, caplog, damage):
    data = tmp_path / "data"
    write_tree(data)
    fresh = load_cifar10(data, download=False)
    damage(cifar_data.decoded_cache_path(data))
    count_decodes.clear()
    with caplog.at_level(logging.WARNING, logger=cifar_data.__name__):
        rebuilt = load_cifar10(data, download=False)
    assert count_decodes == [12, 12]
    assert "is corrupt" in caplog.text and "decoding again" in caplog.text
    assert_same_arrays(fresh, rebuilt)
    count_decodes.clear()
    assert_same_arrays(fresh, load_cifar10(data, download=False))  # the rebuilt cache is good
    assert count_decodes == []


def test_an_unwritable_cache_folder_only_warns(tmp_path, count_decodes, caplog, monkeypatch):
    data = tmp_path / "data"
    write_tree(data)
    blocker = tmp_path / "a-file"  # a folder cannot be made under a file, even as root
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))
    with caplog.at_level(logging.WARNING, logger=cifar_data.__name__):
        arrays = load_cifar10(data, download=False)
        load_cifar10(data, download=False)
    assert len(arrays.train_labels) == 12 and count_decodes == [12, 12, 12, 12]
    assert "could not write the decoded-image cache" in caplog.text


def test_a_failed_cache_write_leaves_no_temp_file(tmp_path, count_decodes, caplog, monkeypatch,
                                                  cache_dir):
    def disk_full(payload, file):
        file.write(b"half a cache")
        raise RuntimeError("PytorchStreamWriter failed writing file: No space left on device")

    write_tree(tmp_path / "data")
    monkeypatch.setattr(cifar_data.torch, "save", disk_full)
    with caplog.at_level(logging.WARNING, logger=cifar_data.__name__):
        load_cifar10(tmp_path / "data", download=False)
    assert "No space left on device" in caplog.text
    assert [p for p in cache_dir.rglob("*") if p.is_file()] == []
