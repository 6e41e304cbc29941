import pytest

from benchmarks.lockstep import run_lockstep
from benchmarks.timing import WindowTimer


def loop(name: str, log: list, warmup: int = 1, timed: int = 4, block: int = 2,
         fail_at: int | None = None):
    """An arm: ``warmup + timed`` iterations, each logged, marked on a WindowTimer."""
    def run() -> str:
        timer = WindowTimer(warmup, timed, block)
        try:
            for done in range(1, warmup + timed + 1):
                if done == fail_at:
                    raise RuntimeError(f"{name} failed")
                log.append((name, done))
                timer.mark(done)
            log.append((name, "end"))
            return f"{name}: {len(timer.blocks)} blocks"
        finally:
            log.append((name, "unwound"))
    return run


def test_arms_run_block_by_block_in_an_order_rotated_every_round():
    log = []
    results = run_lockstep({"a": loop("a", log), "b": loop("b", log), "c": loop("c", log)})
    assert results == {"a": "a: 2 blocks", "b": "b: 2 blocks", "c": "c: 2 blocks"}
    assert log == [
        ("a", 1), ("b", 1), ("c", 1),  # round 0: set-up and warm-up, up to "open"
        ("b", 2), ("b", 3), ("c", 2), ("c", 3), ("a", 2), ("a", 3),  # block 1
        ("c", 4), ("c", 5), ("a", 4), ("a", 5), ("b", 4), ("b", 5),  # block 2, up to "close"
        ("a", "end"), ("a", "unwound"), ("b", "end"), ("b", "unwound"),  # run ends
        ("c", "end"), ("c", "unwound"),
    ]


def test_a_failing_arm_stops_the_others_and_its_error_propagates():
    log = []
    with pytest.raises(RuntimeError, match="b failed"):
        run_lockstep({"a": loop("a", log), "b": loop("b", log, fail_at=3)})
    assert ("a", "unwound") in log and ("a", "end") not in log  # unwound, not finished
    assert ("b", "unwound") in log


def test_a_single_arm_runs_to_its_end():
    log = []
    assert run_lockstep({"a": loop("a", log)}) == {"a": "a: 2 blocks"}
    assert log[-2:] == [("a", "end"), ("a", "unwound")]
