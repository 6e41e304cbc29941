"""``engine/ignite_loop.py``'s fast loop follows one Ignite version's private code: the
trainer runs it only on a version it was checked against, and these tests fail, naming what
to re-check, when such a version no longer has, or no longer calls, what it relies on. On
any other version the trainer runs on Ignite's own loop, which the loop tests pass on too.
(That the fast loop's events match Ignite's is ``test_trainer_loop.py``'s job.)"""

import ast
import inspect
import os
import subprocess
import sys
from pathlib import Path

import ignite
import pytest
from ignite.engine import Engine, Events

from engine import ignite_loop
from engine.ignite_loop import (
    CHECKED_IGNITE_VERSIONS,
    IGNITE_PRIVATE_NAMES,
    FastLoopEngine,
    IgniteLoopEngine,
    trainer_loop,
)

checked_version_only = pytest.mark.skipif(
    ignite.__version__ not in CHECKED_IGNITE_VERSIONS,
    reason=f"pytorch-ignite {ignite.__version__}: the trainer runs on Ignite's own loop")

RECHECK = ("re-check engine/ignite_loop.py against Engine._run_once_on_dataset_legacy, "
           "_internal_run_legacy and _fire_event in ignite/engine/engine.py")


def echo(engine: Engine, batch):
    return batch


def private_names_used() -> set[str]:
    """Every ``_name`` (not ``__dunder__``) that ignite_loop.py reads or writes as an
    attribute."""
    tree = ast.parse(inspect.getsource(ignite_loop))
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and node.attr.startswith("_") and not node.attr.startswith("__")}


@pytest.mark.parametrize("version, asked, loop", [
    ("0.5.5", "", FastLoopEngine), ("0.5.5", "ignite", IgniteLoopEngine),
    ("0.6.0", "", IgniteLoopEngine), ("0.6.0", "fast", IgniteLoopEngine)])
def test_the_fast_loop_runs_only_on_a_checked_ignite_unless_ignites_own_is_asked_for(
        version, asked, loop, monkeypatch):
    monkeypatch.setattr(ignite, "__version__", version)
    monkeypatch.setenv("ENGINE_LOOP", asked)
    assert trainer_loop() is loop


def test_the_loop_tests_pass_on_ignites_own_loop():
    """The trainer on Ignite's own loop (what it runs on an unchecked Ignite version) fires
    what Ignite fires in every scenario of the loop tests."""
    tests = Path(__file__).with_name("test_trainer_loop.py")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             str(tests)], capture_output=True, text=True,
                            env={**os.environ, "ENGINE_LOOP": "ignite"}, check=False)
    assert result.returncode == 0, result.stdout[-3000:]
    assert " passed" in result.stdout.splitlines()[-1]


def test_ignites_own_loop_reads_one_private_name_which_ignite_still_has():
    assert {name for name in private_names_used() if hasattr(Engine(echo), name)
            and name in inspect.getsource(IgniteLoopEngine)} == {"_dataloader_iter"}
    engine = IgniteLoopEngine(echo)
    engine.add_event_handler(Events.ITERATION_COMPLETED,
                             lambda e: e._drop_batches(1) if e.state.iteration == 1 else None)
    seen = []
    engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen.append(e.state.batch))
    engine.run([1, 2, 3, 4], max_epochs=1, epoch_length=3)
    assert seen == [1, 3, 4]


@checked_version_only
@pytest.mark.parametrize("name", IGNITE_PRIVATE_NAMES)
def test_each_private_name_the_loop_relies_on_is_still_on_ignites_engine(name):
    assert hasattr(Engine(echo), name), (
        f"pytorch-ignite {ignite.__version__}'s Engine has no {name}: {RECHECK}")


@checked_version_only
def test_every_private_name_the_loop_shares_with_ignites_engine_is_declared():
    # One it uses but does not declare would go unchecked; one of its own that Ignite now
    # also has would silently replace Ignite's.
    shared = {name for name in private_names_used() if hasattr(Engine(echo), name)}
    undeclared = sorted(shared - set(IGNITE_PRIVATE_NAMES))
    assert not undeclared, (
        f"engine/ignite_loop.py uses {undeclared}, which pytorch-ignite "
        f"{ignite.__version__}'s Engine also has, without declaring them in "
        f"IGNITE_PRIVATE_NAMES: {RECHECK}")


@checked_version_only
def test_ignites_run_goes_through_the_loops_epoch_and_event_methods():
    calls = {"_run_once_on_dataset_legacy": 0, "_fire_event": 0}

    class Counting(FastLoopEngine):
        def _run_once_on_dataset_legacy(self) -> float:
            calls["_run_once_on_dataset_legacy"] += 1
            return super()._run_once_on_dataset_legacy()

        def _fire_event(self, event_name, *args, **kwargs) -> None:
            calls["_fire_event"] += 1
            super()._fire_event(event_name, *args, **kwargs)

    Counting(echo).run([1, 2, 3], max_epochs=1)
    # All four fired by Ignite's run: STARTED, EPOCH_STARTED, EPOCH_COMPLETED, COMPLETED
    # (the iteration's events have no handlers, so the loop fires none).
    assert calls == {"_run_once_on_dataset_legacy": 1, "_fire_event": 4}, (
        f"pytorch-ignite {ignite.__version__}'s Engine.run no longer calls the loop's epoch "
        f"and event methods once an epoch and for each event ({calls}): {RECHECK}")


def test_before_batch_runs_before_each_batch_ahead_of_its_events():
    log = []
    engine = FastLoopEngine(lambda e, batch: log.append(("process", batch)),
                            before_batch=lambda e: log.append(("before", e.state.iteration)))
    engine.add_event_handler(Events.GET_BATCH_STARTED,
                             lambda e: log.append(("get", e.state.iteration)))
    engine.run([7, 8], max_epochs=1)
    assert log == [("before", 0), ("get", 0), ("process", 7), ("before", 1), ("get", 1),
                   ("process", 8)]


def test_before_batch_sees_the_last_event_even_when_it_was_not_fired():
    """Iteration events without handlers are not fired, but ``last_event_name`` records them."""
    seen = []
    engine = FastLoopEngine(echo, before_batch=lambda e: seen.append(e.last_event_name))
    engine.run([7, 8], max_epochs=1)
    assert seen == [Events.EPOCH_STARTED, Events.ITERATION_COMPLETED]
