"""The training engine (``Trainer``) and the factories for it and for evaluation."""

import math
from collections.abc import Mapping

import torch
from ignite.engine import Engine, Events
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
from engine.compiled_step import CompiledUpdate, compile_mode, graph_breaks, report_graph_breaks
from engine.events import EVENT_TO_ATTR, TrainEvents
from engine.ignite_loop import trainer_loop
from engine.nonfinite import NonFiniteGuard
from engine.precision import Precision, resolve_precision
from engine.step import make_train_step
from engine.update_gate import StepVeto, make_gate

# Engine state that a checkpoint must carry besides epoch and iteration.
TRAINER_STATE_KEYS = ("optimizer_step", "skipped_steps", "consecutive_skips")


class Trainer(trainer_loop()):
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

    Its epoch loop and event firing are ``FastLoopEngine``'s (``engine/ignite_loop.py``):
    Ignite's events and semantics at about a sixth of Ignite's per-iteration cost; Ignite's
    own loop on an Ignite version that loop was not checked against.
    """

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
        # Each micro-batch settles the previous window's step before its own events.
        super().__init__(process_function, None if guard is None else guard.settle)
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
        # previous step settled; each micro-batch settles it first (before_batch above).
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
        self._drop_batches(dropped)
        # Ignite counts the epoch's batches itself and would ask the iterator for the dropped
        # ones again at the end: the epoch ends at its last batch instead.
        self._shortened_epoch = state.epoch
        if not self.has_event_handler(_end_shortened_epoch, Events.ITERATION_COMPLETED):
            self.add_event_handler(Events.ITERATION_COMPLETED, _end_shortened_epoch)
        return dropped


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
    cuda_graphs: bool = False,
) -> Trainer:
    """Build the training engine.

    Batches are ``(x, y)`` and the loss is ``loss_fn(model(x), y)`` unless
    ``forward(model, batch) -> loss`` is given. ``max_grad_norm=None`` measures
    the gradient norm without clipping. The model is moved to the device; build the
    optimizer before or after, its parameters are the same tensors.

    ``compile=True`` compiles the model's forward in place (``nn.Module.compile``, so an
    evaluator on the same model runs it compiled too): the module, its parameters and its
    ``state_dict`` keys stay the same objects and names, so checkpoints move freely between
    compiled and eager runs. Compiled numerics differ from eager in the last bits. The
    optimizer's step is compiled too, with each group's LR handed to it as a tensor
    (``engine.compiled_step``), so no schedule compiles it again. ``cuda_graphs=True`` (with
    ``compile``, on CUDA) compiles both in ``reduce-overhead`` mode: replayed CUDA graphs.
    At the first epoch's end, if dynamo could not compile part of the step (a graph break),
    one warning line says how often and why.
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
    if not isinstance(cuda_graphs, bool):
        raise ValueError(f"cuda_graphs must be True or False, got {cuda_graphs!r}")
    if cuda_graphs and not (compile and resolved.device.type == "cuda"):
        raise ValueError("cuda_graphs=True needs compile=True and a CUDA device, got "
                         f"compile={compile!r} on {resolved.device.type!r}")
    if forward is None:
        if loss_fn is None:
            raise ValueError("loss_fn is required unless forward(model, batch) -> loss is given")
        forward = supervised_forward(loss_fn)
    names = {p: name for name, p in getattr(model, "module", model).named_parameters()}
    guard = NonFiniteGuard(
        make_gate(optimizer, resolved.device), names, non_finite, max_consecutive_skips
    )
    model.to(resolved.device)
    breaks_before = graph_breaks()
    if compile:
        model.compile(mode=compile_mode(cuda_graphs))
        guard.gate.step = CompiledUpdate(optimizer, resolved.device, cuda_graphs)
    scaler = resolved.make_scaler()
    step = make_train_step(
        model, optimizer, scaler, resolved, forward, prepare_batch,
        accum_steps, max_grad_norm, guard,
    )
    trainer = Trainer(step, model, optimizer, scaler, resolved, accum_steps, max_grad_norm,
                      guard)
    if compile:
        trainer.add_event_handler(Events.EPOCH_COMPLETED(once=1),
                                  lambda _: report_graph_breaks(breaks_before))
    return trainer


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
