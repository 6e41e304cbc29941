"""torchrun --max-restarts: one worker killed with SIGKILL, torchrun restarts the group, and
the run ends bit-identical to one that was never interrupted (c10d rendezvous, gloo on the CPU,
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: docs/distributed.md, "Restarts")."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from handlers.checkpoint.formats import read_checkpoint
from tests.helpers import CHARLM, assert_bit_identical, write_text

pytestmark = pytest.mark.reliability

RUN_RECIPE = Path(__file__).with_name("run_recipe.py")
PLAIN_SCRIPT = Path(__file__).with_name("torchrun_restart.py")
REPO = Path(__file__).resolve().parents[2]
TIMEOUT_SEC = 300
# 2 epochs of 19 iterations; a checkpoint every 4 steps, so the kill at iteration 14 loses
# the steps after step 12, which the restarted group trains again.
JOB = [*CHARLM, "--text", "text.txt", "--epochs", "2", "--checkpoint-every", "4",
       "--resume", "never"]


def torchrun(arguments: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """torchrun with 2 processes, one restart allowed, the c10d rendezvous on a free port and
    a store of its own for every start."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node=2",
               "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}",
               *arguments]
    clean = {key: value for key, value in os.environ.items()
             if not key.startswith(("RELIABILITY_", "CKPT_TEST_", "TORCHELASTIC_"))}
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_SEC,
                          env=clean | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                                       # a worker that dies in C++ prints where Python was
                                       "PYTHONFAULTHANDLER": "1",
                                       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **env})


def test_plain_torch_group_restarts_after_one_worker_is_killed(tmp_path):
    done = torchrun([str(PLAIN_SCRIPT), str(tmp_path / "killed-once")], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    # The two processes share torchrun's stdout: their lines can interleave mid-line.
    assert sorted(re.findall(r"rank \d start \d+ sum [\d.]+", done.stdout)) == [
        "rank 0 start 1 sum 20.0", "rank 1 start 1 sum 20.0"], done.stdout


def test_a_killed_worker_restarts_the_group_which_ends_bit_identical(tmp_path):
    write_text(tmp_path / "text.txt")
    reference = torchrun([str(RUN_RECIPE), *JOB, "--run-name", "reference"], tmp_path)
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert "resumed from" not in reference.stdout, reference.stderr[-3000:]

    killed = torchrun([str(RUN_RECIPE), *JOB, "--run-name", "killed"], tmp_path,
                      RELIABILITY_SIGNAL_AT="SIGKILL:iteration:14", RELIABILITY_SIGNAL_RANK="1")
    assert killed.returncode == 0, killed.stderr[-3000:]
    # Rank 1 was killed, and torchrun restarted both. It names the first failure it saw: the
    # kill (-9), or rank 0's lost peer (5) when both ended by the same look.
    assert re.search(r"failed \(exitcode: (-9|5)\)", killed.stderr), killed.stderr[-3000:]
    assert "torchrun restart 1: --resume never becomes auto" in killed.stdout
    # Every process of a torchrun group is told the run folder's absolute path.
    killed_last = tmp_path.resolve() / "runs" / "charlm" / "killed" / "checkpoints" / "last.pt"
    assert f"resumed from {killed_last} (epoch 1, iteration 12, step 12)" in killed.stdout, \
        killed.stdout

    expected, actual = (read_checkpoint(tmp_path / "runs" / "charlm" / name / "checkpoints"
                                        / "last.pt") for name in ("reference", "killed"))
    assert actual["meta"]["iteration"] == expected["meta"]["iteration"] == 38
    for part in ("model", "optimizer"):
        assert_bit_identical(actual[part], expected[part], part)

