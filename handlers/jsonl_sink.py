"""``metrics.jsonl`` as a scalar sink (``handlers.scalar_sink``): one JSON object a line,
that a kill -9 and a resume leave exactly as an uninterrupted run would.

A record is ``{"step": ..., "epoch": ..., "time": ..., "<tag>": <value>, ...}``: the
optimizer step, the trainer's epoch, Unix seconds (to the millisecond) and the scalars,
each a float; JSON has no NaN or infinity, so a non-finite value is ``null``.

Records are held as numbers and encoded and appended to the file, in one write, at each
``flush()`` (each evaluation, epoch end and checkpoint): encoding them there, together,
keeps them out of the step loop, and the file only ever grows by whole lines, so a kill -9
cannot leave half a record (a failing disk still can; a resume removes it).

Across a resume the file is cut back to the checkpoint: ``state_dict()`` (in every
checkpoint) holds the number of records written so far, and after ``load_state_dict`` the
first write keeps that many lines and drops the rest (what a killed process wrote after
the checkpoint, which the resumed run writes again). The file is only opened at the first
``flush()``: a run that writes nothing (one found already complete) leaves it untouched,
and a run that starts without a checkpoint starts the file anew. A file shorter than the
checkpoint says (edited, or lost with an unsynced disk) is kept as it is, with a warning.

A write the disk refuses (full, read-only) raises an ``OSError`` naming the file at that
``flush()`` and at every later one, so that no checkpoint counts lines the file lacks; the
file is closed then, and ``close()`` raises nothing more: the run stops on one error.
"""

import contextlib
import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)


class JsonLinesSink:
    """Appends one JSON line per record to ``path``.

    Example::

        sink = JsonLinesSink(run_dir / "metrics.jsonl")
        sink.write(step=50, epoch=1, wall_time=time.time(), scalars={"train/loss": 2.3})
        sink.close()
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._held: list[tuple[int, int, float, Mapping[str, float]]] = []  # records to write
        self._records = 0  # in the file (once opened) and held
        self._keep = 0  # the file's records to keep when it is opened: the checkpoint's
        self._file: IO[bytes] | None = None
        self._closed = False
        self._failed: OSError | None = None  # the disk's refusal, raised at every flush

    def write(self, step: int, epoch: int, wall_time: float,
              scalars: Mapping[str, float]) -> None:
        # Encoded at flush(), all together: a record costs a tuple here, among the step's work.
        self._held.append((step, epoch, wall_time, scalars))
        self._records += 1

    def flush(self) -> None:
        if self._failed is not None:
            raise OSError(self._failed.errno, self._failed.strerror, str(self.path))
        if self._closed:
            return
        try:
            if self._file is None:
                self._open()
            if self._held:
                held, self._held = self._held, []
                self._file.write("".join(map(_line, held)).encode())
                self._file.flush()
        except OSError as error:
            self._failed = error
            self._abandon()
            raise OSError(error.errno, error.strerror, str(self.path)) from error

    def close(self) -> None:
        """Write what is held and close; closing again, or after a failed write, does
        nothing."""
        if self._held and self._failed is None:
            self.flush()
        if self._file is not None:
            self._file.close()
        self._closed = True

    def state_dict(self) -> dict[str, int]:
        self.flush()
        return {"records": self._records}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Keep the file's first ``state["records"]`` records; the rest goes at the next write."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._keep = self._records = int(state["records"])
        self._held = []

    def _abandon(self) -> None:
        """Close the file without what its buffer still holds: closing would write it again,
        and fail again."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()  # the descriptor is closed even when the flush fails
            self._file = None
        self._held = []

    def _open(self) -> None:
        """Cut the file to the records to keep, then open it to append."""
        try:
            data = self.path.read_bytes() if self._keep else b""
        except FileNotFoundError:
            data = b""
        end = kept = 0
        while kept < self._keep:
            newline = data.find(b"\n", end)
            if newline < 0:
                break
            end, kept = newline + 1, kept + 1
        if kept < self._keep:
            logger.warning("%s holds %d records, its checkpoint %d: appending after them",
                           self.path, kept, self._keep)
            self._records += kept - self._keep
        if self._keep and end < len(data):
            os.truncate(self.path, end)
        self._file = open(self.path, "ab" if self._keep else "wb")  # noqa: SIM115 - close()


def _line(held: tuple[int, int, float, Mapping[str, float]]) -> str:
    step, epoch, wall_time, scalars = held
    record = {"step": int(step), "epoch": int(epoch), "time": round(wall_time, 3)}
    for tag, value in scalars.items():
        record[tag] = float(value)
    try:
        return json.dumps(record, allow_nan=False) + "\n"
    except ValueError:  # NaN or infinity, rare: JSON has neither
        return json.dumps({key: value if math.isfinite(value) else None
                           for key, value in record.items()}) + "\n"
