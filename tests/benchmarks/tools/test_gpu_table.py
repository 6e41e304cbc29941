"""``make bench-gpu``'s table as far as a CPU can run it: the dry run's phases and its one
table, the time budget, the time to 90.6%, the refusal without CUDA and the doc's markers."""

import pytest
import torch

from benchmarks.tools import gpu_table
from benchmarks.tools.gpu_table import MARKERS, Budget, Row


def fake_recipe_run(recipe: str, args: list[str]) -> dict:
    """A run's summary in the shape the recipe writes, without training for minutes."""
    if recipe == "cifar":
        compiled = "--compile" in args
        return {"wall_sec": 10.0 if compiled else 20.0, "final_val_accuracy": 0.91}
    return {"tokens_per_sec_per_device": 1234.0, "mfu": None, "optimizer_steps": 9}


def test_a_dry_run_prints_one_table_and_leaves_the_doc_alone(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu_table, "recipe_run", fake_recipe_run)
    doc = tmp_path / "performance.md"
    doc.write_text(f"before\n{MARKERS[0]}\nUnmeasured on a GPU\n{MARKERS[1]}\nafter\n")
    assert gpu_table.main(["--dry-run", "--doc", str(doc), "--commit", "abc1234"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("DRY RUN on the CPU at toy sizes: these are no GPU figures")
    assert "; commit abc1234; " in out.splitlines()[0]
    assert out.count("| what | figure |") == 1
    assert "| airbench94 x3 | not run: airbench94 needs a CUDA device |" in out
    assert "| recipe defaults, compiled x1 | 10.0 s wall, 91.00% test |" in out
    assert "| time to 90.6% (mean of the runs) | 10.0 s median wall: recipe defaults, " \
           "compiled |" in out
    step = next(line for line in out.splitlines() if "ms per step, batch 16, eager" in line)
    assert float(step.split("|")[2]) > 0  # measured, on this CPU
    ops = next(line for line in out.splitlines() if "aten ops per step" in line)
    assert int(ops.split("|")[2]) > 50
    assert "| charlm, toy size | 1.2k tokens/s, MFU n/a, 9 steps |" in out
    assert "Unmeasured on a GPU" in doc.read_text()  # toy CPU figures never reach the doc


def test_without_cuda_a_measurement_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_table.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no CUDA device here") and err.count("\n") == 1


def test_a_doc_without_the_markers_is_refused_before_measuring(tmp_path, capsys):
    doc = tmp_path / "performance.md"
    doc.write_text("no markers\n")
    assert gpu_table.main(["--dry-run", "--doc", str(doc)]) == 2
    assert capsys.readouterr().err.startswith(f"error: --doc {doc} has no {MARKERS[0]}")


def test_the_table_replaces_what_stands_between_the_markers(tmp_path):
    doc = tmp_path / "performance.md"
    doc.write_text(f"before\n{MARKERS[0]}\nold\n{MARKERS[1]}\nafter\n")
    gpu_table.write_doc(doc, "| new |")
    assert doc.read_text() == f"before\n{MARKERS[0]}\n| new |\n{MARKERS[1]}\nafter\n"


def test_arms_past_the_budget_are_listed_as_not_run():
    calls = []
    rows, reaching = gpu_table.run_rows(
        {"a": lambda: calls.append("a") or (5.0, 0.95)}, 3, Budget(-1), lambda _: None)
    assert calls == [] and reaching == {}
    assert rows == [Row("a x3", "not run: the time budget was spent")]


def test_a_repeat_starts_only_if_it_fits_what_the_later_phases_leave():
    runs = iter([(50.0, 0.95), (50.0, 0.95)]).__next__
    rows, _ = gpu_table.run_rows({"a": runs}, 3, Budget(100), lambda _: None, reserve=60)
    # 40 s left after the reserve: the first starts, the second (as long as 50 s) does not
    assert rows == [Row("a x1", "50.0 s wall, 95.00% test")]


def test_time_to_target_is_the_fastest_arm_whose_mean_reaches_it():
    rows, reaching = gpu_table.run_rows(
        {"slow": iter([(30.0, 0.91), (31.0, 0.91)]).__next__,
         "fast but short of it": iter([(5.0, 0.905), (5.0, 0.906)]).__next__,
         "fast": iter([(12.0, 0.905), (14.0, 0.908)]).__next__},
        2, Budget(60), lambda _: None)
    assert reaching == {"slow": 30.5, "fast": 13.0}
    assert gpu_table.time_to_target(reaching).figure == "13.0 s median wall: fast"
    assert gpu_table.time_to_target({}).figure == "no arm's mean reached 90.6%"


@pytest.mark.slow  # the real dry run: a CIFAR run eager and compiled, a charlm; minutes
def test_the_whole_dry_run_runs(capsys):
    assert gpu_table.main(["--dry-run"]) == 0
    assert "| recipe defaults, compiled x1 |" in capsys.readouterr().out
