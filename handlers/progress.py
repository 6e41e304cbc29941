"""Progress display: a tqdm bar on a terminal, plain log lines elsewhere; a line per
evaluation; the time left to the run's end, evaluations included."""

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from ignite.engine import Engine, Events
from tqdm import tqdm

from engine.trainer import Trainer
from handlers.arguments import check_choice
from handlers.cost import CostMeter
from handlers.goal import Goal, is_better
from handlers.grad_telemetry import GradientTelemetry, TelemetryReport
from handlers.history import RunHistory
from handlers.time_left import EvaluationSchedule, TimeLeft

PROGRESS_MODES = ("auto", "bar", "plain", "off")
EVAL_QUIET_SEC = 3.0  # an evaluation shorter than this shows no progress of its own
EVAL_LINE_EVERY_SEC = 10.0  # plain mode: a progress line of a long evaluation this often
DIVERGED_RATIO = 3.0  # a validation loss this many times its start's: a warning
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, {rate_fmt}{postfix}]"


@dataclass(frozen=True)
class Evaluations:
    """What the evaluation lines need: the run's history (every evaluation's metrics,
    resumes included), the metric that ranks the best, the optimizer steps per epoch (to
    name a best's epoch) and the evaluation schedule (for the time left)."""

    history: RunHistory
    best: Goal
    steps_per_epoch: int
    schedule: EvaluationSchedule


def best_so_far(history: RunHistory, goal: Goal, steps_per_epoch: int
                ) -> tuple[float, int] | None:
    """The best value of ``goal``'s metric among the run's evaluations and its epoch."""
    best, step = None, 0
    for value, at_step in zip(history.val.get(goal.metric, []), history.val["step"],
                              strict=True):
        if is_better(value, best, goal.mode):
            best, step = value, at_step
    return None if best is None else (best, math.ceil(step / steps_per_epoch))


class Progress:
    """Loss, learning rate, gradient norm and time left, refreshed at each telemetry report;
    with ``evaluations``, a line per evaluation and the progress of a long one.

    ``attach(trainer, evaluator=None)`` listens to the trainer's ``Events.STARTED`` and
    (for the bar) ``EPOCH_STARTED``, ``ITERATION_COMPLETED`` and ``COMPLETED``, to the
    evaluator's ``STARTED``, ``ITERATION_COMPLETED`` and ``COMPLETED`` when both it and
    ``evaluations`` are given, and takes its training numbers from ``telemetry``'s reports
    (already on the host: no sync of its own). ``mode="auto"`` draws a bar when the output
    stream (stderr by default) is a terminal and prints plain lines otherwise (log files,
    CI), e.g.
    ``epoch 2/10 step 340 it 68/98 loss 1.234 lr 0.04 grad_norm 0.83 eta 4m12s``;
    ``"bar"``, ``"plain"`` and ``"off"`` force a mode. Plain lines and evaluation lines go
    to stdout unless ``stream`` is given. The time left (``TimeLeft``) counts the
    evaluations still to come once one has been measured (``eta 4m12s+eval`` before).

    An evaluation line, e.g.
    ``eval epoch 2/10 accuracy 0.8123 loss 0.6521 | best accuracy 0.8123 (epoch 2) |
    elapsed 1m02s eta 4m12s``, holds the recipe's metrics, the best so far and the times
    (with ``cost``, a ``CostMeter`` attached before, the last epoch's cost before the times:
    ``| per device: 812 samples/s, 104k tokens/s, MFU n/a, peak mem 1.2 GB``);
    an evaluation that takes longer than ``EVAL_QUIET_SEC`` shows its own progress (a
    second bar, or a line every ``EVAL_LINE_EVERY_SEC``). A validation loss that rises
    above ``DIVERGED_RATIO`` times its first value or the first training loss gets one
    warning line (``divergence``).

    The bar is one tqdm bar for the whole run; its ``eta`` is the same estimate as the
    plain lines'. It drives tqdm directly rather than through Ignite's
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
                 telemetry: GradientTelemetry, evaluations: Evaluations | None = None,
                 cost: CostMeter | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        check_choice("mode", mode, PROGRESS_MODES)
        if mode == "auto":
            mode = "bar" if (stream or sys.stderr).isatty() else "plain"
        self.mode, self.stream, self.telemetry = mode, stream, telemetry
        self.evaluations, self.cost = evaluations, cost
        self.time_left = TimeLeft(evaluations.schedule if evaluations else None, clock)
        self._trainer: Trainer | None = None
        self._bar: tqdm | None = None
        self._eval_bar: tqdm | None = None
        self._eval_next_line = 0.0
        self._evaluated_epoch = 0  # the epoch of the last evaluation this process ran
        self._held_line: str | None = None  # the run's last evaluation, until its steps' report
        self._warned_divergence = False
        self._values = ""  # the last report's numbers, which the bar shows with the time left

    def attach(self, trainer: Trainer, evaluator: Engine | None = None) -> None:
        if self.mode == "off":
            return
        self._trainer = trainer
        trainer.add_event_handler(Events.STARTED, self._on_started)
        self.telemetry.add_listener(self._on_report)
        # A held evaluation line is said after the report it waits for (_on_report), or as
        # the run ends should that report not come.
        trainer.add_event_handler(Events.COMPLETED, self._say_held_evaluation)
        trainer.add_event_handler(Events.TERMINATE, self._say_held_evaluation)
        if self.mode == "bar":
            trainer.add_event_handler(Events.EPOCH_STARTED, self._on_epoch_started)
            trainer.add_event_handler(Events.ITERATION_COMPLETED, self._on_iteration)
            trainer.add_event_handler(Events.COMPLETED, self._on_completed)
        if evaluator is not None and self.evaluations is not None:
            evaluator.add_event_handler(Events.STARTED, self._on_evaluation_started)
            evaluator.add_event_handler(Events.ITERATION_COMPLETED, self._on_evaluation_step)
            evaluator.add_event_handler(Events.COMPLETED, self._on_evaluation_completed)

    def _on_started(self, trainer: Engine) -> None:
        self.time_left.start(trainer.state.iteration)
        if self.mode == "bar":
            self._bar = tqdm(total=_total_iterations(trainer), initial=trainer.state.iteration,
                             file=self.stream, bar_format=BAR_FORMAT)

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
        self._values = values
        state = self._trainer.state
        # A report may come after its epoch's evaluation (the last one's, at the end).
        eta = f"eta {self._eta(max(state.epoch, self._evaluated_epoch + 1))}"
        if self.mode == "bar":
            self._bar.set_postfix_str(f"{values}, {eta}", refresh=False)
        else:
            iteration = f"{state.iteration}"
            if state.epoch_length is not None:
                iteration = (f"{(state.iteration - 1) % state.epoch_length + 1}/"
                             f"{state.epoch_length}")
            self._print(f"epoch {state.epoch}/{state.max_epochs} step {report.step} it "
                        f"{iteration} {values} {eta}")
        self._say_held_evaluation()  # the run's last evaluation, if it waited for this report

    def _eta(self, next_evaluated_epoch: int) -> str:
        """The time left; ``next_evaluated_epoch``: the first epoch whose evaluation is
        still to come."""
        state = self._trainer.state
        total = _total_iterations(self._trainer)
        if total is None:
            return "?"
        seconds = self.time_left.seconds(state.iteration, total, next_evaluated_epoch,
                                         state.max_epochs)
        if seconds is None:
            return "?"
        unknown = self.time_left.evaluations_unknown(next_evaluated_epoch, state.max_epochs)
        return format_duration(seconds) + ("+eval" if unknown else "")

    def _on_evaluation_started(self, evaluator: Engine) -> None:
        self.time_left.evaluation_started()
        self._eval_next_line = self.time_left.clock() + EVAL_QUIET_SEC
        if self.mode == "bar":
            self._eval_bar = tqdm(total=evaluator.state.epoch_length, desc="evaluating",
                                  delay=EVAL_QUIET_SEC, leave=False, file=self.stream)

    def _on_evaluation_step(self, evaluator: Engine) -> None:
        if self._eval_bar is not None:
            self._eval_bar.update(1)
            return
        now = self.time_left.clock()
        done, total = evaluator.state.iteration, evaluator.state.epoch_length
        if now < self._eval_next_line or done == total:  # the evaluation line comes next
            return
        self._eval_next_line = now + EVAL_LINE_EVERY_SEC
        line = f"evaluating {done}/{total or '?'}"
        if total:
            seconds = self.time_left.evaluation_elapsed() / done * (total - done)
            line += f" eta {format_duration(seconds)}"
        self._print(line)

    def _on_evaluation_completed(self, evaluator: Engine) -> None:
        if self._eval_bar is not None:
            self._eval_bar.close()
            self._eval_bar = None
        state = self._trainer.state
        self.time_left.evaluation_completed(final=state.epoch == state.max_epochs)
        self._evaluated_epoch = state.epoch
        metrics = evaluator.state.metrics
        shown = " ".join(f"{name} {_number(metrics[name])}"
                         for name in self.evaluations.history.modes if name in metrics)
        # An evaluation inside an epoch (--eval-every-steps) names its step: the epoch's
        # own comes at its end.
        inside = bool(state.epoch_length) and state.iteration % state.epoch_length != 0
        step = f" step {getattr(state, 'optimizer_step', state.iteration)}" if inside else ""
        line = f"eval epoch {state.epoch}/{state.max_epochs}{step} {shown}"
        evaluations = self.evaluations
        best = best_so_far(evaluations.history, evaluations.best, evaluations.steps_per_epoch)
        if best is not None:
            line += f" | best {evaluations.best.metric} {_number(best[0])} (epoch {best[1]})"
        cost = self.cost.line() if self.cost is not None else ""
        line += f" | {cost}" if cost else ""
        eta = self._eta(state.epoch + 1)
        line += f" | elapsed {format_duration(self.time_left.elapsed())} eta {eta}"
        if self._bar is not None:  # the evaluation just measured changes the time left
            postfix = f"{self._values}, eta {eta}" if self._values else f"eta {eta}"
            self._bar.set_postfix_str(postfix, refresh=False)
        self._held_line = line
        # The run's last evaluation waits for the report of the steps before it, which
        # comes as the run completes (a partial interval); every other is said at once.
        if (state.iteration != _total_iterations(self._trainer)
                or not self.telemetry.unreported_steps):
            self._say_held_evaluation()

    def _say_held_evaluation(self, _: Engine | None = None) -> None:
        if self._held_line is not None:
            self._print(self._held_line)
            self._held_line = None
            self._warn_if_diverging()

    def _warn_if_diverging(self) -> None:
        if self._warned_divergence:
            return
        why = divergence(self.evaluations.history)
        if why is None:
            return
        self._warned_divergence = True
        self._print(f"warning: {why}: the training is diverging; try a lower --lr (a third "
                    "or a tenth)")

    def _print(self, line: str) -> None:
        stream = self.stream or sys.stdout
        if self.mode == "bar":
            tqdm.write(line, file=stream)  # above the bars, which are drawn again below
        else:
            print(line, file=stream, flush=True)


def divergence(history: RunHistory) -> str | None:
    """Why the last validation loss says the run diverged, else None: it is not finite, or
    above ``DIVERGED_RATIO`` times a sane reference, the smaller of the first evaluation's
    loss and the first training loss reported. The training loss is needed: a first
    evaluation that comes after the divergence (a high LR from the start) would hide it."""
    losses, train = history.val.get("loss", []), history.train["loss"]
    if not losses:
        return None
    last = losses[-1]
    references = [(value, what) for value, what in (
        (losses[0] if len(losses) > 1 else math.nan, "the first evaluation's"),
        (train[0] if train else math.nan, "the first training loss"))
        if math.isfinite(value)]
    if math.isfinite(last) and all(last <= DIVERGED_RATIO * value for value, _ in references):
        return None
    if not references:
        return f"the validation loss is {_number(last)}"
    value, what = min(references)
    return (f"the validation loss rose to {_number(last)}, over {DIVERGED_RATIO:g}x "
            f"{what} {_number(value)}")


def format_duration(seconds: float) -> str:
    """``12s``, ``4m12s``, ``1h02m``."""
    seconds = round(seconds)
    hours, minutes = seconds // 3600, seconds // 60 % 60
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{seconds % 60:02d}s" if minutes else f"{seconds}s"


def _number(value: object) -> str:
    return f"{float(value):.4g}"


def _total_iterations(trainer: Engine) -> int | None:
    if trainer.state.epoch_length is None:
        return None
    return trainer.state.max_epochs * trainer.state.epoch_length
