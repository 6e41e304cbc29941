"""A TensorBoard event file written by the training process itself, through a file buffer.

TensorBoard's own writer (``EventFileWriter``, under torch's ``SummaryWriter``) hands
every record to a thread that opens the file, appends the record and closes it again,
holding the GIL while it runs Python; without TensorFlow it also checksums in pure
Python (~90 µs a 190-byte record). In a training loop that is a wake-up, three system
calls and a GIL hand-over per record, paid by the step loop. ``EventFile`` writes the
same bytes (TFRecord framing, CRC32C in C through ``google_crc32c``, the same first
``file_version`` record, TensorBoard's file name with a suffix) into this process's file
buffer: a record
costs a serialisation and a buffered write, and the OS gets the bytes at ``flush()``,
when the buffer fills, and at ``close()``.
"""

import itertools
import os
import socket
import struct
import time
from pathlib import Path

import google_crc32c
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
from tensorboard.compat.tensorflow_stub.errors import OutOfRangeError

_file_numbers = itertools.count()  # two files of one process in one second stay apart
# TensorBoard reads any file with "tfevents" in its name. Without this suffix a
# SummaryWriter made by the same process in the same second (a recipe's own, for text)
# would get the very same name, open it with "wb" and wipe this file.
SUFFIX = ".engine"


def masked_crc32c(data: bytes) -> int:
    """The TFRecord checksum of ``data`` (CRC32C, rotated and offset), computed in C."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tensorflow_bins() -> list[float]:
    """TensorBoard's default histogram bucket edges (``SummaryWriter.default_bins``):
    ±1e-12 growing by 10% to ±1e20, and 0."""
    edges, edge = [], 1e-12
    while edge < 1e20:
        edges.append(edge)
        edge *= 1.1
    return [-edge for edge in reversed(edges)] + [0] + edges


class EventFile:
    """Appends events to a new ``events.out.tfevents.*.engine`` file in ``log_dir``.

    Example::

        events = EventFile(run_dir)
        events.add_summary(Summary(value=[Summary.Value(tag="x", simple_value=1.0)]), step=3)
        events.close()
    """

    def __init__(self, log_dir: str | Path) -> None:
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        while True:  # "x": a name taken already is never opened again
            self.path = log_dir / (f"events.out.tfevents.{int(time.time()):010d}."
                                   f"{socket.gethostname()}.{os.getpid()}."
                                   f"{next(_file_numbers)}{SUFFIX}")
            try:
                self._file = open(self.path, "xb")  # noqa: SIM115 - closed by close()
                break
            except FileExistsError:
                continue
        self.add_event(Event(wall_time=time.time(), file_version="brain.Event:2"))
        self.flush()

    def add_summary(self, summary: Summary, step: int | None = None,
                    wall_time: float | None = None) -> None:
        """One event holding ``summary``; the current time unless ``wall_time`` is given."""
        event = Event(summary=summary, wall_time=time.time() if wall_time is None else wall_time)
        if step is not None:
            event.step = int(step)
        self.add_event(event)

    def add_event(self, event: Event) -> None:
        data = event.SerializeToString()
        length = struct.pack("<Q", len(data))
        self._file.write(b"".join((length, struct.pack("<I", masked_crc32c(length)), data,
                                   struct.pack("<I", masked_crc32c(data)))))

    def flush(self) -> None:
        """Hand the buffered records to the OS (no fsync: TensorBoard's writer has none)."""
        if not self._file.closed:
            self._file.flush()

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        """Flush and close; closing again does nothing."""
        self._file.close()


def read_events(path: str | Path) -> list[Event]:
    """Every event of one event file, in order, through TensorBoard's own record reader,
    which checks both checksums of each record."""
    reader = pywrap_tensorflow.PyRecordReader_New(str(path))
    events = []
    while True:
        try:
            reader.GetNext()
        except OutOfRangeError:
            return events
        events.append(Event.FromString(reader.record()))
