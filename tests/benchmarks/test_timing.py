import pytest

from benchmarks.timing import Stats, WindowTimer, interleaved_order


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


def test_window_timer_covers_only_the_timed_iterations():
    timer = WindowTimer(warmup=2, timed=3)
    for done in range(1, 6):
        timer.mark(done)
        if done < 2:
            assert timer.start is None
    assert timer.start is not None and timer.end >= timer.start
    assert timer.seconds == timer.end - timer.start


def test_window_timer_refuses_an_incomplete_window():
    timer = WindowTimer(warmup=1, timed=5)
    for done in range(1, 4):
        timer.mark(done)
    with pytest.raises(RuntimeError, match="iteration 6"):
        _ = timer.seconds
