"""Disk errors while saving a checkpoint (no space left, permission denied, read-only folder).

We run as root, where chmod does not stop a write, so ``run_recipe.py`` makes the 5th
checkpoint file fail the way the OS would (``RELIABILITY_DISK_ERROR``). Decision, checked
here: training stops (exit 4, one ``error:`` line naming the file and the OS reason) rather
than run on without checkpoints; the previous checkpoint stays intact and no temp file is
left, so once the disk is fixed the same command resumes and finishes identically.
"""

import json

import pytest

from handlers.checkpoint.formats import read_checkpoint

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

EXIT_SAVE_FAILED = 4
FAILING_SAVE = 5  # step 3, step 6, best-step-8, step 9 are written; step 12 fails
REASONS = {
    "ENOSPC": "[Errno 28] No space left on device",
    "EACCES": "[Errno 13] Permission denied",
    "EROFS": "[Errno 30] Read-only file system",
}


@pytest.mark.parametrize("code", REASONS)
def test_disk_error_stops_cleanly_keeps_the_previous_checkpoint_and_resumes(code, reference,
                                                                            harness, tmp_path):
    run_dir = tmp_path / "run"
    folder = run_dir / "checkpoints"
    failed = harness.run_recipe(run_dir,
                                faults={"RELIABILITY_DISK_ERROR": f"{code}:{FAILING_SAVE}"})

    assert failed.returncode == EXIT_SAVE_FAILED, failed.stderr
    assert "Traceback" not in failed.stderr
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and len(failed.stderr.strip().splitlines()) == 1, failed.stderr
    assert errors[0].startswith(f"error: {folder / 'step-00000012.pt'}: could not save: "
                                f"{REASONS[code]}")
    assert not [path.name for path in folder.iterdir() if path.name.endswith(".tmp")]
    # Every file left verifies against the sha256 its sidecar recorded when it was committed.
    for path in folder.glob("*.pt"):
        read_checkpoint(path)
    assert json.loads((folder / "last.pt.json").read_text())["optimizer_step"] == 9
    assert not (folder / "step-00000012.pt").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"].startswith("stopped: ") and REASONS[code] in summary["status"]
    assert summary["optimizer_steps"] == 12  # stopped at the step whose save failed

    resumed = harness.run_recipe(run_dir)  # the disk is fine again
    assert resumed.returncode == 0, resumed.stderr
    assert "iteration 9, step 9)" in resumed.stdout
    reference.assert_matches(run_dir)
