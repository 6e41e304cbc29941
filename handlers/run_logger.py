"""The run's scalars, decided once and handed to every sink (TensorBoard, metrics.jsonl, ...)."""

import numbers
import time
from collections.abc import Mapping
from typing import Any

import torch
from ignite.engine import Engine, Events

from engine.trainer import Trainer
from handlers.arguments import check_int
from handlers.cost import CostMeter
from handlers.goal import STANDARD_MODES, check_mode, is_better
from handlers.grad_telemetry import GradientTelemetry, TelemetryReport
from handlers.scalar_sink import ScalarSink

# Telemetry stat -> tag.
TRAIN_TAGS = {
    "loss_mean": "train/loss",
    "lr": "train/lr",
    "grad_norm_mean": "train/grad_norm",
    "grad_norm_max": "train/grad_norm_max",
    "grad_norm_clipped_mean": "train/grad_norm_clipped",
    "clip_fraction": "train/clip_fraction",
    "amp_scale": "train/amp_scale",
    "skipped_steps": "train/skipped_steps",
}
HISTOGRAM_TAG = "train/grad_norm_hist"
# Telemetry reports held as numbers before they are handed to the sinks together (see RunLogger).
REPORTS_PER_WRITE = 20


class RunLogger:
    """Logs the run's scalars to every sink in ``sinks`` (name -> ``ScalarSink``, see
    ``handlers.scalar_sink``), every record indexed by ``trainer.state.optimizer_step`` so
    train and validation curves share one axis.

    ``attach(trainer, evaluator=None)`` registers:
    - a listener on ``telemetry`` (a ``GradientTelemetry``): ``train/loss``, ``train/lr``,
      ``train/grad_norm``, ``train/grad_norm_max``, ``train/grad_norm_clipped``,
      ``train/clip_fraction``, ``train/skipped_steps``, ``train/amp_scale`` (fp16),
      and on the telemetry's ``layer_every`` cadence ``train/layer_grad_norm/<name>``
      and, to sinks with ``write_histogram``, ``train/grad_norm_hist``. These numbers were
      read from the device once by the telemetry: logging adds no sync and no
      per-iteration work;
    - the evaluator's ``Events.COMPLETED`` (when given): ``val/<name>`` for every scalar
      metric;
    - the trainer's ``Events.EPOCH_COMPLETED``: ``perf/epoch_time_sec`` (Ignite's
      epoch loop time, before validation runs) and ``perf/samples_per_sec``
      (iterations x ``batch_size``; without it, the leading size of the epoch's last
      batch, which is short unless the loader drops it), and with ``cost`` (a ``CostMeter``
      attached before this logger) its ``perf/*`` scalars: per device samples/s, tokens/s,
      model FLOP/s, MFU, and the peak memory in MB;
    - the trainer's ``Events.COMPLETED``: to sinks with ``write_hparams``, the HParams
      entry (``hparams``, with the best of each validation metric as its metrics), and
      ``best/val/<name>`` to every sink (the bests are kept in ``state_dict()`` across a
      resume; ``modes`` gives each metric's direction, ``"min"`` or ``"max"`` as
      ``handlers.goal`` ranks them; a metric it does not name is logged but has no best);
      then every sink is closed.

    A telemetry report is one record, stamped with the time it came; reports are held as
    numbers and handed to the sinks ``REPORTS_PER_WRITE`` at a time, and before every other
    record: encoding one report among the step's work cost ~100 µs (its code and protobuf's
    fall out of the CPU caches between reports), a batch of them a fraction of that each
    (the recipe's handler set: -12 µs an iteration on the tiny benchmark model). Every sink
    is flushed at every ``state_dict()`` (each checkpoint), evaluation, epoch end and
    ``log_now``, and at ``close()``: what a sink holds reaches at least the newest
    checkpoint. ``state_dict()`` also holds the state of each sink that has one, loaded
    back on resume. The run layer closes the logger when a run ends by an exception; no
    ``EXCEPTION_RAISED`` handler is registered, since Ignite swallows the exception once one
    exists. Attach it after handlers that evaluate on ``COMPLETED`` so the closing records
    see their metrics.

    Example::

        telemetry = GradientTelemetry(log_every=50, layer_every=500)
        telemetry.attach(trainer)
        logger = RunLogger({"tensorboard": TensorBoardSink(run_dir),
                            "metrics": JsonLinesSink(run_dir / "metrics.jsonl")},
                           hparams=asdict(config), batch_size=128, telemetry=telemetry)
        logger.attach(trainer, evaluator)
    """

    def __init__(
        self,
        sinks: Mapping[str, ScalarSink],
        hparams: Mapping[str, Any] | None = None,
        batch_size: int | None = None,
        modes: Mapping[str, str] | None = None,
        *,
        telemetry: GradientTelemetry,
        cost: CostMeter | None = None,
    ) -> None:
        if batch_size is not None:
            check_int("batch_size", batch_size, 1)
        if hparams is not None and not isinstance(hparams, Mapping):
            raise ValueError(f"hparams must be None or a mapping, got {type(hparams).__name__}")
        modes = dict(STANDARD_MODES if modes is None else modes)
        for name, mode in modes.items():
            check_mode(mode, f"modes[{name!r}]")
        self.hparams, self.batch_size, self.modes = hparams, batch_size, modes
        self.telemetry, self.cost = telemetry, cost
        self.sinks = dict(sinks)
        self._all = list(self.sinks.values())
        self._histograms = [sink for sink in self._all if hasattr(sink, "write_histogram")]
        self._stateful = {name: sink for name, sink in self.sinks.items()
                          if hasattr(sink, "state_dict") and hasattr(sink, "load_state_dict")}
        self.best: dict[str, float] = {}  # validation metric -> best value so far
        self._epoch = 0  # the trainer's, from each EPOCH_STARTED: no lookup per report
        self._epoch_start_iteration = 0
        self._reports: list[tuple[TelemetryReport, float]] = []  # (report, wall time)
        self._trainer: Trainer | None = None
        self._closed = False

    def attach(self, trainer: Trainer, evaluator: Engine | None = None) -> None:
        self._trainer = trainer
        self.telemetry.add_listener(self._on_report)
        trainer.add_event_handler(Events.EPOCH_STARTED, self._on_epoch_started)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self._on_epoch_completed)
        trainer.add_event_handler(Events.COMPLETED, self.end)
        if evaluator is not None:
            evaluator.add_event_handler(Events.COMPLETED, self._on_validation)

    def close(self) -> None:
        """Write what is held and close every sink; closing again does nothing."""
        if self._closed:
            return
        self._write_reports()
        self._closed = True
        for sink in self._all:
            sink.close()

    def log_now(self, scalars: Mapping[str, float], step: int) -> None:
        """Write ``scalars`` (tag -> value) at ``step`` to every sink and flush."""
        self._write(step, scalars)
        self._flush()

    def state_dict(self) -> dict[str, Any]:
        # Every checkpoint saves this: what each sink holds reaches it first.
        self._flush()
        return {"best": dict(self.best),
                "sinks": {name: sink.state_dict() for name, sink in self._stateful.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best = dict(state["best"])
        for name, sink_state in state["sinks"].items():
            if name in self._stateful:  # a sink this run no longer has keeps nothing
                self._stateful[name].load_state_dict(sink_state)

    def _on_report(self, report: TelemetryReport) -> None:
        self._reports.append((report, time.time()))
        if len(self._reports) == REPORTS_PER_WRITE:
            self._write_reports()

    def _write_reports(self) -> None:
        """Hand the reports held so far to the sinks, in order."""
        reports, self._reports = self._reports, []
        epoch = self._epoch
        for report, wall_time in reports:
            scalars = {TRAIN_TAGS.get(name) or f"train/{name}": value
                       for name, value in report.stats.items()}
            for name, value in report.top_layer_norms.items():
                scalars[f"train/layer_grad_norm/{name}"] = value
            for sink in self._all:
                sink.write(report.step, epoch, wall_time, scalars)
            if report.grad_norms:
                for sink in self._histograms:
                    sink.write_histogram(HISTOGRAM_TAG, report.grad_norms, report.step,
                                         wall_time)

    def _write(self, step: int, scalars: Mapping[str, float]) -> None:
        """One record now, after the reports held (records stay in step order)."""
        self._write_reports()
        if self._closed or not scalars:
            return
        wall_time = time.time()
        for sink in self._all:
            sink.write(step, self._epoch, wall_time, scalars)

    def _flush(self) -> None:
        self._write_reports()
        if not self._closed:
            for sink in self._all:
                sink.flush()

    def _on_validation(self, evaluator: Engine) -> None:
        scalars = {}
        for name, value in evaluator.state.metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()  # once per evaluation
            if not isinstance(value, numbers.Real):
                continue  # e.g. a confusion matrix
            scalars[f"val/{name}"] = float(value)
            mode = self.modes.get(name)
            if mode is not None and is_better(value, self.best.get(name), mode):
                self.best[name] = float(value)
        self._write(self._trainer.state.optimizer_step, scalars)
        self._flush()

    def _on_epoch_started(self, trainer: Engine) -> None:
        self._epoch = trainer.state.epoch
        self._epoch_start_iteration = trainer.state.iteration

    def _on_epoch_completed(self, trainer: Engine) -> None:
        seconds = trainer.state.times["EPOCH_COMPLETED"]
        batch_size = self.batch_size or _leading_size(trainer.state.batch)
        iterations = trainer.state.iteration - self._epoch_start_iteration
        self._write(trainer.state.optimizer_step, {
            "perf/epoch_time_sec": seconds,
            "perf/samples_per_sec": iterations * batch_size / seconds,
            **(self.cost.scalars() if self.cost is not None else {})})
        self._flush()

    def end(self, trainer: Engine) -> None:
        """The closing records (HParams, ``best/val/*``), then close: at ``COMPLETED``, and
        from the run layer for a finished run started again, whose last checkpoint came
        before them (a kill may have come between)."""
        self._epoch = trainer.state.epoch  # no EPOCH_STARTED came in a run started once done
        self._write_reports()
        if self.hparams is not None:
            metrics = {f"best/val/{name}": value for name, value in self.best.items()}
            for sink in self._all:
                if hasattr(sink, "write_hparams"):
                    sink.write_hparams(self.hparams, metrics)
            self._write(trainer.state.optimizer_step, metrics)
        self.close()


def _leading_size(batch: Any) -> int:
    """The first dimension of a batch's first tensor: ``x`` of ``(x, y)``, a dict's first value."""
    while not isinstance(batch, torch.Tensor):
        batch = next(iter(batch.values() if isinstance(batch, Mapping) else batch))
    return batch.shape[0]
