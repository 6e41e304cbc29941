import math
import os
import random
import time

import pytest
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
from tensorboard.summary.writer import event_file_writer
from torch.utils.tensorboard import SummaryWriter

from handlers.event_file import (
    EventFile,
    encode_scalars,
    masked_crc32c,
    read_events,
    tensorflow_bins,
)


def scalar(tag, value):
    return Summary(value=[Summary.Value(tag=tag, simple_value=value)])


@pytest.mark.parametrize("size", [0, 1, 8, 190, 4099])
def test_the_c_checksum_equals_tensorboards_own(size):
    data = os.urandom(size)
    assert masked_crc32c(data) == pywrap_tensorflow.masked_crc32c(data)


def test_the_default_bins_are_tensorboards(tmp_path):
    assert tensorflow_bins() == SummaryWriter(str(tmp_path)).default_bins


def test_records_pass_tensorboards_reader_with_their_steps_and_wall_times(tmp_path):
    events = EventFile(tmp_path / "run")
    assert events.path.parent == tmp_path / "run"
    assert events.path.name.startswith("events.out.tfevents.")
    events.add_summary(scalar("a", 1.0), step=3, wall_time=1000.0)
    events.add_summary(scalar("b", 2.0))
    events.close()
    first, a, b = read_events(events.path)
    assert first.file_version == "brain.Event:2"
    assert (a.step, a.wall_time, a.summary.value[0].tag, a.summary.value[0].simple_value) == (
        3, 1000.0, "a", 1.0)
    assert b.step == 0 and b.wall_time > 1000.0


def test_records_reach_the_file_at_flush_and_close_is_idempotent(tmp_path):
    events = EventFile(tmp_path)
    events.add_summary(scalar("a", 1.0), step=1)
    assert len(read_events(events.path)) == 1  # the version record, flushed at creation
    events.flush()
    assert len(read_events(events.path)) == 2
    events.close()
    events.close()
    events.flush()  # after close: nothing to do


def test_two_files_of_one_process_get_two_names(tmp_path):
    first, second = EventFile(tmp_path), EventFile(tmp_path)
    assert first.path != second.path
    first.close()
    second.close()


def test_a_summary_writer_of_the_same_process_and_second_leaves_the_file_alone(
        tmp_path, monkeypatch):
    monkeypatch.setattr(time, "time", lambda: 1_795_000_000.5)  # one second for both
    events = EventFile(tmp_path)
    events.add_summary(scalar("ours", 1.0), step=1)
    # TensorBoard's writer numbers its files from a counter of its own: give it ours.
    number = int(events.path.name.split(".")[6])
    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(number))
    with SummaryWriter(str(tmp_path)) as writer:  # TensorBoard's name scheme
        writer.add_scalar("theirs", 2.0, 1)
    events.add_summary(scalar("ours", 3.0), step=2)
    events.close()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    ours = [(e.step, e.summary.value[0].simple_value) for e in read_events(events.path)[1:]]
    assert ours == [(1, 1.0), (2, 3.0)]


# Values protobuf treats specially: zero and minus zero (a oneof member is written even at 0),
# beyond float32 (an infinity), NaN, the smallest subnormal; tags whose length needs a
# two-byte varint; steps of 0 (left out), one and two varint bytes, and negative (ten bytes).
SPECIAL_VALUES = [0.0, -0.0, 1e40, -1e40, math.inf, math.nan, 1e-45, 3]
SPECIAL_STEPS = [None, 0, 1, 127, 128, 2**40, -1]


def test_scalars_are_encoded_as_protobuf_encodes_them_byte_for_byte(tmp_path):
    rng = random.Random(0)
    events, expected = EventFile(tmp_path), []
    for case in range(200):
        scalars = {f"train/{'x' * rng.randint(0, 200)}{i}":
                   rng.choice([*SPECIAL_VALUES, rng.uniform(-1e6, 1e6)])
                   for i in range(rng.randint(0, 12))}
        step, wall_time = SPECIAL_STEPS[case % len(SPECIAL_STEPS)], 1.7e9 + rng.random()
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)
                                 for tag, value in scalars.items()])
        assert encode_scalars(scalars) == summary.SerializeToString()
        events.add_summary(encode_scalars(scalars), step, wall_time=wall_time)
        event = Event(summary=summary, wall_time=wall_time)
        if step is not None:
            event.step = step
        expected.append(event.SerializeToString())
    events.close()
    assert [event.SerializeToString() for event in read_events(events.path)[1:]] == expected


def test_a_message_and_its_encoding_write_the_same_record(tmp_path):
    by_message, by_bytes = EventFile(tmp_path / "a"), EventFile(tmp_path / "b")
    by_message.add_summary(scalar("loss", 0.5), step=7, wall_time=1.5e9)
    by_bytes.add_summary(encode_scalars({"loss": 0.5}), step=7, wall_time=1.5e9)
    for events in (by_message, by_bytes):
        events.close()
    records = [path.read_bytes().split(b"brain.Event:2", 1)[1][4:]  # after the first record
               for path in (by_message.path, by_bytes.path)]
    assert records[0] == records[1] and records[0]


def test_encoded_summaries_concatenate_into_one():
    both = Summary.FromString(encode_scalars({"a": 1.0}) + encode_scalars({"b": 2.0}))
    assert [(value.tag, value.simple_value) for value in both.value] == [("a", 1.0), ("b", 2.0)]
