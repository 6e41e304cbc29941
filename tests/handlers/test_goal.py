import math

import pytest

from handlers.goal import best_of, check_mode, is_better


@pytest.mark.parametrize(("score", "best", "mode", "better"), [
    (0.5, None, "max", True),
    (0.5, None, "min", True),
    (0.6, 0.5, "max", True),
    (0.4, 0.5, "max", False),
    (0.4, 0.5, "min", True),
    (0.5, 0.5, "min", False),  # a tie does not improve
    (math.nan, None, "max", False),  # a non-finite score never does
    (math.inf, 0.5, "max", False),
])
def test_is_better(score, best, mode, better):
    assert is_better(score, best, mode) is better


def test_min_delta_must_be_exceeded():
    assert not is_better(0.55, 0.5, "max", min_delta=0.1)
    assert is_better(0.65, 0.5, "max", min_delta=0.1)
    assert is_better(0.35, 0.5, "min", min_delta=0.1)


def test_best_of_skips_non_finite_and_follows_the_mode():
    assert best_of([2.0, math.nan, 1.0, 3.0], "min") == 1.0
    assert best_of([2.0, math.nan, 1.0, 3.0], "max") == 3.0
    assert best_of([math.nan], "max") is None
    assert best_of([], "min") is None


def test_an_unknown_mode_is_named():
    with pytest.raises(ValueError,
                       match="metrics\\['acc'\\]='up' is not known; allowed: 'min', 'max'"):
        check_mode("up", "metrics['acc']")
