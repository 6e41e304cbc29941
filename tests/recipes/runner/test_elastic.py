"""A start of torchrun's group: a restarted one resumes ``auto``; a first one that allows
restarts warns while torchrun shares its store (the whole restart: tests/reliability)."""

import pytest

from recipes.runner.training.elastic import SHARED_STORE_HINT, prepare_start
from tests.recipes.runner.test_continue import charlm_config


def torchrun_start(monkeypatch, rank: int, restart: int, max_restarts: int, shared: bool
                   ) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", str(max_restarts))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", str(shared))


@pytest.mark.parametrize("resume", ["never", "a file"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_restarted_group_resumes_the_newest_checkpoint_whatever_resume_asked(
        resume, rank, monkeypatch, capsys, tmp_path):
    torchrun_start(monkeypatch, rank, restart=2, max_restarts=3, shared=False)
    if resume == "a file":
        resume = str(tmp_path / "step-00000004.pt")
        (tmp_path / "step-00000004.pt").touch()
    _, config, _ = charlm_config("--resume", resume)
    prepare_start(config)
    assert config.resume == "auto"
    said = f"torchrun restart 2: --resume {resume} becomes auto (the newest good checkpoint " \
           "of the run)\n"
    assert capsys.readouterr() == ((said if rank == 0 else ""), "")


def test_the_first_start_keeps_its_resume(monkeypatch, capsys):
    torchrun_start(monkeypatch, 0, restart=0, max_restarts=3, shared=False)
    _, config, _ = charlm_config("--resume", "never")
    prepare_start(config)
    assert config.resume == "never" and capsys.readouterr() == ("", "")


@pytest.mark.parametrize("rank, restart, max_restarts, shared, warned", [
    (0, 0, 1, True, True), (1, 0, 1, True, False), (0, 1, 1, True, False),
    (0, 0, 0, True, False), (0, 0, 1, False, False)])
def test_rank_zero_of_a_first_start_warns_when_restarts_share_torchruns_store(
        rank, restart, max_restarts, shared, warned, monkeypatch, capsys):
    torchrun_start(monkeypatch, rank, restart, max_restarts, shared)
    _, config, _ = charlm_config()
    prepare_start(config)
    assert capsys.readouterr().err == (SHARED_STORE_HINT + "\n" if warned else "")
