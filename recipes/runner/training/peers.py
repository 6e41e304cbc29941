"""A process of a group that loses another: one line naming it, and exit code 5.

A process that dies (``kill -9``, a machine that goes down) closes its connections, and gloo
raises at once in the next collective of every process still running. One that stops answering
(a stopped process, a machine cut off from the network) is noticed by the first collective that
waits longer than ``--collective-timeout``, the group's timeout (``init_process_group``). Either
way the group cannot go on: each process still running says in one line whom it lost and how to
continue, and exits with ``ExitCode.PEER_LOST``. What the run committed stays as it was: a
checkpoint is committed whole or not at all.

gloo's error names only the address of the connection that failed, so every process learns
each rank's host and process id as the group forms (``roll_call``) and the line names the
other ranks from that: in a group of two, exactly the one lost.
"""

import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ignite.distributed as idist
import torch.distributed as dist

from recipes.runner.config.command_line import ExitCode
from recipes.runner.console import warn

# gloo raises a plain RuntimeError, whose text starts with the source file that raised it:
# "[.../gloo/transport/tcp/pair.cc:545] Read error [10.0.0.2]:4520: Connection reset by peer.
# This is typically caused by ...". The other backends raise torch's DistError.
GLOO_TRANSPORT = "gloo/transport/"
SOURCE_PREFIX = re.compile(r"^\[[^\]]*\] ")
ADVICE = ". This is typically caused by"


@dataclass(frozen=True)
class Peer:
    """One process of the group, as it was when the group formed."""

    rank: int
    host: str
    pid: int


def roll_call() -> list[Peer]:
    """Every process's host and process id, by rank: a collective, which every process of the
    group calls as it joins."""
    gathered: list[Any] = [None] * idist.get_world_size()
    dist.all_gather_object(gathered, (socket.gethostname(), os.getpid()))
    return [Peer(rank, host, pid) for rank, (host, pid) in enumerate(gathered)]


def lost_peer_cause(error: BaseException) -> str | None:
    """What the backend said when a collective lost a peer, in one line without gloo's source
    location and advice; None when ``error`` is anything else."""
    text = str(error)
    if not isinstance(error, dist.DistError) and not (
            isinstance(error, RuntimeError) and GLOO_TRANSPORT in text):
        return None
    first_line = SOURCE_PREFIX.sub("", text.strip()).splitlines()[0]
    return first_line.split(ADVICE)[0].rstrip(".")


def lost_peer_line(rank: int, peers: list[Peer], cause: str, timeout_sec: int,
                   how_to_continue: str) -> str:
    """The one line a process says when its group lost a peer: which ranks it may be, whether it
    died or stopped answering, and how to continue."""
    others = [peer for peer in peers if peer.rank != rank]
    if len(others) == 1:
        lost = f"rank {others[0].rank} (pid {others[0].pid} on {others[0].host})"
    else:
        lost = "one of " + ", ".join(f"rank {peer.rank} ({peer.host})" for peer in others)
    why = (f"no answer within --collective-timeout {timeout_sec} s"
           if "timed out" in cause.lower() else "the connection to it failed")
    return (f"error: rank {rank} lost {lost}: {why} ({cause}); the checkpoints written are "
            f"kept; {how_to_continue}")


def unless_peer_lost(work: Callable[[], int], timeout_sec: int, how_to_continue: str) -> int:
    """``work()``'s exit code in a process of a group, or ``ExitCode.PEER_LOST`` once the one
    line is said, when a collective lost a peer. Every process of the group calls it as it
    joins (the roll call is a collective)."""
    peers = roll_call()
    try:
        return work()
    except RuntimeError as error:
        cause = lost_peer_cause(error)
        if cause is None:
            raise
        warn(lost_peer_line(idist.get_rank(), peers, cause, timeout_sec, how_to_continue),
             flush=True)
        return ExitCode.PEER_LOST
