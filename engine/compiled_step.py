"""``--compile``'s optimizer update: ``optimizer.step`` compiled once for the whole run.

Dynamo reads a param group's float ``lr`` as a constant of the graph, so every new LR a
schedule sets would compile the step again (and after eight, run it eagerly). Here each
group's ``lr`` (and ``betas``, which OneCycleLR cycles) reaches the compiled step as 0-dim
tensors on the parameters' device, the same objects at every step, filled in place with the
group's floats when they changed: a new LR is new data, not a new graph. Loading a state
dict into the optimizer (a resume in the same process) copies the loaded values into the
state tensors it had, which the compiled step's guards also hold by identity. Outside the
step the groups keep their floats, so schedules, handlers, an LR scale and checkpoints
(``weights_only=True`` included) see exactly what an eager run sees, and a resume loads the
same state either way.

With ``cuda_graphs`` (CUDA only) the step compiles in ``reduce-overhead`` mode: inductor
records it in a CUDA graph and replays it, one launch instead of one per op; this needs a
step that never waits for the host, which the masked gate's step is.
"""

import logging
from collections.abc import Callable

import torch
from torch._dynamo.utils import counters

logger = logging.getLogger(__name__)

# What the compiled step takes as tensors: the values schedules change step by step, each
# group's LR and (OneCycleLR's momentum cycle, for optimizers with betas) its betas.
HELD_KEYS = ("lr", "betas")


def compile_mode(cuda_graphs: bool) -> str:
    """torch.compile's mode: ``reduce-overhead`` records CUDA graphs, ``default`` does not."""
    return "reduce-overhead" if cuda_graphs else "default"


def _as_tuple(value: float | tuple[float, ...]) -> tuple[float, ...]:
    return value if isinstance(value, tuple) else (value,)


class CompiledUpdate:
    """Call it in place of ``optimizer.step()``: the same update, compiled, with the held
    values as tensors (see the module's note)."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device,
                 cuda_graphs: bool = False) -> None:
        self.optimizer = optimizer
        self._keys = [[key for key in HELD_KEYS if key in group]
                      for group in optimizer.param_groups]
        # per group and key: the tensors (one per element of a tuple like betas) and the
        # floats they hold now
        self._held = [{key: tuple(torch.tensor(float(v), device=device)
                                  for v in _as_tuple(group[key])) for key in keys}
                      for group, keys in zip(optimizer.param_groups, self._keys, strict=True)]
        self._last = [{key: tuple(float(v) for v in _as_tuple(group[key])) for key in keys}
                      for group, keys in zip(optimizer.param_groups, self._keys, strict=True)]
        # torch.optim's compiled steps guard on their state tensors' identity, and loading a
        # state dict puts new ones in: the loaded values go into the old tensors instead.
        self._state_before_load: dict[torch.Tensor, dict] = {}
        optimizer.register_load_state_dict_pre_hook(self._note_state)
        optimizer.register_load_state_dict_post_hook(self._keep_state_tensors)
        # The class's step, not the wrapper an LR scheduler puts on the instance: dynamo does
        # not trace into torch's lr_scheduler module (a graph break at every step).
        self._step: Callable[[], object] = torch.compile(
            type(optimizer).step.__get__(optimizer), mode=compile_mode(cuda_graphs))

    def __call__(self) -> None:
        groups = self.optimizer.param_groups
        floats = []
        for group, keys, held, last in zip(groups, self._keys, self._held, self._last,
                                           strict=True):
            values = {key: group[key] for key in keys}
            for key, value in values.items():
                elements = _as_tuple(value)
                if elements != last[key]:  # a fill is a kernel launch on a GPU: only on change
                    for tensor, element in zip(held[key], elements, strict=True):
                        tensor.fill_(element)
                    last[key] = elements
                group[key] = held[key] if isinstance(value, tuple) else held[key][0]
            floats.append(values)
        # What that wrapper records, so the scheduler knows the optimizer has stepped.
        self.optimizer._opt_called = True
        try:
            self._step()
        finally:
            for group, values in zip(groups, floats, strict=True):
                group.update(values)


    def _note_state(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        self._state_before_load = {p: dict(state) for p, state in optimizer.state.items()}

    def _keep_state_tensors(self, optimizer: torch.optim.Optimizer) -> None:
        for p, state in optimizer.state.items():
            before = self._state_before_load.get(p, {})
            for key, value in state.items():
                old = before.get(key)
                if (isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor)
                        and (old.shape, old.dtype, old.device)
                        == (value.shape, value.dtype, value.device)):
                    old.copy_(value)
                    state[key] = old
        self._state_before_load = {}


# A break code asks for: torch.optim's step makes two around its body, to run it under
# no_grad, and the body compiles whole. Not a fallback, so not reported.
DELIBERATE = "Call to `torch._dynamo.graph_break()`"


def graph_breaks() -> dict[str, int]:
    """Dynamo's graph breaks in this process so far: reason -> count."""
    return dict(counters["graph_break"])


def report_graph_breaks(before: dict[str, int]) -> None:
    """ONE line when dynamo ran part of the step eagerly (graph breaks since ``before``):
    how many and the first reason; nothing when the step compiled whole."""
    new = {reason: count - before.get(reason, 0) for reason, count in graph_breaks().items()
           if count > before.get(reason, 0) and not reason.startswith(DELIBERATE)}
    if not new:
        return
    reason = next(iter(new)).strip().splitlines()[0]
    logger.warning("compile: the step fell back to eager at %d graph break(s), so it is not "
                   "compiled whole; the first: %s", sum(new.values()), reason)
