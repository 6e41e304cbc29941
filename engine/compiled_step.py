"""``--compile``'s optimizer update: ``optimizer.step`` compiled once for the whole run.

Dynamo reads a param group's float ``lr`` as a constant of the graph, so every new LR a
schedule sets would compile the step again (and after eight, run it eagerly). Here each
group's ``lr`` reaches the compiled step as a 0-dim tensor on the parameters' device, the
same object at every step, filled in place with the group's float when it changed: a new
LR is new data, not a new graph. Outside the step the groups keep their floats, so
schedules, handlers, an LR scale and checkpoints (``weights_only=True`` included) see
exactly what an eager run sees, and a resume loads the same state either way.

With ``cuda_graphs`` (CUDA only) the step compiles in ``reduce-overhead`` mode: inductor
records it in a CUDA graph and replays it, one launch instead of one per op; this needs a
step that never waits for the host, which the masked gate's step is.
"""

import logging
from collections.abc import Callable

import torch
from torch._dynamo.utils import counters

logger = logging.getLogger(__name__)

# What the compiled step takes as tensors: the value every schedule changes, step by step.
HELD_KEYS = ("lr",)


def compile_mode(cuda_graphs: bool) -> str:
    """torch.compile's mode: ``reduce-overhead`` records CUDA graphs, ``default`` does not."""
    return "reduce-overhead" if cuda_graphs else "default"


class CompiledUpdate:
    """Call it in place of ``optimizer.step()``: the same update, compiled, with the held
    values as tensors (see the module's note)."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device,
                 cuda_graphs: bool = False) -> None:
        self.optimizer = optimizer
        self._held = [{key: torch.tensor(float(group[key]), device=device) for key in HELD_KEYS}
                      for group in optimizer.param_groups]
        self._last = [{key: float(group[key]) for key in HELD_KEYS}
                      for group in optimizer.param_groups]
        # The class's step, not the wrapper an LR scheduler puts on the instance: dynamo does
        # not trace into torch's lr_scheduler module (a graph break at every step).
        self._step: Callable[[], object] = torch.compile(
            type(optimizer).step.__get__(optimizer), mode=compile_mode(cuda_graphs))

    def __call__(self) -> None:
        groups = self.optimizer.param_groups
        floats = []
        for group, held, last in zip(groups, self._held, self._last, strict=True):
            values = {key: group[key] for key in HELD_KEYS}
            for key, value in values.items():
                if value != last[key]:  # a fill is a kernel launch on a GPU: only on change
                    held[key].fill_(value)
                    last[key] = value
            group.update(held)
            floats.append(values)
        # What that wrapper records, so the scheduler knows the optimizer has stepped.
        self.optimizer._opt_called = True
        try:
            self._step()
        finally:
            for group, values in zip(groups, floats, strict=True):
                group.update(values)


def graph_breaks() -> dict[str, int]:
    """Dynamo's graph breaks in this process so far: reason -> count."""
    return dict(counters["graph_break"])


def report_graph_breaks(before: dict[str, int]) -> None:
    """ONE line when dynamo ran part of the step eagerly (graph breaks since ``before``):
    how many and the first reason; nothing when the step compiled whole."""
    new = {reason: count - before.get(reason, 0) for reason, count in graph_breaks().items()
           if count > before.get(reason, 0)}
    if not new:
        return
    reason = next(iter(new)).strip().splitlines()[0]
    logger.warning("compile: the step fell back to eager at %d graph break(s), so it is not "
                   "compiled whole; the first: %s", sum(new.values()), reason)
