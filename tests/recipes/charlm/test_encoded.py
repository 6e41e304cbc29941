"""charlm's text encoded once to a memory-mapped file: the same bytes, windows and batches as
the files read whole, re-encoded when the text changes or the file is damaged."""

import hashlib
from pathlib import Path

import pytest
import torch

from recipes.charlm import encoded
from recipes.charlm.recipe import Config, build, load_data
from recipes.charlm.text import Segment
from recipes.runner.api import Context
from recipes.runner.config.command_line import DataError
from tests.helpers import write_text_folder

# Digests of the batches that charlm gave for these texts and seed 3 when it read the files
# whole into memory, before the encoded file: (training windows, validation windows, the
# data's sha256, epoch 1's batches, epoch 2's from batch 3 on, the validation batches), for
# one process and for rank 1 of 2. Equal digests: the same data order, so the same results.
BEFORE = {
    ("folder", 1): ((1146, 39), "99a8601980392bdf", "0aa4b3e078fffd63", "c86ae9cf2c61fdb5",
                    "2d90642faea7585e"),
    ("folder", 2): ((1146, 39), "99a8601980392bdf", "a6aeb948c858104b", "87ab85851e28616c",
                    "216796e7adfddf55"),
    ("single", 1): ((417, 46), "041df340f2784039", "3fe4528d22665474", "90d452f1bdf305da",
                    "0e3462273ff2a3b5"),
    ("single", 2): ((417, 46), "041df340f2784039", "d408b48620fdb914", "381903833ede2289",
                    "8b2641ed3fffea87"),
    ("capped", 1): ((186, 31), "13fe7c1f4e49eafe", "cf948e274605d696", "a85ea06f67314629",
                    "ee84a88506bfd44b"),
    ("capped", 2): ((186, 31), "13fe7c1f4e49eafe", "4b38a17b1f3bfe84", "59cc7193c0a94af1",
                    "23abd5025612fa4f"),
}


def texts(root: Path) -> dict[str, Config]:
    folder = write_text_folder(root / "text", n_files=30, lines_per_file=20)
    single = root / "single.txt"
    single.write_bytes((folder / "module_0.py").read_bytes() * 12)
    common = {"block_size": 16, "batch_size": 8, "seed": 3}
    return {"folder": Config(text=str(folder), **common),
            "single": Config(text=str(single), **common),
            "capped": Config(text=str(folder), max_train_bytes=3000, max_val_bytes=500,
                             **common)}


def digest(tensors) -> str:
    sha = hashlib.sha256()
    for tensor in tensors:
        sha.update(tensor.numpy().tobytes())
    return sha.hexdigest()[:16]


def encoded_file(config: Config) -> Path:
    return encoded.encoded_path(config.text, config.val_fraction, config.max_train_bytes,
                                config.max_val_bytes)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", ["folder", "single", "capped"])
def test_the_batches_are_the_ones_of_the_text_read_whole(name, world, tmp_path):
    config = texts(tmp_path)[name]
    corpus = load_data(config)
    parts = build(config, corpus, Context(torch.device("cpu"), world - 1, world, tmp_path))
    batches = parts.train_batches
    assert (corpus.windows, corpus.facts["sha256"][:16], digest(batches.epoch_batches(1)),
            digest(batches.epoch_batches(2, 3)), digest(parts.val_batches)) == BEFORE[name, world]


def test_the_training_and_validation_bytes_are_the_files_and_are_mapped_not_read(tmp_path):
    config = texts(tmp_path)["single"]
    whole = Path(config.text).read_bytes()
    corpus = load_data(config)
    assert corpus.train.numpy().tobytes() + corpus.val.numpy().tobytes() == whole
    assert corpus.facts["sha256"] == hashlib.sha256(whole).hexdigest()
    maps = Path("/proc/self/maps").read_text()
    assert str(encoded_file(config)) in maps  # the tensors are views of the mapped file


def test_the_text_is_encoded_once_and_again_when_a_file_changes(tmp_path):
    config = texts(tmp_path)["folder"]
    first = load_data(config)
    path = encoded_file(config)
    inode = path.stat().st_ino
    assert load_data(config).facts == first.facts and path.stat().st_ino == inode  # reused

    module = Path(config.text) / "module_0.py"
    module.write_text(module.read_text() + "# one more line\n")
    changed = load_data(config)
    assert path.stat().st_ino != inode  # encoded again, atomically (a new file)
    assert changed.facts["sha256"] != first.facts["sha256"]
    assert changed.facts["train_bytes"] + changed.facts["val_bytes"] == \
        first.facts["train_bytes"] + first.facts["val_bytes"] + len("# one more line\n")
    assert torch.equal(first.train, first.train.clone())  # the old mapping is still readable


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "sidecar lost"])
def test_a_damaged_encoded_file_is_encoded_again(damage, tmp_path):
    config = texts(tmp_path)["single"]
    expected = load_data(config).facts
    path = encoded_file(config)
    data = bytearray(path.read_bytes())
    if damage == "flip a byte":
        data[100] ^= 1
        path.write_bytes(data)
    elif damage == "truncate":
        path.write_bytes(data[:-10])
    else:
        path.with_suffix(".json").unlink()
    corpus = load_data(config)
    assert corpus.facts == expected
    assert corpus.train.numpy().tobytes() + corpus.val.numpy().tobytes() == \
        Path(config.text).read_bytes()


def test_a_cache_folder_that_cannot_be_written_is_a_user_error_naming_it(tmp_path, monkeypatch):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("IGNITE_ENGINE_CACHE", str(blocker / "cache"))
    config = texts(tmp_path)["single"]
    with pytest.raises(DataError, match=r"^cannot write the encoded text .*a file/cache/charlm/"
                                        r"\w+\.bin: .*; set IGNITE_ENGINE_CACHE to a writable "
                                        r"folder$"):
        load_data(config)


@pytest.mark.parametrize("problem, error", [
    ("a folder", "--text: cannot read .*a folder: Is a directory"),
    ("shorter", "--text: .*shorter.txt got shorter while it was read")])
def test_a_text_file_that_cannot_be_read_whole_is_a_user_error_naming_it(problem, error,
                                                                         tmp_path):
    (tmp_path / "a folder").mkdir()
    (tmp_path / "shorter.txt").write_text("twelve bytes")
    segment = Segment(tmp_path / ("a folder" if problem == "a folder" else "shorter.txt"), 0, 20)
    with pytest.raises(DataError, match=error):
        encoded.load_encoded(tmp_path / "cache" / "x.bin", [segment], [])
    assert not (tmp_path / "cache" / "x.bin").exists()


def test_one_text_named_two_ways_shares_one_encoded_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text").mkdir()
    assert encoded.encoded_path("text", 0.1, 100, 10) == \
        encoded.encoded_path("./text/../text/", 0.1, 100, 10) == \
        encoded.encoded_path(str(tmp_path / "text"), 0.1, 100, 10)
    assert encoded.encoded_path("text", 0.1, 100, 10) != encoded.encoded_path("text", 0.1, 99, 10)
