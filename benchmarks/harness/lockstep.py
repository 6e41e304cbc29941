"""Run several arms at once, block by block, so that each block of one arm is timed next to
the same block of the others.

The machines here change speed by 20-50% over tens of milliseconds (other tenants, clock
changes): a tuned loop's 25-iteration blocks measured 470-770 µs per iteration within one
run. Runs of whole arms one after another therefore differ by more than the overheads
being measured: over 10 such repeats the trainer's overhead on the tiny model spread from
-230 to +280 µs per iteration. Side by side (3 arms, 3 x 1000 iterations), it came out as
20.8 µs, 95% interval 20.0-23.3, in blocks of 10 iterations; 20.7, 7.5-26.8, in blocks of
50 (a round of the arms lasts longer, and the machine drifts within it).

Every arm runs in its own greenlet, all in this one thread (the signal handlers of the
recipe's handler set need the main thread), and hands control on at each ``WindowTimer``
event: once warmed up ("open"), after every block ("block"), at the window's end
("close"). Block ``k`` of every arm runs within round ``k``, and each round takes the arms
in a new random order (seeded): a fixed or rotated order keeps each arm behind the same
neighbour, and two runs of the very same loop then came out 3.2 µs per iteration apart
(95% interval 0.8-5.5); in random order, 2.2 (-0.8 to 4.6). greenlet (in the dev and
bench extras) does the switching: a switch there and back took 0.7-1.3 µs (timeit), and it
falls outside every block (``WindowTimer`` stops its clock before it hands control on).
"""

import random
from collections.abc import Callable, Mapping
from typing import TypeVar

import greenlet

from benchmarks.harness import timing

T = TypeVar("T")


def run_lockstep(calls: Mapping[str, Callable[[], T]], seed: int = 0) -> dict[str, T]:
    """Call every ``calls[name]()`` interleaved at their window events; returns each one's
    result. An exception in one call stops them all and propagates."""
    scheduler = greenlet.getcurrent()
    results: dict[str, T] = {}

    def hand_back(event: str) -> None:
        if greenlet.getcurrent() is not scheduler:  # called from an arm
            scheduler.switch()

    def arm(name: str, call: Callable[[], T]) -> greenlet.greenlet:
        def body() -> None:
            results[name] = call()
        return greenlet.greenlet(body, parent=scheduler)

    arms = {name: arm(name, call) for name, call in calls.items()}
    order = list(arms)
    shuffle = random.Random(seed).shuffle
    timing.window_listeners.append(hand_back)
    try:
        while any(not let.dead for let in arms.values()):
            for name in order:
                if not arms[name].dead:
                    arms[name].switch()
            shuffle(order)
    finally:
        timing.window_listeners.remove(hand_back)
        for let in arms.values():
            if not let.dead:
                let.throw(greenlet.GreenletExit)  # unwinds its context managers
    return results
