"""Restarts by torchrun (``--max-restarts N``): a restarted group continues its run.

torchrun starts every process of a restarted group with the command line of the first start,
and tells it which start this is in ``TORCHELASTIC_RESTART_COUNT``. The same command again
already continues its run (the run folder is chosen as for a second start by hand, the run
lock died with the processes that held it, ``--resume auto`` loads the newest good
checkpoint); what the first start's ``--resume`` asked (``never``: a new run; a file: that
checkpoint) would start the run over or go back to an older step, so a restart resumes
``auto`` whatever ``--resume`` says (``plan.py`` decides it from ``restart_count``).

torch 2.14.1's agent shares one TCP store with every start of the workers by default, and a
restarted group can then fail to join (gloo's ``connectFullMesh``: "Connection refused") or
hang (tests/reliability/torchrun_restart.py shows it without project code). With
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` and the c10d rendezvous each start gets its own
store: rank 0 of a first start with restarts allowed says so when that is not set.
"""

import os

from recipes.runner.console import warn

SHARED_STORE_HINT = (
    "warning: torchrun --max-restarts: a restarted group may fail to join while torchrun "
    "shares its store with the workers; start torchrun with "
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and --rdzv-backend c10d (docs/distributed.md, "
    "\"Restarts\")")


def restart_count() -> int:
    """Which start of torchrun's group this process belongs to: 0 for the first."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def how_to_continue() -> str:
    """What continues a torchrun group that has stopped on an error: torchrun itself while it
    has restarts left, else the same command again."""
    left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - restart_count()
    if left > 0:
        return (f"torchrun starts the group again ({left} restart(s) left); where a machine's "
                "torchrun is gone, run the same torchrun command there again")
    return "to continue the run, run the same torchrun command again on every machine"


def warn_if_store_shared() -> None:
    """Under torchrun, before the group joins: rank 0 of a first start that allows restarts
    warns when they may fail to join. (That a restart resumes ``auto`` is ``plan.py``'s.)"""
    count, rank = restart_count(), int(os.environ["RANK"])
    restarts_allowed = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if rank == 0 and count == 0 and restarts_allowed and shared:
        warn(SHARED_STORE_HINT, flush=True)
