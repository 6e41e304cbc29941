import logging
import random
import re

import pytest
import torch

from engine.run_state import RngState, new_run_id


def _draws() -> tuple[torch.Tensor, list[float]]:
    return torch.rand(5), [random.random(), random.gauss(0.0, 1.0), random.gauss(0.0, 1.0)]


def test_restoring_the_state_replays_torch_and_python_draws():
    torch.manual_seed(3)
    random.seed(3)
    random.gauss(0.0, 1.0)  # leaves a cached second normal in Python's state (gauss_next)
    rng = RngState()
    saved = rng.state_dict()
    first = _draws()
    rng.load_state_dict(saved)
    second = _draws()
    assert torch.equal(first[0], second[0])
    assert first[1] == second[1]


def test_state_survives_a_weights_only_round_trip_through_a_file(tmp_path):
    rng = RngState()
    torch.save(rng.state_dict(), tmp_path / "rng.pt")
    expected = _draws()
    _draws()  # move both generators further on
    rng.load_state_dict(torch.load(tmp_path / "rng.pt", weights_only=True))
    replayed = _draws()
    assert torch.equal(expected[0], replayed[0])
    assert expected[1] == replayed[1]


def test_cpu_only_machine_saves_no_cuda_state_and_warns_when_loading_some(caplog):
    rng = RngState()
    state = rng.state_dict()
    assert state["torch_cuda"] == []
    state["torch_cuda"] = [torch.zeros(16, dtype=torch.uint8)]  # as if saved on one GPU
    with caplog.at_level(logging.WARNING, logger="engine.run_state"):
        rng.load_state_dict(state)
    assert "1 CUDA device(s), this machine has 0" in caplog.text


def test_missing_keys_are_named():
    with pytest.raises(ValueError, match=r"missing \['python', 'torch_cuda'\]"):
        RngState().load_state_dict({"torch_cpu": torch.get_rng_state()})


def test_new_run_id_is_unique_readable_and_leaves_seeded_generators_alone():
    torch.manual_seed(0)
    random.seed(0)
    torch_before, python_before = torch.get_rng_state(), random.getstate()
    ids = {new_run_id() for _ in range(20)}
    assert len(ids) == 20
    assert all(re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{8}", run_id) for run_id in ids)
    assert torch.equal(torch.get_rng_state(), torch_before)
    assert random.getstate() == python_before
