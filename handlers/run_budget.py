"""Stop a run cleanly at a step count or a wall-clock budget: finish the step, commit, end.

``--max-steps`` and ``--max-time`` (Lightning's ``max_steps``/``max_time``, the Hugging Face
Trainer's ``max_steps``): the run stops as after SIGTERM, with its ``last`` checkpoint, but
by request, so it ends with exit code 0 and says which budget it reached. Both count the
whole run across resumes: the step count is the trainer's, and the time is the run's wall
time that its checkpoints carry (``RunHistory.wall_time``), so a run killed and resumed has
what was left at its newest checkpoint. Started again at its budget, it trains nothing.
"""

from collections.abc import Callable

import ignite.distributed as idist
from ignite.engine import Engine, Events

from engine.step import window_position
from engine.trainer import Trainer


class RunBudget:
    """Stop once the run has made ``max_steps`` optimizer steps or has run ``max_seconds``
    (``elapsed()``: the run's wall time, resumes included; ``time_label``: how the budget was
    written): at the end of an accumulation
    window, ``trainer.settle()``, ``save(trainer)`` (the ``last`` checkpoint), then
    ``trainer.terminate()``; ``reason`` then says which budget (``--max-steps 100``), else
    None.

    ``attach(trainer)`` listens to ``Events.STARTED`` (a run resumed at its budget ends
    there, before a step, and saves nothing: its checkpoint is the one it resumed from),
    ``Events.ITERATION_COMPLETED`` (a window's end, but not an epoch's last iteration) and
    ``Events.EPOCH_COMPLETED`` (after the epoch's evaluation and save: attach it after
    those). The step count is read without a sync: only a window that can reach
    ``max_steps`` is settled first. Under several processes the time is agreed on with one
    small all-reduce at each window's end (a rank that stopped alone would hang the others).
    """

    def __init__(self, save: Callable[[Trainer], None], *, max_steps: int | None = None,
                 max_seconds: float | None = None, elapsed: Callable[[], float],
                 time_label: str = "") -> None:
        if max_steps is None and max_seconds is None:
            raise ValueError("RunBudget needs max_steps or max_seconds")
        self.save, self.elapsed = save, elapsed
        self.max_steps, self.max_seconds = max_steps, max_seconds
        # How --max-time was written, for the reason.
        self.time_label = time_label or ("" if max_seconds is None else f"{max_seconds:g}s")
        self.reason: str | None = None
        self._world_size = 1

    def attach(self, trainer: Trainer, evaluator: Engine | None = None) -> None:
        self._world_size = idist.get_world_size()
        trainer.add_event_handler(Events.STARTED, self._on_started)
        trainer.add_event_handler(Events.ITERATION_COMPLETED, self._on_iteration)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self._stop)

    def _on_started(self, trainer: Trainer) -> None:
        if self._reached(trainer):
            trainer.terminate()

    def _on_iteration(self, trainer: Trainer) -> None:
        state = trainer.state
        if state.iteration % state.epoch_length == 0:
            return  # the epoch's last window: EPOCH_COMPLETED, after its evaluation and save
        if window_position(state, trainer.accum_steps)[1]:
            self._stop(trainer)

    def _stop(self, trainer: Trainer) -> None:
        if trainer.should_terminate or not self._reached(trainer):
            return
        trainer.settle()  # the window's step, its counters and schedule, before the save
        self.save(trainer)
        trainer.terminate()

    def _reached(self, trainer: Trainer) -> bool:
        """Whether a budget is spent, setting ``reason``; every rank calls it at the same
        points, so the time's all-reduce pairs up."""
        if self.max_steps is not None and trainer.state.optimizer_step + 1 >= self.max_steps:
            trainer.settle()  # the window just closed may be the last step: count it
            if trainer.state.optimizer_step >= self.max_steps:
                self.reason = f"--max-steps {self.max_steps}"
                return True
        if self.max_seconds is None:
            return False
        late = self.elapsed() >= self.max_seconds
        if self._world_size > 1:
            late = bool(idist.all_reduce(int(late), op="MAX"))
        if late:
            self.reason = f"--max-time {self.time_label}"
        return late
