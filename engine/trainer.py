"""Factories for the training and evaluation engines."""

import logging
import math
import time
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from ignite.engine import Engine, Events
from ignite.engine.engine import _EngineTerminateException, _EngineTerminateSingleEpochException
from ignite.metrics import Metric
from torch import nn

from engine.batch import (
    Forward,
    Predict,
    PrepareBatch,
    move_to_device,
    supervised_forward,
    supervised_predict,
)
from engine.events import EVENT_TO_ATTR, TrainEvents
from engine.nonfinite import NonFiniteGuard
from engine.precision import Precision, resolve_precision
from engine.step import make_train_step
from engine.update_gate import StepVeto, make_gate

# Engine state that a checkpoint must carry besides epoch and iteration.
TRAINER_STATE_KEYS = ("optimizer_step", "skipped_steps", "consecutive_skips")

# The events of every iteration, looked up once: reading ``Events.X`` runs enum code that
# costs about as much as calling a handler (~1000 instructions).
_GET_BATCH_STARTED = Events.GET_BATCH_STARTED
_GET_BATCH_COMPLETED = Events.GET_BATCH_COMPLETED
_ITERATION_STARTED = Events.ITERATION_STARTED
_ITERATION_COMPLETED = Events.ITERATION_COMPLETED
_DATALOADER_STOP_ITERATION = Events.DATALOADER_STOP_ITERATION
_ITERATION_EVENTS = (_GET_BATCH_STARTED, _GET_BATCH_COMPLETED, _ITERATION_STARTED,
                     _ITERATION_COMPLETED)


class Trainer(Engine):
    """An Ignite ``Engine`` that also holds what its step trains with.

    Handlers (checkpointing, telemetry) read ``model``, ``optimizer``,
    ``scaler`` and ``precision`` from here instead of being handed each one.

    A window's step is queued on the device without the host reading its outcome; the
    counters (``optimizer_step``, ``skipped_steps``, ``consecutive_skips``) and the step's
    event (``OPTIMIZER_STEP`` or ``STEP_SKIPPED``) follow as the next micro-batch starts,
    before its ``GET_BATCH_STARTED`` and its forward, or first thing at ``EPOCH_COMPLETED``,
    ``COMPLETED`` and ``TERMINATE``. So ``ITERATION_COMPLETED`` handlers of a window's
    last micro-batch run before its step's event; one that reads the counters or saves
    the run there calls ``settle()`` first.

    It runs Ignite's plain loop (``interrupt_resume_enabled = False``: Ignite's other loop
    is a generator, there so that ``interrupt()`` can pause a run, which this trainer does
    not offer) with its own epoch and event firing, which keep Ignite's events and
    semantics at about a sixth of its per-iteration cost (``_run_once_on_dataset_legacy``).
    """

    interrupt_resume_enabled = False

    def __init__(
        self,
        process_function,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        precision: Precision,
        accum_steps: int,
        max_grad_norm: float | None,
        guard: NonFiniteGuard | None = None,
    ) -> None:
        # Handler lists by event name (see _fire_event); set before Ignite's __init__ runs.
        self._handlers_by_name: dict[str, list] = {}
        self._log_events = False  # whether _fire_event logs each event (at DEBUG)
        # Ignite stores it as the only argument of a handler that takes the engine alone.
        self._weak_self = weakref.ref(self)
        super().__init__(process_function)
        # Read again at every epoch's start: a level set later shows from the next epoch.
        self._log_events = self.logger.isEnabledFor(logging.DEBUG)
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.precision = precision
        self.accum_steps, self.max_grad_norm = accum_steps, max_grad_norm
        self._guard = guard
        self._shortened_epoch: int | None = None  # see skip_batches
        self.register_events(*TrainEvents, event_to_attr=EVENT_TO_ATTR)
        for key in TRAINER_STATE_KEYS:
            setattr(self.state, key, 0)
            self.state_dict_user_keys.append(key)
        self.add_event_handler(Events.STARTED, _start_counters)
        if accum_steps > 1:
            self.add_event_handler(Events.STARTED, _require_epoch_length)
        if guard is None:  # a process function that fires the step events itself
            return
        # Registered before any other handler, so every handler of these events sees the
        # previous step settled; each micro-batch settles it first (_run_once_on_dataset_legacy).
        for event in (Events.EPOCH_COMPLETED, Events.COMPLETED, Events.TERMINATE):
            self.add_event_handler(event, guard.settle)

    def settle(self) -> None:
        """Read the last step's outcome now (the host waits for the device if it must) and
        fire its event; a no-op when nothing is pending."""
        if self._guard is not None:
            self._guard.settle(self)

    def set_step_veto(self, veto: StepVeto | None) -> None:
        """Consult ``veto(window_losses, pre_clip_norm)`` before every optimizer step: a True
        (a bool tensor, decided on the device) keeps the step off the weights and the
        optimizer state like a non-finite one, and it settles as ``STEP_SKIPPED`` then
        ``STEP_VETOED``. ``None`` removes it."""
        if self._guard is None:
            raise ValueError("this trainer's process function fires its own step events: "
                             "it has no update gate to veto")
        self._guard.veto = veto

    def set_lr_scale(self, lr_scale: float) -> None:
        """Multiply every group's LR by ``lr_scale`` inside each optimizer step from now on
        (1.0: as scheduled). The scaled LR exists only during ``optimizer.step()``: handlers,
        schedules and checkpoints see the scheduled one."""
        if self._guard is None:
            raise ValueError("this trainer's process function steps the optimizer itself")
        if isinstance(lr_scale, bool) or not isinstance(lr_scale, int | float) or not (
                0 < lr_scale < math.inf):
            raise ValueError(f"lr_scale must be a finite number > 0, got {lr_scale!r}")
        self._guard.gate.lr_scale = float(lr_scale)

    def skip_batches(self, count: int) -> int:
        """Drop the next ``count`` batches of this epoch, fewer at its end, without training
        on them: ``state.iteration`` moves past them and the data iterator skips them.
        Call it between windows (from a handler of a step's event or of
        ``GET_BATCH_STARTED``); the skip stops at a window's start. Returns how many were
        dropped. Skipping to the epoch's end ends the epoch now (its ``EPOCH_COMPLETED``
        follows); a shorter skip ends it after its last batch instead of asking for more.
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        state = self.state
        if state.epoch_length is None:
            raise ValueError("skip_batches needs a known epoch length")
        position = state.iteration - (state.epoch - 1) * state.epoch_length
        target = -(-(position + count) // self.accum_steps) * self.accum_steps
        dropped = min(target, state.epoch_length) - position
        if dropped == 0:
            return 0
        state.iteration += dropped
        if position + dropped == state.epoch_length:
            self.terminate_epoch()
            return dropped
        for _ in range(dropped):
            next(self._dataloader_iter)
        # Ignite counts the epoch's batches itself and would ask the iterator for the dropped
        # ones again at the end: the epoch ends at its last batch instead.
        self._shortened_epoch = state.epoch
        if not self.has_event_handler(_end_shortened_epoch, Events.ITERATION_COMPLETED):
            self.add_event_handler(Events.ITERATION_COMPLETED, _end_shortened_epoch)
        return dropped

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
        and error handling (``Engine._run_once_on_dataset_legacy`` of pytorch-ignite
        0.5.5), at a sixth of its cost per iteration: the events are module constants
        (reading ``Events.X`` runs enum code), fired only when they have handlers, the
        last event is compared by identity (Ignite's ``!=`` runs two enum property lookups
        in Python), and the termination flags are tested before calling out. Returns the
        epoch's seconds."""
        started = time.time()
        state = self.state
        count = self._init_iter or 0  # the epoch's batches run so far (> 0 when resumed)
        self._init_iter = None
        with_data = state.dataloader is not None  # run(data=None) fires no batch events
        restarted = False  # the data iterator ran dry and was set up again
        guard = self._guard
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
                if guard is not None:  # the last window's step, before the next batch's events
                    guard.settle(self)
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


def _end_shortened_epoch(trainer: Trainer) -> None:
    """Ends an epoch that ``skip_batches`` shortened at its last batch. (Ending an epoch
    whose count Ignite has right is harmless: its iterator is spent there too.)"""
    state = trainer.state
    if state.epoch == trainer._shortened_epoch and state.iteration % state.epoch_length == 0:
        trainer._shortened_epoch = None
        trainer.terminate_epoch()


def _start_counters(engine: Engine) -> None:
    """A run from scratch (Ignite reset iteration to 0) restarts the step counters too;
    a resumed one (iteration > 0 after load_state_dict) keeps them."""
    if engine.state.iteration == 0:
        for key in TRAINER_STATE_KEYS:
            setattr(engine.state, key, 0)


def _require_epoch_length(engine: Engine) -> None:
    if engine.state.epoch_length is None:
        raise ValueError(
            "accum_steps > 1 needs a known epoch length to close each epoch's last window: "
            "pass a sized loader or run(..., epoch_length=N)"
        )


def create_trainer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn=None,
    *,
    device: str | torch.device = "cpu",
    precision: str = "fp32",
    accum_steps: int = 1,
    max_grad_norm: float | None = None,
    non_finite: str = "skip",
    max_consecutive_skips: int = 3,
    prepare_batch: PrepareBatch = move_to_device,
    forward: Forward | None = None,
    compile: bool = False,
) -> Trainer:
    """Build the training engine.

    Batches are ``(x, y)`` and the loss is ``loss_fn(model(x), y)`` unless
    ``forward(model, batch) -> loss`` is given. ``max_grad_norm=None`` measures
    the gradient norm without clipping. The model is moved to the device; build the
    optimizer before or after, its parameters are the same tensors.

    ``compile=True`` compiles the model's forward in place (``nn.Module.compile``, so an
    evaluator on the same model runs it compiled too): the module, its parameters and its
    ``state_dict`` keys stay the same objects and names, so checkpoints move freely between
    compiled and eager runs. Compiled numerics differ from eager in the last bits.
    """
    resolved = resolve_precision(precision, device)
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"accum_steps must be an int >= 1, got {accum_steps!r}")
    if max_grad_norm is not None and (
        isinstance(max_grad_norm, bool)
        or not isinstance(max_grad_norm, int | float)
        or not max_grad_norm > 0
        or max_grad_norm == float("inf")
    ):
        raise ValueError(
            f"max_grad_norm must be a finite number > 0 or None, got {max_grad_norm!r}"
        )
    if not isinstance(compile, bool):
        raise ValueError(f"compile must be True or False, got {compile!r}")
    if forward is None:
        if loss_fn is None:
            raise ValueError("loss_fn is required unless forward(model, batch) -> loss is given")
        forward = supervised_forward(loss_fn)
    names = {p: name for name, p in getattr(model, "module", model).named_parameters()}
    guard = NonFiniteGuard(
        make_gate(optimizer, resolved.device), names, non_finite, max_consecutive_skips
    )
    model.to(resolved.device)
    if compile:
        model.compile()
    scaler = resolved.make_scaler()
    step = make_train_step(
        model, optimizer, scaler, resolved, forward, prepare_batch,
        accum_steps, max_grad_norm, guard,
    )
    return Trainer(step, model, optimizer, scaler, resolved, accum_steps, max_grad_norm, guard)


def create_evaluator(
    model: nn.Module,
    metrics: Mapping[str, Metric],
    *,
    device: str | torch.device = "cpu",
    precision: str = "fp32",
    prepare_batch: PrepareBatch = move_to_device,
    predict: Predict = supervised_predict,
) -> Engine:
    """Build an evaluation engine: ``model.eval()``, ``torch.inference_mode()``, the
    trainer's autocast, and ``ignite.metrics`` fed ``(y_pred, y)`` from ``predict``."""
    resolved = resolve_precision(precision, device)
    model.to(resolved.device)

    def eval_step(engine: Engine, batch) -> tuple[torch.Tensor, torch.Tensor]:
        model.eval()
        with torch.inference_mode(), resolved.autocast():
            return predict(model, prepare_batch(batch, resolved.device, True))

    evaluator = Engine(eval_step)
    for name, metric in metrics.items():
        metric.attach(evaluator, name)
    return evaluator
