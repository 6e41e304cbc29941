import pytest
import torch
from ignite.engine import Engine

from recipes.common.data_order import IndexBatches, OrderedBatches, epoch_order


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
