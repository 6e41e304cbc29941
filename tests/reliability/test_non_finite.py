"""Non-finite values through the command line: ``run_recipe.py`` multiplies the loss of the
chosen iterations by NaN (``RELIABILITY_NAN_ITERATIONS``), so every gradient is NaN while the
forward pass, and so BatchNorm's running statistics, stay as they were."""

import json

import pytest
import torch

from handlers.checkpoint.formats import read_checkpoint

pytestmark = [pytest.mark.reliability, pytest.mark.slow]


def _all_finite(state) -> bool:
    return all(bool(torch.isfinite(value).all()) for value in state.values()
               if isinstance(value, torch.Tensor) and value.is_floating_point())


def test_one_nan_step_is_skipped_and_counted(harness, tmp_path):
    run_dir, snapshots = tmp_path / "run", tmp_path / "snapshots"
    done = harness.run_recipe(run_dir, faults={
        "RELIABILITY_NAN_ITERATIONS": "5", "RELIABILITY_SNAPSHOT_ITERATIONS": "4,5,6",
        "RELIABILITY_SNAPSHOT_DIR": str(snapshots)})

    assert done.returncode == 0, done.stderr
    after = {n: torch.load(snapshots / f"it-{n}.pt", weights_only=True) for n in (4, 5, 6)}
    parameters = [name for name in after[4]["model"] if "running_" not in name
                  and "num_batches_tracked" not in name]
    for name in parameters:  # iteration 5 changed no weight ...
        assert torch.equal(after[5]["model"][name], after[4]["model"][name]), name
    assert harness.differences(after[5]["optimizer"], after[4]["optimizer"]) == []
    # ... and training went on at iteration 6.
    assert any(not torch.equal(after[6]["model"][name], after[5]["model"][name])
               for name in parameters)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert (summary["skipped_steps"], summary["optimizer_steps"]) == (1, 23)
    for path in (run_dir / "checkpoints").glob("*.pt"):
        assert _all_finite(read_checkpoint(path)["model"]), path.name


def test_three_nan_steps_in_a_row_stop_the_run_without_saving_past_the_last_good_state(
        reference, harness, tmp_path):
    run_dir = tmp_path / "run"
    stopped = harness.run_recipe(run_dir, faults={"RELIABILITY_NAN_ITERATIONS": "5,6,7"})

    assert stopped.returncode == 3, stopped.stderr
    errors = [line for line in stopped.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and len(stopped.stderr.strip().splitlines()) == 1, stopped.stderr
    assert "first non-finite gradient in parameter '" in errors[0]
    assert "at iteration 5; 3 consecutive optimizer step(s) skipped" in errors[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"].startswith("stopped: first non-finite gradient")
    assert (summary["skipped_steps"], summary["optimizer_steps"]) == (3, 4)
    # Iteration 4 was the last finite state; the newest checkpoint is older or equal.
    positions = [json.loads(path.read_text())["iteration"]
                 for path in (run_dir / "checkpoints").glob("*.pt.json")]
    assert max(positions) <= 4
    for path in (run_dir / "checkpoints").glob("*.pt"):
        payload = read_checkpoint(path)
        assert _all_finite(payload["model"]), path.name

    # Once the cause is gone the same command resumes from there and ends identically.
    resumed = harness.run_recipe(run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert "iteration 3, step 3)" in resumed.stdout
    reference.assert_matches(run_dir)
