"""Repeats, interleaving and summary statistics shared by every benchmark."""

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Stats:
    """Median, min and max of a benchmark's repeats, in the unit of its values."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Stats":
        if not values:
            raise ValueError("values must hold at least one repeat")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def format(self, digits: int = 3, scale: float = 1.0) -> str:
        """``median [min, max]``, values times ``scale``, each to ``digits`` significant
        digits (whole numbers when larger)."""
        median, low, high = (number(scale * v, digits) for v in (self.median, self.min, self.max))
        return median if self.n == 1 else f"{median} [{low}, {high}]"


def number(value: float, digits: int = 3) -> str:
    """``digits`` significant digits without exponent notation: 0.0123, 12.3, 12346."""
    if value == 0 or abs(value) >= 10 ** (digits - 1):
        return f"{value:.0f}"
    decimals = digits - 1 - math.floor(math.log10(abs(value)))
    return f"{value:.{decimals}f}"


def interleaved_order(names: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """``(repeat, name)`` pairs: every name once per repeat, the order rotated by one each
    repeat, so machine drift over the run and the cost of running first or after a given
    neighbour fall on every arm alike."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    order = []
    for repeat in range(repeats):
        shift = repeat % len(names)
        order += [(repeat, name) for name in [*names[shift:], *names[:shift]]]
    return order


# Called with "open" and "close" at every WindowTimer's edges (``benchmarks.instructions``
# counts the instructions between them).
window_listeners: list[Callable[[str], None]] = []


class WindowTimer:
    """Times iterations ``warmup + 1 .. warmup + timed`` of a run from inside its loop.

    ``mark(done)`` is called after each iteration with the number of iterations completed
    (1-based); the window opens when ``done == warmup`` and closes at ``warmup + timed``,
    so warm-up, set-up and end-of-run work stay outside it.
    """

    def __init__(self, warmup: int, timed: int) -> None:
        if warmup < 1 or timed < 1:
            raise ValueError(f"warmup and timed must be >= 1, got {warmup!r}, {timed!r}")
        self.warmup, self.timed = warmup, timed
        self.start: float | None = None
        self.end: float | None = None

    def mark(self, done: int) -> None:
        if done == self.warmup:
            self.start = time.perf_counter()
            for listener in window_listeners:
                listener("open")
        elif done == self.warmup + self.timed:
            for listener in window_listeners:
                listener("close")
            self.end = time.perf_counter()

    @property
    def seconds(self) -> float:
        if self.start is None or self.end is None:
            raise RuntimeError(
                f"the timed window was not completed: the run must reach iteration "
                f"{self.warmup + self.timed}"
            )
        return self.end - self.start
