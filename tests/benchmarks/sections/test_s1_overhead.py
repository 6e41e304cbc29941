import dataclasses

import pytest

from benchmarks.arms.loops import ARMS, ArmResult, hand_loop
from benchmarks.arms.workloads import Workload, tiny_workload
from benchmarks.sections import s1_overhead


def result(losses: dict[str, list[float]], seconds: dict[str, list[float]] | None = None):
    seconds = seconds or {arm: [1.0] * len(values) for arm, values in losses.items()}
    runs = {arm: [ArmResult(s, 0.01, loss, (s,))
                  for s, loss in zip(seconds[arm], values, strict=True)]
            for arm, values in losses.items()}
    return s1_overhead.OverheadResult("tiny", 32, 2, 100, runs)


def test_parity_holds_within_the_tolerance():
    same = result({"hand": [1.0, 1.0], "trainer": [1.0 + 1e-6, 1.0]})
    assert s1_overhead.parity_failures(same) == []


def test_parity_fails_for_the_arm_and_repeat_that_diverged():
    diverged = result({"hand": [1.0, 1.0], "trainer": [1.0, 1.0], "lightning": [1.0, 1.001]})
    failures = s1_overhead.parity_failures(diverged)
    assert len(failures) == 1 and "lightning repeat 2" in failures[0]
    assert s1_overhead.parity_failures(result({"hand": [1.0], "x": [float("nan")]}))


def test_one_skipped_step_breaks_parity(monkeypatch):
    def skips_last_step(workload: Workload) -> ArmResult:
        fewer = Workload(workload.name, workload.template, workload.make_optimizer,
                         workload.loss_fn, workload.batches[:-1], workload.probe,
                         workload.warmup, workload.batch_size)
        return hand_loop(fewer)

    monkeypatch.setitem(ARMS, "skips_last_step", skips_last_step)
    workload = tiny_workload(warmup=2, timed=8)
    measured = s1_overhead.measure(workload, repeats=1, threads=1, log=lambda line: None,
                                arms=("hand", "trainer", "skips_last_step"))
    failures = s1_overhead.parity_failures(measured)
    assert len(failures) == 1 and "skips_last_step" in failures[0]


def test_paired_overhead_and_targets():
    arms = ("hand", "hand-tuned", "trainer", "trainer+recipe", "lightning")
    tiny = result({arm: [1.0, 1.0] for arm in arms},
                  {"hand": [1.0, 2.0], "hand-tuned": [0.99, 1.99], "trainer": [1.1, 2.1],
                   "trainer+recipe": [0.99003, 1.99003], "lightning": [1.5, 2.5]})
    assert tiny.paired("trainer", lambda a, h: a - h) == pytest.approx([0.001, 0.001])
    assert tiny.paired("trainer", lambda a, h: a - h, "hand-tuned") == pytest.approx([0.0011] * 2)
    cifar = result({"hand": [1.0], "hand-tuned": [1.0], "trainer+recipe": [1.0]},
                   {"hand": [10.0], "hand-tuned": [10.0], "trainer+recipe": [10.05]})
    lines = s1_overhead.targets(tiny, cifar)
    assert "NOT met" in lines[0]  # trainer: 1.1 ms per iteration over the tuned loop
    assert "**met**" in lines[1]  # trainer+recipe: 0.3 µs
    assert "**met**" in lines[2]  # 10.05 vs 10.0 s: ratio 0.995
    text = s1_overhead.render(tiny, cifar, "note")
    assert "All runs of all arms reached the same probe loss" in text
    assert "| `lightning` |" in text and "| `hand-tuned` |" in text


def test_paired_compares_the_blocks_of_one_round():
    def run(*blocks: float) -> ArmResult:
        return ArmResult(sum(blocks), 0.0, 1.0, blocks)

    measured = s1_overhead.OverheadResult(
        "tiny", 32, 2, 20, {"hand": [run(1.0, 3.0), run(2.0, 2.0)],
                            "trainer": [run(1.5, 3.0), run(2.0, 4.0)]}, block=10)
    # per iteration: block seconds / 10, repeat by repeat, block by block
    assert measured.paired("trainer", lambda a, h: a - h) == pytest.approx([0.05, 0, 0, 0.2])
    assert measured.per_iteration("trainer") == pytest.approx([0.225, 0.3])


def test_measure_runs_the_arms_side_by_side_in_blocks():
    workload = dataclasses.replace(tiny_workload(warmup=2, timed=8), block=2)
    measured = s1_overhead.measure(workload, repeats=2, threads=1, log=lambda line: None,
                                arms=("hand", "hand-tuned", "trainer"))
    assert all(len(run.blocks) == 4 for runs in measured.runs.values() for run in runs)
    assert len(measured.paired("trainer", lambda a, h: a - h)) == 8
    assert s1_overhead.parity_failures(measured) == []


def test_the_tracker_cost_is_paired_with_the_handler_set_or_said_to_be_unmeasured():
    with_tracker = result({arm: [1.0, 1.0] for arm in s1_overhead.TRACKER_ARMS},
                          {"hand-tuned": [1.0, 1.0], "trainer+recipe": [1.0, 2.0],
                           "trainer+recipe+mlflow": [1.0002, 2.0002]})
    with_tracker.runs["trainer+recipe+mlflow"] = [  # its log_batch in the run end
        dataclasses.replace(run, end_seconds=0.03) for run in with_tracker.runs[
            "trainer+recipe+mlflow"]]
    text = s1_overhead.tracker_cost(with_tracker)
    assert "is 196.1 µs an iteration" in text  # 0.02 s more over 2 + 100 iterations
    # 0.0002 s over 100 iterations: 2 µs per iteration in each of the two pairs.
    assert "| `trainer+recipe+mlflow` | 15002 [10002, 20002] | 2.00 (2.00 to 2.00) |" in text
    without = result({"hand-tuned": [1.0], "trainer+recipe": [1.0]})
    assert "Unmeasured: MLflow is not installed" in s1_overhead.tracker_cost(without)
