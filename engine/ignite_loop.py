"""The trainer's epoch loop: Ignite's plain loop and event firing rewritten for speed on
Ignite's private API where that was checked, Ignite's own loop everywhere else.

``FastLoopEngine`` is an Ignite ``Engine`` that keeps Ignite's events, their order, the
state handlers see, data-iterator restarts, termination and error handling, at about a
sixth of Ignite's cost per iteration (``tests/engine/test_trainer_loop.py`` compares the
two event by event). It overrides two of ``Engine``'s private methods and calls into
others, so it follows one Ignite version's code: it was written against and checked with
pytorch-ignite 0.5.5 (``CHECKED_IGNITE_VERSIONS``). ``setup.cfg`` allows a range of
Ignite versions: on any other, or with ``ENGINE_LOOP=ignite`` in the environment (to rule
the fast loop out when a run behaves oddly), the trainer runs on ``IgniteLoopEngine``,
Ignite's own loop: ~40 µs more an iteration, under 0.5% of a GPU step at the recipes'
sizes, and the same events (the loop tests run on it too).

What it relies on in ``ignite/engine/engine.py`` (``IGNITE_PRIVATE_NAMES``):

- ``Engine._internal_run`` runs ``_internal_run_legacy`` when ``interrupt_resume_enabled``
  is False, and that calls ``_run_once_on_dataset_legacy`` once an epoch and
  ``_fire_event`` for every event: the two methods overridden here.
- The overrides follow ``Engine._run_once_on_dataset_legacy`` and ``Engine._fire_event``
  line by line, calling ``_maybe_terminate_legacy``, ``_setup_dataloader_iter``,
  ``_handle_exception`` and ``_is_done``, and reading or writing ``_event_handlers``,
  ``_init_iter``, ``_dataloader_iter`` and ``_process_function``.
- The module-level exceptions ``_EngineTerminateException`` and
  ``_EngineTerminateSingleEpochException``, which carry ``terminate()`` and
  ``terminate_epoch()`` out of the epoch.
- ``_event_handlers`` matches an event by its name (Ignite's events are equal when their
  names are), and ``remove_event_handler`` replaces an event's list with a new one.

Before adding a version to ``CHECKED_IGNITE_VERSIONS``, compare those methods of the new
version with the ones here (``tests/engine/test_ignite_loop.py`` fails until then).
"""

import logging
import math
import os
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import ignite
from ignite.engine import Engine, Events
from ignite.engine.engine import _EngineTerminateException, _EngineTerminateSingleEpochException

# The pytorch-ignite versions whose Engine this module was compared with, line by line.
CHECKED_IGNITE_VERSIONS = ("0.5.5",)
LOOP_VARIABLE = "ENGINE_LOOP"  # "ignite": Ignite's own loop even on a checked version

# Ignite's private Engine names this module overrides, calls or reads (see the docstring).
IGNITE_PRIVATE_NAMES = (
    "_internal_run",
    "_internal_run_legacy",
    "_run_once_on_dataset_legacy",
    "_fire_event",
    "_maybe_terminate_legacy",
    "_setup_dataloader_iter",
    "_handle_exception",
    "_is_done",
    "_event_handlers",
    "_init_iter",
    "_dataloader_iter",
    "_process_function",
)

# The events of every iteration, looked up once: reading ``Events.X`` runs enum code that
# costs about as much as calling a handler (~1000 instructions).
_GET_BATCH_STARTED = Events.GET_BATCH_STARTED
_GET_BATCH_COMPLETED = Events.GET_BATCH_COMPLETED
_ITERATION_STARTED = Events.ITERATION_STARTED
_ITERATION_COMPLETED = Events.ITERATION_COMPLETED
_DATALOADER_STOP_ITERATION = Events.DATALOADER_STOP_ITERATION
_ITERATION_EVENTS = (_GET_BATCH_STARTED, _GET_BATCH_COMPLETED, _ITERATION_STARTED,
                     _ITERATION_COMPLETED)


class FastLoopEngine(Engine):
    """An Ignite ``Engine`` with its own epoch loop and event firing (see the module).

    It runs Ignite's plain loop (``interrupt_resume_enabled = False``: Ignite's other loop
    is a generator, there so that ``interrupt()`` can pause a run, which this engine does
    not offer). ``before_batch(engine)``, when given, runs before each batch is fetched,
    ahead of its ``GET_BATCH_STARTED``.
    """

    interrupt_resume_enabled = False

    def __init__(self, process_function: Callable[[Engine, Any], Any],
                 before_batch: Callable[[Engine], None] | None = None) -> None:
        # Handler lists by event name (see _fire_event); set before Ignite's __init__ runs.
        self._handlers_by_name: dict[str, list] = {}
        self._log_events = False  # whether _fire_event logs each event (at DEBUG)
        # Ignite stores it as the only argument of a handler that takes the engine alone.
        self._weak_self = weakref.ref(self)
        super().__init__(process_function)
        # Read again at every epoch's start: a level set later shows from the next epoch.
        self._log_events = self.logger.isEnabledFor(logging.DEBUG)
        self._before_batch = before_batch

    def _drop_batches(self, count: int) -> None:
        """Take ``count`` batches from this epoch's data iterator without running them."""
        for _ in range(count):
            next(self._dataloader_iter)

    def _fire_event(self, event_name: Any, *event_args: Any, **event_kwargs: Any) -> None:
        # Ignite's own looks the handlers up by the event, whose hash is Python code, and
        # formats a debug message for every event, logged or not: together ~2000
        # instructions an event, several events an iteration. The same loop over the same
        # lists, found by the event's name (Ignite's events are equal when their names are),
        # and a handler of the engine alone, the usual kind, called in one test: its
        # arguments are this engine's weak reference, which CPython hands out once and
        # again to every ``weakref.ref(self)`` while one lives (this engine keeps one).
        handlers = self._handlers_by_name.get(
            event_name if isinstance(event_name, str) else event_name._name_)  # _name_of
        if handlers is None:
            handlers = self._handlers(event_name)
        if self._log_events:
            self.logger.debug(f"{self.state.epoch} | {self.state.iteration}, "
                              f"Firing handlers for event {event_name}")
        self.last_event_name = event_name
        if event_args or event_kwargs:
            for func, args, kwargs in handlers:
                self._call_handler(func, args, kwargs, event_args, event_kwargs)
            return
        me = self._weak_self
        for func, args, kwargs in handlers:
            if len(args) == 1 and args[0] is me and not kwargs:
                func(self)
            else:
                self._call_handler(func, args, kwargs, (), {})

    def _call_handler(self, func: Any, args: tuple, kwargs: dict, event_args: tuple,
                      event_kwargs: dict) -> None:
        """One handler as Ignite's ``_fire_event`` calls it."""
        if event_kwargs:
            kwargs.update(event_kwargs)
        if args and isinstance(args[0], weakref.ref):
            engine = args[0]()
            if engine is None:
                raise RuntimeError("Engine reference not resolved: cannot run the handler")
            func(engine, *event_args, *args[1:], **kwargs)
        else:
            func(*event_args, *args, **kwargs)

    def _handlers(self, event_name: Any) -> list:
        """The event's handler list (Ignite's own list object), now kept by name."""
        handlers = self._handlers_by_name[_name_of(event_name)] = self._event_handlers[event_name]
        return handlers

    def remove_event_handler(self, handler: Any, event_name: Any) -> None:
        super().remove_event_handler(handler, event_name)
        self._handlers(event_name)  # Ignite replaced the event's list with a new one

    def _run_once_on_dataset_legacy(self) -> float:
        """One epoch, with Ignite's events, counters, data-iterator restarts, termination
        and error handling (``Engine._run_once_on_dataset_legacy``), at a sixth of its cost
        per iteration: the events are module constants (reading ``Events.X`` runs enum
        code), fired only when they have handlers, the last event is compared by identity
        (Ignite's ``!=`` runs two enum property lookups in Python), and the termination
        flags are tested before calling out. Returns the epoch's seconds."""
        started = time.time()
        state = self.state
        count = self._init_iter or 0  # the epoch's batches run so far (> 0 when resumed)
        self._init_iter = None
        with_data = state.dataloader is not None  # run(data=None) fires no batch events
        restarted = False  # the data iterator ran dry and was set up again
        before_batch = self._before_batch
        self._log_events = self.logger.isEnabledFor(logging.DEBUG)
        # The iteration's events are fired only when they have a handler (or events are
        # logged); else ``last_event_name`` records them as a fire would: most have none,
        # and a fire costs ~2000 instructions. Handlers added later join these lists, and
        # a removal puts the event's new list here (see remove_event_handler).
        for event in _ITERATION_EVENTS:
            self._handlers(event)
        by_name, log = self._handlers_by_name, self._log_events
        try:
            while True:
                state.batch = None
                if before_batch is not None:
                    before_batch(self)
                try:
                    if with_data and self.last_event_name is not _DATALOADER_STOP_ITERATION:
                        if log or by_name["GET_BATCH_STARTED"]:
                            self._fire_event(_GET_BATCH_STARTED)
                        else:
                            self.last_event_name = _GET_BATCH_STARTED
                        if self.should_terminate or self.should_terminate_single_epoch:
                            self._maybe_terminate_legacy()
                    state.batch = next(self._dataloader_iter)
                    state.output = None  # not the previous batch's, should this one fail
                    if with_data:
                        if log or by_name["GET_BATCH_COMPLETED"]:
                            self._fire_event(_GET_BATCH_COMPLETED)
                        else:
                            self.last_event_name = _GET_BATCH_COMPLETED
                        if self.should_terminate or self.should_terminate_single_epoch:
                            self._maybe_terminate_legacy()
                    count += 1
                    restarted = False
                except StopIteration:
                    if self._data_ran_dry(count, restarted, with_data):
                        break
                    restarted = True
                    continue
                state.iteration += 1
                if log or by_name["ITERATION_STARTED"]:
                    self._fire_event(_ITERATION_STARTED)
                else:
                    self.last_event_name = _ITERATION_STARTED
                if self.should_terminate or self.should_terminate_single_epoch:
                    self._maybe_terminate_legacy()
                state.output = self._process_function(self, state.batch)
                if log or by_name["ITERATION_COMPLETED"]:
                    self._fire_event(_ITERATION_COMPLETED)
                else:
                    self.last_event_name = _ITERATION_COMPLETED
                if self.should_terminate or self.should_terminate_single_epoch:
                    self._maybe_terminate_legacy()
                if count == state.epoch_length:
                    break
                if state.max_iters is not None and state.iteration == state.max_iters:
                    self.should_terminate = True
                    raise _EngineTerminateException()
        except _EngineTerminateSingleEpochException:
            self._fire_event(Events.TERMINATE_SINGLE_EPOCH, iter_counter=count)
            self._setup_dataloader_iter()
        except _EngineTerminateException:
            raise  # ends the run: Ignite's run loop handles it
        except Exception as error:
            self.logger.error(f"Current run is terminating due to exception: {error}")
            self._handle_exception(error)
        return time.time() - started

    def _data_ran_dry(self, count: int, restarted: bool, with_data: bool) -> bool:
        """The data iterator is exhausted after ``count`` batches of this epoch: whether the
        epoch ends here (True), or the iterator was set up again to go on (False)."""
        state = self.state
        if state.epoch_length is None:  # the first pass over data of unknown length
            state.epoch_length = count
            if state.max_iters is not None:
                state.max_epochs = math.ceil(state.max_iters / count)
            return True
        if restarted:  # a fresh iterator that gives nothing
            if not self._is_done(state):
                total = (state.epoch_length * state.max_epochs if state.max_epochs is not None
                         else state.max_iters)
                warnings.warn("Data iterator can not provide data anymore but required total "
                              "number of iterations to run is not reached. Current iteration: "
                              f"{state.iteration} vs Total iterations to run : {total}",
                              stacklevel=2)
            return True
        if with_data:
            self._fire_event(_DATALOADER_STOP_ITERATION)
            if self.should_terminate or self.should_terminate_single_epoch:
                self._maybe_terminate_legacy()
        self._setup_dataloader_iter()
        return False


def _name_of(event_name: Any) -> str:
    """The key Ignite's handler table matches an event by: its name (a str event is one)."""
    return event_name if isinstance(event_name, str) else event_name._name_


class IgniteLoopEngine(Engine):
    """Ignite's own ``Engine`` loop with what ``Trainer`` asks of its base: ``before_batch``
    runs as the first ``GET_BATCH_STARTED`` handler (every handler added later runs after
    it), and ``_drop_batches`` takes batches from Ignite's data iterator, the one private
    name it reads (``_dataloader_iter``, there since Ignite 0.4; a test checks it)."""

    def __init__(self, process_function: Callable[[Engine, Any], Any],
                 before_batch: Callable[[Engine], None] | None = None) -> None:
        super().__init__(process_function)
        if before_batch is not None:
            self.add_event_handler(Events.GET_BATCH_STARTED, before_batch)

    def _drop_batches(self, count: int) -> None:
        for _ in range(count):
            next(self._dataloader_iter)


def trainer_loop() -> type[Engine]:
    """The loop ``Trainer`` runs on: the fast one on a checked Ignite version, unless
    ``ENGINE_LOOP=ignite`` asks for Ignite's own."""
    fast = (ignite.__version__ in CHECKED_IGNITE_VERSIONS
            and os.environ.get(LOOP_VARIABLE, "") != "ignite")
    return FastLoopEngine if fast else IgniteLoopEngine
