"""The one definition of "better" for a metric: ``"min"`` (lower is better) or ``"max"``.

Early stopping, the best checkpoint, TensorBoard's best values and the run summary all
rank scores through ``is_better``, so a metric means the same direction everywhere. A
``Goal`` names the metric a run ranks by and its direction, with no default: early
stopping and the best checkpoint share one ``Goal`` and so cannot disagree.
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass

from ignite.engine import Engine

from handlers.arguments import check_choice, check_name

MODES = ("min", "max")
# The directions of the metrics every recipe's evaluator has, for a logger given no modes.
STANDARD_MODES = {"loss": "min", "accuracy": "max"}


def check_mode(mode: str, name: str = "mode") -> str:
    check_choice(name, mode, MODES)
    return mode


@dataclass(frozen=True)
class Goal:
    """The evaluator metric a run ranks by and whether lower (``"min"``) or higher
    (``"max"``) is better."""

    metric: str
    mode: str

    def __post_init__(self) -> None:
        check_name("metric", self.metric, "an evaluator metric")
        check_mode(self.mode)

    def score(self, evaluator: Engine) -> float:
        """The metric of the evaluation that just completed, as a float (read once)."""
        if self.metric not in evaluator.state.metrics:
            raise KeyError(f"metric {self.metric!r} is not among the evaluator's metrics "
                           f"{sorted(evaluator.state.metrics)}")
        return float(evaluator.state.metrics[self.metric])

    def is_better(self, score: float, best: float | None, min_delta: float = 0.0) -> bool:
        return is_better(score, best, self.mode, min_delta)


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
