"""Cost telemetry: the peak table, MFU, peak memory, FLOP counts and the per-epoch meter."""

import resource

import pytest
import torch
from ignite.engine import Engine, Events
from torch import nn

import handlers.cost as cost_module
from handlers.cost import (
    CostMeter,
    device_peak_flops,
    forward_flops,
    peak_flops,
    peak_memory,
    training_flops,
)


@pytest.mark.parametrize(("name", "number_format", "expected"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12),  # the SXM module's name
    ("NVIDIA H100 PCIe", "fp16", 756e12),
    ("NVIDIA H200", "bf16", 989.4e12),
    ("NVIDIA A100-SXM4-80GB", "fp32", 19.5e12),
    ("NVIDIA A100 80GB PCIe", "bf16", 312e12),
    ("NVIDIA L4", "bf16", 121e12),
    ("NVIDIA A10", "fp16", 125e12),
    ("NVIDIA GeForce RTX 4090", "bf16", 165.2e12),
])
def test_known_accelerators_have_their_dense_peak(name, number_format, expected):
    assert peak_flops(name, number_format) == expected


@pytest.mark.parametrize("name", ["NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA L40S",
                                  "NVIDIA A10G", "NVIDIA GeForce RTX 4090 D", "Tesla T4", ""])
def test_accelerators_not_in_the_table_have_no_peak(name):
    assert peak_flops(name, "bf16") is None


def test_fp32_uses_the_tf32_rate_only_when_tf32_is_allowed():
    assert peak_flops("NVIDIA A100-SXM4-40GB", "fp32") == 19.5e12
    assert peak_flops("NVIDIA A100-SXM4-40GB", "fp32", tf32=True) == 156e12
    assert peak_flops("NVIDIA A100-SXM4-40GB", "bf16", tf32=True) == 312e12


def test_the_cpu_has_no_peak_and_a_faked_cuda_device_is_looked_up(monkeypatch):
    assert device_peak_flops(torch.device("cpu"), "fp32") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 PCIe")
    assert device_peak_flops(torch.device("cuda", 0), "bf16") == 756e12
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert device_peak_flops(torch.device("cuda", 0), "fp32") == 378e12


def test_an_unknown_number_format_is_refused():
    with pytest.raises(ValueError, match="number_format must be one of"):
        peak_flops("NVIDIA L4", "fp8")


def test_cpu_peak_memory_is_the_process_peak_rss():
    size, source = peak_memory(torch.device("cpu"))
    assert source == "process_peak_rss"
    assert size == resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_forward_flops_count_multiply_adds_twice_and_training_three_forwards():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    assert forward_flops(model, torch.zeros(1, 4)) == 2 * (4 * 3 + 3 * 2)
    assert training_flops(model, torch.zeros(1, 4)) == 3 * 2 * (4 * 3 + 3 * 2)


def test_counting_flops_changes_no_statistics_and_restores_the_mode():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5))
    before = {name: value.clone() for name, value in model.state_dict().items()}
    example = torch.randn(1, 3, 8, 8)
    rng = torch.get_rng_state()
    assert forward_flops(model, example) == 2 * 3 * 9 * 4 * 6 * 6
    assert model.training
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    forward_flops(model.eval(), example)
    assert not model.training


def test_the_meter_reports_rates_per_device_and_mfu_against_the_peak():
    meter = CostMeter(batch_size=64, world_size=2, device=torch.device("cpu"),
                      flops_per_sample=1e9, tokens_per_sample=128, peak_flops=1e12)
    report = meter.report(200.0, [3 * 2**20, 5 * 2**20])
    assert report.samples_per_sec == 100.0
    assert report.tokens_per_sec == 100.0 * 128
    assert report.flops_per_sec == 100.0 * 1e9
    assert report.mfu == pytest.approx(0.1)


def test_without_a_peak_mfu_is_n_a_and_left_out_of_the_scalars():
    meter = CostMeter(batch_size=8, world_size=1, device=torch.device("cpu"),
                      flops_per_sample=1e6)
    meter.latest = meter.report(10.0, [300 * 2**20])
    assert meter.report(10.0, [1]).mfu is None
    assert "MFU n/a" in meter.line()
    assert meter.scalars() == {"perf/samples_per_sec_per_device": 10.0,
                               "perf/model_flops_per_sec_per_device": 1e7,
                               "perf/peak_memory_mb": 300.0}
    meter.peak_flops = 1e8
    meter.latest = meter.report(10.0, [300 * 2**20])
    assert meter.line() == "per device: 10 samples/s, MFU 10.0%, peak mem 300 MB"
    assert meter.scalars()["perf/mfu"] == pytest.approx(0.1)


def test_the_meter_measures_each_epoch_from_its_iterations_and_time():
    meter = CostMeter(batch_size=4, world_size=1, device=torch.device("cpu"),
                      tokens_per_sample=16)
    engine = Engine(lambda engine, batch: sum(range(20_000)))
    meter.attach(engine)
    epoch_times = []  # Ignite adds the handlers' time to it once they have run
    engine.add_event_handler(Events.EPOCH_COMPLETED,
                             lambda: epoch_times.append(engine.state.times["EPOCH_COMPLETED"]))
    assert meter.line() == "" and meter.scalars() == {}
    engine.run(range(6), max_epochs=2)
    seconds = epoch_times[-1]
    assert meter.latest.samples_per_sec == pytest.approx(6 * 4 / seconds)
    assert meter.latest.tokens_per_sec == pytest.approx(6 * 4 * 16 / seconds)
    assert meter.latest.peak_memory == [peak_memory(torch.device("cpu"))[0]]
    assert "tokens/s" in meter.line() and "MFU" not in meter.line()


def test_the_summary_has_the_run_rate_per_device_and_this_process_peak_now():
    meter = CostMeter(batch_size=4, world_size=1, device=torch.device("cpu"),
                      flops_per_sample=100.0, tokens_per_sample=2)
    summary = meter.summary(50.0)
    assert summary["samples_per_sec_per_device"] == 50.0
    assert summary["tokens_per_sec_per_device"] == 100.0
    assert summary["model_flops_per_sample"] == 100.0
    assert summary["mfu"] is None and summary["peak_flops_per_device"] is None
    assert summary["peak_memory_bytes"] == summary["peak_memory_bytes_per_process"][0] > 0
    assert summary["peak_memory_source"] == "process_peak_rss"
    assert meter.summary(None)["samples_per_sec_per_device"] is None


def test_before_the_first_epoch_ends_the_other_processes_peaks_are_unknown():
    meter = CostMeter(batch_size=4, world_size=2, device=torch.device("cpu"))
    summary = meter.summary(None)
    assert summary["peak_memory_bytes_per_process"][1] is None
    assert summary["peak_memory_bytes"] == summary["peak_memory_bytes_per_process"][0] > 0


@pytest.mark.parametrize(("options", "message"), [
    ({"batch_size": 0}, "batch_size"),
    ({"world_size": 0}, "world_size"),
    ({"tokens_per_sample": 0}, "tokens_per_sample"),
    ({"flops_per_sample": 0.0}, "flops_per_sample must be > 0"),
    ({"peak_flops": -1.0}, "peak_flops must be > 0"),
])
def test_bad_arguments_are_refused(options, message):
    arguments = {"batch_size": 4, "world_size": 1, **options}
    with pytest.raises(ValueError, match=message):
        CostMeter(device=torch.device("cpu"), **arguments)


def test_every_table_entry_gives_each_number_format():
    for peaks in cost_module.PEAK_FLOPS.values():
        assert set(peaks) == {"bf16", "fp16", "tf32", "fp32"}
