import json

import pytest
from ignite.engine import Engine, Events

from recipes.__main__ import main
from recipes.runner.training.standard_handlers import METRICS_FILE, Evaluation
from tests.recipes.runner.test_run import CHARLM, write_text


def test_evaluation_runs_every_n_epochs_and_after_the_last_with_its_hook_first():
    trainer, evaluator = Engine(lambda engine, batch: None), Engine(lambda engine, batch: None)
    seen = []
    evaluator.add_event_handler(Events.COMPLETED,
                                lambda: seen.append(("evaluated", trainer.state.epoch)))
    evaluation = Evaluation([0], every=2, epochs=5,
                            before=lambda final: seen.append(("before", final)))
    evaluation.attach(trainer, evaluator)
    trainer.run([0], max_epochs=5)
    assert seen == [("before", False), ("evaluated", 2), ("before", False), ("evaluated", 4),
                    ("before", True), ("evaluated", 5)]


def test_evaluation_needs_the_evaluator_it_runs():
    with pytest.raises(ValueError, match=r"attach\(trainer, evaluator\)"):
        Evaluation([0], every=1, epochs=1).attach(Engine(lambda engine, batch: None))


def test_a_run_folder_holds_metrics_jsonl_which_a_longer_resumed_run_continues(tmp_path):
    """One epoch, then the same run continued to two (new settings): metrics.jsonl reads as
    one two-epoch run. What the first session wrote after its last checkpoint (the epoch
    end: its partial interval's report and its closing best/* record) is cut. Started
    again once complete, after losing its closing record (a kill after the final save), the
    run writes it again."""
    text = write_text(tmp_path / "corpus.txt")
    run = [*CHARLM, "--text", str(text), "--run-dir", str(tmp_path / "run"), "--log-every", "2"]
    assert main([*run, "--epochs", "1"]) == 0
    path = tmp_path / "run" / METRICS_FILE
    first = [json.loads(line) for line in path.read_text().splitlines()]
    steps_per_epoch = first[-1]["step"]  # 19: odd, so the end reports a partial interval
    saved = 1 + max(i for i, r in enumerate(first) if "val/loss" in r or "perf/epoch_time_sec" in r)
    assert [("train/loss" in r, "best/val/loss" in r) for r in first[saved:]] == [
        (True, False), (False, True)]
    assert main([*run, "--epochs", "2"]) == 0

    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records[:saved] == first[:saved]
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(2, 2 * steps_per_epoch + 1, 2))
    assert [r["epoch"] for r in train] == [1 + (r["step"] - 1) // steps_per_epoch for r in train]
    assert {"train/lr", "train/grad_norm", "train/skipped_steps"} <= set(train[0])
    val = [r for r in records if "val/loss" in r]
    assert [(r["step"], r["epoch"]) for r in val] == [(steps_per_epoch, 1),
                                                      (2 * steps_per_epoch, 2)]
    assert [r["step"] for r in records if "perf/samples_per_sec" in r] == [
        steps_per_epoch, 2 * steps_per_epoch]
    assert [r["step"] for r in records if "best/val/loss" in r] == [2 * steps_per_epoch]
    assert records[-1]["best/val/loss"] == min(r["val/loss"] for r in val)

    path.write_text("".join(line + "\n" for line in path.read_text().splitlines()[:-1]))
    assert main([*run, "--epochs", "2"]) == 0  # "already complete": trains nothing
    again = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in again if "train/loss" in r] == [r["step"] for r in train]
    assert [{**r, "time": 0} for r in again] == [{**r, "time": 0} for r in records]
