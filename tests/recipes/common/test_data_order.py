import pytest
import torch
from ignite.engine import Engine

from recipes.common.data_order import IndexBatches, OrderedBatches, epoch_order, mix_seed


def test_epoch_order_is_a_permutation_fixed_by_seed_and_epoch():
    order = epoch_order(50, seed=3, epoch=2)
    assert sorted(order.tolist()) == list(range(50))
    assert torch.equal(order, epoch_order(50, seed=3, epoch=2))
    assert not torch.equal(order, epoch_order(50, seed=3, epoch=3))
    assert not torch.equal(order, epoch_order(50, seed=4, epoch=2))


def test_ranks_together_see_the_batches_of_one_process():
    data = list(range(40))
    whole = IndexBatches(data, 8, seed=1)
    ranks = [IndexBatches(data, 8, seed=1, rank=r, world_size=2) for r in range(2)]
    for epoch in (1, 2):
        for batch, *slices in zip(whole.epoch_batches(epoch),
                                  *(r.epoch_batches(epoch) for r in ranks), strict=True):
            assert torch.equal(batch, torch.cat(slices))


def test_per_sample_randomness_does_not_depend_on_the_rank():
    """The transform's generator is seeded by (seed, epoch, batch, position in the global
    batch): one process and two ranks draw the same per-sample numbers."""
    def noisy(sample, generator):
        return torch.rand((), generator=generator) + sample

    data = list(range(16))
    whole = list(IndexBatches(data, 8, seed=0, transform=noisy).epoch_batches(1))
    halves = [list(IndexBatches(data, 8, seed=0, rank=r, world_size=2,
                                transform=noisy).epoch_batches(1)) for r in range(2)]
    for index, batch in enumerate(whole):
        assert torch.equal(batch, torch.cat([halves[0][index], halves[1][index]]))


def test_bound_batches_resume_mid_epoch_with_the_batches_an_uninterrupted_run_sees():
    data = list(range(30))
    seen: list[list[int]] = []
    uninterrupted = Engine(lambda engine, batch: seen.append(batch.tolist()))
    batches = IndexBatches(data, 5, seed=7)
    uninterrupted.run(batches.bind(uninterrupted), max_epochs=2)

    resumed_seen: list[list[int]] = []
    resumed = Engine(lambda engine, batch: resumed_seen.append(batch.tolist()))
    resumed.load_state_dict({"iteration": 9, "epoch_length": 6, "max_epochs": 2})
    resumed.run(IndexBatches(data, 5, seed=7).bind(resumed))
    assert resumed_seen == seen[9:]


def test_ordered_batches_evaluate_every_sample_once_across_ranks():
    data = list(range(11))
    parts = [torch.cat(list(OrderedBatches(data, 3, rank=r, world_size=3))) for r in range(3)]
    assert torch.cat(parts).tolist() == data
    assert [len(OrderedBatches(data, 3, rank=r, world_size=3)) for r in range(3)] == [1, 2, 2]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="batch_size 12 exceeds the 10 samples"):
        IndexBatches(list(range(10)), 12, seed=0)
    with pytest.raises(ValueError, match="divisible by world_size 3"):
        IndexBatches(list(range(10)), 4, seed=0, world_size=3)
    with pytest.raises(ValueError, match="rank must be an int in \\[0, 2\\)"):
        OrderedBatches(list(range(10)), 4, rank=2, world_size=2)



@pytest.mark.parametrize("bound", [True, False], ids=["bound", "unbound"])
def test_every_epoch_draws_a_new_shuffle_of_every_sample(bound):
    """Iterated epoch after epoch, through an engine or alone, each epoch's order is a
    permutation of its own: the same shuffle every epoch would repeat the batches."""
    data = list(range(24))
    batches = IndexBatches(data, 6, seed=5)
    if bound:
        seen: dict[int, list[int]] = {}
        engine = Engine(lambda engine, batch: seen.setdefault(engine.state.epoch, []).extend(
            batch.tolist()))
        engine.run(batches.bind(engine), max_epochs=3)
        epochs = list(seen.values())
    else:
        epochs = [torch.cat(list(batches)).tolist() for _ in range(3)]
    assert len(epochs) == 3
    assert all(sorted(order) == data for order in epochs)
    assert len({tuple(order) for order in epochs}) == 3


def test_unbound_batches_count_their_epochs_from_one():
    """Iterated alone, epoch after epoch, the batches are those of epochs 1, 2 and 3."""
    batches = IndexBatches(list(range(12)), 4, seed=2)
    for epoch in (1, 2, 3):
        assert [b.tolist() for b in batches] == [
            b.tolist() for b in batches.epoch_batches(epoch)]


def test_ordered_batches_default_to_one_rank_with_every_sample_in_order():
    batches = OrderedBatches(list(range(5)), 1)
    assert [b.tolist() for b in batches] == [[0], [1], [2], [3], [4]]


@pytest.mark.parametrize(("make", "message"), [
    (lambda: OrderedBatches(list(range(5)), 0), "batch_size must be an int >= 1, got 0"),
    (lambda: IndexBatches(list(range(5)), 0, seed=0), "batch_size must be an int >= 1, got 0"),
    (lambda: IndexBatches(list(range(5)), 1, seed=-1), "seed must be an int >= 0, got -1"),
    (lambda: IndexBatches(list(range(5)), 1, seed=0, world_size=0),
     "world_size must be an int >= 1, got 0"),
    (lambda: IndexBatches(list(range(5)), 2, seed=0, rank=True, world_size=2),
     r"rank must be an int in \[0, 2\), got True"),
])
def test_each_bad_argument_is_refused_naming_it(make, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        make()


def test_the_smallest_batch_and_one_batch_of_every_sample_are_allowed():
    assert [b.tolist() for b in IndexBatches([5, 6, 7], 1, seed=0).epoch_batches(1)] == [
        [5], [7], [6]]  # epoch 1's order of 3 samples is [0, 2, 1]
    assert len(IndexBatches(list(range(4)), 4, seed=0)) == 1


def test_the_order_of_a_seed_is_the_same_in_every_version():
    """A run resumed by a newer version continues the same sample order: the seed mixing
    (splitmix64 steps) and the permutation are pinned to their values."""
    assert mix_seed(0) == 8147104208329303767
    assert mix_seed(1, 2) == 6804074658870690613
    assert mix_seed(7, 3, 5, 2) == 350261644976585302
    assert epoch_order(10, seed=0, epoch=1).tolist() == [6, 8, 2, 4, 1, 7, 5, 3, 9, 0]
    assert epoch_order(10, seed=3, epoch=2).tolist() == [6, 4, 9, 0, 2, 5, 7, 8, 3, 1]


def test_each_samples_transform_is_seeded_by_seed_epoch_batch_and_place_in_the_batch():
    seeds = []

    def record(sample, generator):
        seeds.append(generator.initial_seed())
        return sample

    batches = IndexBatches(list(range(8)), 4, seed=3, rank=1, world_size=2, transform=record)
    list(batches.epoch_batches(2))
    assert seeds == [mix_seed(3, 2, index, place) for index in (0, 1) for place in (2, 3)]
