"""Gradient telemetry: per-interval statistics of the step's norms, read from the device once."""

import logging
import statistics
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from ignite.engine import Engine, Events
from torch.utils.hooks import RemovableHandle

from engine.events import TrainEvents
from engine.gradients import CLIP_EPS
from engine.sharding import local_shards, shard_group, whole_norms
from engine.trainer import Trainer
from handlers.arguments import check_int

logger = logging.getLogger(__name__)

# A median pre-clip norm above this multiple of max_grad_norm means clipping does the job of a
# smaller learning rate; said only after this many steps: the first steps' norms are an
# untrained model's, large whatever the learning rate (a 3-step try is no evidence).
FAR_ABOVE_CLIP = 5.0
STEPS_BEFORE_HINT = 20


@dataclass(frozen=True)
class TelemetryReport:
    """One interval's numbers, all plain Python values.

    ``top_layer_norms`` (the k largest per-parameter gradient norms, by name) and
    ``grad_norms`` (every pre-clip norm since the previous such report, for a
    histogram) are filled only on the ``layer_every`` cadence, else empty.
    """

    step: int
    stats: dict[str, float]
    top_layer_norms: dict[str, float] = field(default_factory=dict)
    grad_norms: list[float] = field(default_factory=list)


class GradientTelemetry:
    """Gradient norms, clipping, AMP scale and train loss, summarised every ``log_every`` steps.

    ``attach(trainer, evaluator=None)`` listens to the trainer's
    ``TrainEvents.OPTIMIZER_STEP`` (every applied step), ``TrainEvents.STEP_SKIPPED``,
    ``Events.ITERATION_COMPLETED`` when the trainer accumulates (the losses of a window's
    earlier micro-batches), and ``Events.COMPLETED``/``Events.TERMINATE``; evaluations are
    not watched. Between reports nothing runs on the device: the step's pre-clip norm and
    each micro-batch's loss, already device scalars, are only kept in lists. Every
    ``log_every`` optimizer steps one transfer reads them and builds ``stats``:
    ``loss_mean``, ``lr``, ``grad_norm_mean``, ``grad_norm_max``,
    ``grad_norm_clipped_mean``, ``clip_fraction``, ``skipped_steps`` and, under fp16,
    ``amp_scale``; ``lr`` is the first param group's, and when the groups' LRs differ (Muon
    and SGD groups) each one's is there too, as ``lr/<group name>`` (its ``name`` key, else
    its index). The post-clip norm and whether a step was clipped follow on the host from
    the pre-clip norm and the trainer's ``max_grad_norm`` (a step is clipped when its norm
    exceeds it). The report is kept as ``latest`` and passed to every ``add_listener``
    callback.

    With ``layer_every`` (a multiple of ``log_every``), an optimizer step pre-hook,
    registered for those steps only, measures each parameter's gradient norm (unscaled,
    clipped) just before their ``optimizer.step()``; the step zeroes the gradients before
    ``OPTIMIZER_STEP`` fires. At the end of the run the partial interval is reported
    and one ``health_line()`` is logged (INFO, this module's ``logger``). Attach it before
    step-based checkpoints, so that a checkpoint taken at a step already holds that step's
    numbers.

    Example::

        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = create_trainer(model, optimizer, torch.nn.functional.mse_loss, max_grad_norm=1.0)
        telemetry = GradientTelemetry(log_every=2)
        telemetry.attach(trainer)
        telemetry.add_listener(lambda report: print(report.step, report.stats["grad_norm_mean"]))
        trainer.run([(torch.ones(4, 2), torch.zeros(4, 1))] * 4, max_epochs=1)
    """

    def __init__(
        self, log_every: int, layer_every: int | None = None, top_k_layers: int = 5
    ) -> None:
        check_int("log_every", log_every, 1)
        if layer_every is not None:
            check_int("layer_every", layer_every, log_every)
            if layer_every % log_every:
                raise ValueError(f"layer_every must be a multiple of log_every={log_every}, "
                                 f"got {layer_every!r}")
        check_int("top_k_layers", top_k_layers, 1)
        self.log_every, self.layer_every, self.top_k_layers = log_every, layer_every, top_k_layers
        self.latest: TelemetryReport | None = None
        self._listeners: list[Callable[[TelemetryReport], None]] = []
        self._trainer: Trainer | None = None
        # The open interval: device scalars, read together at the report.
        self._norms: list[torch.Tensor] = []  # pre-clip norm of each applied step
        self._losses: list[torch.Tensor] = []  # every micro-batch's loss
        self._loss_iteration = -1  # the iteration whose loss was added last
        self._scale: torch.Tensor | None = None
        self._layer_names: list[str] = []
        self._layer_norms: list[torch.Tensor] = []
        self._layer_hook: RemovableHandle | None = None  # set before a layer_every step
        # The run so far, on the host, filled at each read.
        self._norm_history = array("f")
        self._clipped_total = 0
        self._hist_start = 0
        self._health_said = False

    def attach(self, trainer: Trainer, evaluator: Engine | None = None) -> None:
        self._trainer = trainer
        self._move_to(trainer.precision.device)  # a state loaded before attaching
        trainer.add_event_handler(Events.STARTED, self._on_started)
        # Every micro-batch's loss counts. A window of one has a step event, applied or
        # skipped, that brings it; a longer window's earlier micro-batches have none.
        if trainer.accum_steps > 1:
            trainer.add_event_handler(Events.ITERATION_COMPLETED, self._add_loss)
        trainer.add_event_handler(TrainEvents.OPTIMIZER_STEP, self)
        trainer.add_event_handler(TrainEvents.STEP_SKIPPED, self._on_skipped)
        trainer.add_event_handler(Events.COMPLETED, self.end)
        trainer.add_event_handler(Events.TERMINATE, self.end)

    def add_listener(self, listener: Callable[[TelemetryReport], None]) -> None:
        self._listeners.append(listener)

    def __call__(self, engine: Engine) -> None:
        # Runs at every optimizer step: _add_loss and _arm_layer_hook's tests inline.
        state = engine.state
        output = state.output
        if state.iteration != self._loss_iteration:
            self._losses.append(output["loss"])
            self._loss_iteration = state.iteration
        self._norms.append(output["grad_norm"])
        self._scale = output.get("scale")
        if len(self._norms) == self.log_every:
            self._report(engine)
        if self.layer_every is not None and (state.optimizer_step + 1) % self.layer_every == 0:
            self._arm_layer_hook(engine)

    def health_line(self) -> str:
        """The run's gradient health in one line (steps read so far)."""
        skipped = self._trainer.state.skipped_steps
        steps = len(self._norm_history)
        if not steps:
            return f"grad health: no optimizer step applied, {skipped} skipped"
        median = statistics.median(self._norm_history)
        line = (
            f"grad health: {100 * self._clipped_total / steps:.1f}% of {steps} steps clipped, "
            f"{skipped} skipped, median norm {median:.3g}, max {max(self._norm_history):.3g}"
        )
        max_grad_norm = self._trainer.max_grad_norm
        if (max_grad_norm is not None and steps >= STEPS_BEFORE_HINT
                and median > FAR_ABOVE_CLIP * max_grad_norm):
            line += (
                f"; norms sit far above max_grad_norm={max_grad_norm:g}: "
                "the learning rate is the likelier cause"
            )
        return line

    def state_dict(self) -> dict[str, Any]:
        state = {
            "log_every": self.log_every,
            "norms": _to_host(self._norms),
            "losses": _to_host(self._losses),
            "norm_history": torch.tensor(self._norm_history.tolist(), dtype=torch.float32),
            "clipped_total": self._clipped_total,
            "hist_start": self._hist_start,
        }
        if self._scale is not None:
            state["scale"] = self._scale.to("cpu", copy=True)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["log_every"] != self.log_every:
            raise ValueError(
                f"log_every={self.log_every} but the saved telemetry used "
                f"log_every={state['log_every']}; resume with the same log_every"
            )
        self._norms, self._losses = list(state["norms"].unbind()), list(state["losses"].unbind())
        self._scale = state.get("scale")
        if self._trainer is not None:
            self._move_to(self._trainer.precision.device)
        self._norm_history = array("f", state["norm_history"].tolist())
        self._clipped_total, self._hist_start = state["clipped_total"], state["hist_start"]

    def _move_to(self, device: torch.device) -> None:
        self._norms = [norm.to(device) for norm in self._norms]
        self._losses = [loss.to(device) for loss in self._losses]
        if self._scale is not None:
            self._scale = self._scale.to(device)

    def _on_started(self, engine: Engine) -> None:
        self._health_said = False
        self._arm_layer_hook(engine)

    def _on_skipped(self, engine: Engine) -> None:
        self._add_loss(engine)
        self._arm_layer_hook(engine)  # a skipped step leaves its number to the next

    def _add_loss(self, engine: Engine) -> None:
        # A loss can come twice: at its micro-batch's ITERATION_COMPLETED and its step's
        # event. Each counts once.
        if engine.state.iteration != self._loss_iteration:
            self._losses.append(engine.state.output["loss"])
            self._loss_iteration = engine.state.iteration

    def _arm_layer_hook(self, engine: Engine) -> None:
        """Hook ``_measure_layers`` before the optimizer's next step when that step is on
        the ``layer_every`` cadence: only there (it unhooks itself), since a step pre-hook
        costs at every step even when it returns at once."""
        if self.layer_every is None or self._layer_hook is not None:
            return
        if (engine.state.optimizer_step + 1) % self.layer_every == 0:
            self._layer_hook = self._trainer.optimizer.register_step_pre_hook(
                self._measure_layers)

    def _measure_layers(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._layer_hook.remove()
        self._layer_hook = None
        model = getattr(self._trainer.model, "module", self._trainer.model)  # DDP: no "module."
        named = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
        if named:
            self._layer_names = [name for name, _ in named]
            grads = [grad for _, grad in named]
            # FSDP2's gradients are slices: each rank's norms, summed over the ranks.
            norms = torch._foreach_norm(local_shards(grads), 2, dtype=torch.float32)
            group = shard_group(grads)
            self._layer_norms = list(norms if group is None
                                     else whole_norms(torch.stack(norms), group))

    def _group_lrs(self) -> dict[str, float]:
        groups = self._trainer.optimizer.param_groups
        if len({group["lr"] for group in groups}) == 1:
            return {}
        return {f"lr/{group.get('name', index)}": float(group["lr"])
                for index, group in enumerate(groups)}

    def _report(self, engine: Engine) -> None:
        steps, losses, layers = len(self._norms), len(self._losses), len(self._layer_norms)
        extra = [self._scale] if self._scale is not None else []
        values = torch.stack(  # the interval's one read
            [*self._norms, *self._losses, *extra, *self._layer_norms]
        ).float().tolist()
        pre, loss_values = values[:steps], values[steps : steps + losses]
        max_grad_norm = self._trainer.max_grad_norm
        if max_grad_norm is None:
            post, clipped = pre, [False] * steps
        else:  # the step's own formula, clip_grad_norm_'s
            post = [norm * min(1.0, max_grad_norm / (norm + CLIP_EPS)) for norm in pre]
            clipped = [norm > max_grad_norm for norm in pre]
        stats = {
            "loss_mean": sum(loss_values) / losses,
            "lr": float(self._trainer.optimizer.param_groups[0]["lr"]),
            **self._group_lrs(),
            "grad_norm_mean": sum(pre) / steps,
            "grad_norm_max": max(pre),
            "grad_norm_clipped_mean": sum(post) / steps,
            "clip_fraction": sum(clipped) / steps,
            "skipped_steps": float(engine.state.skipped_steps),
        }
        if extra:
            stats["amp_scale"] = values[steps + losses]
        self._norm_history.extend(pre)
        self._clipped_total += sum(clipped)
        top_layers, grad_norms = {}, []
        if layers:
            named = zip(self._layer_names, values[-layers:], strict=True)
            top_layers = dict(sorted(named, key=lambda pair: -pair[1])[: self.top_k_layers])
            grad_norms = self._norm_history[self._hist_start :].tolist()
            self._hist_start = len(self._norm_history)
        self._norms, self._losses, self._layer_norms = [], [], []
        self.latest = TelemetryReport(engine.state.optimizer_step, stats, top_layers, grad_norms)
        for listener in self._listeners:
            listener(self.latest)

    @property
    def unreported_steps(self) -> int:
        """Steps read since the last report: the run's end reports them (a partial interval)."""
        return len(self._norms)

    def end(self, engine: Engine) -> None:
        """The run's end (``COMPLETED``, ``TERMINATE``; the run layer calls it for a finished
        run started again): the partial interval's report and the health line, once."""
        if self._health_said:  # terminate() fires TERMINATE and then COMPLETED
            return
        if self._norms:
            self._report(engine)
        logger.info(self.health_line())
        self._health_said = True


def _to_host(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(values).float().cpu() if values else torch.zeros(0)
