"""Argument checks shared by the handlers and the run layer: one message for one mistake."""

from typing import Any


def check_int(name: str, value: Any, lowest: int) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is an int (not a bool) >= ``lowest``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ValueError(f"{name} must be an int >= {lowest}, got {value!r}")
