"""The GPU section's parts that need no GPU: skip reasons, the recipe runs' arguments, the
tables from given rows, and ``--only gpu`` from the command line to the report."""

import importlib.util

import pytest
import torch

from benchmarks import __main__ as bench
from benchmarks.arms.workloads import cifar_workload
from benchmarks.harness.timing import Stats
from benchmarks.sections import s5_gpu
from recipes.cifar.data import make_synthetic
from recipes.cifar.recipe import Config
from recipes.runner.config.command_line import parse_args


def _installed_except(missing: str):
    return lambda name, *args: None if name == missing else object()


def test_without_cuda_the_section_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reason = s5_gpu.skip_reason()
    assert reason == "no CUDA device on this machine"
    text = s5_gpu.render([], [], reason)
    assert "Unmeasured: no CUDA device on this machine." in text
    assert "`python -m benchmarks --only gpu`" in text


def test_with_cuda_it_still_needs_airbench_and_the_data(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", _installed_except("airbench"))
    assert "airbench is not installed" in s5_gpu.skip_reason()
    monkeypatch.setattr(importlib.util, "find_spec", _installed_except("nothing"))
    monkeypatch.setattr(s5_gpu, "SHARED_CIFAR", tmp_path / "absent")
    assert s5_gpu.skip_reason() == f"no CIFAR-10 image folders at `{tmp_path / 'absent'}`"
    monkeypatch.setattr(s5_gpu, "SHARED_CIFAR", tmp_path)
    assert s5_gpu.skip_reason() is None


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("options", s5_gpu.RECIPE_RUNS)
def test_the_recipe_runs_parse_as_the_recipe_reads_them(options, compile):
    args = s5_gpu.recipe_args(options, compile, epochs=None)
    assert args[0] == "cifar"
    config, _ = parse_args(Config, args[1:])
    assert config.compile is compile and config.epochs == Config().epochs
    # airbench's LR per 1024 samples, scaled to each step's samples: 1.5 at 1024, 0.375 at 256
    assert config.lr == pytest.approx(1.5 * config.batch_size * config.accum_steps / 1024)
    assert parse_args(Config, s5_gpu.recipe_args(options, compile, epochs=1)[1:])[0].epochs == 1


def test_the_recipe_runs_at_both_step_batch_sizes():
    configs = [parse_args(Config, s5_gpu.recipe_args(options, False, None)[1:])[0]
               for options in s5_gpu.RECIPE_RUNS]
    assert {config.batch_size * config.accum_steps for config in configs} == set(
        s5_gpu.BATCH_SIZES)


def _step(arm: str, batch_size: int, ms: float) -> s5_gpu.StepRow:
    return s5_gpu.StepRow(arm, batch_size, "bf16", Stats.of([ms, ms * 1.1, ms * 0.9]))


def test_the_tables_put_the_arms_side_by_side():
    steps = [_step(s5_gpu.EAGER, 1024, 20.0), _step(s5_gpu.COMPILED, 1024, 12.5),
             _step(s5_gpu.AIRBENCH, 1024, 10.0), _step(s5_gpu.EAGER, 256, 8.0)]
    runs = [s5_gpu.RunRow("airbench94", "`airbench.train94`, its defaults", 1024, "fp16", 9.9,
                          Stats.of([4.25]), Stats.of([0.9401])),
            s5_gpu.RunRow("recipe, compiled", "`python -m recipes cifar --compile true`", 256,
                          "bf16", 10, Stats.of([61.0, 60.0, 65.0]), Stats.of([0.93, 0.931, 0.929]))]
    text = s5_gpu.render(steps, runs, None)
    lines = text.splitlines()
    assert "| `recipe step, eager` | 1024 | bf16 | 51200 | 20.0 [18.0, 22.0] | 0.50x |" in lines
    assert "| `recipe step, compiled` | 1024 | bf16 | 81920 | 12.5 [11.2, 13.8] | 0.80x |" in lines
    assert "| `airbench94 loop` | 1024 | bf16 | 102400 | 10.0 [9.00, 11.0] | 1.00x |" in lines
    assert "| `recipe step, eager` | 256 | bf16 | 32000 | 8.00 [7.20, 8.80] |  |" in lines
    assert ("| airbench94 | `airbench.train94`, its defaults | 1024 | fp16 | 9.9 | 4.25 | "
            "94.01 |") in lines
    assert ("| recipe, compiled | `python -m recipes cifar --compile true` | 256 | bf16 | 10 | "
            "61.0 [60.0, 65.0] | 93.00 [92.90, 93.10] |") in lines
    assert text.index("### Training step") < text.index("### Time to accuracy")


def test_the_recipe_step_trains_on_the_arrays_it_is_given():
    arrays = make_synthetic(64, 16, seed=3)
    workload = cifar_workload(warmup=1, timed=1, batch_size=8, arrays=arrays)
    assert len(workload.batches) == 2 and workload.probe[0].shape[0] == 8
    assert set(torch.cat([y for _, y in workload.batches]).tolist()) <= set(
        arrays.train_labels[:16].tolist())
    with pytest.raises(ValueError, match="need 1024 training images; the arrays hold 64"):
        cifar_workload(warmup=1, timed=1, batch_size=512, arrays=arrays)


def test_only_gpu_refuses_to_start_without_cuda(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu.md"
    assert bench.main(["--only", "gpu", "--out", str(out)]) == 2
    assert "the GPU section cannot run here: no CUDA device" in capsys.readouterr().err
    assert not out.exists()


def test_only_gpu_writes_the_gpu_section_alone(monkeypatch, tmp_path):
    steps = [_step(s5_gpu.AIRBENCH, 256, 2.0)]
    monkeypatch.setattr(s5_gpu, "skip_reason", lambda: None)
    monkeypatch.setattr(s5_gpu, "measure", lambda plan, log: (steps, []))
    out = tmp_path / "gpu.md"
    assert bench.main(["--only", "gpu", "--quick", "--threads", "1", "--out", str(out)]) == 0
    report = out.read_text()
    assert "Generated by `python -m benchmarks --only gpu --quick" in report
    assert "## 5. GPU: the CIFAR recipe against airbench94" in report
    assert "| `airbench94 loop` | 256 |" in report and "## 1." not in report


def test_only_gpu_writes_beside_the_full_report_not_over_it():
    assert bench.default_out(bench.parse_args(["--only", "gpu"])) == bench.GPU_OUT
    assert bench.default_out(bench.parse_args(["--only", "gpu", "--quick"])) == bench.GPU_OUT
    assert bench.default_out(bench.parse_args([])) == bench.DOC_OUT
    assert bench.default_out(bench.parse_args(["--quick"])) == bench.SMOKE_OUT


def test_only_tracker_refuses_to_start_without_mlflow(monkeypatch, tmp_path, capsys):
    monkeypatch.delitem(bench.ARMS, bench.WITH_MLFLOW, raising=False)
    out = tmp_path / "tracker.md"
    assert bench.main(["--only", "tracker", "--out", str(out)]) == 2
    assert "MLflow is not installed" in capsys.readouterr().err
    assert not out.exists()
    assert bench.default_out(bench.parse_args(["--only", "tracker"])) == bench.TRACKER_OUT
