
import pytest
import torch
from ignite.engine import Events
from ignite.metrics import Accuracy, Loss
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData
from torch import nn

import handlers.run_logger as run_logger_module
from engine.trainer import create_evaluator, create_trainer
from handlers.cost import CostMeter
from handlers.event_file import read_events
from handlers.grad_telemetry import GradientTelemetry, TelemetryReport
from handlers.run_logger import REPORTS_PER_WRITE, RunLogger
from handlers.tensorboard import TensorBoardSink, flatten

BATCH, BATCHES = 5, 8
TELEMETRY = GradientTelemetry(log_every=1)  # for a logger that is never attached
HPARAMS = {"optimizer": {"name": "sgd", "lr": 0.1}, "epochs": 2, "amp": False, "milestones": (3, 6)}


def tensorboard_logger(log_dir, **options):
    """The run logger with TensorBoard as its one sink."""
    return RunLogger({"tensorboard": TensorBoardSink(log_dir)}, telemetry=TELEMETRY,
                     **options)


def train(log_dir, precision="fp32", logger_state=None, bias_lr=None, cost=None):
    """Two epochs of 8 batches; telemetry every 4 steps, layer norms and histogram every 8.
    ``bias_lr``: the bias in a group of its own named "bias", at that LR. ``cost``: a
    ``CostMeter`` attached before the logger."""
    torch.manual_seed(0)
    model = nn.Linear(3, 4)
    groups = [{"params": [model.weight]},
              {"params": [model.bias], "lr": bias_lr or 0.1, "name": "bias"}]
    optimizer = torch.optim.SGD(groups, lr=0.1)
    trainer = create_trainer(
        model, optimizer, nn.functional.cross_entropy, precision=precision, max_grad_norm=1.0
    )
    metrics = {"loss": Loss(nn.functional.cross_entropy), "accuracy": Accuracy()}
    evaluator = create_evaluator(model, metrics, precision=precision)
    data = [(torch.randn(BATCH, 3), torch.randint(0, 4, (BATCH,))) for _ in range(BATCHES)]
    telemetry = GradientTelemetry(log_every=4, layer_every=8, top_k_layers=2)
    telemetry.attach(trainer)
    reports = []
    telemetry.add_listener(reports.append)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: evaluator.run(data[:2]))
    if cost is not None:
        cost.attach(trainer)
    logger = RunLogger({"tensorboard": TensorBoardSink(log_dir)}, hparams=HPARAMS,
                       telemetry=telemetry, cost=cost)
    if logger_state is not None:
        logger.load_state_dict(torch.load(logger_state, weights_only=True))
    logger.attach(trainer, evaluator)
    trainer.run(data, max_epochs=2)
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    return events, reports


def steps(events, tag):
    return [event.step for event in events.Scalars(tag)]


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("fp32")
    events, reports = train(log_dir)
    return log_dir, events, reports


def test_train_curves_come_from_the_telemetry_on_the_optimizer_step_axis(fp32_run):
    _, events, reports = fp32_run
    for tag in ("loss", "lr", "grad_norm", "grad_norm_max", "grad_norm_clipped", "clip_fraction",
                "skipped_steps"):
        assert steps(events, f"train/{tag}") == [4, 8, 12, 16], tag
    losses = [event.value for event in events.Scalars("train/loss")]
    assert losses == pytest.approx([report.stats["loss_mean"] for report in reports])
    assert "train/amp_scale" not in events.Tags()["scalars"]


def test_groups_with_different_lrs_get_a_curve_each(fp32_run, tmp_path):
    assert not [tag for tag in fp32_run[1].Tags()["scalars"] if tag.startswith("train/lr/")]
    events, _ = train(tmp_path, bias_lr=0.3)
    assert [event.value for event in events.Scalars("train/lr/0")] == pytest.approx([0.1] * 4)
    assert [event.value for event in events.Scalars("train/lr/bias")] == pytest.approx([0.3] * 4)
    assert steps(events, "train/lr/bias") == [4, 8, 12, 16]


def test_layer_norms_and_histogram_on_the_slow_cadence(fp32_run):
    _, events, reports = fp32_run
    for name in ("weight", "bias"):
        assert steps(events, f"train/layer_grad_norm/{name}") == [8, 16]
    histograms = events.Histograms("train/grad_norm_hist")
    assert [h.step for h in histograms] == [8, 16]
    assert [h.histogram_value.num for h in histograms] == [8, 8]  # the pre-clip norm of each step
    assert histograms[1].histogram_value.max == pytest.approx(
        max(report.stats["grad_norm_max"] for report in reports[2:])
    )


def test_validation_and_throughput_at_each_epoch_end(fp32_run):
    _, events, _ = fp32_run
    for tag in ("val/loss", "val/accuracy", "perf/epoch_time_sec", "perf/samples_per_sec"):
        assert steps(events, tag) == [8, 16], tag
    for time, rate in zip(
        events.Scalars("perf/epoch_time_sec"), events.Scalars("perf/samples_per_sec"), strict=True
    ):
        assert rate.value == pytest.approx(BATCHES * BATCH / time.value, rel=1e-4)


def test_a_cost_meter_adds_its_perf_scalars_at_each_epoch_end(tmp_path):
    cost = CostMeter(BATCH, 1, torch.device("cpu"), flops_per_sample=1e6,
                     tokens_per_sample=3, peak_flops=1e12)
    events, _ = train(tmp_path, cost=cost)
    for tag in ("perf/samples_per_sec_per_device", "perf/tokens_per_sec_per_device",
                "perf/model_flops_per_sec_per_device", "perf/mfu", "perf/peak_memory_mb"):
        assert steps(events, tag) == [8, 16], tag
    assert events.Scalars("perf/mfu")[-1].value == pytest.approx(cost.latest.mfu)


def test_hparams_with_best_validation_metrics_in_the_same_run(fp32_run):
    log_dir, events, _ = fp32_run
    assert [path.name for path in log_dir.iterdir()] == [
        next(log_dir.glob("events.out.tfevents.*")).name
    ]  # one run: no add_hparams sub-run
    best = {tag: events.Scalars(tag) for tag in ("best/val/loss", "best/val/accuracy")}
    assert [e.step for e in best["best/val/loss"]] == [16]
    assert best["best/val/loss"][0].value == pytest.approx(
        min(e.value for e in events.Scalars("val/loss"))
    )
    assert best["best/val/accuracy"][0].value == pytest.approx(
        max(e.value for e in events.Scalars("val/accuracy"))
    )
    content = events.PluginTagToContent("hparams")
    experiment = HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {m.name.tag for m in experiment.metric_infos} == set(best)
    start = HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert hparams["optimizer.name"].string_value == "sgd"
    assert hparams["optimizer.lr"].number_value == pytest.approx(0.1)
    assert hparams["milestones"].string_value == "(3, 6)"


def test_amp_scale_only_under_fp16(tmp_path):
    events, reports = train(tmp_path, precision="fp16")
    assert len(reports) >= 2  # some steps are skipped while GradScaler backs off
    scales = events.Scalars("train/amp_scale")
    assert [e.step for e in scales] == steps(events, "train/loss") == [r.step for r in reports]
    assert [e.value for e in scales] == [report.stats["amp_scale"] for report in reports]


def test_best_metrics_survive_a_state_roundtrip(tmp_path):
    torch.save({"best": {"loss": 1e-3, "accuracy": 0.0}, "sinks": {}}, tmp_path / "logger.pt")
    events, _ = train(tmp_path / "run", logger_state=tmp_path / "logger.pt")
    assert events.Scalars("best/val/loss")[0].value == pytest.approx(1e-3)  # the saved one
    assert events.Scalars("best/val/accuracy")[0].value == pytest.approx(
        max(e.value for e in events.Scalars("val/accuracy"))
    )


def test_flatten_keeps_plain_values_and_stringifies_the_rest():
    assert flatten({"a": {"b": 1, "c": {"d": True}}, "e": None, "f": [1, 2], "g": 0.5}) == {
        "a.b": 1, "a.c.d": True, "e": "None", "f": "[1, 2]", "g": 0.5
    }


@pytest.mark.parametrize("batch_size", [0, 2.5, True])
def test_rejects_a_bad_batch_size(tmp_path, batch_size):
    with pytest.raises(ValueError, match="batch_size"):
        tensorboard_logger(tmp_path, batch_size=batch_size)


def test_a_checkpoint_of_the_logger_puts_its_curves_on_disk_first(tmp_path):
    logger = tensorboard_logger(tmp_path)
    for step in (10, 20):
        logger._on_report(TelemetryReport(step=step, stats={"loss_mean": step / 10}))
    logger.state_dict()  # what each checkpoint save calls
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(10, 1.0), (20, 2.0)]
    logger.close()
    logger.close()  # the run layer closes it again after an exception: harmless


def read_records(log_dir):
    """Every event of the run's one file, CRC-checked."""
    (path,) = log_dir.glob("events.out.tfevents.*")
    return read_events(path)


def test_reports_reach_the_file_at_each_checkpoint_each_in_one_event(tmp_path):
    logger = tensorboard_logger(tmp_path)
    for step in (10, 20):
        logger._on_report(TelemetryReport(step=step, stats={"loss_mean": step / 10, "lr": 0.1}))
    assert [event.step for event in read_records(tmp_path)] == [0]  # still in the buffer
    logger.state_dict()  # what each checkpoint save calls
    events = read_records(tmp_path)[1:]
    assert [(e.step, [v.tag for v in e.summary.value]) for e in events] == [
        (10, ["train/loss", "train/lr"]), (20, ["train/loss", "train/lr"])]
    logger.log_now({"health/rollbacks": 1.0}, step=20)  # written and flushed at once
    assert read_records(tmp_path)[-1].summary.value[0].tag == "health/rollbacks"
    logger.close()


def test_reports_are_encoded_in_batches_stamped_with_the_time_each_came(tmp_path, monkeypatch):
    clock = iter(range(1000, 2000))
    monkeypatch.setattr(run_logger_module.time, "time", lambda: float(next(clock)))
    logger = tensorboard_logger(tmp_path)
    for step in range(1, REPORTS_PER_WRITE):
        logger._on_report(TelemetryReport(step=step, stats={"loss_mean": 1.0}))
    logger.sinks["tensorboard"].flush()
    assert [event.step for event in read_records(tmp_path)] == [0]  # held as numbers
    logger._on_report(TelemetryReport(step=REPORTS_PER_WRITE, stats={"loss_mean": 1.0}))
    logger.sinks["tensorboard"].flush()
    events = read_records(tmp_path)[1:]
    assert [e.step for e in events] == list(range(1, REPORTS_PER_WRITE + 1))
    times = [e.wall_time for e in events]
    assert times == sorted(times) and len(set(times)) == REPORTS_PER_WRITE  # each its own
    logger.close()


def test_held_reports_are_written_before_any_later_event(tmp_path):
    logger = tensorboard_logger(tmp_path)
    logger._on_report(TelemetryReport(step=10, stats={"loss_mean": 1.0}))
    logger.log_now({"health/rollbacks": 1.0}, step=10)
    logger._on_report(TelemetryReport(step=20, stats={"loss_mean": 2.0}))
    logger.close()
    assert [(e.step, e.summary.value[0].tag) for e in read_records(tmp_path)[1:]] == [
        (10, "train/loss"), (10, "health/rollbacks"), (20, "train/loss")]
