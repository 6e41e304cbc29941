"""kill -9 at chosen places of an epoch (``run_recipe.py`` sends itself SIGKILL there): the
resume starts from the newest checkpoint before it and the run ends bit-identical.

8 iterations an epoch, a step checkpoint every 3 optimizer steps, never at an epoch's last
iteration (the epoch-end save after validation covers it).
"""

import json

import pytest

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

# name: (where the process kills itself, iteration of the checkpoint it must resume from)
POSITIONS = {
    "first_iteration_of_an_epoch": ("SIGKILL:iteration:10", 9),  # step 9 opens epoch 2
    "mid_epoch": ("SIGKILL:iteration:14", 12),
    "before_an_epochs_last_iteration": ("SIGKILL:iteration:16", 15),  # redoes 16, validates
    "after_an_epochs_last_iteration": ("SIGKILL:iteration:17", 16),  # the epoch-end save
    "during_validation": ("SIGKILL:validation:1", 6),  # redoes 7 and 8, then validates
}


@pytest.mark.parametrize("position", POSITIONS)
def test_kill_at_a_position_resumes_from_the_checkpoint_before_it(position, reference,
                                                                  harness, tmp_path):
    where, resume_iteration = POSITIONS[position]
    run_dir = tmp_path / "run"
    killed = harness.run_recipe(run_dir, faults={"RELIABILITY_SIGNAL_AT": where})
    assert killed.returncode == -9, killed.stderr
    last = json.loads((run_dir / "checkpoints" / "last.pt.json").read_text())
    assert last["iteration"] == resume_iteration

    resumed = harness.run_recipe(run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert f"iteration {resume_iteration}, step {resume_iteration})" in resumed.stdout
    reference.assert_matches(run_dir)


def test_samples_trained_count_the_whole_run_after_a_mid_epoch_resume(interrupted_run, harness,
                                                                      tmp_path):
    run_dir = harness.copy_run(interrupted_run, tmp_path / "run")  # resumes at iteration 15
    assert harness.run_recipe(run_dir).returncode == 0
    samples_per_iteration = 32
    assert (harness.final_checkpoint(run_dir)["history"]["train_samples"]
            == harness.TOTAL_ITERATIONS * samples_per_iteration)
