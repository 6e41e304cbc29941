"""The one definition of "better" for a metric: ``"min"`` (lower is better) or ``"max"``.

Early stopping, the best checkpoint, TensorBoard's best values and the run summary all
rank scores through ``is_better``, so a metric means the same direction everywhere.
"""

import math
from collections.abc import Iterable

MODES = ("min", "max")


def check_mode(mode: str, name: str = "mode") -> str:
    if mode not in MODES:
        raise ValueError(f"{name}={mode!r} is not known; allowed: 'min', 'max'")
    return mode


def is_better(score: float, best: float | None, mode: str, min_delta: float = 0.0) -> bool:
    """Whether ``score`` beats ``best`` by more than ``min_delta``; a non-finite score never
    does, and any finite score beats no best yet (``None``)."""
    if not math.isfinite(score):
        return False
    if best is None:
        return True
    return score < best - min_delta if mode == "min" else score > best + min_delta


def best_of(scores: Iterable[float], mode: str) -> float | None:
    """The best finite score, or None when there is none."""
    best = None
    for score in scores:
        if is_better(score, best, mode):
            best = score
    return best
