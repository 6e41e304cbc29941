"""Stop on SIGTERM, Ctrl-C or a scheduler's SIGUSR1 without losing the run: finish the step,
commit, exit."""

import logging
import signal
import sys
from collections.abc import Callable
from types import FrameType

import ignite.distributed as idist
from ignite.engine import Engine, Events

from engine.step import window_position
from engine.trainer import Trainer

# 128 + the signal's number, as shells report. SIGUSR1 is what a cluster scheduler sends
# before it preempts (SLURM's --signal=USR1@<seconds>): Python's default would end the process
# unsaved.
EXIT_CODES = {signal.SIGTERM: 143, signal.SIGINT: 130, signal.SIGUSR1: 138}
logger = logging.getLogger(__name__)


class GracefulStop:
    """On SIGTERM, SIGINT or SIGUSR1, let the current accumulation window finish (its
    micro-batches' gradients are not in any checkpoint), call ``save(trainer)``
    to commit a ``last`` checkpoint, then ``terminate()`` the trainer.

    Checks at the trainer's ``Events.ITERATION_COMPLETED`` (only at the end of a
    window and not at an epoch's last iteration; under several processes with one
    small all-reduce there, so every rank stops after the same step) and
    ``Events.EPOCH_COMPLETED`` (after the epoch's evaluation and checkpoint: attach
    it after those). A second signal while waiting restores the previous handlers and
    hands it to them, so pressing Ctrl-C twice stops at once; where that handler is
    Python's own (a ``KeyboardInterrupt`` and its traceback), one warning is logged and the
    process ends by the signal, as its default action does (exit status 130). The first
    signal is logged at INFO (this module's ``logger``; the command line says it).
    ``exit_code`` is 143, 130 or 138 (``EXIT_CODES``) once a signal was handled, else None.
    Call ``restore()`` when the run is over.

    Example::

        stop = GracefulStop(checkpointer.last_handler)
        stop.attach(trainer)
        trainer.run(batches, max_epochs=10)
        stop.restore()
        sys.exit(stop.exit_code or 0)
    """

    def __init__(self, save: Callable[[Trainer], None]) -> None:
        if not callable(save):
            raise ValueError(f"save must be callable(trainer), got {save!r}")
        self.save = save
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}
        self._world_size = 1  # known at attach(), once the process group exists

    @property
    def exit_code(self) -> int | None:
        return None if self.received is None else EXIT_CODES[self.received]

    def attach(self, trainer: Trainer, evaluator: Engine | None = None) -> None:
        """Install the signal handlers and listen to the trainer's events named in the
        class docstring; evaluations are not interrupted."""
        # Read once: idist's lookup costs microseconds, and this runs at every window's end.
        self._world_size = idist.get_world_size()
        for signum in EXIT_CODES:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        trainer.add_event_handler(Events.ITERATION_COMPLETED, self._on_iteration)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self._stop)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            previous = self._previous.get(signal.Signals(signum))
            self.restore()
            if previous is signal.default_int_handler:  # a KeyboardInterrupt: a traceback
                # of wherever the step was, dozens of lines; end as the signal's default does
                logger.warning("%s again: stopping at once", signal.Signals(signum).name)
                sys.stdout.flush()
                signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.received = signal.Signals(signum)
        logger.info("%s: finishing the current step, then saving and stopping (send it again "
                    "to stop at once)", self.received.name)

    def _on_iteration(self, trainer: Trainer) -> None:
        if self._world_size == 1 and self.received is None:
            return  # the common case, first: this runs at every micro-batch
        # An epoch's last iteration is left to the EPOCH_COMPLETED check, which runs after
        # the epoch's evaluation: a stop here would commit a checkpoint that skips it.
        state = trainer.state
        if state.iteration % state.epoch_length == 0:
            return
        if window_position(state, trainer.accum_steps)[1]:
            self._stop(trainer)

    def _stop(self, trainer: Trainer) -> None:
        if trainer.should_terminate or not self._requested():
            return
        trainer.settle()  # the window's step, its counters and schedule, before the save
        self.save(trainer)
        trainer.terminate()

    def _requested(self) -> bool:
        """Whether any process got a signal. In a process group every rank calls this at
        the same points, so the collective pairs up and all ranks stop after the same step
        (a rank that stopped alone would leave the others waiting in the next all-reduce)."""
        if self._world_size == 1:
            return self.received is not None
        signum = idist.all_reduce(int(self.received or 0), op="MAX")
        if signum and self.received is None:
            self.received = signal.Signals(signum)  # stopping because another rank was told to
        return bool(signum)
