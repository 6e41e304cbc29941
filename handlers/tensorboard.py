"""TensorBoard: train curves from gradient telemetry, validation metrics, throughput, hparams."""

import numbers
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ignite.engine import Engine, Events
from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard.summary import histogram
from torch.utils.tensorboard.summary import hparams as hparams_summaries

from engine import Trainer
from handlers.arguments import check_int
from handlers.cost import CostMeter
from handlers.event_file import EventFile, tensorflow_bins
from handlers.goal import STANDARD_MODES, check_mode, is_better
from handlers.grad_telemetry import GradientTelemetry, TelemetryReport

# Telemetry stat -> TensorBoard tag.
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
# Telemetry reports held as numbers before they are encoded together (see TensorBoardLogger).
REPORTS_PER_WRITE = 20


class TensorBoardLogger:
    """Writes one TensorBoard run into ``log_dir``, every scalar indexed by
    ``trainer.state.optimizer_step`` so train and validation curves share one axis.

    ``attach(trainer, evaluator=None)`` registers:
    - a listener on ``telemetry`` (a ``GradientTelemetry``): ``train/loss``, ``train/lr``,
      ``train/grad_norm``, ``train/grad_norm_max``, ``train/grad_norm_clipped``,
      ``train/clip_fraction``, ``train/skipped_steps``, ``train/amp_scale`` (fp16),
      and on the telemetry's ``layer_every`` cadence ``train/layer_grad_norm/<name>``
      and the histogram ``train/grad_norm_hist``. These numbers were read from the
      device once by the telemetry: logging adds no sync and no per-iteration work;
    - the evaluator's ``Events.COMPLETED`` (when given): ``val/<name>`` for every scalar
      metric;
    - the trainer's ``Events.EPOCH_COMPLETED``: ``perf/epoch_time_sec`` (Ignite's
      epoch loop time, before validation runs) and ``perf/samples_per_sec``
      (iterations x ``batch_size``; without it, the leading size of the epoch's last
      batch, which is short unless the loader drops it), and with ``cost`` (a ``CostMeter``
      attached before this logger) its ``perf/*`` scalars: per device samples/s, tokens/s,
      model FLOP/s, MFU, and the peak memory in MB;
    - the trainer's ``Events.COMPLETED``: the HParams entry (``hparams`` flattened,
      the best of each validation metric as ``best/val/<name>``, kept in
      ``state_dict()`` across a resume; ``modes`` gives each metric's direction,
      ``"min"`` or ``"max"`` as ``handlers.goal`` ranks them; a metric it does not
      name is logged but has no best) and close.

    Built on TensorBoard's protos and summary builders rather than Ignite's
    ``TensorboardLogger``: Ignite's output handlers call ``.item()`` on tensors at every
    event they log and count their own event steps, while our values arrive as floats at
    the telemetry's cadence. The file is written by ``EventFile``, the process's own
    buffered writes rather than TensorBoard's writer thread (which opens and closes the
    file for every record), so the HParams entry lands in this run too. A telemetry
    report is one event, stamped with the time it came; reports are held as numbers and
    encoded ``REPORTS_PER_WRITE`` at a time, and before every other write: encoding one
    report among the step's work cost ~100 µs (its code and protobuf's fall out of the
    CPU caches between reports), a batch of them a fraction of that each (the recipe's
    handler set: -12 µs an iteration on the tiny benchmark model). Writes reach the OS at
    every ``state_dict()`` (each checkpoint), every evaluation and ``close()``, and when
    the file buffer fills: the curves on disk reach at least the newest checkpoint, and a
    resumed run writes the rest again. The run
    layer closes the logger when a run ends by an exception; no ``EXCEPTION_RAISED``
    handler is registered, since Ignite swallows the exception once one exists. Attach it
    after handlers that evaluate on ``COMPLETED`` so the HParams entry sees their metrics.

    Example::

        telemetry = GradientTelemetry(log_every=50, layer_every=500)
        telemetry.attach(trainer)
        tensorboard = TensorBoardLogger(run_dir, hparams=asdict(config), batch_size=128,
                                        telemetry=telemetry)
        tensorboard.attach(trainer, evaluator)
    """

    def __init__(
        self,
        log_dir: str | Path,
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
        self.writer = EventFile(log_dir)
        # TensorBoard's default bucket edges (~1500) as an array once: the histogram would
        # convert the list at every call, four fifths of its cost.
        self._bins = np.asarray(tensorflow_bins())
        self.best: dict[str, float] = {}  # validation metric -> best value so far
        self._trainer: Trainer | None = None
        self._epoch_start_iteration = 0
        self._reports: list[tuple[TelemetryReport, float]] = []  # (report, wall time)

    def attach(self, trainer: Trainer, evaluator: Engine | None = None) -> None:
        self._trainer = trainer
        self.telemetry.add_listener(self._on_report)
        trainer.add_event_handler(Events.EPOCH_STARTED, self._on_epoch_started)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self._on_epoch_completed)
        trainer.add_event_handler(Events.COMPLETED, self._on_completed)
        if evaluator is not None:
            evaluator.add_event_handler(Events.COMPLETED, self._on_validation)

    def close(self) -> None:
        if not self.writer.closed:
            self._write_reports()
        self.writer.close()

    def log_now(self, scalars: Mapping[str, float], step: int) -> None:
        """Write ``scalars`` (tag -> value) at ``step`` and flush."""
        self._write_reports()
        self.writer.add_summary(Summary(value=[_scalar(tag, value)
                                               for tag, value in scalars.items()]), step)
        self.writer.flush()

    def state_dict(self) -> dict[str, dict[str, float]]:
        # Every checkpoint saves this: the curves up to it are on disk when it is, and a
        # resumed run writes the rest again.
        self._write_reports()
        self.writer.flush()
        return {"best": dict(self.best)}

    def load_state_dict(self, state: dict[str, dict[str, float]]) -> None:
        self.best = dict(state["best"])

    def _on_report(self, report: TelemetryReport) -> None:
        self._reports.append((report, time.time()))
        if len(self._reports) == REPORTS_PER_WRITE:
            self._write_reports()

    def _write_reports(self) -> None:
        """Encode and write the reports held so far, in order."""
        reports, self._reports = self._reports, []
        for report, wall_time in reports:
            self._write_report(report, wall_time)

    def _write_report(self, report: TelemetryReport, wall_time: float) -> None:
        # One event for all values; each added in place (building Summary.Value objects
        # and passing them in copies each: twice the cost).
        summary = Summary()
        add = summary.value.add
        for name, value in report.stats.items():
            add(tag=TRAIN_TAGS.get(name, f"train/{name}"), simple_value=float(value))
        for name, value in report.top_layer_norms.items():
            add(tag=f"train/layer_grad_norm/{name}", simple_value=float(value))
        if report.grad_norms:
            norms = np.array(report.grad_norms, dtype=np.float32)
            summary.value.extend(histogram("train/grad_norm_hist", norms, bins=self._bins).value)
        self.writer.add_summary(summary, report.step, wall_time)

    def _on_validation(self, evaluator: Engine) -> None:
        self._write_reports()
        step = self._trainer.state.optimizer_step
        for name, value in evaluator.state.metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()  # once per evaluation
            if not isinstance(value, numbers.Real):
                continue  # e.g. a confusion matrix
            self.writer.add_summary(Summary(value=[_scalar(f"val/{name}", value)]), step)
            mode = self.modes.get(name)
            if mode is not None and is_better(value, self.best.get(name), mode):
                self.best[name] = float(value)
        self.writer.flush()

    def _on_epoch_started(self, trainer: Engine) -> None:
        self._epoch_start_iteration = trainer.state.iteration

    def _on_epoch_completed(self, trainer: Engine) -> None:
        self._write_reports()
        step, seconds = trainer.state.optimizer_step, trainer.state.times["EPOCH_COMPLETED"]
        batch_size = self.batch_size or _leading_size(trainer.state.batch)
        iterations = trainer.state.iteration - self._epoch_start_iteration
        self.writer.add_summary(Summary(value=[
            _scalar("perf/epoch_time_sec", seconds),
            _scalar("perf/samples_per_sec", iterations * batch_size / seconds),
            *(_scalar(tag, value) for tag, value in
              (self.cost.scalars() if self.cost is not None else {}).items())]), step)
        self.writer.flush()

    def _on_completed(self, trainer: Engine) -> None:
        self._write_reports()
        if self.hparams is not None:
            metrics = {f"best/val/{name}": value for name, value in self.best.items()}
            for summary in hparams_summaries(flatten(self.hparams), metrics):
                self.writer.add_summary(summary)
            for tag, value in metrics.items():
                self.writer.add_summary(Summary(value=[_scalar(tag, value)]),
                                        trainer.state.optimizer_step)
        self.close()


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """Nested mappings to dotted keys; values the HParams plugin cannot hold become strings."""
    flat: dict[str, bool | int | float | str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            keep = isinstance(value, bool | int | float | str)
            flat[f"{prefix}{key}"] = value if keep else str(value)
    return flat


def _leading_size(batch: Any) -> int:
    """The first dimension of a batch's first tensor: ``x`` of ``(x, y)``, a dict's first value."""
    while not isinstance(batch, torch.Tensor):
        batch = next(iter(batch.values() if isinstance(batch, Mapping) else batch))
    return batch.shape[0]


def _scalar(tag: str, value: float) -> Summary.Value:
    """What ``add_scalar`` writes for a Python number, without its NumPy round trip."""
    return Summary.Value(tag=tag, simple_value=float(value))
