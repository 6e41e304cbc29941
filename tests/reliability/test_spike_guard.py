"""``--spike-guard`` through the command line: injected loss spikes (the loss of chosen
iterations multiplied by 1e3, ``RELIABILITY_SPIKE_ITERATIONS``) climb the ladder, and a
recovered run killed with -9 and run again ends bit-identical to the same recovered run
uninterrupted."""

import json
import signal

import pytest

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

# Sized for the suite's 24-iteration job (8 per epoch, a checkpoint every 3 steps): windows
# are known from the 4th on; two spikes within 5 steps roll back to the snapshot of the
# epoch's first step (iteration 9), drop 2 batches and cool the LR for 3 steps. The guard
# watches the loss only: in these tiny jobs' first steps the gradient norm of a fresh
# network (the images recipe's resnet18) swings by more than 6x on its own.
GUARD_ARGS = ("--spike-guard", "true", "--spike-watch", "loss", "--spike-window", "8",
              "--spike-min-history", "4",
              "--spike-repeat", "2", "--spike-repeat-window", "5", "--spike-snapshot-every", "3",
              "--spike-skip-batches", "2", "--spike-cooldown-steps", "3")
SPIKES = {"RELIABILITY_SPIKE_ITERATIONS": "10,12"}


@pytest.fixture(scope="module")
def recovered(harness, tmp_path_factory):
    """The uninterrupted recovered run."""
    run_dir = tmp_path_factory.mktemp("recovered") / "run"
    result = harness.run_recipe(run_dir, *GUARD_ARGS, faults=SPIKES)
    assert result.returncode == 0, result.stderr
    return run_dir, result


def test_two_spikes_are_skipped_then_the_run_rolls_back_and_finishes(recovered, harness):
    run_dir, result = recovered
    assert ("warning: spike guard: skipped the update of step 10 (iteration 10)"
            in result.stderr)
    assert ("rolled back to step 9 (iteration 9), skipped 2 batches to iteration 14"
            in result.stderr)
    assert "LR cool-down over" in result.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["spikes_skipped"], summary["rollbacks"]) == (2, 1)
    assert summary["status"] == "completed"
    assert harness.tensorboard_scalars(run_dir, "health/rollbacks")
    assert harness.final_checkpoint(run_dir)["spike_guard"]["rollbacks"] == 1
    # metrics.jsonl keeps what happened: the abandoned step 10's records, the rollback logged
    # at step 9, the step axis going on from there.
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [record["step"] for record in records]
    rollback = next(i for i, record in enumerate(records) if record.get("health/rollbacks") == 1)
    assert (max(steps[:rollback]), steps[rollback], steps[rollback + 1]) == (10, 9, 11)


def test_spikes_after_the_rollback_stop_the_run_with_exit_code_3(harness, tmp_path):
    run_dir = tmp_path / "run"
    stopped = harness.run_recipe(run_dir, *GUARD_ARGS,
                                 faults={"RELIABILITY_SPIKE_ITERATIONS": "10,12,18,19"})
    assert stopped.returncode == 3, stopped.stderr
    assert "loss spikes at step" in stopped.stderr and "(iteration 19)" in stopped.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"].startswith("stopped: loss spikes at step")
    assert (summary["spikes_skipped"], summary["rollbacks"]) == (4, 1)


# Saves: steps 3, 6, 9 and the epoch ends (iterations 8, 16); the rollback at iteration 12
# takes the step back to 9 and moves on to iteration 15. A kill at the start of iteration
# N resumes from (iteration, step): 11, between the spikes; 15, after the rollback, from the
# checkpoint before it (the run spikes and rolls back again, with the snapshot it saved);
# 17, from the epoch end after the rollback, one step of the cool-down still to go.
KILLS = {11: (9, 9), 15: (9, 9), 17: (16, 11)}


@pytest.mark.parametrize("iteration", KILLS)
def test_a_recovered_run_killed_and_rerun_ends_bit_identical(iteration, recovered, harness,
                                                             tmp_path):
    reference = harness.Reference.of(recovered[0])
    run_dir = tmp_path / "run"
    killed = harness.run_recipe(run_dir, *GUARD_ARGS, faults={
        **SPIKES, "RELIABILITY_SIGNAL_AT": f"SIGKILL:iteration:{iteration}"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert ("rolled back" in killed.stderr) == (iteration > 12)

    resumed = harness.run_recipe(run_dir, *GUARD_ARGS, faults=SPIKES)
    assert resumed.returncode == 0, resumed.stderr
    resume_iteration, resume_step = KILLS[iteration]
    assert f"iteration {resume_iteration}, step {resume_step})" in resumed.stdout
    reference.assert_matches(run_dir)
