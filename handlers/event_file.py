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

Scalars, written at every telemetry report, are encoded here by hand (``encode_scalars``):
building the ``Summary`` and ``Event`` messages through protobuf took about half of a
report's time on the tiny benchmark model, and the bytes of a scalar are fixed apart from
its 4-byte value. The encoding is protobuf's own, byte for byte (a test compares them).
"""

import functools
import itertools
import math
import os
import socket
import struct
import time
from collections.abc import Mapping
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


def _varint(value: int) -> bytes:
    """Protobuf's base-128 varint of a non-negative int (a negative int64: its 64-bit two's
    complement, ten bytes)."""
    value &= 0xFFFFFFFFFFFFFFFF
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


@functools.cache
def _scalar_prefix(tag: str) -> bytes:
    """The bytes of ``Summary.value`` entry ``{tag, simple_value}`` up to the value: field 1
    (a message) holding field 1 (the tag, a string) and the key of field 2 (a float32)."""
    tag_bytes = tag.encode()
    value = b"\x0a" + _varint(len(tag_bytes)) + tag_bytes + b"\x15"
    return b"\x0a" + _varint(len(value) + 4) + value


def _float32(value: float) -> bytes:
    try:
        return _PACK_FLOAT(value)
    except OverflowError:  # beyond float32: protobuf stores an infinity of that sign
        return _PACK_FLOAT(math.copysign(math.inf, value))


_PACK_FLOAT = struct.Struct("<f").pack


def encode_scalars(scalars: Mapping[str, float]) -> bytes:
    """A serialized ``Summary`` with one ``simple_value`` per tag, in the mapping's order,
    as ``Summary(value=[Summary.Value(tag=t, simple_value=v), ...]).SerializeToString()``
    makes it. Serialized summaries concatenated are one summary with all their values."""
    return b"".join([_scalar_prefix(tag) + _float32(float(value))
                     for tag, value in scalars.items()])


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

    def add_summary(self, summary: Summary | bytes, step: int | None = None,
                    wall_time: float | None = None) -> None:
        """One event holding ``summary`` (a message, or serialized: ``encode_scalars``);
        the current time unless ``wall_time`` is given."""
        if not isinstance(summary, bytes):
            summary = summary.SerializeToString()
        # Event's fields 1 (wall_time, a double), 2 (step, an int64) and 5 (summary, a
        # message), in protobuf's order; a field at its default (0) is left out, as
        # protobuf leaves it out.
        wall_time = time.time() if wall_time is None else wall_time
        parts = [b"\x09", struct.pack("<d", wall_time)] if wall_time else []
        if step:
            parts += [b"\x10", _varint(int(step))]
        parts += [b"\x2a", _varint(len(summary)), summary]
        self._write_record(b"".join(parts))

    def add_event(self, event: Event) -> None:
        self._write_record(event.SerializeToString())

    def _write_record(self, data: bytes) -> None:
        length = struct.pack("<Q", len(data))
        self._file.write(b"".join((length, struct.pack("<I", masked_crc32c(length)), data,
                                   struct.pack("<I", masked_crc32c(data)))))

    def flush(self) -> None:
        """Hand the buffered records to the OS (no fsync: TensorBoard's writer has none)."""
        if not self._file.closed:
            self._file.flush()

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
