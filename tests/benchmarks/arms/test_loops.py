import time

import pytest
import torch

from benchmarks.arms.loops import ARMS, run_arm
from benchmarks.arms.workloads import tiny_workload


@pytest.mark.parametrize("arm", [name for name in ARMS if name != "lightning"])
def test_arm_trains_the_same_weights_as_the_hand_loop(arm):
    workload = tiny_workload(warmup=2, timed=6)
    hand = run_arm("hand", workload, threads=1)
    result = run_arm(arm, workload, threads=1)
    assert result.probe_loss == hand.probe_loss
    assert result.seconds > 0 and result.end_seconds >= 0


def test_lightning_trains_the_same_weights_as_the_hand_loop():
    pytest.importorskip("pytorch_lightning")
    workload = tiny_workload(warmup=2, timed=6)
    assert run_arm("lightning", workload, 1).probe_loss == run_arm("hand", workload, 1).probe_loss


def test_training_moves_the_probe_loss():
    workload = tiny_workload(warmup=2, timed=6)
    model, _ = workload.fresh()
    assert run_arm("hand", workload, 1).probe_loss != workload.probe_loss(model)


def test_run_arm_restores_stdout_and_keeps_the_thread_count(capsys):
    workload = tiny_workload(warmup=1, timed=2)
    run_arm("trainer+recipe", workload, threads=1)  # prints the telemetry's health line
    assert capsys.readouterr().out == ""
    assert torch.get_num_threads() == 1


def test_the_run_end_leaves_the_probe_loss_out(monkeypatch):
    workload = tiny_workload(warmup=1, timed=2)
    probe = workload.probe_loss
    monkeypatch.setattr(workload, "probe_loss", lambda model: time.sleep(0.3) or probe(model))
    for arm in ("hand", "trainer"):
        assert run_arm(arm, workload, threads=1).end_seconds < 0.3
