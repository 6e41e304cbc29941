"""The time left to a run's end: the training steps left and the evaluations still to come."""

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class EvaluationSchedule:
    """When a run evaluates and what each evaluation costs.

    ``due(epoch)``: whether the run evaluates after that epoch (the last one included).
    ``forwards(final)``: the forwards per validation sample of an evaluation, ``final`` for
    the one after the last epoch (e.g. a test-time augmentation of 6 forwards at the end,
    2 during the run); the time of the evaluations to come is that of those measured, scaled by it.
    """

    due: Callable[[int], bool]
    forwards: Callable[[bool], float] = lambda final: 1.0


class TimeLeft:
    """Estimates the seconds left from what this process measured since ``start``: the
    training time per iteration (evaluation time excluded) and the evaluation time per
    forward. Both the bar and the plain lines read this one estimate, so they agree, also
    after a resume (which restarts the measurements, as a resumed process may run on other
    hardware). ``clock`` is injectable for tests.

    Until an evaluation has been measured, ``seconds`` leaves the evaluations out and
    ``evaluations_unknown`` says so.
    """

    def __init__(self, schedule: EvaluationSchedule | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.schedule, self.clock = schedule, clock
        self._start, self._start_iteration = 0.0, 0
        self._eval_seconds, self._eval_forwards = 0.0, 0.0
        self._eval_started: float | None = None

    def start(self, iteration: int) -> None:
        self._start, self._start_iteration = self.clock(), iteration
        self._eval_seconds, self._eval_forwards = 0.0, 0.0

    def evaluation_started(self) -> None:
        self._eval_started = self.clock()

    def evaluation_completed(self, final: bool) -> float:
        """Records the evaluation that started last; returns its seconds."""
        seconds = self.clock() - self._eval_started
        self._eval_seconds += seconds
        self._eval_forwards += self._forwards(final)
        self._eval_started = None
        return seconds

    def evaluation_elapsed(self) -> float:
        """Seconds since the evaluation in progress started."""
        return self.clock() - self._eval_started

    def elapsed(self) -> float:
        return self.clock() - self._start

    def seconds(self, iteration: int, total_iterations: int, next_epoch: int,
                max_epochs: int) -> float | None:
        """Seconds left after ``iteration`` of ``total_iterations``, the evaluations from
        ``next_epoch`` to ``max_epochs`` included once one has been measured; None before
        any iteration was timed."""
        done = iteration - self._start_iteration
        if done <= 0:
            return None
        now = self.clock()
        in_evaluation = now - self._eval_started if self._eval_started is not None else 0.0
        training = now - self._start - self._eval_seconds - in_evaluation
        left = training / done * max(0, total_iterations - iteration)
        if self._eval_forwards:
            forwards = sum(self._forwards(epoch == max_epochs)
                           for epoch in self._evaluations(next_epoch, max_epochs))
            left += self._eval_seconds / self._eval_forwards * forwards
        return left

    def evaluations_unknown(self, next_epoch: int, max_epochs: int) -> bool:
        """Whether evaluations are still to come whose time cannot be estimated yet."""
        return not self._eval_forwards and any(self._evaluations(next_epoch, max_epochs))

    def _evaluations(self, next_epoch: int, max_epochs: int) -> list[int]:
        if self.schedule is None:
            return []
        return [epoch for epoch in range(next_epoch, max_epochs + 1)
                if self.schedule.due(epoch)]

    def _forwards(self, final: bool) -> float:
        return self.schedule.forwards(final) if self.schedule is not None else 1.0
