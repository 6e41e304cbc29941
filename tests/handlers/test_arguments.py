import math

import pytest

from handlers.arguments import check_bool, check_choice, check_int, check_name, check_number


@pytest.mark.parametrize(
    ("value", "message"),
    [(0, r"n must be an int >= 1 \(steps\), got 0"), (True, "got True"), (1.0, "got 1.0")],
)
def test_check_int_names_the_argument_the_bound_and_the_unit(value, message):
    with pytest.raises(ValueError, match=message):
        check_int("n", value, 1, "steps")
    check_int("n", 1, 1)


@pytest.mark.parametrize(
    ("value", "low", "high", "bounds", "message"),
    [
        (0, 0, 1, "()", r"x must be a number in \(0, 1\), got 0"),
        (1, 0, 1, "[)", r"x must be a number in \[0, 1\), got 1"),
        (math.inf, 0, math.inf, "()", "x must be a finite number > 0, got inf"),
        (-1, 0, math.inf, "[)", "x must be a finite number >= 0, got -1"),
        (math.nan, 0, 1, "[]", "got nan"),
        (True, 0, 1, "[]", "got True"),
        ("1", 0, 1, "[]", "got '1'"),
    ],
)
def test_check_number_refuses_values_outside_its_bounds(value, low, high, bounds, message):
    with pytest.raises(ValueError, match=message):
        check_number("x", value, low, high, bounds)


@pytest.mark.parametrize(("value", "bounds"), [(0, "[]"), (1, "[]"), (0.5, "()"), (0, "[)")])
def test_check_number_accepts_the_ends_its_bounds_include(value, bounds):
    check_number("x", value, 0, 1, bounds)


def test_the_other_checks_name_the_argument_and_what_is_allowed():
    with pytest.raises(ValueError, match="mode='up' is not known; allowed: 'min', 'max'"):
        check_choice("mode", "up", ("min", "max"))
    with pytest.raises(ValueError, match="quiet must be True or False, got 1"):
        check_bool("quiet", 1)
    with pytest.raises(ValueError, match="metric must be the name of an evaluator metric"):
        check_name("metric", "", "an evaluator metric")
