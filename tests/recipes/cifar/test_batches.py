import pytest
import torch
from ignite.engine import Engine, Events

from recipes.cifar.batches import CIFAR10_MEAN, CIFAR10_STD, EvalBatches, TrainBatches
from recipes.common.data_order import mix_seed


def make_data(n=40, seed=0):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=generator)
    return images, torch.arange(n)


def normalise(images):
    mean = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
    return (images.float() / 255 - mean) / std


def collect(batches, epoch):
    return list(batches.epoch_batches(epoch))


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_mix_seed_is_stable_and_separates_nearby_tuples():
    assert mix_seed(0, 1) == mix_seed(0, 1)
    seeds = {mix_seed(0, 1), mix_seed(0, 2), mix_seed(1, 1), mix_seed(0, 1, 0), mix_seed(1, 0)}
    assert len(seeds) == 5 and all(0 <= s < 2**63 for s in seeds)


def test_same_seed_and_epoch_give_same_order_and_augmentation_other_epochs_differ():
    images, labels = make_data()
    a = TrainBatches(images, labels, 8, seed=1)
    b = TrainBatches(images, labels, 8, seed=1)
    assert len(a) == 5
    assert_same_batches(collect(a, 3), collect(b, 3))
    labels_epoch1 = torch.cat([y for _, y in collect(a, 1)])
    labels_epoch2 = torch.cat([y for _, y in collect(a, 2)])
    assert sorted(labels_epoch1.tolist()) == list(range(40))  # each sample once per epoch
    assert not torch.equal(labels_epoch1, labels_epoch2)
    other_seed = torch.cat([y for _, y in collect(TrainBatches(images, labels, 8, seed=2), 1)])
    assert not torch.equal(labels_epoch1, other_seed)


def test_batches_are_normalised_float_and_unaugmented_when_asked():
    images, labels = make_data()
    batches = TrainBatches(images, labels, 8, seed=0, augment=False)
    for x, y in batches.epoch_batches(1):
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        torch.testing.assert_close(x, normalise(images[y]))


def test_augmentation_is_a_flip_and_a_reflect_padded_translate():
    images, labels = make_data(n=64)
    batches = TrainBatches(images, labels, 64, seed=0, crop_padding=2)
    (x, y), = collect(batches, 1)
    source = torch.nn.functional.pad(normalise(images[y]), (2, 2, 2, 2), mode="reflect")
    matched, flipped = 0, 0
    for k in range(64):
        candidates = [
            (flip, source[k, :, dy:dy + 32, dx:dx + 32].flip(-1) if flip else
             source[k, :, dy:dy + 32, dx:dx + 32])
            for flip in (False, True) for dy in range(5) for dx in range(5)
        ]
        hits = [flip for flip, crop in candidates if torch.allclose(crop, x[k], atol=1e-5)]
        matched += bool(hits)
        flipped += bool(hits) and hits[0]
    assert matched == 64
    assert 16 < flipped < 48  # about half the images are mirrored


def flipped_by_sample(batches, epoch):
    """{sample label: whether epoch ``epoch`` showed it mirrored} (crop_padding=0)."""
    seen = {}
    for x, y in batches.epoch_batches(epoch):
        source = normalise(batches.images[y])
        for k, label in enumerate(y.tolist()):
            mirrored = torch.allclose(x[k], source[k].flip(-1), atol=1e-5)
            assert mirrored or torch.allclose(x[k], source[k], atol=1e-5)
            seen[label] = mirrored
    return seen


def test_alternating_flip_shows_each_image_both_ways_in_two_epochs():
    images, labels = make_data(n=64)
    batches = TrainBatches(images, labels, 16, seed=3, crop_padding=0, flip="alternating")
    first, second, third = (flipped_by_sample(batches, epoch) for epoch in (1, 2, 3))
    assert 16 < sum(first.values()) < 48  # about half mirrored in the odd epochs
    assert all(second[k] != first[k] for k in first)
    assert third == first
    two_ranks = [TrainBatches(images, labels, 16, seed=3, crop_padding=0, flip="alternating",
                              rank=r, world_size=2) for r in range(2)]
    for (x, _), (x0, _), (x1, _) in zip(*(b.epoch_batches(2) for b in [batches, *two_ranks]),
                                        strict=True):
        assert torch.equal(torch.cat([x0, x1]), x)


def test_random_flip_redraws_every_epoch():
    images, labels = make_data(n=64)
    batches = TrainBatches(images, labels, 16, seed=3, crop_padding=0)
    first, second = flipped_by_sample(batches, 1), flipped_by_sample(batches, 2)
    assert 0 < sum(first[k] == second[k] for k in first) < 64


def test_unbound_iteration_counts_epochs_from_one():
    images, labels = make_data()
    batches = TrainBatches(images, labels, 8, seed=5)
    assert_same_batches(list(batches), collect(batches, 1))
    assert_same_batches(list(batches), collect(batches, 2))


def run_recording(batches, engine_state=None, max_epochs=3, stop_at=None):
    seen = []

    def step(engine, batch):
        seen.append(batch)

    engine = Engine(step)
    if stop_at is not None:
        engine.add_event_handler(Events.ITERATION_COMPLETED(once=stop_at), lambda e: e.terminate())
    if engine_state is not None:
        engine.load_state_dict(engine_state)
    engine.run(batches.bind(engine), max_epochs=max_epochs)
    return engine, seen


def test_bound_engine_epochs_match_epoch_batches():
    images, labels = make_data()
    batches = TrainBatches(images, labels, 8, seed=2)
    _, seen = run_recording(batches)
    expected = collect(batches, 1) + collect(batches, 2) + collect(batches, 3)
    assert_same_batches(seen, expected)


@pytest.mark.parametrize("stop_at", [3, 5, 7])  # mid-epoch 1, end of epoch 1, mid-epoch 2
def test_resume_mid_epoch_yields_exactly_the_remaining_batches(stop_at):
    images, labels = make_data()
    _, full = run_recording(TrainBatches(images, labels, 8, seed=4))
    interrupted, first = run_recording(TrainBatches(images, labels, 8, seed=4), stop_at=stop_at)
    state = interrupted.state_dict()
    assert state["iteration"] == stop_at
    # A fresh process: new loader, new engine, state loaded from the "checkpoint".
    _, rest = run_recording(TrainBatches(images, labels, 8, seed=4), engine_state=state)
    assert len(first) == stop_at
    assert_same_batches(first + rest, full)


def test_engine_epoch_length_other_than_len_is_refused():
    images, labels = make_data()
    batches = TrainBatches(images, labels, 8, seed=0)
    engine = Engine(lambda engine, batch: None)
    with pytest.raises(ValueError, match="epoch_length 3 must equal len\\(batches\\) 5"):
        engine.run(batches.bind(engine), max_epochs=1, epoch_length=3)


def test_two_ranks_concatenated_equal_one_rank():
    images, labels = make_data()
    single = collect(TrainBatches(images, labels, 8, seed=7), 2)
    shards = [collect(TrainBatches(images, labels, 8, seed=7, rank=r, world_size=2), 2)
              for r in range(2)]
    for (x, y), (x0, y0), (x1, y1) in zip(single, *shards, strict=True):
        assert x0.shape[0] == 4
        assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)


def test_drop_last_controls_the_short_last_batch():
    images, labels = make_data(n=20)
    assert len(TrainBatches(images, labels, 8, seed=0)) == 2
    kept = TrainBatches(images, labels, 8, seed=0, drop_last=False)
    assert len(kept) == 3
    assert [len(y) for _, y in kept.epoch_batches(1)] == [8, 8, 4]


def test_invalid_arguments_are_refused_by_name():
    images, labels = make_data()
    with pytest.raises(ValueError, match="batch_size 6 \\(global\\) must be divisible by "
                                         "world_size 4"):
        TrainBatches(images, labels, 6, seed=0, rank=0, world_size=4)
    with pytest.raises(ValueError, match="rank"):
        TrainBatches(images, labels, 8, seed=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="images must be uint8"):
        TrainBatches(images.float(), labels, 8, seed=0)
    with pytest.raises(ValueError, match="crop_padding"):
        TrainBatches(images, labels, 8, seed=0, crop_padding=-1)
    with pytest.raises(ValueError, match="flip must be one of"):
        TrainBatches(images, labels, 8, seed=0, flip="sometimes")
    with pytest.raises(ValueError, match="drop_last=False needs world_size 1"):
        TrainBatches(images, labels, 8, seed=0, drop_last=False, world_size=2)


def test_channels_last_changes_layout_not_values():
    images, labels = make_data()
    plain = collect(TrainBatches(images, labels, 8, seed=0), 1)
    cl = collect(TrainBatches(images, labels, 8, seed=0, channels_last=True), 1)
    assert cl[0][0].is_contiguous(memory_format=torch.channels_last)
    assert_same_batches(plain, cl)


@pytest.mark.parametrize("n", [10, 11])
def test_eval_batches_cover_every_sample_once_across_two_ranks(n):
    images, labels = make_data(n=n)
    ranks = [list(EvalBatches(images, labels, 3, rank=r, world_size=2)) for r in range(2)]
    seen = torch.cat([y for batches in ranks for _, y in batches])
    assert seen.tolist() == list(range(n))
    x_all = torch.cat([x for batches in ranks for x, _ in batches])
    torch.testing.assert_close(x_all, normalise(images))
    assert len(EvalBatches(images, labels, 3, rank=0, world_size=2)) == 2
