import errno
import json
import math
from pathlib import Path

import pytest
import torch
from ignite.engine import Events
from ignite.metrics import Loss
from torch import nn

from engine.trainer import create_evaluator, create_trainer
from handlers.grad_telemetry import GradientTelemetry
from handlers.jsonl_sink import JsonLinesSink
from handlers.run_logger import RunLogger

BATCH, BATCHES = 5, 8


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def train(path):
    """Two epochs of 8 batches, telemetry every 4 steps, an evaluation after each epoch;
    every record goes to ``path`` only. Returns the telemetry reports."""
    torch.manual_seed(0)
    model = nn.Linear(3, 4)
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             nn.functional.cross_entropy, max_grad_norm=1.0)
    evaluator = create_evaluator(model, {"loss": Loss(nn.functional.cross_entropy)})
    data = [(torch.randn(BATCH, 3), torch.randint(0, 4, (BATCH,))) for _ in range(BATCHES)]
    telemetry = GradientTelemetry(log_every=4, layer_every=8, top_k_layers=1)
    telemetry.attach(trainer)
    reports = []
    telemetry.add_listener(reports.append)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: evaluator.run(data[:2]))
    logger = RunLogger({"metrics": JsonLinesSink(path)}, hparams={"lr": 0.1}, batch_size=BATCH,
                       telemetry=telemetry)
    logger.attach(trainer, evaluator)
    trainer.run(data, max_epochs=2)
    return reports


def test_one_record_per_report_evaluation_epoch_and_end_with_every_scalar(tmp_path):
    path = tmp_path / "metrics.jsonl"
    reports = train(path)
    records = read(path)
    kinds = [(r["step"], r["epoch"], sorted({tag.split("/")[0] for tag in r} - {"step", "epoch",
                                                                               "time"}))
             for r in records]
    assert kinds == [(4, 1, ["train"]), (8, 1, ["train"]), (8, 1, ["val"]), (8, 1, ["perf"]),
                     (12, 2, ["train"]), (16, 2, ["train"]), (16, 2, ["val"]), (16, 2, ["perf"]),
                     (16, 2, ["best"])]
    train_records = [r for r in records if "train/loss" in r]
    assert [r["train/loss"] for r in train_records] == [r.stats["loss_mean"] for r in reports]
    assert "train/layer_grad_norm/weight" in train_records[1]  # the layer_every cadence
    assert records[-1]["best/val/loss"] == min(r["val/loss"] for r in records if "val/loss" in r)
    times = [r["time"] for r in records]
    assert times == sorted(times) and all(isinstance(t, float) for t in times)


def test_records_reach_the_file_at_a_flush_not_at_each_write(tmp_path):
    sink = JsonLinesSink(tmp_path / "metrics.jsonl")
    sink.write(1, 1, 100.0, {"train/loss": 2.0})
    assert not sink.path.exists()
    sink.flush()
    sink.write(2, 1, 101.0, {"train/loss": 1.0})
    assert read(sink.path) == [{"step": 1, "epoch": 1, "time": 100.0, "train/loss": 2.0}]
    assert sink.state_dict() == {"records": 2}  # a checkpoint: the file holds both first
    assert [r["step"] for r in read(sink.path)] == [1, 2]
    sink.close()
    sink.close()


def test_a_non_finite_value_is_null(tmp_path):
    sink = JsonLinesSink(tmp_path / "metrics.jsonl")
    sink.write(1, 1, 100.0, {"train/loss": math.nan, "train/grad_norm": math.inf, "x": 1})
    sink.close()
    assert read(sink.path) == [{"step": 1, "epoch": 1, "time": 100.0, "train/loss": None,
                                "train/grad_norm": None, "x": 1.0}]


def test_a_resume_cuts_what_was_written_after_the_checkpoint_torn_line_included(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonLinesSink(path)
    for step in (1, 2, 3):
        sink.write(step, 1, 100.0, {"train/loss": 1.0})
    state = sink.state_dict()  # the checkpoint
    for step in (4, 5):
        sink.write(step, 1, 100.0, {"train/loss": 1.0})
    sink.flush()
    with path.open("ab") as file:  # killed inside a write
        file.write(b'{"step": 6, "epo')

    resumed = JsonLinesSink(path)
    resumed.load_state_dict(state)
    resumed.write(4, 1, 200.0, {"train/loss": 0.5})
    assert resumed.state_dict() == {"records": 4}
    resumed.close()
    assert [(r["step"], r["time"]) for r in read(path)] == [
        (1, 100.0), (2, 100.0), (3, 100.0), (4, 200.0)]


def test_a_run_that_writes_nothing_leaves_the_file_alone(tmp_path):
    """A finished run started again loads its checkpoint and trains nothing: the records
    after its last checkpoint (the closing best/*) stay."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 1, "best/val/loss": 1.0}\n')
    sink = JsonLinesSink(path)
    sink.load_state_dict({"records": 1})
    sink.close()
    assert len(read(path)) == 2


def test_a_start_without_a_checkpoint_starts_the_file_anew(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 3}\n')  # a process killed before its first checkpoint
    sink = JsonLinesSink(path)
    sink.write(1, 1, 100.0, {"train/loss": 1.0})
    sink.close()
    assert [r["step"] for r in read(path)] == [1]


def test_a_file_shorter_than_its_checkpoint_is_kept_with_a_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2')
    sink = JsonLinesSink(path)
    sink.load_state_dict({"records": 3})
    sink.write(4, 1, 100.0, {})
    assert sink.state_dict() == {"records": 2}
    sink.close()
    assert [r["step"] for r in read(path)] == [1, 4]
    assert "holds 1 records, its checkpoint 3" in caplog.text


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_raises_at_every_flush_naming_the_file_and_close_adds_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.symlink_to("/dev/full")  # every write fails with ENOSPC
    sink = JsonLinesSink(path)
    sink.write(step=1, epoch=1, wall_time=0.0, scalars={"train/loss": 1.0})
    with pytest.raises(OSError) as raised:
        sink.flush()
    assert (raised.value.errno, raised.value.filename) == (errno.ENOSPC, str(path))
    sink.write(step=2, epoch=1, wall_time=0.0, scalars={"train/loss": 0.5})
    with pytest.raises(OSError, match="No space left on device"):
        sink.state_dict()  # a checkpoint must not count records the file lacks
    sink.close()  # the error was raised: closing raises nothing more
    sink.close()
