"""``--async-checkpoint`` through the command line (charlm's tiny job, every save written
behind training): a process killed inside a save's background write, or whose background
write the disk refuses, leaves the previous checkpoint as ``last``; the same command then
finishes identically to an uninterrupted run."""

import json

import pytest

pytestmark = pytest.mark.reliability

CRASHED_SAVE = 5  # step 12's save (steps 3, 6, best-step-8 and 9 come first), as test_kill's


def test_kill_inside_a_background_write_then_rerun_finishes_identically(async_job, tmp_path):
    """The background thread dies half-way through step 12's file while training has gone
    on: step 9 is still ``last``, and the resume from it ends as the reference did."""
    run_dir = tmp_path / "run"
    crashed = async_job.run_recipe(
        run_dir, faults={"CKPT_TEST_CRASH_PHASE": f"mid_write:{CRASHED_SAVE}"})
    assert crashed.returncode == 137, crashed.stderr
    folder = run_dir / "checkpoints"
    assert json.loads((folder / "last.pt.json").read_text())["optimizer_step"] == 9
    assert not (folder / "step-00000012.pt.json").exists()

    resumed = async_job.run_recipe(run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert "iteration 9, step 9)" in resumed.stdout
    async_job.reference.assert_matches(run_dir)  # also: no temp file left
    async_job.reference.assert_same_metrics(run_dir)


@pytest.mark.slow
def test_a_disk_error_in_a_background_write_stops_the_run_with_exit_4(async_job, tmp_path):
    """Step 12's file fails behind training (a full disk, half of it written); the next
    save raises the error a synchronous save would (one ``error:`` line, exit 4), nothing
    of step 12 is committed, and once the disk is fine the run finishes identically."""
    run_dir = tmp_path / "run"
    folder = run_dir / "checkpoints"
    failed = async_job.run_recipe(
        run_dir, faults={"RELIABILITY_DISK_ERROR": f"ENOSPC:{CRASHED_SAVE}"})
    assert failed.returncode == 4, failed.stderr
    lines = failed.stderr.strip().splitlines()
    assert lines == [f"error: {folder / 'step-00000012.pt'}: could not save: [Errno 28] No "
                     "space left on device"], failed.stderr
    assert json.loads((folder / "last.pt.json").read_text())["optimizer_step"] == 9
    assert not [path.name for path in folder.iterdir()
                if path.name.startswith(("step-00000012", ".step-00000012"))]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"].startswith("stopped: ") and "[Errno 28]" in summary["status"]

    resumed = async_job.run_recipe(run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert "iteration 9, step 9)" in resumed.stdout
    async_job.reference.assert_matches(run_dir)
