"""recipes.images.data: listing and checking trees, per-sample seeded augmentation, and
training batches that resume exactly mid-epoch with and without worker processes."""

import io
from pathlib import Path

import pytest
import torch
from ignite.engine import Events
from torch import nn

from engine.events import TrainEvents
from engine.trainer import create_trainer
from recipes.common.data_order import IndexBatches
from recipes.common.image_files import read_image
from recipes.images.data import (
    EpochBatchSampler,
    ImageFiles,
    NormaliseOnDevice,
    TrainLoader,
    channel_stats,
    eval_loader,
    eval_transform,
    hold_out,
    list_image_folders,
    train_transform,
)
from recipes.runner.config.command_line import DataError

# The filter in recipes.images.data is reset by pytest's own warning capture.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

@pytest.fixture
def tree(tmp_path, make_image_tree) -> Path:
    return make_image_tree(tmp_path / "tree", {"train": 8, "val": 2})


def test_listing_labels_files_by_sorted_class_and_skips_non_images(tree):
    (tree / "train" / "dog" / "README.md").write_text("not an image")
    (tree / "train" / "dog" / ".DS_Store").write_text("hidden: ignored")
    folders = list_image_folders(tree)
    assert folders.classes == ["cat", "dog", "eel"] and folders.val_source == "val"
    assert len(folders.train) == 24 and len(folders.val) == 6
    assert [label for _, label in folders.train] == [0] * 8 + [1] * 8 + [2] * 8
    assert folders.train[8][0] == str(tree / "train" / "dog" / "000.jpg")
    assert folders.skipped == [str(tree / "train" / "dog" / "README.md")]


def test_test_folder_serves_as_validation_and_may_lack_a_class(tmp_path, make_image_tree):
    tree = make_image_tree(tmp_path, {"train": 2})
    make_image_tree(tmp_path, {"test": 1}, classes=("cat", "dog"))
    folders = list_image_folders(tree)
    assert folders.val_source == "test" and [label for _, label in folders.val] == [0, 1]


@pytest.mark.parametrize("breakage, message", [
    (lambda tree: (tree / "val" / "fox").mkdir(), "train/ lacks: ['fox']"),
    (lambda tree: (tree / "train" / "gnu").mkdir(), "no images"),
    (lambda tree: [path.unlink() for path in (tree / "val" / "eel").iterdir()], "no images"),
    (lambda tree: [path.rename(path.with_suffix(".txt"))
                   for path in (tree / "train" / "cat").iterdir()], "no images"),
    (lambda tree: [folder.rename(tree / "other" / folder.name) for folder in
                   [*(tree / "train").iterdir(), (tree / "other").mkdir()][:-1]],
     "no class folders"),
    (lambda tree: (tree / "val").rename(tree / "elsewhere"), "no val/ or test/"),
    (lambda tree: (tree / "train").rename(tree / "training"), "no train/ folder"),
])
def test_bad_trees_raise_a_data_error_saying_what_is_wrong(tree, breakage, message):
    breakage(tree)
    with pytest.raises(DataError, match=message.replace("[", r"\[").replace("]", r"\]")):
        list_image_folders(tree)


def test_hold_out_takes_the_same_files_from_every_class_each_time(tmp_path, make_image_tree):
    tree = make_image_tree(tmp_path, {"train": 10})
    folders = list_image_folders(tree, val_fraction=0.2)
    assert folders.val_source == "train (0.2 held out)"
    assert [label for _, label in folders.val] == [0, 0, 1, 1, 2, 2]
    assert len(folders.train) == 24
    assert not {path for path, _ in folders.val} & {path for path, _ in folders.train}
    again = list_image_folders(tree, val_fraction=0.2)
    assert again.val == folders.val and again.train == folders.train
    with pytest.raises(DataError, match="holds out none"):
        hold_out(folders.train[:2], 0.1, tree)


def test_a_corrupt_or_unreadable_image_names_its_file(tree):
    broken = tree / "train" / "cat" / "001.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    with pytest.raises(DataError, match=f"cannot read image {broken}"):
        read_image(str(broken))
    with pytest.raises(DataError, match="cannot read image .*missing.png"):
        read_image(str(tree / "missing.png"))


def test_transforms_give_the_side_asked_for_from_any_size(tree):
    image = read_image(str(tree / "train" / "cat" / "000.jpg"))
    assert image.shape == (3, 12, 12) and image.dtype == torch.uint8
    for size in (8, 80):  # pad-and-crop, and random resized crop
        assert train_transform(size)(image).shape == (3, size, size)
        assert eval_transform(size)(image).shape == (3, size, size)


def test_channel_stats_are_measured_on_the_evaluation_view(tree):
    folders = list_image_folders(tree)
    mean, std = channel_stats(folders.train, 8)
    assert len(mean) == len(std) == 3
    assert 0.2 < mean[0] < 0.7 and 0.1 < std[0] < 0.4  # colours 0-80, 80-160, 160-240 / 255
    assert channel_stats(folders.train, 8) == (mean, std)


def test_a_samples_augmentation_depends_on_seed_epoch_and_index_only(tree):
    dataset = ImageFiles(list_image_folders(tree).train, train_transform(8), seed=3)
    torch.manual_seed(0)
    first = dataset[(2, 5)][0]
    global_state = torch.get_rng_state()
    torch.manual_seed(123)  # another global stream: same sample
    assert torch.equal(dataset[(2, 5)][0], first)
    torch.manual_seed(0)
    dataset[(2, 5)]
    assert torch.equal(torch.get_rng_state(), global_state)  # the caller's stream untouched
    # Other epochs draw other crops and flips (18 outcomes here: several differ).
    views = {tuple(dataset[(epoch, 5)][0].flatten().tolist()) for epoch in range(1, 7)}
    assert len(views) > 1


def test_the_sampler_follows_the_data_order_of_index_batches_on_every_rank():
    for rank in (0, 1):
        sampler = EpochBatchSampler(20, 8, seed=4, rank=rank, world_size=2)
        reference = IndexBatches(list(range(20)), 8, seed=4, rank=rank, world_size=2)
        for epoch in (1, 2, 3):
            expected = [batch.tolist() for batch in reference.epoch_batches(epoch)]
            drawn = [[index for key_epoch, index in batch if key_epoch == epoch]
                     for batch in sampler]
            assert drawn == expected and len(sampler) == 2


def test_the_sampler_continues_its_epoch_after_load_state_dict():
    sampler = EpochBatchSampler(12, 4, seed=0)
    whole = [*sampler, *sampler]  # epochs 1 and 2, 3 batches each
    resumed = EpochBatchSampler(12, 4, seed=0)
    resumed.load_state_dict({"epoch": 1, "next_batch": 1})
    assert [*resumed, *resumed] == whole[1:]


def _batches(loader: TrainLoader, count: int) -> list:
    """``count`` batches, starting a new pass (epoch) whenever one ends, like Ignite."""
    batches, iterator = [], iter(loader)
    while len(batches) < count:
        try:
            batches.append(next(iterator))
        except StopIteration:
            iterator = iter(loader)
    return batches


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop", [2, 3, 5])  # mid-epoch, at an epoch's end, in the next one
def test_the_loader_resumed_from_its_state_dict_yields_the_rest_exactly(tree, workers, stop):
    samples = list_image_folders(tree).train
    dataset = ImageFiles(samples, train_transform(8), seed=1)

    def loader() -> TrainLoader:
        return TrainLoader(dataset, EpochBatchSampler(len(samples), 8, seed=1),
                           num_workers=workers)

    uninterrupted = _batches(loader(), 7)
    first = loader()
    before = _batches(first, stop)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # as a checkpoint holds it
    resumed = loader()
    resumed.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    after = _batches(resumed, 7 - stop)
    for (x, y), (x_ref, y_ref) in zip(before + after, uninterrupted, strict=True):
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    # Workers do not change the data: the same batches as loading in this process.
    if workers:
        in_process = _batches(TrainLoader(dataset, EpochBatchSampler(len(samples), 8, seed=1),
                                          num_workers=0), 7)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(in_process, uninterrupted,
                                                           strict=True))


def test_bound_to_the_trainer_an_epoch_skipped_to_its_end_is_not_continued_in_the_next(tree):
    """``Trainer.skip_batches`` to the epoch's end ends the epoch early: the next one
    starts at its own first batch, not at the rest of the skipped one."""
    samples = list_image_folders(tree).train
    dataset = ImageFiles(samples, train_transform(8), seed=1)

    def labels_seen(skip_after_step: int | None) -> list[list[int]]:
        loader = TrainLoader(dataset, EpochBatchSampler(len(samples), 8, seed=1), num_workers=0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 3))
        trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 nn.functional.cross_entropy,
                                 prepare_batch=NormaliseOnDevice((0.5,) * 3, (0.25,) * 3))
        seen: list[list[int]] = []
        trainer.add_event_handler(Events.ITERATION_STARTED,
                                  lambda engine: seen.append(engine.state.batch[1].tolist()))
        if skip_after_step is not None:
            trainer.add_event_handler(TrainEvents.OPTIMIZER_STEP(once=skip_after_step),
                                      lambda engine: engine.skip_batches(2))
        trainer.run(loader.bind(trainer), max_epochs=2)
        return seen

    uninterrupted, skipped = labels_seen(None), labels_seen(1)
    assert len(uninterrupted) == 6  # 3 batches per epoch
    assert skipped == uninterrupted[:1] + uninterrupted[3:]


def test_a_corrupt_image_found_by_a_worker_is_reported_in_one_line(tree):
    broken = tree / "val" / "dog" / "001.png"
    broken.write_bytes(b"garbage")
    dataset = ImageFiles(list_image_folders(tree).val, eval_transform(8))
    with pytest.raises(DataError) as raised:
        list(eval_loader(dataset, 2, num_workers=2))
    assert str(raised.value).startswith(f"cannot read image {broken}")
    assert "\n" not in str(raised.value)


def test_evaluation_blocks_cover_every_sample_once_across_ranks(tree):
    dataset = ImageFiles(list_image_folders(tree).val, eval_transform(8))
    labels = [torch.cat([y for _, y in eval_loader(dataset, 4, num_workers=0, rank=rank,
                                                  world_size=2)]) for rank in (0, 1)]
    assert torch.cat(labels).tolist() == [0, 0, 1, 1, 2, 2]


def test_normalise_on_device_scales_uint8_by_the_statistics():
    images = torch.tensor([0, 51, 255], dtype=torch.uint8).view(1, 3, 1, 1)
    x, y = NormaliseOnDevice((0.0, 0.2, 0.5), (1.0, 0.5, 0.25))(
        (images, torch.tensor([1])), torch.device("cpu"))
    assert torch.allclose(x.flatten(), torch.tensor([0.0, 0.0, 2.0]), atol=1e-6)
    assert y.tolist() == [1]
