"""Config on resume. Keys whose value the checkpoint carries or whose shape it holds are
refused, naming the key, before anything is written; the others win, are logged as
``override: key old -> new`` and change nothing in the training itself."""

import json

import pytest

from recipes.__main__ import main

pytestmark = pytest.mark.reliability

# Each would be silently undone by the checkpoint (the optimizer's and the schedule's own
# values, the telemetry's window, early stopping's presence) or cannot load into it.
FIXED = {
    "model": "resnet18", "batch-size": "64", "precision": "bf16", "seed": "1",
    "scheduler": "cosine", "accum-steps": "2", "train-subset": "128", "dataset": "cifar10",
    "epochs": "4", "lr": "0.05", "momentum": "0.5", "weight-decay": "0", "log-every": "5",
    "patience": "2",
}


@pytest.mark.parametrize("key", FIXED)
def test_change_that_does_not_fit_the_saved_state_is_refused(key, reference, harness,
                                                             tmp_path, capsys):
    run_dir = harness.copy_run(reference.run_dir, tmp_path / "run")
    before = harness.file_digests(run_dir)

    code = main(["cifar", "--run-dir", str(run_dir), f"--{key}", FIXED[key]])

    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith(f"error: --{key}: cannot change on resume")
    assert harness.file_digests(run_dir) == before


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
    assert history == ["step-00000020.pt", "step-00000022.pt"]
    state = harness.final_checkpoint(run_dir)
    for key in ("model", "optimizer", "scaler", "scheduler", "trainer", "rng", "telemetry",
                "tensorboard"):
        assert harness.differences(state[key], reference.state[key]) == [], key
