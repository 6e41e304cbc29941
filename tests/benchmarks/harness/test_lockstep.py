import pytest

from benchmarks.harness.lockstep import run_lockstep
from benchmarks.harness.timing import WindowTimer


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


def test_arms_run_block_by_block_each_round_in_a_new_order():
    log = []
    arms = {name: loop(name, log, timed=16, block=2) for name in "abc"}
    assert run_lockstep(arms) == {name: f"{name}: 8 blocks" for name in "abc"}
    # Round 0 runs set-up and warm-up up to "open"; rounds 1-8 a block each (two iterations);
    # round 9 the run's end. Every round runs each arm once, and a round ends before the next.
    rounds = [[(name, 1) for name in "abc"]]
    rounds += [log[3 + 6 * k: 3 + 6 * (k + 1)] for k in range(8)]
    for k, entries in enumerate(rounds[1:], start=1):
        firsts = entries[0::2]
        assert sorted(name for name, _ in firsts) == ["a", "b", "c"]
        assert all(entries[2 * i + 1] == (name, 2 * k + 1) for i, (name, done) in
                   enumerate(firsts)) and all(done == 2 * k for _, done in firsts)
    orders = {tuple(name for name, _ in entries[0::2]) for entries in rounds[1:]}
    assert len(orders) > 3  # a rotation gives at most 3, each arm behind the same neighbour
    assert sorted(log[3 + 6 * 8:]) == sorted(
        [(name, "end") for name in "abc"] + [(name, "unwound") for name in "abc"])


def test_the_order_follows_the_seed():
    def order(seed: int) -> list:
        log = []
        run_lockstep({name: loop(name, log, timed=8, block=1) for name in "abcd"}, seed=seed)
        return log

    assert order(0) == order(0) and order(0) != order(1)


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
