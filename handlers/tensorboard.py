"""TensorBoard: train curves from gradient telemetry, validation metrics, throughput, hparams."""

import numbers
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import google_crc32c
import torch
from ignite.engine import Engine, Events
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer import record_writer
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import histogram
from torch.utils.tensorboard.summary import hparams as hparams_summaries

from engine import Trainer
from handlers.goal import check_mode, is_better
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
# Telemetry reports held before they go to the writer together (see TensorBoardLogger).
REPORTS_PER_HANDOFF = 10


def masked_crc32c(data: bytes) -> int:
    """The TFRecord checksum of ``data`` (CRC32C, rotated and offset), computed in C."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def use_c_record_checksums() -> None:
    """Make TensorBoard's event writer checksum records in C.

    Without TensorFlow it checksums every record twice with a pure-Python CRC32C: about
    90 µs for one 190-byte telemetry report, on the writer thread, which holds the GIL
    while the training loop waits for it. ``google_crc32c`` gives the same values in
    under a microsecond. The writer has no hook for it, so the module's function is
    replaced; the bytes on disk are the same.
    """
    record_writer.masked_crc32c = masked_crc32c


class TensorBoardLogger:
    """Writes one TensorBoard run into ``log_dir``, every scalar indexed by
    ``trainer.state.optimizer_step`` so train and validation curves share one axis.

    ``attach(trainer, telemetry, evaluator=None)`` registers:
    - a ``GradientTelemetry`` listener: ``train/loss``, ``train/lr``,
      ``train/grad_norm``, ``train/grad_norm_max``, ``train/grad_norm_clipped``,
      ``train/clip_fraction``, ``train/skipped_steps``, ``train/amp_scale`` (fp16),
      and on the telemetry's ``layer_every`` cadence ``train/layer_grad_norm/<name>``
      and the histogram ``train/grad_norm_hist``. These numbers were read from the
      device once by the telemetry: logging adds no sync and no per-iteration work;
    - the evaluator's ``Events.COMPLETED``: ``val/<name>`` for every scalar metric;
    - the trainer's ``Events.EPOCH_COMPLETED``: ``perf/epoch_time_sec`` (Ignite's
      epoch loop time, before validation runs) and ``perf/samples_per_sec``
      (iterations x ``batch_size``; without it, the leading size of the epoch's last
      batch, which is short unless the loader drops it);
    - the trainer's ``Events.COMPLETED``: the HParams entry (``hparams`` flattened,
      the best of each validation metric as ``best/val/<name>``, kept in
      ``state_dict()`` across a resume; ``modes`` gives each metric's direction,
      ``"min"`` or ``"max"`` as ``handlers.goal`` ranks them; a metric it does not
      name is logged but has no best) and close.

    Built on ``torch.utils.tensorboard.SummaryWriter`` rather than Ignite's
    ``TensorboardLogger``: Ignite's output handlers call ``.item()`` on tensors at
    every event they log and count their own event steps, while our values arrive as
    floats at the telemetry's cadence, and the HParams entry must go through the
    writer's own ``file_writer`` to land in this run rather than in the sub-run that
    ``add_hparams`` creates. Writes are flushed by every ``state_dict()`` (each
    checkpoint), every evaluation and ``close()``, not at each report: a flush is a
    system call that waits for the writer thread. Records are checksummed in C (see
    ``use_c_record_checksums``). Telemetry reports go to the writer
    ``REPORTS_PER_HANDOFF`` at a time, with the wall time of each report, and before
    anything else is written or flushed: each hand-off wakes the writer's thread, which
    opens, appends to and closes the file once a record while holding the GIL, and one
    wake-up a report cost the step loop about 40 µs an iteration on this CPU. So the
    curves on disk reach at least the newest checkpoint, and a resumed run writes the
    rest again. The run layer closes the logger when a run ends by an exception; no
    ``EXCEPTION_RAISED`` handler is registered, since Ignite swallows the exception once
    one exists. Attach it after handlers that evaluate on ``COMPLETED`` so the HParams
    entry sees their metrics.

    Example::

        telemetry = GradientTelemetry(log_every=50, layer_every=500)
        telemetry.attach(trainer)
        tensorboard = TensorBoardLogger(run_dir, hparams=asdict(config), batch_size=128)
        tensorboard.attach(trainer, telemetry, evaluator)
    """

    def __init__(
        self,
        log_dir: str | Path,
        hparams: Mapping[str, Any] | None = None,
        batch_size: int | None = None,
        modes: Mapping[str, str] | None = None,
    ) -> None:
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
        ):
            raise ValueError(f"batch_size must be None or an int >= 1, got {batch_size!r}")
        if hparams is not None and not isinstance(hparams, Mapping):
            raise ValueError(f"hparams must be None or a mapping, got {type(hparams).__name__}")
        modes = {"loss": "min", "accuracy": "max"} if modes is None else dict(modes)
        for name, mode in modes.items():
            check_mode(mode, f"modes[{name!r}]")
        self.hparams, self.batch_size, self.modes = hparams, batch_size, modes
        use_c_record_checksums()
        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.best: dict[str, float] = {}  # validation metric -> best value so far
        self._trainer: Trainer | None = None
        self._epoch_start_iteration = 0
        self._held: list[tuple[Summary, int, float]] = []  # (summary, step, wall time)

    def attach(
        self, trainer: Trainer, telemetry: GradientTelemetry, evaluator: Engine | None = None
    ) -> None:
        self._trainer = trainer
        telemetry.add_listener(self._on_report)
        trainer.add_event_handler(Events.EPOCH_STARTED, self._on_epoch_started)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self._on_epoch_completed)
        trainer.add_event_handler(Events.COMPLETED, self._on_completed)
        if evaluator is not None:
            evaluator.add_event_handler(Events.COMPLETED, self._on_validation)

    def close(self) -> None:
        self._hand_off()
        self.writer.close()

    def log_now(self, scalars: Mapping[str, float], step: int) -> None:
        """Write ``scalars`` (tag -> value) at ``step`` and flush, after the held reports."""
        self._hand_off()
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def state_dict(self) -> dict[str, dict[str, float]]:
        # Every checkpoint saves this: the curves up to it are on disk when it is, and a
        # resumed run writes the rest again.
        self._hand_off()
        self.writer.flush()
        return {"best": dict(self.best)}

    def load_state_dict(self, state: dict[str, dict[str, float]]) -> None:
        self.best = dict(state["best"])

    def _on_report(self, report: TelemetryReport) -> None:
        values = [_scalar(TRAIN_TAGS.get(name, f"train/{name}"), value)  # train/lr/<group>
                  for name, value in report.stats.items()]
        values += [_scalar(f"train/layer_grad_norm/{name}", value)
                   for name, value in report.top_layer_norms.items()]
        if report.grad_norms:
            norms = torch.tensor(report.grad_norms)
            values += histogram("train/grad_norm_hist", norms, bins=self.writer.default_bins).value
        self._hold(values, report.step)
        if len(self._held) >= REPORTS_PER_HANDOFF:
            self._hand_off()

    def _on_validation(self, evaluator: Engine) -> None:
        self._hand_off()
        step = self._trainer.state.optimizer_step
        for name, value in evaluator.state.metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()  # once per evaluation
            if not isinstance(value, numbers.Real):
                continue  # e.g. a confusion matrix
            self.writer.add_scalar(f"val/{name}", value, step)
            mode = self.modes.get(name)
            if mode is not None and is_better(value, self.best.get(name), mode):
                self.best[name] = float(value)
        self.writer.flush()

    def _on_epoch_started(self, trainer: Engine) -> None:
        self._epoch_start_iteration = trainer.state.iteration

    def _on_epoch_completed(self, trainer: Engine) -> None:
        step, seconds = trainer.state.optimizer_step, trainer.state.times["EPOCH_COMPLETED"]
        batch_size = self.batch_size or _leading_size(trainer.state.batch)
        iterations = trainer.state.iteration - self._epoch_start_iteration
        self._hold([_scalar("perf/epoch_time_sec", seconds),
                    _scalar("perf/samples_per_sec", iterations * batch_size / seconds)], step)
        self._hand_off()

    def _hold(self, values: list[Summary.Value], step: int) -> None:
        # One event for all of them: the writer's cost is per record, not per value.
        self._held.append((Summary(value=values), step, time.time()))

    def _hand_off(self) -> None:
        """Queue the held records on the writer, in order, with their own wall times."""
        for summary, step, wall_time in self._held:
            self.writer.file_writer.add_summary(summary, step, wall_time)
        self._held.clear()

    def _on_completed(self, trainer: Engine) -> None:
        self._hand_off()
        if self.hparams is not None:
            metrics = {f"best/val/{name}": value for name, value in self.best.items()}
            for summary in hparams_summaries(flatten(self.hparams), metrics):
                self.writer.file_writer.add_summary(summary)
            for tag, value in metrics.items():
                self.writer.add_scalar(tag, value, trainer.state.optimizer_step)
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
