"""Damaged, foreign and malicious checkpoints: the resume names each bad file and why, falls
back to the newest good one and finishes identically; with none good it exits 2."""

import hashlib
import json
import os
import shutil

import pytest
import torch

from handlers.checkpoint.formats import read_checkpoint
from tests.helpers import (
    RunsCodeWhenUnpickled,
    plant_build_on_a_class,
    plant_pickle_in_a_bytes_entry,
)

pytestmark = pytest.mark.reliability


def _truncate_to_zero(path):
    os.truncate(path, 0)


def _truncate_to_half(path):
    os.truncate(path, path.stat().st_size // 2)


def _flip_one_byte(path):
    with open(path, "r+b") as file:
        file.seek(path.stat().st_size // 2)
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0xFF]))


def _append_junk(path):
    with open(path, "ab") as file:
        file.write(b"junk" * 100)


# last.pt shares its data with step-00000015.pt (a hard link), as on a real disk: damage
# to one is damage to both, and the resume must go back to step 12.
DAMAGE = {
    "truncated_to_0_bytes": (_truncate_to_zero, "truncated (0 bytes)"),
    "truncated_to_half": (_truncate_to_half, "truncated ("),
    "one_byte_flipped": (_flip_one_byte, "checksum mismatch"),
    "junk_appended": (_append_junk, "checksum mismatch ("),
}


def _skipped(stderr: str) -> dict[str, str]:
    """``warning: checkpoint <path> rejected: <reason>; trying an older one`` lines of the
    recipe (the checkpointer's, in the console's voice), by file name."""
    prefix, suffix = "warning: checkpoint ", "; trying an older one"
    lines = [line[len(prefix):].removesuffix(suffix) for line in stderr.splitlines()
             if line.startswith(prefix) and line.endswith(suffix)]
    return {os.path.basename(path): reason for path, _, reason in
            (line.partition(" rejected: ") for line in lines)}


# One kind of damage is the core every recipe runs; the others are slow (see conftest.py).
@pytest.mark.parametrize("damage", [
    name if name == "one_byte_flipped" else pytest.param(name, marks=pytest.mark.slow)
    for name in DAMAGE])
def test_damaged_last_checkpoint_falls_back_and_finishes_identically(damage, interrupted_run,
                                                                     reference, harness,
                                                                     tmp_path):
    run_dir = harness.copy_run(interrupted_run, tmp_path / "run")
    corrupt, reason = DAMAGE[damage]
    corrupt(run_dir / "checkpoints" / "last.pt")

    resumed = harness.run_recipe(run_dir)
    assert resumed.returncode == 0, resumed.stderr
    skipped = _skipped(resumed.stderr)
    assert set(skipped) == {"last.pt", "step-00000015.pt"}
    assert all(text.startswith(reason) for text in skipped.values()), skipped
    assert "resumed from" in resumed.stdout and "iteration 12, step 12)" in resumed.stdout
    reference.assert_matches(run_dir)


@pytest.mark.slow
def test_checkpoint_of_another_run_copied_in_as_newest_is_refused(interrupted_run, reference,
                                                                  harness, tmp_path):
    run_dir = harness.copy_run(interrupted_run, tmp_path / "run")
    folder = run_dir / "checkpoints"
    for suffix in ("", ".json"):  # the reference run's step 21, sidecar and all: it verifies
        shutil.copy(reference.run_dir / "checkpoints" / f"step-00000021.pt{suffix}",
                    folder / f"step-00000021.pt{suffix}")

    resumed = harness.run_recipe(run_dir)
    assert resumed.returncode == 0, resumed.stderr
    skipped = _skipped(resumed.stderr)
    assert list(skipped) == ["step-00000021.pt"]
    assert skipped["step-00000021.pt"].startswith(
        f"from another run {reference.state['meta']['run_id']} (this run is ")
    assert "iteration 15, step 15)" in resumed.stdout
    reference.assert_matches(run_dir)


@pytest.mark.slow
def test_no_good_checkpoint_exits_2_naming_each_file_and_touches_nothing(interrupted_run,
                                                                         harness, tmp_path):
    run_dir = harness.copy_run(interrupted_run, tmp_path / "run")
    for path in (run_dir / "checkpoints").glob("*.pt"):
        _truncate_to_zero(path)
    before = harness.file_digests(run_dir / "checkpoints")

    resumed = harness.run_recipe(run_dir)
    assert resumed.returncode == 2, resumed.stderr
    last_line = resumed.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"error: {run_dir / 'checkpoints'}: no usable checkpoint (")
    for name in before:
        if name.endswith(".pt"):
            assert f"{name}: truncated (0 bytes)" in last_line
    assert "Traceback" not in resumed.stderr
    assert harness.file_digests(run_dir / "checkpoints") == before



@pytest.mark.slow
def test_checkpoint_that_would_run_code_is_refused_unrun(interrupted_run, reference, harness,
                                                         tmp_path):
    run_dir = harness.copy_run(interrupted_run, tmp_path / "run")
    folder, marker = run_dir / "checkpoints", tmp_path / "code-ran"
    payload = read_checkpoint(folder / "last.pt")
    payload["model"]["extra"] = RunsCodeWhenUnpickled(marker)
    sidecar = json.loads((folder / "last.pt.json").read_text())
    (folder / "last.pt").unlink()  # keeps step 15, its other name, intact
    torch.save(payload, folder / "last.pt")
    data = (folder / "last.pt").read_bytes()
    # A matching sidecar: only torch.load(weights_only=True) stands in the way.
    sidecar.update(sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))
    (folder / "last.pt.json").unlink()
    (folder / "last.pt.json").write_text(json.dumps(sidecar))

    resumed = harness.run_recipe(run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert not marker.exists()
    skipped = _skipped(resumed.stderr)
    assert list(skipped) == ["last.pt"]
    assert skipped["last.pt"].startswith("not a checkpoint: ")
    assert "iteration 15, step 15)" in resumed.stdout
    reference.assert_matches(run_dir)
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("plant", ["a pickle in a byte entry", "BUILD on a class"])
def test_a_hostile_newest_sharded_checkpoint_is_passed_over_and_the_run_finishes(
        plant, fsdp_job, tmp_path):
    """An FSDP run (2 processes) whose folder gains a hostile ``step-00000099.dcp`` with a
    matching sidecar: the resume rejects it unrun, falls back to step 9 and ends identical."""
    run_dir = tmp_path / "run"
    crashed = fsdp_job.run_recipe(run_dir, faults={"CKPT_TEST_CRASH_PHASE": "mid_write:5"})
    assert crashed.returncode == 137, crashed.stderr
    folder, marker = run_dir / "checkpoints", tmp_path / "code-ran"
    planted = folder / "step-00000099.dcp"
    shutil.copytree(folder / "step-00000009.dcp", planted)
    shutil.copy(folder / "step-00000009.dcp.json", folder / "step-00000099.dcp.json")
    if plant == "a pickle in a byte entry":
        plant_pickle_in_a_bytes_entry(planted, marker)
    else:
        plant_build_on_a_class(planted)

    resumed = fsdp_job.run_recipe(run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert not marker.exists()
    skipped = _skipped(resumed.stderr)
    assert list(skipped) == ["step-00000099.dcp"], resumed.stderr
    assert skipped["step-00000099.dcp"].startswith("refused: "), skipped
    assert "iteration 9, step 9)" in resumed.stdout
    shutil.rmtree(planted)  # the planted files stay where they were put; the rest must match
    (folder / "step-00000099.dcp.json").unlink()
    fsdp_job.reference.assert_matches(run_dir)
