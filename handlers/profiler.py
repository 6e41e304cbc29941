"""``torch.profiler`` over a window of optimizer steps: a trace and the top operators."""

import logging
import os
from pathlib import Path

from ignite.engine import Engine, Events
from torch.profiler import ProfilerAction, ProfilerActivity, profile

from engine.events import TrainEvents
from engine.trainer import Trainer
from handlers.arguments import check_int

logger = logging.getLogger(__name__)

TOP_OPERATORS = 10  # lines of the table printed when the window ends
# Kineto, the profiler's C++ side, logs straight to stderr: on a machine without a GPU a CUDA
# build of torch says "ERROR ... gpuGetDeviceCount failed" and "profiler_start/stop" lines at
# every window, though only CPU activity is asked for. Above its highest level it says
# nothing; it reads the variable when the first profiler starts, and a user's value is kept.
KINETO_QUIET = {"KINETO_LOG_LEVEL": "6"}


class StepProfiler:
    """Profiles optimizer steps ``start + 1`` to ``stop`` (``start:stop`` counts steps as
    a slice does: ``0:10`` is the run's first ten) with ``torch.profiler``: CPU activity,
    and CUDA's when ``cuda`` (without, the profiler's C++ logging is off: ``KINETO_QUIET``).
    When the window ends it writes ``trace_dir/trace-steps-FIRST-LAST.json.gz`` (Chrome's
    trace format, gzipped; Perfetto and ``chrome://tracing`` open it), named by the steps it
    holds so that a run interrupted inside the window and resumed keeps both parts, and logs
    (INFO, this module's ``logger``; the command line says it) the ``top`` operators by
    self time (the device's with ``cuda``). ``trace_path`` is that file once written, else
    None.

    ``attach(trainer, evaluator=None)`` registers on the trainer:
    - ``Events.STARTED`` and ``TrainEvents.OPTIMIZER_STEP``: the window opens once
      ``optimizer_step`` reaches ``start`` (at once for ``start`` 0, or for a run resumed
      inside the window), and each step is marked (``ProfilerStep#N`` in the trace); the
      window closes at step ``stop``, after which the handler removes itself;
    - ``Events.COMPLETED`` and ``Events.TERMINATE``: a window the run ends inside (a
      stop, or fewer steps than ``stop``) closes there with what it holds.

    A step's ``OPTIMIZER_STEP`` fires as the next micro-batch starts (``engine.trainer``), so
    the window holds whole steps: data loading, forward, backward, the update, and an
    evaluation that falls inside. A run that ends by an error writes no trace.
    """

    def __init__(self, start: int, stop: int, trace_dir: str | Path, *, cuda: bool = False,
                 top: int = TOP_OPERATORS) -> None:
        check_int("start", start, 0, "optimizer steps")
        check_int("stop", stop, start + 1, "optimizer steps")
        check_int("top", top, 1, "operators")
        self.start, self.stop, self.trace_dir = start, stop, Path(trace_dir)
        self.trace_path: Path | None = None
        self.cuda, self.top = cuda, top
        self._profiler: profile | None = None
        self._first_step = 0
        self.done = False

    def attach(self, trainer: Trainer, evaluator: Engine | None = None) -> None:
        trainer.add_event_handler(Events.STARTED, self._on_step)
        trainer.add_event_handler(TrainEvents.OPTIMIZER_STEP, self._on_step)
        trainer.add_event_handler(Events.COMPLETED, self._finish)
        trainer.add_event_handler(Events.TERMINATE, self._finish)

    def _on_step(self, trainer: Engine) -> None:
        step = trainer.state.optimizer_step
        if self._profiler is not None:
            if step >= self.stop:
                self._finish(trainer)  # closes ProfilerStep#stop; a step() would open another
            else:
                self._profiler.step()
        elif not self.done and self.start <= step < self.stop:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            if not self.cuda:
                for name, value in KINETO_QUIET.items():
                    os.environ.setdefault(name, value)
            # A schedule (one that always records, as profile's default) is what makes
            # profile.step() mark each step ProfilerStep#N; numbered by optimizer step.
            self._profiler = profile(activities=activities,
                                     schedule=lambda _step: ProfilerAction.RECORD)
            self._profiler.step_num = step + 1
            self._profiler.start()
            self._first_step = step + 1

    def _finish(self, trainer: Engine) -> None:
        if self._profiler is None:
            return
        profiler, self._profiler, self.done = self._profiler, None, True
        profiler.stop()
        for event in (Events.STARTED, TrainEvents.OPTIMIZER_STEP):  # nothing left to do
            trainer.remove_event_handler(self._on_step, event)
        last = trainer.state.optimizer_step
        self.trace_path = self.trace_dir / f"trace-steps-{self._first_step}-{last}.json.gz"
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.trace_path))
        logger.info("\n".join(self.summary(profiler, self._first_step, last)))

    def summary(self, profiler: profile, first: int, last: int) -> list[str]:
        """A heading and the ``top`` operators by self time, one line each."""
        clock = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        # The ProfilerStep markers are not operators: their self time is what runs between.
        operators = [op for op in profiler.key_averages() if not op.key.startswith("ProfilerStep")]
        operators = sorted(operators, key=lambda op: getattr(op, clock), reverse=True)[:self.top]
        heading = (f"profile: optimizer steps {first}-{last} in {self.trace_path} "
                   f"(open in ui.perfetto.dev); top {len(operators)} operators by self "
                   f"{'CUDA' if self.cuda else 'CPU'} time:")
        return [heading, *(f"  {getattr(op, clock) / 1e3:10.3f} ms  {op.count:7d} calls  "
                           f"{op.key}" for op in operators)]
