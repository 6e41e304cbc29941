"""The trainer's own epoch loop against Ignite's: the same events, in the same order, with
the same state, in every way an epoch can start, run dry, end and fail."""

import functools
import logging
import time
import warnings

import pytest
import torch
from ignite.engine import Engine, Events
from torch import nn

from engine.precision import resolve_precision
from engine.trainer import Trainer

# Every event Ignite fires, in no particular order.
ALL_EVENTS = (
    Events.STARTED, Events.EPOCH_STARTED, Events.GET_BATCH_STARTED, Events.GET_BATCH_COMPLETED,
    Events.DATALOADER_STOP_ITERATION, Events.ITERATION_STARTED, Events.ITERATION_COMPLETED,
    Events.TERMINATE_SINGLE_EPOCH, Events.EPOCH_COMPLETED, Events.TERMINATE, Events.COMPLETED,
    Events.EXCEPTION_RAISED,
)


class Unsized:
    """An iterable without ``__len__``, like a streaming dataset."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __iter__(self):
        return iter(self.items)


def bare_trainer(process_function) -> Trainer:
    """A trainer with a caller's process function and no update gate: the loop alone."""
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return Trainer(process_function, model, optimizer, torch.amp.GradScaler("cpu", enabled=False),
                   resolve_precision("fp32", "cpu"), 1, None, guard=None)


def echo(engine: Engine, batch):
    if batch == "boom":
        raise ValueError("boom")
    return batch


def record(engine: Engine, log: list, action=None) -> None:
    """Log every event with the state handlers see; ``action(engine, event)`` runs after."""
    for event in ALL_EVENTS:
        def handler(engine, *args, event=event):
            state = engine.state
            log.append((event.name, state.epoch, state.iteration, state.batch, state.output,
                        state.epoch_length, state.max_epochs, tuple(map(repr, args))))
            if action is not None:
                action(engine, event)
        engine.add_event_handler(event, handler)


def call_at(event, iteration: int, method: str):
    def action(engine, fired):
        if fired == event and engine.state.iteration == iteration:
            getattr(engine, method)()
    return action


SCENARIOS = {
    "two epochs": (lambda: [1, 2, 3], {"max_epochs": 2}, None),
    "epoch shorter than the data": (lambda: list(range(5)), {"epoch_length": 3, "max_epochs": 3},
                                    None),
    "data runs dry mid-epoch": (lambda: list(range(5)), {"epoch_length": 7, "max_epochs": 2}, None),
    "data runs dry twice an epoch": (lambda: [1, 2], {"epoch_length": 5, "max_epochs": 2}, None),
    "unsized": (lambda: Unsized([1, 2, 3]), {"max_epochs": 2}, None),
    "unsized, epoch length given": (lambda: Unsized([1, 2, 3]),
                                    {"epoch_length": 2, "max_epochs": 3}, None),
    "one-pass iterator runs out": (lambda: iter(range(5)), {"epoch_length": 3, "max_epochs": 3},
                                   None),
    # Ignite warns only when the run is not done: in the last epoch it is (epoch == max_epochs).
    "one-pass iterator runs out in the last epoch": (lambda: iter(range(5)),
                                                     {"epoch_length": 3, "max_epochs": 2}, None),
    # max_epochs stays None under max_iters; Ignite would run empty epochs forever after.
    "one-pass iterator runs out before max_iters": (
        lambda: iter(range(5)), {"epoch_length": 3, "max_iters": 8},
        call_at(Events.EPOCH_COMPLETED, 5, "terminate")),
    # The first pass sets epoch_length, and max_epochs from max_iters.
    "unsized, max_iters": (lambda: Unsized([1, 2, 3]), {"max_iters": 5}, None),
    "no data": (lambda: None, {"epoch_length": 3, "max_epochs": 2}, None),
    "max_iters": (lambda: [1, 2, 3], {"max_iters": 7}, None),
    "terminate at ITERATION_COMPLETED": (lambda: [1, 2, 3], {"max_epochs": 3},
                                         call_at(Events.ITERATION_COMPLETED, 4, "terminate")),
    "terminate at GET_BATCH_STARTED": (lambda: [1, 2, 3], {"max_epochs": 3},
                                       call_at(Events.GET_BATCH_STARTED, 4, "terminate")),
    "terminate at GET_BATCH_COMPLETED": (lambda: [1, 2, 3], {"max_epochs": 3},
                                         call_at(Events.GET_BATCH_COMPLETED, 4, "terminate")),
    "terminate at ITERATION_STARTED": (lambda: [1, 2, 3], {"max_epochs": 3},
                                       call_at(Events.ITERATION_STARTED, 5, "terminate")),
    "terminate_epoch at ITERATION_COMPLETED": (
        lambda: [1, 2, 3], {"max_epochs": 2},
        call_at(Events.ITERATION_COMPLETED, 2, "terminate_epoch")),
    "terminate_epoch at GET_BATCH_STARTED": (
        lambda: [1, 2, 3], {"max_epochs": 2},
        call_at(Events.GET_BATCH_STARTED, 4, "terminate_epoch")),
    "terminate at DATALOADER_STOP_ITERATION": (
        lambda: [1, 2], {"epoch_length": 3, "max_epochs": 2},
        call_at(Events.DATALOADER_STOP_ITERATION, 2, "terminate")),
    "error handled by EXCEPTION_RAISED": (lambda: [1, "boom", 3], {"max_epochs": 1}, None),
}


def run_both(make_data, run_kwargs, action, state=None):
    """(Ignite's log, the trainer's log), each with the run's outcome last."""
    logs = []
    for engine in (Engine(echo), bare_trainer(echo)):
        log: list = []
        record(engine, log, action)
        if state is not None:  # the trainer's step counters besides Ignite's own keys
            engine.load_state_dict({**state, **{key: 0 for key in engine.state_dict_user_keys}})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.run(make_data(), **run_kwargs)
        log.append(("warnings", [str(w.message) for w in caught]))
        log.append(("end", engine.state.epoch, engine.state.iteration, engine.state.epoch_length))
        logs.append(log)
    return logs


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_trainer_fires_what_ignite_fires(scenario):
    ignite_log, trainer_log = run_both(*SCENARIOS[scenario])
    assert any(entry[0] == "ITERATION_COMPLETED" for entry in ignite_log)
    assert trainer_log == ignite_log


def test_a_resumed_epoch_starts_where_it_stopped_as_in_ignite():
    state = {"iteration": 4, "epoch_length": 3, "max_epochs": 3}
    ignite_log, trainer_log = run_both(lambda: [1, 2, 3], {"max_epochs": 3}, None, state)
    assert ignite_log[0][:3] == ("STARTED", 1, 4)
    assert trainer_log == ignite_log


def test_a_state_loaded_mid_epoch_after_a_run_resumes_at_its_position_as_in_ignite():
    logs = []
    for engine in (Engine(echo), bare_trainer(echo)):
        engine.run([1, 2, 3], max_epochs=1)  # the loaded state is not the engine's first
        log: list = []
        record(engine, log)
        engine.load_state_dict({"iteration": 4, "epoch_length": 3, "max_epochs": 3,
                                **{key: 0 for key in engine.state_dict_user_keys}})
        engine.run([1, 2, 3])
        logs.append(log)
    ignite_log, trainer_log = logs
    # Epoch 2 runs its last two iterations (5, 6), epoch 3 all three.
    assert [entry[1:3] for entry in ignite_log if entry[0] == "ITERATION_COMPLETED"] == [
        (2, 5), (2, 6), (3, 7), (3, 8), (3, 9)]
    assert trainer_log == ignite_log


def test_an_error_without_an_exception_handler_propagates_as_in_ignite():
    for engine in (Engine(echo), bare_trainer(echo)):
        with pytest.raises(ValueError, match="boom"):
            engine.run([1, "boom", 3])
        assert engine.state.iteration == 2


def test_handlers_added_or_removed_mid_run_take_effect_at_once():
    trainer = bare_trainer(echo)
    seen = []

    def late(engine):
        seen.append(("late", engine.state.iteration))

    def early(engine):
        seen.append(("early", engine.state.iteration))
        if engine.state.iteration == 2:
            engine.remove_event_handler(early, Events.ITERATION_COMPLETED)
            engine.add_event_handler(Events.ITERATION_COMPLETED, late)

    trainer.add_event_handler(Events.ITERATION_COMPLETED, early)
    trainer.run([1, 2, 3, 4])
    assert seen == [("early", 1), ("early", 2), ("late", 3), ("late", 4)]


def test_events_registered_as_strings_fire_by_name():
    trainer = bare_trainer(echo)
    trainer.register_events("custom_event")
    seen = []
    trainer.add_event_handler("custom_event", lambda engine: seen.append(engine.state.iteration))
    trainer.add_event_handler(Events.ITERATION_COMPLETED,
                              lambda engine: engine.fire_event("custom_event"))
    trainer.run([1, 2])
    assert seen == [1, 2]


def calls_of_every_handler_signature(engine: Engine) -> list:
    log = []
    on = functools.partial(engine.add_event_handler, Events.ITERATION_COMPLETED)
    on(lambda e: log.append(("engine", e is engine)))
    on(lambda e, a, b=0: log.append(("engine and arguments", e is engine, a, b)), 1, b=2)
    on(lambda: log.append(("nothing",)))
    on(lambda a: log.append(("arguments only", a)), 5)
    engine.run([1, 2], max_epochs=1)
    return log


def test_handlers_of_every_signature_are_called_as_ignite_calls_them():
    ours = calls_of_every_handler_signature(bare_trainer(echo))
    assert ours == calls_of_every_handler_signature(Engine(echo))
    assert ours[:4] == [("engine", True), ("engine and arguments", True, 1, 2), ("nothing",),
                        ("arguments only", 5)]


def calls_when_handlers_change_while_running(engine: Engine) -> list:
    """A handler that adds another to its own event once, and one replaced in Ignite's list
    in place between iterations (as Ignite's ``BasicTimeProfiler`` wraps handlers)."""
    log = []

    def added(e):
        log.append(("added", e.state.iteration))

    def adder(e):
        log.append(("adder", e.state.iteration))
        if e.state.iteration == 1:
            e.add_event_handler(Events.ITERATION_COMPLETED, added)

    def original(e):
        log.append(("original", e.state.iteration))

    def replacement(e):
        log.append(("replacement", e.state.iteration))

    def replace(e):
        if e.state.iteration == 3:  # after the list's last change in length
            entries = e._event_handlers[Events.ITERATION_COMPLETED]
            index = next(i for i, (f, _, _) in enumerate(entries) if f is original)
            entries[index] = (replacement, *entries[index][1:])

    engine.add_event_handler(Events.ITERATION_COMPLETED, adder)
    engine.add_event_handler(Events.ITERATION_COMPLETED, original)
    engine.add_event_handler(Events.ITERATION_STARTED, replace)
    engine.run([1, 2, 3], max_epochs=1)
    return log


def test_handlers_added_while_their_event_fires_or_replaced_in_place_run_as_in_ignite():
    ours = calls_when_handlers_change_while_running(bare_trainer(echo))
    assert ours == calls_when_handlers_change_while_running(Engine(echo))
    assert ours == [("adder", 1), ("original", 1), ("added", 1), ("adder", 2),
                    ("original", 2), ("added", 2), ("adder", 3), ("replacement", 3),
                    ("added", 3)]


def test_a_handler_without_the_engine_gets_the_events_arguments_then_its_own_as_in_ignite():
    """A handler that takes no engine is called with the event's arguments (the exception of
    ``EXCEPTION_RAISED``), then the ones it was added with, as Ignite calls it."""
    def arguments_seen(engine: Engine) -> list:
        seen = []
        engine.add_event_handler(
            Events.EXCEPTION_RAISED,
            lambda error, label, *, where: seen.append((repr(error), label, where)),
            "label", where="here")
        engine.run(["boom"], max_epochs=1)
        return seen

    ours = arguments_seen(bare_trainer(echo))
    assert ours == arguments_seen(Engine(echo))
    assert ours == [("ValueError('boom')", "label", "here")]


def failing_data():
    yield 1
    raise RuntimeError("the data broke")


def test_the_last_event_and_the_error_log_around_a_failure_are_ignites(caplog):
    """Events without handlers are not fired, but ``last_event_name`` records them as
    Ignite's fire does: the process function sees ITERATION_STARTED, a failed fetch leaves
    GET_BATCH_STARTED, a failed step ITERATION_STARTED."""
    outcomes = []
    for make in (Engine, bare_trainer):
        seen = []
        make(lambda e, batch, seen=seen: seen.append(e.last_event_name)).run([1, 2])
        engine = make(echo)
        caplog.clear()
        with pytest.raises(RuntimeError, match="the data broke"):
            engine.run(failing_data(), max_epochs=1, epoch_length=2)
        after_fetch = engine.last_event_name, [r.getMessage() for r in caplog.records][:1]
        engine = make(echo)
        with pytest.raises(ValueError, match="boom"):
            engine.run(["boom"], max_epochs=1)
        outcomes.append((seen, after_fetch, engine.last_event_name))
    assert outcomes[0] == (
        [Events.ITERATION_STARTED, Events.ITERATION_STARTED],
        (Events.GET_BATCH_STARTED, ["Current run is terminating due to exception: the data broke"]),
        Events.ITERATION_STARTED,
    )
    assert outcomes[1] == outcomes[0]


def test_events_are_logged_at_debug_as_ignite_logs_them(caplog):
    """A DEBUG level set before the engine is built logs every event, the run's first ones
    and those of its iterations (which have no handlers here)."""
    caplog.set_level(logging.DEBUG, logger="ignite.engine.engine")
    logs = []
    for engine in (Engine(echo), bare_trainer(echo)):
        caplog.clear()
        engine.run([1, 2], max_epochs=1)
        logs.append([r.getMessage() for r in caplog.records if "Firing handlers" in r.getMessage()])
    assert logs[0][:2] == ["0 | 0, Firing handlers for event Events.STARTED",
                           "1 | 0, Firing handlers for event Events.EPOCH_STARTED"]
    assert "1 | 1, Firing handlers for event Events.ITERATION_COMPLETED" in logs[0]
    assert logs[1] == logs[0]


def test_max_iters_terminates_and_an_ended_epoch_passes_its_count_as_in_ignite():
    outcomes = []
    for engine in (Engine(echo), bare_trainer(echo)):
        seen: list = []
        engine.add_event_handler(Events.TERMINATE,
                                 lambda e, seen=seen: seen.append(e.should_terminate))
        engine.add_event_handler(Events.ITERATION_COMPLETED(once=2),
                                 lambda e: e.terminate_epoch())
        engine.add_event_handler(Events.TERMINATE_SINGLE_EPOCH,
                                 lambda e, iter_counter, seen=seen: seen.append(iter_counter))
        engine.run([1, 2, 3], max_iters=4)  # ends inside epoch 2
        outcomes.append(seen)
    assert outcomes[0] == [2, True]
    assert outcomes[1] == outcomes[0]


def test_an_epochs_time_is_within_the_runs_wall_time():
    trainer = bare_trainer(echo)
    started = time.time()
    trainer.run([1, 2], max_epochs=1)
    assert 0 <= trainer.state.times["EPOCH_COMPLETED"] <= time.time() - started
