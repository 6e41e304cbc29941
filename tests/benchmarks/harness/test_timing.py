import math
import random
import time

import pytest

from benchmarks.harness import timing
from benchmarks.harness.timing import MedianInterval, Stats, WindowTimer, interleaved_order


def test_stats_median_min_max():
    stats = Stats.of([3.0, 1.0, 2.0, 10.0])
    assert (stats.median, stats.min, stats.max, stats.n) == (2.5, 1.0, 10.0, 4)
    assert stats.format(3) == "2.50 [1.00, 10.0]"
    assert Stats.of([0.5]).format(3, scale=1e3) == "500"
    assert Stats.of([0.000123]).format(2, scale=1e3) == "0.12"
    assert Stats.of([-31.0, 123456.0]).format(3) == "61712 [-31.0, 123456]"


def test_stats_needs_a_value():
    with pytest.raises(ValueError, match="at least one"):
        Stats.of([])


def test_interleaved_order_runs_every_arm_once_per_repeat_and_rotates():
    order = interleaved_order(["a", "b", "c"], 3)
    assert order == [(0, "a"), (0, "b"), (0, "c"),
                     (1, "b"), (1, "c"), (1, "a"),
                     (2, "c"), (2, "a"), (2, "b")]
    first = {repeat: next(name for r, name in order if r == repeat) for repeat in range(3)}
    assert sorted(first.values()) == ["a", "b", "c"]  # no arm always goes first


def test_window_timer_covers_only_the_timed_iterations_in_blocks(monkeypatch):
    events = []
    monkeypatch.setattr(timing, "window_listeners", [events.append])
    timer = WindowTimer(warmup=2, timed=6, block=2)
    for done in range(1, 10):
        timer.mark(done)
        events.append(done)
    assert events == [1, "open", 2, 3, "block", 4, 5, "block", 6, 7, "close", 8, 9]
    assert len(timer.blocks) == 3 and all(seconds > 0 for seconds in timer.blocks)
    assert timer.seconds == sum(timer.blocks)
    assert timer.end is not None


def test_window_timer_leaves_a_listeners_time_out_of_its_blocks(monkeypatch):
    monkeypatch.setattr(timing, "window_listeners", [lambda event: time.sleep(0.05)])
    timer = WindowTimer(warmup=1, timed=4, block=1)
    for done in range(1, 6):
        timer.mark(done)
    assert len(timer.blocks) == 4 and timer.seconds < 0.05


@pytest.mark.parametrize("block", [0, 4, 7])
def test_window_timer_refuses_a_block_that_does_not_divide_the_window(block):
    with pytest.raises(ValueError, match="divide timed"):
        WindowTimer(warmup=1, timed=6, block=block)


def test_window_timer_refuses_an_incomplete_window():
    timer = WindowTimer(warmup=1, timed=5)
    for done in range(1, 4):
        timer.mark(done)
    with pytest.raises(RuntimeError, match="iteration 6"):
        _ = timer.seconds


def test_median_interval_is_the_sign_test_interval():
    values = [float(v) for v in range(1, 101)]  # 1 .. 100
    interval = MedianInterval.of(list(reversed(values)))
    # n = 100: ranks 50 -/+ 9.8, rounded outwards: values 40 and 61
    assert (interval.median, interval.low, interval.high, interval.n) == (50.5, 40.0, 61.0, 100)
    assert interval.format(3) == "50.5 (40.0 to 61.0)"
    assert MedianInterval.of([2.0]).format(3) == "2.00"
    with pytest.raises(ValueError, match="at least one"):
        MedianInterval.of([])


def test_median_interval_holds_the_true_median_in_at_least_95_percent_of_samples():
    rng = random.Random(0)
    median = math.log(2)  # the exponential distribution's: skewed, like slow-machine noise
    intervals = [MedianInterval.of([rng.expovariate(1.0) for _ in range(60)])
                 for _ in range(1000)]
    hits = sum(interval.low <= median <= interval.high for interval in intervals)
    assert hits >= 940  # 95% nominal; 1000 samples put the rate within about +-1.4%
