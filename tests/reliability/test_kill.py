"""kill -9 at random moments and inside every phase of a checkpoint save: running the same
command again finishes the run bit-identically to one that was never interrupted, with the
same records in metrics.jsonl."""

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from handlers.checkpoint.crash_points import CRASH_PHASES

pytestmark = pytest.mark.reliability

RANDOM_TRIALS = 12
CRASHED_SAVE = 5  # the 5th save (step 12) also evicts step 3: every phase is reached


def _trial(seed: int):
    marks = [] if seed == 0 else [pytest.mark.slow]  # trial 0 runs in `pytest -m "not slow"`
    return pytest.param(seed, marks=marks, id=f"seed{seed}")


@pytest.mark.parametrize("seed", [_trial(seed) for seed in range(RANDOM_TRIALS)])
def test_kill9_at_a_random_moment_then_rerun_finishes_identically(seed, reference, harness,
                                                                  tmp_path):
    moment = random.Random(seed)
    # A progress line comes every 2 of 24 iterations; after the 9th at most, 6 iterations, a
    # validation and its saves are still ahead, so the kill lands inside the run.
    after_lines, delay_sec = moment.randint(1, 9), moment.uniform(0.0, 0.4)
    run_dir = tmp_path / "run"

    killed = harness.run_and_signal(run_dir, signal.SIGKILL, after_lines, delay_sec)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert killed.extra["progress_lines"] == after_lines

    resumed = harness.run_recipe(run_dir)
    assert resumed.returncode == 0, resumed.stderr
    reference.assert_matches(run_dir)
    reference.assert_same_metrics(run_dir)



def test_kill9_at_fp16_or_bf16_then_rerun_finishes_identically(low_precision_job, tmp_path):
    """The same kill with a loss scaler in play (fp16: its scale and growth tracker must
    come back from the checkpoint) and with bf16 autocast."""
    job, run_dir = low_precision_job, tmp_path / "run"
    scaler = job.reference.state["scaler"]
    if job.precision == "fp16":
        assert scaler["scale"] > 0 and scaler["_growth_tracker"] > 0
    else:
        assert scaler == {}  # bf16 needs no scaler: a disabled one saves nothing

    killed = job.run_and_signal(run_dir, signal.SIGKILL, 5, 0.2)  # past the step-9 save
    assert killed.returncode == -signal.SIGKILL, killed.stderr

    resumed = job.run_recipe(run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    job.reference.assert_matches(run_dir)
    job.reference.assert_same_metrics(run_dir)

@pytest.mark.slow
@pytest.mark.parametrize("phase", CRASH_PHASES)
def test_crash_inside_a_checkpoint_save_then_rerun_finishes_identically(phase, reference,
                                                                        harness, tmp_path):
    run_dir = tmp_path / "run"
    crashed = harness.run_recipe(
        run_dir, faults={"CKPT_TEST_CRASH_PHASE": f"{phase}:{CRASHED_SAVE}"})
    assert crashed.returncode == 137, crashed.stderr
    folder = run_dir / "checkpoints"
    # Until the switch of last.pt, it names the previous save (step 9); from the eviction
    # on, step 12 is committed. Before its sidecar exists, step 12 is not trusted.
    committed = 12 if phase == "during_eviction" else 9
    assert json.loads((folder / "last.pt.json").read_text())["optimizer_step"] == committed
    if phase == "during_eviction":
        assert not (folder / "step-00000003.pt").exists()
        assert (folder / "step-00000003.pt.json").exists()  # its sidecar was next

    resumed = harness.run_recipe(run_dir)
    assert resumed.returncode == 0, resumed.stderr
    resumed_from = 12 if phase in ("before_link", "during_eviction") else 9
    assert f"iteration {resumed_from}, step {resumed_from})" in resumed.stdout
    reference.assert_matches(run_dir)  # also: no temp file and no orphan sidecar left
    reference.assert_same_metrics(run_dir)


# One phase outside -m slow; tests/handlers/checkpoint/test_failures.py kills the first save at
# every phase in-process, in about a third of the time.
@pytest.mark.parametrize("phase", [pytest.param("before_dir_fsync", marks=pytest.mark.slow),
                                   "before_sidecar"])
def test_crash_inside_the_first_save_then_rerun_starts_over_and_finishes_identically(
        phase, reference, harness, tmp_path):
    """The first save's .pt is in place but has no sidecar: nothing was ever committed, so
    the same command starts the run again (a random kill found this: it used to exit 2)."""
    run_dir = tmp_path / "run"
    crashed = harness.run_recipe(run_dir, faults={"CKPT_TEST_CRASH_PHASE": f"{phase}:1"})
    assert crashed.returncode == 137, crashed.stderr
    folder = run_dir / "checkpoints"
    assert {path.name for path in folder.iterdir()} == {"step-00000003.pt"}

    restarted = harness.run_recipe(run_dir)
    assert restarted.returncode == 0, restarted.stderr
    assert "never got its sidecar" in restarted.stderr and "resumed from" not in restarted.stdout
    reference.assert_matches(run_dir)
    reference.assert_same_metrics(run_dir)


@pytest.mark.slow
def test_two_crashes_in_a_row_then_rerun_finishes_identically(reference, harness, tmp_path):
    run_dir = tmp_path / "run"
    first = harness.run_recipe(run_dir, faults={"CKPT_TEST_CRASH_PHASE": "mid_write:4"})
    assert first.returncode == 137, first.stderr
    # The second start crashes at its own 2nd save, after the resume, in another phase.
    second = harness.run_recipe(run_dir, faults={"CKPT_TEST_CRASH_PHASE": "before_rename:2"})
    assert second.returncode == 137, second.stderr
    assert "resumed from" in second.stdout

    third = harness.run_recipe(run_dir)
    assert third.returncode == 0, third.stderr
    reference.assert_matches(run_dir)
    reference.assert_same_metrics(run_dir)


@pytest.mark.slow
def test_unwrapped_command_line_with_the_full_size_net_resumes_identically(harness, tmp_path):
    """The same job through plain ``python -m recipes``: the default-width net (~2M
    parameters, 16 MB checkpoints), no test hooks in the process at all."""
    unwrapped = ("-m", "recipes")
    assert harness.run_recipe(tmp_path / "reference", entry=unwrapped).returncode == 0
    reference = harness.Reference.of(tmp_path / "reference")
    run_dir = tmp_path / "run"
    killed = harness.run_and_signal(run_dir, signal.SIGKILL, 6, 0.2, entry=unwrapped)
    assert killed.returncode == -signal.SIGKILL, killed.stderr

    resumed = harness.run_recipe(run_dir, entry=unwrapped)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    reference.assert_matches(run_dir)
    reference.assert_same_metrics(run_dir)


@pytest.mark.slow
def test_kill9_of_the_cifar_defaults_accumulation_resumes_identically(harness, tmp_path):
    """The cifar default makes each optimizer step of two micro-batches (``--accum-steps 2``,
    512 + 512 samples; here 32 + 32): killed mid-run, its resume is bit-identical."""
    if harness.recipe != "cifar":
        pytest.skip("the cifar recipe's default accumulation")
    accum = ("--accum-steps", "2")
    assert harness.run_recipe(tmp_path / "reference", *accum).returncode == 0
    reference = harness.Reference.of(tmp_path / "reference")
    run_dir = tmp_path / "run"
    killed = harness.run_and_signal(run_dir, signal.SIGKILL, 3, 0.3, *accum)
    assert killed.returncode == -signal.SIGKILL, killed.stderr

    resumed = harness.run_recipe(run_dir, *accum)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    reference.assert_matches(run_dir)
    reference.assert_same_metrics(run_dir)


def test_rerun_of_a_finished_run_trains_nothing_and_changes_no_checkpoint(reference, harness,
                                                                          tmp_path):
    """As after a kill between the final save and the exit (or a second start by mistake)."""
    run_dir = harness.copy_run(reference.run_dir, tmp_path / "run")
    (run_dir / "summary.json").unlink()
    checkpoints = harness.file_digests(run_dir / "checkpoints")

    rerun = harness.run_recipe(run_dir)
    assert rerun.returncode == 0, rerun.stderr
    assert "the run is already complete: nothing left to train" in rerun.stdout
    assert harness.file_digests(run_dir / "checkpoints") == checkpoints
    reference.assert_matches(run_dir)
    reference.assert_same_metrics(run_dir)


# --strategy fsdp: 2 processes writing sharded checkpoints (charlm; the whole group killed,
# as a job is). The 5th save (step 12) is the crashed one, as above.
FSDP_TRIALS = 1  # each row costs two 2-process runs (~30 s each on a loaded 2-core machine)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(FSDP_TRIALS))
def test_kill9_of_an_fsdp_group_at_a_random_moment_then_rerun_finishes_identically(
        seed, fsdp_job, tmp_path):
    moment = random.Random(100 + seed)
    after_lines, delay_sec = moment.randint(1, 9), moment.uniform(0.0, 0.4)
    run_dir = tmp_path / "run"
    killed = fsdp_job.run_and_signal(run_dir, signal.SIGKILL, after_lines, delay_sec)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert killed.extra["progress_lines"] == after_lines

    resumed = fsdp_job.run_recipe(run_dir)
    assert resumed.returncode == 0, resumed.stderr
    fsdp_job.reference.assert_matches(run_dir)


@pytest.mark.slow
def test_crash_inside_a_sharded_save_then_rerun_finishes_identically(fsdp_job, tmp_path):
    """Rank 0 dies once every process has written its shards of step 12, before state.pt:
    the temp folder is not a checkpoint, the resume takes step 9 and removes it."""
    run_dir = tmp_path / "run"
    crashed = fsdp_job.run_recipe(
        run_dir, faults={"CKPT_TEST_CRASH_PHASE": f"mid_write:{CRASHED_SAVE}"})
    assert crashed.returncode == 137, crashed.stderr
    folder = run_dir / "checkpoints"
    assert json.loads((folder / "last.dcp.json").read_text())["optimizer_step"] == 9
    assert [path.name for path in folder.iterdir() if path.name.startswith(".step-00000012")]

    resumed = fsdp_job.run_recipe(run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert "iteration 9, step 9)" in resumed.stdout
    fsdp_job.reference.assert_matches(run_dir)


# Three 2-process starts (~2 min on 2 cores): slow; tests/recipes/runner/training/test_lock.py
# keeps the mechanism (a spawned process holds the lock past a kill -9 of its parent) in
# `make test`.
@pytest.mark.slow
def test_kill9_of_the_nproc_launcher_keeps_the_folder_locked_until_its_last_process_ends(
        harness, tmp_path):
    """``kill -9`` of the ``--nproc 2`` parent while its two processes live on (stopped here,
    so that they surely outlive it; torch's spawn sends them SIGINT as the parent dies, and
    they finish the step and save): a start of the same folder is refused with the lock's one
    line naming them, never runs beside them; once they have ended, the same command
    continues the run to its end."""
    run_dir = tmp_path / "run"
    command = harness.command(run_dir, "--nproc", "2")
    launcher = subprocess.Popen(command, env=harness.child_env(), cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ranks: list[int] = []
    try:
        while not launcher.stdout.readline().startswith("epoch "):  # both processes train
            assert launcher.poll() is None, "the --nproc 2 run ended before its first step"
        ranks += _spawned_processes(launcher.pid)
        assert len(ranks) == 2
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        launcher.kill()
        launcher.wait()

        second = harness.run_recipe(run_dir, "--nproc", "2")
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert lines[0].startswith(f"error: {run_dir} is in use by processes "), lines[0]
        assert all(str(pid) in lines[0] for pid in ranks), lines[0]
        assert all(_alive(pid) for pid in ranks)
    finally:
        launcher.kill()
        launcher.wait()
        for pid in filter(_alive, ranks):
            os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 120
    while any(_alive(pid) for pid in ranks):  # they finish the step, save and exit
        assert time.monotonic() < deadline, "the old processes did not end"
        time.sleep(0.1)

    third = harness.run_recipe(run_dir, "--nproc", "2")
    assert third.returncode == 0, third.stderr
    assert "resumed from" in third.stdout
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


def _spawned_processes(parent: int) -> list[int]:
    """The processes the ``--nproc`` parent spawned (not its resource tracker)."""
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    return [int(pid) for pid in children
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def _alive(pid: int) -> bool:
    """Whether the process exists and has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
