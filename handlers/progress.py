"""Progress display: a tqdm bar on a terminal, plain log lines elsewhere."""

import sys
import time
from typing import TextIO

from ignite.engine import Engine, Events
from tqdm import tqdm

from engine import Trainer
from handlers.arguments import check_choice
from handlers.grad_telemetry import GradientTelemetry, TelemetryReport

PROGRESS_MODES = ("auto", "bar", "plain", "off")


class Progress:
    """Loss, learning rate, gradient norm and time left, refreshed at each telemetry report.

    ``attach(trainer, evaluator=None)`` listens to the trainer's ``Events.STARTED`` and
    (for the bar) ``EPOCH_STARTED``, ``ITERATION_COMPLETED`` and ``COMPLETED``, and takes
    its numbers from ``telemetry``'s reports (already on the host: no sync of its own);
    evaluations are not shown. ``mode="auto"`` draws a bar
    when the output stream (stderr by default) is a terminal and prints plain lines
    otherwise (log files, CI), e.g.
    ``epoch 2/10 step 340 it 68/98 loss 1.234 lr 0.04 grad_norm 0.83 eta 4m12s``;
    ``"bar"``, ``"plain"`` and ``"off"`` force a mode. Plain lines go to stdout
    unless ``stream`` is given.

    The bar is one tqdm bar for the whole run, so its ``<remaining`` is the time left
    to the run's end. It drives tqdm directly rather than through Ignite's
    ``ProgressBar``, which calls tqdm's ``set_description`` and ``set_postfix`` with
    ``refresh=True`` at every event, redrawing the bar each iteration past tqdm's
    ``mininterval`` throttle (about 130 us per iteration here, ten times the bare
    engine), and calls ``.item()`` on tensor outputs. Here the per-iteration work is
    ``tqdm.update(1)``, which redraws at most every ``mininterval``; the postfix
    changes only at reports.

    Example::

        telemetry = GradientTelemetry(log_every=50)
        telemetry.attach(trainer)
        Progress(mode="auto", telemetry=telemetry).attach(trainer)
    """

    def __init__(self, mode: str = "auto", stream: TextIO | None = None, *,
                 telemetry: GradientTelemetry) -> None:
        check_choice("mode", mode, PROGRESS_MODES)
        if mode == "auto":
            mode = "bar" if (stream or sys.stderr).isatty() else "plain"
        self.mode, self.stream, self.telemetry = mode, stream, telemetry
        self._trainer: Trainer | None = None
        self._bar: tqdm | None = None
        self._start_time, self._start_iteration = 0.0, 0

    def attach(self, trainer: Trainer, evaluator: Engine | None = None) -> None:
        if self.mode == "off":
            return
        self._trainer = trainer
        trainer.add_event_handler(Events.STARTED, self._on_started)
        self.telemetry.add_listener(self._on_report)
        if self.mode == "bar":
            trainer.add_event_handler(Events.EPOCH_STARTED, self._on_epoch_started)
            trainer.add_event_handler(Events.ITERATION_COMPLETED, self._on_iteration)
            trainer.add_event_handler(Events.COMPLETED, self._on_completed)

    def _on_started(self, trainer: Engine) -> None:
        self._start_time, self._start_iteration = time.perf_counter(), trainer.state.iteration
        if self.mode == "bar":
            self._bar = tqdm(
                total=_total_iterations(trainer), initial=trainer.state.iteration, file=self.stream
            )

    def _on_epoch_started(self, trainer: Engine) -> None:
        self._bar.set_description(f"epoch {trainer.state.epoch}/{trainer.state.max_epochs}", False)

    def _on_iteration(self, trainer: Engine) -> None:
        self._bar.update(1)

    def _on_completed(self, trainer: Engine) -> None:
        self._bar.close()

    def _on_report(self, report: TelemetryReport) -> None:
        stats = report.stats
        values = f"loss {stats['loss_mean']:.4g} lr {stats['lr']:.4g} "
        values += f"grad_norm {stats['grad_norm_mean']:.3g}"
        if self.mode == "bar":
            self._bar.set_postfix_str(values, refresh=False)
            return
        state = self._trainer.state
        iteration = f"{state.iteration}"
        if state.epoch_length is not None:
            iteration = f"{(state.iteration - 1) % state.epoch_length + 1}/{state.epoch_length}"
        print(
            f"epoch {state.epoch}/{state.max_epochs} step {report.step} it {iteration} "
            f"{values} eta {self._time_left()}",
            file=self.stream or sys.stdout,
            flush=True,
        )

    def _time_left(self) -> str:
        state = self._trainer.state
        total, done = _total_iterations(self._trainer), state.iteration - self._start_iteration
        if total is None or done == 0:
            return "?"
        seconds_per_iteration = (time.perf_counter() - self._start_time) / done
        return format_duration(seconds_per_iteration * (total - state.iteration))


def format_duration(seconds: float) -> str:
    """``12s``, ``4m12s``, ``1h02m``."""
    seconds = round(seconds)
    hours, minutes = seconds // 3600, seconds // 60 % 60
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{seconds % 60:02d}s" if minutes else f"{seconds}s"


def _total_iterations(trainer: Engine) -> int | None:
    if trainer.state.epoch_length is None:
        return None
    return trainer.state.max_epochs * trainer.state.epoch_length
