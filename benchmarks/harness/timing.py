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


# Called with "open", "block" and "close" at every WindowTimer's edges and block boundaries:
# ``benchmarks.tools.instructions`` counts the instructions between "open" and "close",
# ``benchmarks.harness.lockstep`` passes control to the next arm at each of them. A listener's own
# time is outside every block.
window_listeners: list[Callable[[str], None]] = []


def _notify(event: str) -> None:
    for listener in window_listeners:
        listener(event)


class WindowTimer:
    """Times iterations ``warmup + 1 .. warmup + timed`` of a run from inside its loop, in
    blocks of ``block`` iterations (all of them by default).

    ``mark(done)`` is called after each iteration with the number of iterations completed
    (1-based); the window opens when ``done == warmup`` and closes at ``warmup + timed``,
    so warm-up, set-up and end-of-run work stay outside it. ``blocks`` holds each block's
    seconds; ``end`` is when the run went on after the window (its end-of-run work starts).
    """

    def __init__(self, warmup: int, timed: int, block: int | None = None) -> None:
        if warmup < 1 or timed < 1:
            raise ValueError(f"warmup and timed must be >= 1, got {warmup!r}, {timed!r}")
        block = timed if block is None else block
        if block < 1 or timed % block:
            raise ValueError(f"block must be >= 1 and divide timed ({timed}), got {block!r}")
        self.warmup, self.timed, self.block = warmup, timed, block
        self.blocks: list[float] = []
        self.end: float | None = None
        self._block_start = 0.0

    def mark(self, done: int) -> None:
        into_window = done - self.warmup
        if into_window < 0 or into_window % self.block:
            return
        if into_window > 0:
            self.blocks.append(time.perf_counter() - self._block_start)
        if into_window == self.timed:
            _notify("close")
            self.end = time.perf_counter()
        else:
            _notify("open" if into_window == 0 else "block")
            self._block_start = time.perf_counter()

    @property
    def seconds(self) -> float:
        """The timed window's seconds: its blocks' sum."""
        if self.end is None:
            raise RuntimeError(
                f"the timed window was not completed: the run must reach iteration "
                f"{self.warmup + self.timed}"
            )
        return sum(self.blocks)


@dataclass(frozen=True)
class MedianInterval:
    """The median of many paired measurements and its 95% confidence interval.

    Distribution-free (the sign-test interval): with ``n`` values in order, the interval
    runs from value ``n/2 - 0.98 sqrt(n)`` to value ``n/2 + 0.98 sqrt(n)`` (1-based,
    rounded outwards), which holds the true median with probability >= 95% whatever the
    values' distribution, heavy tails from a noisy machine included."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "MedianInterval":
        if not values:
            raise ValueError("values must hold at least one measurement")
        ordered = sorted(values)
        n = len(ordered)
        half_width = 0.98 * math.sqrt(n)  # 1.96 standard deviations of Binomial(n, 1/2)
        low = max(math.floor(n / 2 - half_width), 1)
        high = min(math.ceil(n / 2 + half_width) + 1, n)
        return cls(statistics.median(ordered), ordered[low - 1], ordered[high - 1], n)

    def format(self, digits: int = 3, scale: float = 1.0) -> str:
        """``median (low to high)``, values times ``scale``."""
        median, low, high = (number(scale * v, digits) for v in (self.median, self.low, self.high))
        return median if self.n == 1 else f"{median} ({low} to {high})"
