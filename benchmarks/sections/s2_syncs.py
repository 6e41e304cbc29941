"""Section 2: device-to-host synchronisations per iteration, counted by instrumenting the
tensor methods that copy a value to the host."""

import os
import sys
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from ignite.engine import Engine, Events, create_supervised_trainer

from benchmarks.arms.loops import quiet_stdout
from benchmarks.arms.recipe_handlers import RecipeHandlers
from benchmarks.arms.workloads import Workload
from benchmarks.harness.report import table
from engine.trainer import create_trainer
from recipes.cifar.recipe import Config

# Each of these makes the host wait for the device when the tensor lives on a GPU.
SYNC_METHODS = ("item", "cpu", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")
_TORCH_DIR = os.path.dirname(torch.__file__)
_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class SyncCall:
    phase: Hashable  # an iteration number (1-based), or "run start", "epoch end", "run end"
    method: str
    site: str  # the first calling frame outside torch: path:line


def call_site() -> str:
    """``path:line`` of the innermost calling frame outside torch and this module; paths
    relative to site-packages for libraries, to the repository for its own files."""
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back
    if frame is None:
        return "<torch internals>"
    path = Path(frame.f_code.co_filename)
    if "site-packages" in path.parts:
        path = Path(*path.parts[path.parts.index("site-packages") + 1:])
    elif path.is_relative_to(_ROOT):
        path = path.relative_to(_ROOT)
    return f"{path}:{frame.f_lineno}"


class SyncCounter:
    """Counts host syncs while active: every call of ``SYNC_METHODS`` on any tensor is
    recorded with the current ``phase`` and its call site (torch's own Python code that
    calls them, such as ``Tensor.__format__`` calling ``item``, counts at its caller).

    >>> with SyncCounter() as counter:
    ...     _ = torch.ones(2).sum().item()
    >>> [call.method for call in counter.calls]
    ['item']
    """

    def __init__(self) -> None:
        self.calls: list[SyncCall] = []
        self.phase: Hashable = "run start"
        self._saved: dict[str, object] = {}

    def __enter__(self) -> "SyncCounter":
        for name in SYNC_METHODS:
            self._saved[name] = torch.Tensor.__dict__.get(name)  # None: inherited from C
            setattr(torch.Tensor, name, self._counting(name, getattr(torch.Tensor, name)))
        return self

    def __exit__(self, *exc_info: object) -> None:
        for name, saved in self._saved.items():
            if saved is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, saved)
        self._saved.clear()

    def _counting(self, name: str, method: Callable) -> Callable:
        def counted(tensor: torch.Tensor, *args, **kwargs):
            self.calls.append(SyncCall(self.phase, name, call_site()))
            return method(tensor, *args, **kwargs)

        counted.__name__ = name
        return counted

    def at(self, phase: Hashable) -> list[SyncCall]:
        return [call for call in self.calls if call.phase == phase]


def count_run(engine: Engine, batches: list) -> SyncCounter:
    """Run ``engine`` for one epoch over ``batches`` and count its syncs per iteration.
    Call before attaching other handlers: the phase markers must run first at each event."""
    counter = SyncCounter()

    def mark(phase: Callable[[Engine], Hashable]) -> Callable[[Engine], None]:
        return lambda engine: setattr(counter, "phase", phase(engine))

    # GET_BATCH_STARTED is an iteration's first event: the fetch counts with its step.
    engine.add_event_handler(Events.GET_BATCH_STARTED, mark(lambda e: e.state.iteration + 1))
    engine.add_event_handler(Events.EPOCH_COMPLETED, mark(lambda e: "epoch end"))
    engine.add_event_handler(Events.COMPLETED, mark(lambda e: "run end"))
    return counter


@dataclass
class Scenario:
    """Iterations grouped into categories, with the most syncs each may make."""

    name: str
    counter: SyncCounter
    categories: dict[str, list[Hashable]]
    allowed: dict[str, int] = field(default_factory=dict)  # category -> max per iteration


def _trainer(workload: Workload, accum_steps: int):
    model, optimizer = workload.fresh()
    return create_trainer(model, optimizer, workload.loss_fn, accum_steps=accum_steps,
                          max_grad_norm=workload.max_grad_norm)


def step_only(workload: Workload, accum_steps: int) -> Scenario:
    trainer = _trainer(workload, accum_steps)
    counter = count_run(trainer, workload.batches)
    with quiet_stdout(), counter:
        trainer.run(workload.batches, max_epochs=1)
    iterations = range(1, len(workload.batches) + 1)
    if accum_steps == 1:
        return Scenario("step only, accum_steps=1", counter, {"every iteration": list(iterations)},
                        {"every iteration": 0})
    closing = [i for i in iterations if i % accum_steps == 0 or i == len(workload.batches)]
    categories = {"micro-batch inside a window": [i for i in iterations if i not in closing],
                  "micro-batch closing a window (optimizer step)": closing}
    return Scenario(f"step only, accum_steps={accum_steps}", counter, categories,
                    {"micro-batch inside a window": 0,
                     "micro-batch closing a window (optimizer step)": 0})


def with_recipe_handlers(workload: Workload, run_dir: Path, config: Config) -> Scenario:
    trainer = _trainer(workload, 1)
    counter = count_run(trainer, workload.batches)
    handlers = RecipeHandlers(trainer, run_dir, workload.batch_size,
                              steps_per_epoch=len(workload.batches), config=config)
    try:
        with quiet_stdout(), counter:
            trainer.run(workload.batches, max_epochs=1)
    finally:
        handlers.close()
    log_every, layer_every = config.log_every, config.log_every * 10
    iterations = range(1, len(workload.batches) + 1)
    categories = {
        # The start-up checks read the first batch and loss once, by design.
        "first iteration (start-up checks)": [1],
        "between log intervals": [i for i in iterations if i % log_every and i > 1],
        f"at a log interval (every {log_every} steps)":
            [i for i in iterations if i % log_every == 0 and i % layer_every],
        f"at a layer-norm interval (every {layer_every} steps)":
            [i for i in iterations if i % layer_every == 0],
        "epoch end (checkpoint)": ["epoch end"],
        "run end (last report, TensorBoard hparams)": ["run end"],
    }
    return Scenario(f"recipe handler set (log_every={log_every})", counter, categories,
                    {"between log intervals": 0,
                     f"at a log interval (every {log_every} steps)": 1})


def ignite_stock(workload: Workload) -> Scenario:
    model, optimizer = workload.fresh()
    trainer = create_supervised_trainer(model, optimizer, workload.loss_fn, device="cpu")
    counter = count_run(trainer, workload.batches)
    with quiet_stdout(), counter:
        trainer.run(workload.batches, max_epochs=1)
    iterations = list(range(1, len(workload.batches) + 1))
    return Scenario("Ignite create_supervised_trainer (reference)", counter,
                    {"every iteration": iterations})


def _row(scenario: Scenario, category: str, phases: list[Hashable]) -> list[str]:
    per_phase = [len(scenario.counter.at(phase)) for phase in phases]
    low, high = (min(per_phase), max(per_phase)) if per_phase else (0, 0)
    sites = Counter(f"`{call.site}` {call.method}" for phase in phases
                    for call in scenario.counter.at(phase))
    where = "; ".join(f"{site} ×{count / max(len(phases), 1):.3g}"
                      for site, count in sites.most_common()) or "-"
    allowed = scenario.allowed.get(category)
    expected = "-" if allowed is None else (
        f"≤ {allowed}: " + ("ok" if high <= allowed else "**too many**"))
    span = f"{low}" if low == high else f"{low}-{high}"
    return [scenario.name, category, str(len(phases)), span, expected, where]


def render(scenarios: list[Scenario]) -> str:
    rows = [_row(s, category, phases) for s in scenarios
            for category, phases in s.categories.items()]
    gpu = ("a CUDA device is present but this benchmark counts Python-level calls only"
           if torch.cuda.is_available() else
           "no CUDA device on this machine, so `torch.cuda.set_sync_debug_mode` was not run")
    return f"""## 2. Host syncs

Counted by replacing `Tensor.{"`, `Tensor.".join(SYNC_METHODS)}` with counting wrappers while
the engine runs the tiny model (CPU, fp32; `max_grad_norm` set, so the clip path runs). Each
call makes the host wait for the device when the tensor lives on a GPU; on this CPU every
tensor lives in host memory, so the count also includes conversions of tensors that would
stay on the host on a GPU: read "where" to tell them apart. Phases: an iteration starts at
its `GET_BATCH_STARTED`, so the fetch counts with its step. "Where" lists the first calling
frame outside torch (torch's own Python code counts at its caller), with calls per iteration
of the category. Not counted: syncs inside
torch's C++ (`nonzero`, boolean masks), `.to("cpu")`/`copy_` to the host (the handlers use
them only in `state_dict`, at checkpoint time); {gpu}.

Expected: none in the step, optimizer steps included (a non-finite update is kept off the
weights on the device, and its outcome is read one micro-batch later from a host copy), none
from the handlers between log intervals, one at a log interval (the telemetry's read). A
step's events follow as the next micro-batch starts, before its `GET_BATCH_STARTED` and its
phase marker, so what they cost counts with the step's own iteration.

{table(["scenario", "iterations", "how many", "syncs per iteration", "expected",
        "where (calls per iteration)"], rows)}"""
