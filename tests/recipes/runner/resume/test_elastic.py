"""A start of torchrun's group: a first one that allows restarts warns while torchrun shares
its store (that a restarted one resumes ``auto``: test_plan.py; the whole restart:
tests/reliability)."""

import pytest

from recipes.runner.resume.elastic import SHARED_STORE_HINT, warn_if_store_shared


def torchrun_start(monkeypatch, rank: int, restart: int, max_restarts: int, shared: bool
                   ) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", str(max_restarts))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", str(shared))


@pytest.mark.parametrize("rank, restart, max_restarts, shared, warned", [
    (0, 0, 1, True, True), (1, 0, 1, True, False), (0, 1, 1, True, False),
    (0, 0, 0, True, False), (0, 0, 1, False, False)])
def test_rank_zero_of_a_first_start_warns_when_restarts_share_torchruns_store(
        rank, restart, max_restarts, shared, warned, monkeypatch, capsys):
    torchrun_start(monkeypatch, rank, restart, max_restarts, shared)
    warn_if_store_shared()
    assert capsys.readouterr().err == (SHARED_STORE_HINT + "\n" if warned else "")
