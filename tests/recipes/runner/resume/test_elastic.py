"""A start of torchrun's group: a first one that allows restarts warns while torchrun shares
its store, and a group stopped on an error says what continues it (that a restarted one
resumes ``auto``: test_plan.py; the whole restart: tests/reliability)."""

import pytest

from recipes.runner.resume.elastic import SHARED_STORE_HINT, how_to_continue, warn_if_store_shared


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


@pytest.mark.parametrize("restart, max_restarts, expected", [
    (0, 0, "to continue the run, run the same torchrun command again on every machine"),
    (1, 1, "to continue the run, run the same torchrun command again on every machine"),
    (0, 2, "torchrun starts the group again (2 restart(s) left); where a machine's torchrun "
           "is gone, run the same torchrun command there again")])
def test_a_stopped_group_is_continued_by_torchrun_while_it_has_restarts_left(
        restart, max_restarts, expected, monkeypatch):
    torchrun_start(monkeypatch, 0, restart, max_restarts, False)
    assert how_to_continue() == expected
