"""Test-only fault injection for checkpoint saves: exit like a killed process at a named phase.

Off unless ``CKPT_TEST_CRASH_PHASE=PHASE`` or ``PHASE:N`` is in the environment when the
``Checkpointer`` is built: the process then calls ``os._exit(137)`` the first time it reaches
PHASE in or after its N-th save (default 1). The phases, in the order a save reaches them:
``before_temp``, ``mid_write`` (a partly written temp file), ``before_rename``,
``before_dir_fsync`` (each in the .pt write), ``before_sidecar``, ``before_link`` (before the
last/best switch) and ``during_eviction`` (after the first evicted .pt is deleted, before its
sidecar). A save written behind training (``Checkpointer(asynchronous=True)``) reaches them on
its background thread (a .dcp save's ``before_temp`` on the training thread, which agrees on
the temp folder), and three more (``ASYNC_CRASH_PHASES``): ``after_copy`` (on the training
thread: the state is copied, the write not handed over yet), ``background_start`` (the
background thread's first instant: training may have gone on, nothing is written) and
``final_wait`` (the run's end, or a stop, about to wait for a save still in flight). The
reliability suite kills a run at each of them and checks the resume.
"""

import os

CRASH_ENV = "CKPT_TEST_CRASH_PHASE"
CRASH_PHASES = (
    "before_temp", "mid_write", "before_rename", "before_dir_fsync",
    "before_sidecar", "before_link", "during_eviction",
)
ASYNC_CRASH_PHASES = ("after_copy", "background_start", "final_wait")


class CrashPoints:
    """Reads ``CKPT_TEST_CRASH_PHASE`` once; ``reach(phase)`` exits when it names that phase
    and enough saves have started (``save_started()`` counts them)."""

    def __init__(self) -> None:
        self._wanted = _parse(os.environ.get(CRASH_ENV))
        self._saves_started = 0  # this process's saves

    def save_started(self) -> None:
        self._saves_started += 1

    def reach(self, phase: str) -> None:
        if self._wanted is None:
            return
        wanted_phase, from_save = self._wanted
        if phase == wanted_phase and self._saves_started >= from_save:
            os._exit(137)


def _parse(value: str | None) -> tuple[str, int] | None:
    if not value:
        return None
    phase, _, nth = value.partition(":")
    if phase not in CRASH_PHASES + ASYNC_CRASH_PHASES or not (nth.isdigit() or nth == ""):
        raise ValueError(f"{CRASH_ENV}={value!r} is not PHASE or PHASE:N; phases: "
                         f"{', '.join(CRASH_PHASES + ASYNC_CRASH_PHASES)}")
    return phase, int(nth or 1)
