r"""Where a run's scalars go: one small class per destination (a scalar sink).

``RunLogger`` (``handlers.run_logger``) decides which scalars a run has and when they are
logged: ``train/*`` from the gradient telemetry's reports, ``val/*`` at each evaluation,
``perf/*`` at each epoch's end, ``health/*`` at each spike-guard action, ``best/val/*`` at
the end. It hands every record to each of its sinks; a sink only encodes records for its
destination. Sinks: ``TensorBoardSink`` (``handlers.tensorboard``, the event file) and
``JsonLinesSink`` (``handlers.jsonl_sink``, ``metrics.jsonl``).

The interface, ``ScalarSink``:

- ``write(step, epoch, wall_time, scalars)``: one record; ``step`` is the trainer's
  ``optimizer_step``, ``epoch`` its epoch, ``wall_time`` Unix seconds (when the numbers
  were made, which can be earlier than the call), ``scalars`` tag -> plain Python number
  (never a tensor: no device sync). Train records come ``REPORTS_PER_WRITE`` at a time
  (held as numbers by the logger), so ``write`` should only encode or buffer: a network
  call or a file write per record belongs in ``flush``.
- ``flush()``: hand what is buffered to the destination. The logger calls it at every
  evaluation, every epoch end, every spike-guard action and every checkpoint (so a
  destination holds at least what the newest checkpoint covers).
- ``close()``: flush and release; a second ``close()`` does nothing.
- optional ``state_dict()``/``load_state_dict(state)``: the logger saves the state in
  every checkpoint (under ``sinks/<the sink's name>``, after ``flush()``) and loads it
  when the run resumes, before anything more is written. ``JsonLinesSink`` keeps its
  record count there, so a resume cuts what a killed process wrote after that checkpoint.
- optional ``write_histogram(tag, values, step, wall_time)`` and
  ``write_hparams(hparams, metrics)``: only sinks that have them get histograms and the
  HParams entry (TensorBoard's).

A sink is not rolled back by the spike guard (it records what happened): after a rollback
the step axis goes back, and the abandoned steps' records stay before the
``health/rollbacks`` record.

A new sink, given to the logger under a name (``RunLogger(sinks={..., "print": PrintSink()},
telemetry=telemetry)``)::

    class PrintSink:  # each record as one line, written out at every flush
        def __init__(self, stream: TextIO) -> None:
            self.stream, self.lines = stream, []

        def write(self, step, epoch, wall_time, scalars):
            self.lines.append(f"{step} {epoch} {scalars}\n")

        def flush(self):
            self.stream.writelines(self.lines)
            self.lines.clear()

        def close(self):
            self.flush()
"""

from collections.abc import Mapping
from typing import Protocol


class ScalarSink(Protocol):
    def write(self, step: int, epoch: int, wall_time: float,
              scalars: Mapping[str, float]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...
