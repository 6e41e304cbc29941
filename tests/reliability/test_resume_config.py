"""Config on resume. Keys whose value the checkpoint carries or whose shape it holds are
refused, naming the key, before anything is written; the others win and are logged as
``override: key old -> new``: most change nothing in the training itself, and a new
``lr`` or ``epochs`` makes the LR schedule that of a fresh run with the new values, from
the step reached."""

import json

import pytest

from recipes.__main__ import main

pytestmark = pytest.mark.reliability

def test_change_that_does_not_fit_the_saved_state_is_refused(reference, harness, tmp_path,
                                                             capsys):
    """Each key would be silently undone by the checkpoint (the optimizer's and the
    schedule's own values, the telemetry's window, early stopping's presence) or cannot load
    into it: the run keys of every recipe and the recipe's own (``harness.fixed_keys``)."""
    run_dir = harness.copy_run(reference.run_dir, tmp_path / "run")
    before = harness.file_digests(run_dir)
    for key, value in harness.fixed_keys.items():
        code = main([harness.recipe, "--run-dir", str(run_dir), f"--{key}", value])

        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2, key
        assert len(lines) == 1 and lines[0].startswith(f"error: --{key}: cannot change on "
                                                       "resume"), (key, lines)
        assert harness.file_digests(run_dir) == before, key


@pytest.mark.slow
def test_overrides_that_fit_are_logged_applied_and_leave_training_identical(
        interrupted_run, reference, harness, tmp_path):
    run_dir = harness.copy_run(interrupted_run, tmp_path / "run")
    resumed = harness.run_recipe(run_dir, "--checkpoint-every", "2", "--keep-last", "2")

    assert resumed.returncode == 0, resumed.stderr
    assert "override: checkpoint_every 3 -> 2" in resumed.stdout.splitlines()
    assert "override: keep_last 3 -> 2" in resumed.stdout.splitlines()
    saved = json.loads((run_dir / "config.json").read_text())["config"]
    assert (saved["checkpoint_every"], saved["keep_last"]) == (2, 2)
    history = [name for name in harness.checkpoint_files(run_dir)
               if name.startswith("step-") and name.endswith(".pt")]
    # Saves at 16 (epoch end), 18, 20, 22 and 24 (the run's end): the newest two that are
    # not also a best checkpoint stay (a best one is written as best-step-N only).
    last_was_best = any(entry["file"] == "best-step-00000024.pt"
                        for entry in reference.state["checkpointer"]["best"])
    assert history == (["step-00000020.pt", "step-00000022.pt"] if last_was_best
                       else ["step-00000022.pt", "step-00000024.pt"])
    state = harness.final_checkpoint(run_dir)
    for key in ("model", "optimizer", "scaler", "scheduler", "trainer", "rng", "telemetry",
                "logger"):
        assert harness.differences(state[key], reference.state[key]) == [], key


@pytest.mark.slow
def test_new_lr_and_epochs_follow_the_schedule_of_a_fresh_run_with_them(
        interrupted_run, harness, tmp_path):
    run_dir = harness.copy_run(interrupted_run, tmp_path / "run")  # resumes at step 15
    old_lr = json.loads((run_dir / "config.json").read_text())["config"]["lr"]
    changed = ("--lr", "0.2", "--epochs", "4")
    resumed = harness.run_recipe(run_dir, *changed)
    assert resumed.returncode == 0, resumed.stderr
    lines = resumed.stdout.splitlines()
    assert f"override: lr {old_lr!r} -> 0.2" in lines and "override: epochs 3 -> 4" in lines
    fresh_dir = tmp_path / "fresh"
    assert harness.run_recipe(fresh_dir, *changed).returncode == 0

    lrs, expected = (harness.tensorboard_scalars(d, "train/lr") for d in (run_dir, fresh_dir))
    after_resume = {step: values for step, values in lrs.items() if step > 15}
    assert sorted(after_resume) == list(range(16, 4 * harness.ITERATIONS_PER_EPOCH + 1, 2))
    for step, values in after_resume.items():  # the killed session logged 16 and 18 too
        assert values[-1:] == expected[step], f"train/lr at step {step}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["epochs_completed"], summary["optimizer_steps"]) == (4, 32)
    assert json.loads((run_dir / "config.json").read_text())["config"]["lr"] == 0.2


@pytest.mark.slow
def test_more_epochs_after_a_finished_run_train_on(reference, harness, tmp_path):
    run_dir = harness.copy_run(reference.run_dir, tmp_path / "run")
    resumed = harness.run_recipe(run_dir, "--epochs", "4")
    assert resumed.returncode == 0, resumed.stderr
    assert "override: epochs 3 -> 4" in resumed.stdout.splitlines()
    state = harness.final_checkpoint(run_dir)
    assert state["meta"]["iteration"] == 4 * harness.ITERATIONS_PER_EPOCH
    assert state["history"]["epochs_completed"] == 4
