"""The hand-off of our CIFAR-10 arrays to airbench94's own loader, and its step window, on
the CPU (airbench's loader takes ``gpu="cpu"``; its training needs CUDA)."""

import math

import pytest
import torch

from benchmarks.harness.plan import FULL
from benchmarks.sections import s5_gpu
from recipes.cifar.data import make_synthetic
from recipes.cifar.recipe import Config

airbench = pytest.importorskip("airbench")

from benchmarks.arms import airbench94  # noqa: E402  (imports airbench)

BATCH = 8


@pytest.fixture
def arrays():
    return make_synthetic(n_train=8 * BATCH, n_test=12, seed=5)


def test_airbench_reads_our_images_labels_and_classes_in_our_order(arrays, tmp_path):
    folder = airbench94.write_airbench_data(arrays, tmp_path)
    assert folder == tmp_path / airbench94.FOLDER
    splits = {True: (arrays.train_images, arrays.train_labels),
              False: (arrays.test_images, arrays.test_labels)}
    for train, (images, labels) in splits.items():
        loader = airbench.CifarLoader(str(folder), train=train, batch_size=BATCH, gpu="cpu")
        assert loader.classes == arrays.classes
        assert loader.labels.dtype == torch.int64 and torch.equal(loader.labels, labels)
        # airbench keeps images as fp16 in [0, 1], NCHW: fp16 holds k / 255 closely enough
        # for every byte to come back exactly.
        assert loader.images.dtype == torch.float16 and loader.images.shape == images.shape
        assert torch.equal((loader.images.float() * 255).round().to(torch.uint8), images)


def test_the_files_are_in_airbench_s_own_format(arrays, tmp_path):
    saved = torch.load(airbench94.write_airbench_data(arrays, tmp_path) / "train.pt")
    assert set(saved) == {"images", "labels", "classes"}
    assert saved["images"].dtype == torch.uint8 and saved["images"].shape == (8 * BATCH, 32, 32, 3)


def test_the_window_holds_the_steps_between_its_two_synchronised_marks(arrays, tmp_path,
                                                                       monkeypatch):
    folder = airbench94.write_airbench_data(arrays, tmp_path)
    consumed, synced_after = [0], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synced_after.append(consumed[0]))
    loader = airbench94.WindowLoader(str(folder), warmup=2, timed=3, gpu="cpu",
                                     **airbench94.loader_options(BATCH))
    labels = []
    for _, batch_labels in loader:
        consumed[0] += 1
        labels.append(batch_labels)
    assert synced_after == [2, 5]  # steps 3, 4 and 5 lie between the marks
    assert loader.timer.seconds > 0
    # One epoch of airbench's own loader: every training image once, shuffled.
    assert torch.equal(torch.cat(labels).sort().values, arrays.train_labels.sort().values)


@pytest.mark.parametrize("batches_per_epoch", [1, 9, 48, 195, 196])
def test_train_runs_exactly_the_steps_asked_for(batches_per_epoch):
    for steps in range(1, batches_per_epoch + 1):
        epochs = airbench94.epochs_for_steps(steps, batches_per_epoch)
        assert math.ceil(batches_per_epoch * epochs) == steps  # airbench's total_train_steps


def test_the_full_plan_s_window_fits_one_epoch_at_batch_1024():
    batches_per_epoch = 50_000 // max(s5_gpu.BATCH_SIZES)
    assert FULL.gpu_warmup + FULL.gpu_timed + 1 <= batches_per_epoch


def test_the_runs_are_airbench_s_then_the_recipe_s_four(tmp_path, monkeypatch):
    monkeypatch.setattr(s5_gpu, "recipe_precision", lambda: "bf16")  # it resolves on CUDA
    arms = s5_gpu.run_arms(tmp_path, epochs=None)
    assert [(arm.arm, arm.batch_size) for arm in arms] == [
        ("airbench94", 1024), ("recipe, eager", 256), ("recipe, compiled", 256),
        ("recipe, eager", 1024), ("recipe, compiled", 1024)]
    assert arms[0].epochs == 9.9 and {arm.epochs for arm in arms[1:]} == {Config().epochs}
    assert len({arm.command for arm in arms}) == len(arms)  # the key each repeat is filed by
    assert {arm.epochs for arm in s5_gpu.run_arms(tmp_path, epochs=1)} == {1}
