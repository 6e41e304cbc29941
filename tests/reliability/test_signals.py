"""SIGTERM and Ctrl-C (SIGINT): the current step finishes, a ``last`` checkpoint of exactly
that step is committed, the process exits 143 / 130 within seconds, and running the same
command again finishes the run bit-identically."""

import json

import pytest

pytestmark = pytest.mark.reliability

EXIT_WITHIN_SEC = 30  # the step and one save take well under a second; the machine is shared


# Sent after the 5th / 9th progress line (optimizer steps 10 and 18): mid-epoch, away from an
# epoch's last iteration (that case is the next test).
@pytest.mark.parametrize(("name", "after_lines"), [
    pytest.param("SIGTERM", 5),  # in `make test`
    pytest.param("SIGINT", 9, marks=pytest.mark.slow),
])
def test_signal_saves_the_current_step_exits_and_resumes_identically(name, after_lines,
                                                                     reference, harness,
                                                                     tmp_path):
    signum, expected_code = harness.SIGNALS[name]
    run_dir = tmp_path / "run"

    stopped = harness.run_and_signal(run_dir, signum, after_lines, 0.1)
    print(f"{name}: exit {stopped.returncode} {stopped.extra['exit_sec']:.2f} s after the signal")
    assert stopped.returncode == expected_code, stopped.stderr
    assert stopped.extra["exit_sec"] < EXIT_WITHIN_SEC
    assert f"{name}: finishing the current step" in stopped.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == f"interrupted by {name}"
    last = json.loads((run_dir / "checkpoints" / "last.pt.json").read_text())
    # The checkpoint holds the step the process stopped at: nothing done is lost.
    assert last["optimizer_step"] == summary["optimizer_steps"] >= after_lines * harness.LOG_EVERY
    assert harness.final_checkpoint(run_dir)["meta"]["iteration"] == last["iteration"]

    resumed = harness.run_recipe(run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert f"iteration {last['iteration']}, step {last['optimizer_step']})" in resumed.stdout
    reference.assert_matches(run_dir, stopped_at_step=last["optimizer_step"])


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
