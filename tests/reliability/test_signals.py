"""SIGTERM, Ctrl-C (SIGINT) and a scheduler's SIGUSR1: the current step finishes, a ``last``
checkpoint of exactly that step is committed, the process exits 143 / 130 / 138, and running
the same command again finishes the run bit-identically."""

import json

import pytest

pytestmark = pytest.mark.reliability

# Delivered as iteration 11 / 19 starts (mid-epoch, mid-interval): the process signals
# itself (``RELIABILITY_SIGNAL_AT``), so the moment is the same however fast the recipe
# trains; a signal from outside at a random moment is the kill -9 suite's and test_cli's.
@pytest.mark.parametrize(("name", "iteration"), [
    pytest.param("SIGTERM", 11),  # outside -m slow
    pytest.param("SIGINT", 19, marks=pytest.mark.slow),
    pytest.param("SIGUSR1", 13, marks=pytest.mark.slow),
])
def test_signal_saves_the_current_step_exits_and_resumes_identically(name, iteration,
                                                                     reference, harness,
                                                                     tmp_path):
    signum, expected_code = harness.SIGNALS[name]
    run_dir = tmp_path / "run"

    stopped = harness.run_recipe(
        run_dir, faults={"RELIABILITY_SIGNAL_AT": f"{name}:iteration:{iteration}"})
    assert stopped.returncode == expected_code, stopped.stderr
    assert f"{name}: finishing the current step" in stopped.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == f"interrupted by {name}"
    last = json.loads((run_dir / "checkpoints" / "last.pt.json").read_text())
    # The checkpoint holds the step the process stopped at: nothing done is lost.
    assert last["iteration"] == iteration
    assert last["optimizer_step"] == summary["optimizer_steps"] == iteration
    assert harness.final_checkpoint(run_dir)["meta"]["iteration"] == iteration

    resumed = harness.run_recipe(run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert f"iteration {iteration}, step {iteration})" in resumed.stdout
    reference.assert_matches(run_dir, stopped_at_step=iteration)


@pytest.mark.slow
def test_sigterm_at_an_epochs_last_iteration_keeps_its_validation(reference, harness,
                                                                  tmp_path):
    run_dir = tmp_path / "run"
    last_of_epoch_2 = 2 * harness.ITERATIONS_PER_EPOCH
    stopped = harness.run_recipe(
        run_dir, faults={"RELIABILITY_SIGNAL_AT": f"SIGTERM:iteration:{last_of_epoch_2}"})
    assert stopped.returncode == 143, stopped.stderr

    last = json.loads((run_dir / "checkpoints" / "last.pt.json").read_text())
    assert last["iteration"] == last_of_epoch_2

    resumed = harness.run_recipe(run_dir)
    assert resumed.returncode == 0, resumed.stderr
    # It stopped where the epoch's own checkpoint is written anyway, after validation:
    # no extra history checkpoint, and the resumed run is the reference exactly.
    reference.assert_matches(run_dir)
