"""TensorBoard as a scalar sink (``handlers.scalar_sink``): the run's event file, with the
gradient histogram and the HParams entry that only TensorBoard shows."""

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard.summary import histogram
from torch.utils.tensorboard.summary import hparams as hparams_summaries

from handlers.event_file import EventFile, tensorflow_bins


class TensorBoardSink:
    """Writes one TensorBoard run into ``log_dir``: each record is one event at its step.

    Built on TensorBoard's protos and summary builders rather than Ignite's
    ``TensorboardLogger``: Ignite's output handlers call ``.item()`` on tensors at every
    event they log and count their own event steps, while our values arrive as floats at
    the telemetry's cadence. The file is written by ``EventFile``, the process's own
    buffered writes rather than TensorBoard's writer thread (which opens and closes the
    file for every record), so the HParams entry lands in this run too. Records reach the
    OS at ``flush()`` and ``close()``, and when the file buffer fills. Nothing here is
    resumed: a resumed run writes a new event file, and a step written by a killed
    process after its last checkpoint is written again (TensorBoard shows both).

    Example::

        sink = TensorBoardSink(run_dir)
        sink.write(step=50, epoch=1, wall_time=time.time(), scalars={"train/loss": 2.3})
        sink.close()
    """

    def __init__(self, log_dir: str | Path) -> None:
        self.writer = EventFile(log_dir)
        # TensorBoard's default bucket edges (~1500) as an array once: the histogram would
        # convert the list at every call, four fifths of its cost.
        self._bins = np.asarray(tensorflow_bins())

    def write(self, step: int, epoch: int, wall_time: float,
              scalars: Mapping[str, float]) -> None:
        # One event for all values; each added in place (building Summary.Value objects
        # and passing them in copies each: twice the cost).
        summary = Summary()
        add = summary.value.add
        for tag, value in scalars.items():
            add(tag=tag, simple_value=float(value))
        self.writer.add_summary(summary, step, wall_time)

    def write_histogram(self, tag: str, values: Sequence[float], step: int,
                        wall_time: float) -> None:
        norms = np.array(values, dtype=np.float32)
        self.writer.add_summary(histogram(tag, norms, bins=self._bins), step, wall_time)

    def write_hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, float]) -> None:
        """The HParams entry: ``hparams`` flattened, ``metrics`` its metric columns."""
        for summary in hparams_summaries(flatten(hparams), dict(metrics)):
            self.writer.add_summary(summary)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


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
