import os
import time

import pytest
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
from tensorboard.summary.writer import event_file_writer
from torch.utils.tensorboard import SummaryWriter

from handlers.event_file import EventFile, masked_crc32c, read_events, tensorflow_bins


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
