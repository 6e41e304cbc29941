"""A process that loses a peer of its group says so in one line and exits 5; any other error
is not its business (the whole case, two torchrun nodes: tests/reliability/test_nodes.py)."""

import pytest
import torch.distributed as dist

from recipes.runner.config.command_line import ConfigError, ExitCode, parse_args
from recipes.runner.config.registry import load_recipe
from recipes.runner.training import peers
from recipes.runner.training.peers import Peer, lost_peer_cause, lost_peer_line, unless_peer_lost

# What gloo raised here when the peer was killed, and when it was stopped (--collective-timeout 5).
RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
         "[127.0.0.1]:4520: Connection reset by peer. This is typically caused by a remote "
         "worker hanging or bugs in the application. Check the logs of the remote worker "
         "before reporting an error. GLHF!")
TIMED_OUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
             "Timed out waiting 5000ms for recv operation to complete")
GROUP = [Peer(0, "node-a", 100), Peer(1, "node-b", 200), Peer(2, "node-b", 201)]


@pytest.mark.parametrize("error, cause", [
    (RuntimeError(RESET), "Read error [127.0.0.1]:4520: Connection reset by peer"),
    (RuntimeError(TIMED_OUT), "Timed out waiting 5000ms for recv operation to complete"),
    (dist.DistNetworkError("Connection closed by peer\nException raised from ..."),
     "Connection closed by peer"),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), None),
    (ValueError(RESET), None)])
def test_the_cause_is_the_backends_first_line_for_a_lost_peer_only(error, cause):
    assert lost_peer_cause(error) == cause


def test_the_line_names_the_one_other_rank_of_two_with_its_pid_and_host():
    line = lost_peer_line(0, GROUP[:2], "Read error [10.0.0.2]:4520: Connection reset by peer",
                          600, "to continue the run, run the same command again")
    assert line == ("error: rank 0 lost rank 1 (pid 200 on node-b): the connection to it "
                    "failed (Read error [10.0.0.2]:4520: Connection reset by peer); the "
                    "checkpoints written are kept; to continue the run, run the same command "
                    "again")


def test_a_timeout_names_the_timeout_and_a_larger_group_every_other_rank():
    line = lost_peer_line(1, GROUP, TIMED_OUT, 5, "continue")
    assert line.startswith("error: rank 1 lost one of rank 0 (node-a), rank 2 (node-b): no "
                           "answer within --collective-timeout 5 s ("), line


def test_a_lost_peer_is_one_line_and_exit_5_and_any_other_error_goes_on(monkeypatch, capsys):
    monkeypatch.setattr(peers, "roll_call", lambda: GROUP[:2])

    def lost() -> int:
        raise RuntimeError(RESET)

    assert unless_peer_lost(lost, 600, "continue") == ExitCode.PEER_LOST == 5
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: rank 0 lost rank 1 (pid 200 on node-b): ")
    assert unless_peer_lost(lambda: 3, 600, "continue") == 3

    def broken() -> int:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        unless_peer_lost(broken, 600, "continue")


def test_the_collective_timeout_is_a_whole_number_of_seconds_from_one():
    config = load_recipe("charlm").config
    assert parse_args(config, [])[0].collective_timeout == 600
    assert parse_args(config, ["--collective-timeout", "30"])[0].collective_timeout == 30
    with pytest.raises(ConfigError, match=r"^--collective-timeout: must be >= 1, got 0$"):
        parse_args(config, ["--collective-timeout", "0"])
