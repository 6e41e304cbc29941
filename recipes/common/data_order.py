"""Resumable data order for any indexable data set.

Order and randomness are pure functions of ``(seed, epoch, index)``: the epoch's
permutation comes from a generator seeded with ``(seed, epoch)``, and a batch's own
randomness (augmentation) from one seeded with ``(seed, epoch, batch index)``. Resuming
mid-epoch then means skipping to a batch index, not replaying data, and a resumed run on
the CPU is bit-identical to an uninterrupted one. Each of ``world_size`` ranks takes the
``rank``-th contiguous slice of every global batch, so the processes together see exactly
the batches of one process.
"""

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from ignite.engine import Engine
from torch.utils.data import default_collate

from handlers.arguments import check_int

_MASK64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """One generator seed (63-bit) from several ints, by chained splitmix64 steps:
    nearby tuples such as (seed, epoch) and (seed, epoch + 1) give unrelated seeds,
    and unlike ``hash()`` the result is the same in every process and Python run."""
    state = 0
    for value in values:
        state = (state + value + 0x9E3779B97F4A7C15) & _MASK64
        state = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        state = ((state ^ (state >> 27)) * 0x94D049BB133111EB) & _MASK64
        state ^= state >> 31
    return state >> 1


def epoch_order(n: int, seed: int, epoch: int, device: str | torch.device = "cpu"
                ) -> torch.Tensor:
    """The permutation of ``range(n)`` used in ``epoch`` (1-based)."""
    generator = torch.Generator(device).manual_seed(mix_seed(seed, epoch))
    return torch.randperm(n, generator=generator, device=device)


def check_rank(rank: int, world_size: int) -> None:
    check_int("world_size", world_size, 1)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")


class EpochPosition:
    """Which epoch and batch an iterable of batches starts at.

    Bound to an engine (``bind(engine)``), it reads both from ``engine.state`` when an
    epoch starts, so after ``engine.load_state_dict`` to a mid-epoch iteration the next
    ``run`` continues with exactly the batches an uninterrupted run would see. Unbound,
    successive epochs count 1, 2, 3, ... from the start.
    """

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self._next_epoch = 1

    def bind(self, engine: Engine) -> None:
        self.engine = engine

    def start(self, epoch_length: int) -> tuple[int, int]:
        """(epoch, first batch index) for the epoch about to be iterated."""
        if self.engine is None:
            self._next_epoch += 1
            return self._next_epoch - 1, 0
        state = self.engine.state
        if state.epoch_length != epoch_length:
            raise ValueError(
                f"the engine's epoch_length {state.epoch_length} must equal len(batches) "
                f"{epoch_length} for the epoch position to be known"
            )
        return state.epoch, state.iteration - (state.epoch - 1) * epoch_length


class IndexBatches:
    """Shuffled training batches from any data set with ``__len__`` and ``__getitem__``.

    ``batch_size`` is global; this rank collates its slice of each batch with
    ``collate`` (``torch.utils.data.default_collate`` by default). ``transform(sample,
    generator)``, when given, gets each sample and a generator seeded by ``(seed, epoch,
    batch index, position in the global batch)``: per-sample randomness that does not
    depend on which rank or process draws it. ``len()`` is the batches per epoch; the last
    partial batch is dropped (every rank's slice must have the same size).

    >>> batches = IndexBatches(list(range(10)), 4, seed=0)
    >>> len(batches), [b.tolist() for b in batches]
    (2, [[6, 8, 2, 4], [1, 7, 5, 3]])
    """

    def __init__(
        self,
        dataset: Sequence[Any],
        batch_size: int,
        *,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        collate: Callable[[list[Any]], Any] = default_collate,
        transform: Callable[[Any, torch.Generator], Any] | None = None,
    ) -> None:
        check_int("batch_size", batch_size, 1)
        check_int("seed", seed, 0)
        check_rank(rank, world_size)
        if batch_size % world_size:
            raise ValueError(
                f"batch_size {batch_size} (global) must be divisible by world_size {world_size}"
            )
        if batch_size > len(dataset):
            raise ValueError(f"batch_size {batch_size} exceeds the {len(dataset)} samples: "
                             "an epoch would have no batch")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.collate, self.transform = collate, transform
        self.position = EpochPosition()

    def bind(self, engine: Engine) -> "IndexBatches":
        """Read epoch and position from ``engine.state`` at the start of each epoch."""
        self.position.bind(engine)
        return self

    def __len__(self) -> int:
        return len(self.dataset) // self.batch_size

    def __iter__(self) -> Iterator[Any]:
        # A generator: this body runs at the first next(), after Ignite has advanced
        # state.epoch for the new epoch.
        epoch, start = self.position.start(len(self))
        yield from self.epoch_batches(epoch, start)

    def epoch_batches(self, epoch: int, start: int = 0) -> Iterator[Any]:
        """Batches ``start, start+1, ...`` of epoch ``epoch`` (1-based), this rank's slice."""
        # A tensor, not a list: 8 bytes a sample instead of ~36 (charlm's windows of a large
        # text number in the millions); each batch turns only its own slice into ints.
        order = epoch_order(len(self.dataset), self.seed, epoch)
        local = self.batch_size // self.world_size
        for index in range(start, len(self)):
            first = index * self.batch_size + self.rank * local
            samples = []
            for offset, sample_index in enumerate(order[first:first + local].tolist()):
                sample = self.dataset[sample_index]
                if self.transform is not None:
                    seed = mix_seed(self.seed, epoch, index, self.rank * local + offset)
                    sample = self.transform(sample, torch.Generator().manual_seed(seed))
                samples.append(sample)
            yield self.collate(samples)


class OrderedBatches:
    """Evaluation batches in data order: each of ``world_size`` ranks takes a contiguous
    block of the samples (sizes differ by at most one), so every sample is evaluated
    exactly once with no padding. ``batch_size`` is per rank; the last batch may be
    smaller.

    >>> [b.tolist() for b in OrderedBatches(list(range(5)), 2)]
    [[0, 1], [2, 3], [4]]
    """

    def __init__(
        self,
        dataset: Sequence[Any],
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        collate: Callable[[list[Any]], Any] = default_collate,
    ) -> None:
        check_int("batch_size", batch_size, 1)
        check_rank(rank, world_size)
        n = len(dataset)
        self.lo, self.hi = rank * n // world_size, (rank + 1) * n // world_size
        self.dataset, self.batch_size, self.collate = dataset, batch_size, collate

    def __len__(self) -> int:
        return -(-(self.hi - self.lo) // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        for start in range(self.lo, self.hi, self.batch_size):
            end = min(start + self.batch_size, self.hi)
            yield self.collate([self.dataset[i] for i in range(start, end)])
