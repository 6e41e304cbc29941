import json

import pytest
import torch
from ignite.engine import Engine, Events

from engine.events import TrainEvents
from recipes.__main__ import main
from recipes.runner.training.standard_handlers import METRICS_FILE, Evaluation
from tests.helpers import CHARLM, write_text


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

    # Killed after the final checkpoint, before the end's records and the summary: the
    # rerun trains nothing and writes the end again.
    path.write_text("".join(line + "\n" for line in path.read_text().splitlines()[:-1]))
    (tmp_path / "run" / "summary.json").unlink()
    assert main([*run, "--epochs", "2"]) == 0
    again = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in again if "train/loss" in r] == [r["step"] for r in train]
    assert [{**r, "time": 0} for r in again] == [{**r, "time": 0} for r in records]


def test_keep_best_keeps_the_top_k_evaluations_and_best_links_the_first(tmp_path):
    text = write_text(tmp_path / "corpus.txt")
    run_dir = tmp_path / "run"
    assert main([*CHARLM, "--text", str(text), "--run-dir", str(run_dir), "--epochs", "4",
                 "--keep-best", "2", "--lr", "0.05"]) == 0
    checkpoints = run_dir / "checkpoints"
    records = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    losses = sorted(r["val/loss"] for r in records if "val/loss" in r)
    kept = {path.name: torch.load(path, weights_only=True)["meta"]["metric"]["value"]
            for path in checkpoints.glob("best-step-*.pt")}
    assert len(losses) == 4 and sorted(kept.values()) == losses[:2], (kept, losses)
    best = torch.load(checkpoints / "best.pt", weights_only=True)["meta"]["metric"]["value"]
    assert best == losses[0]


def test_eval_every_steps_evaluates_inside_epochs_and_at_their_ends(tmp_path):
    text = write_text(tmp_path / "corpus.txt")
    run_dir = tmp_path / "run"
    assert main([*CHARLM, "--text", str(text), "--run-dir", str(run_dir), "--epochs", "2",
                 "--eval-every-steps", "5", "--checkpoint-every", "5", "--keep-last", "99",
                 "--keep-best", "99"]) == 0
    records = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    per_epoch = max(r["step"] for r in records if "val/loss" not in r and "step" in r) // 2
    inside = [step for step in range(5, 2 * per_epoch, 5) if step % per_epoch]
    assert [r["step"] for r in records if "val/loss" in r] == sorted(
        [*inside, per_epoch, 2 * per_epoch])
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["config"]["eval_every_steps"] == 5
    # Step 5's evaluation (the first: a best) came before its cadence save, which then found
    # the step saved (as best-step-5, which last.pt linked) and was skipped: a resume from
    # step 5 never skips that evaluation.
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "best-step-00000005.pt").exists()
    assert not (checkpoints / "step-00000005.pt").exists()
    assert (checkpoints / "step-00000010.pt").exists() or (
        checkpoints / "best-step-00000010.pt").exists()


def test_evaluation_every_steps_skips_an_epochs_last_step():
    def one_step_per_iteration(engine, batch):
        engine.state.optimizer_step = engine.state.iteration
        engine.fire_event(TrainEvents.OPTIMIZER_STEP)

    trainer, evaluator = Engine(one_step_per_iteration), Engine(lambda engine, batch: None)
    trainer.register_events(*TrainEvents)
    seen = []
    evaluator.add_event_handler(Events.COMPLETED, lambda: seen.append(trainer.state.iteration))

    Evaluation([0], every=1, epochs=2, every_steps=2).attach(trainer, evaluator)
    trainer.run([0] * 4, max_epochs=2)
    assert seen == [2, 4, 6, 8]  # steps 4 and 8 are epoch ends: evaluated once, there
