"""Argument checks shared by the handlers and the run layer: one message for one mistake.

Each check raises ``ValueError`` naming the argument, what is allowed and what it got.
"""

import math
from collections.abc import Iterable
from typing import Any


def check_int(name: str, value: Any, lowest: int, unit: str = "") -> None:
    """An int (not a bool) >= ``lowest``; ``unit`` (e.g. "epochs") is named in the message."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        counted = f" ({unit})" if unit else ""
        raise ValueError(f"{name} must be an int >= {lowest}{counted}, got {value!r}")


def check_number(name: str, value: Any, low: float, high: float = math.inf,
                 bounds: str = "[)") -> None:
    """A number (not a bool) between ``low`` and ``high``; ``bounds`` says which ends are
    allowed, in interval notation: ``"[)"`` is ``low <= value < high``, ``"()"`` excludes
    both. With ``high`` infinite the number must be finite."""
    if bounds not in ("[]", "[)", "(]", "()"):
        raise ValueError(f"bounds={bounds!r} is not known; allowed: '[]', '[)', '(]', '()'")
    if not _in_bounds(value, low, high, bounds):
        allowed = (f"a finite number {'>=' if bounds[0] == '[' else '>'} {low}"
                   if high == math.inf else f"a number in {bounds[0]}{low}, {high}{bounds[1]}")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def check_choice(name: str, value: Any, allowed: Iterable[str]) -> None:
    """One of ``allowed``."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not known; allowed: "
                         f"{', '.join(repr(choice) for choice in allowed)}")


def check_bool(name: str, value: Any) -> None:
    """True or False (not a truthy value)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_name(name: str, value: Any, what: str) -> None:
    """A non-empty string; ``what`` says what it names (e.g. "an evaluator metric")."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be the name of {what}, got {value!r}")


def _in_bounds(value: Any, low: float, high: float, bounds: str) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return False
    above = low <= value if bounds[0] == "[" else low < value
    below = value <= high if bounds[1] == "]" else value < high
    return above and below
