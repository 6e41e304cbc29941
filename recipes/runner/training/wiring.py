"""``--describe``: the events of a run's engines and the handlers on each, in firing order
(as fastai's ``show_training_loop`` shows a Learner's), so a reader sees the whole run
without reading its code."""

from collections.abc import Mapping
from typing import Any

from ignite.engine import Engine

# The order events fire in within a run. A step's OPTIMIZER_STEP (or STEP_SKIPPED) settles
# at the next micro-batch's GET_BATCH_STARTED (or at the epoch's end), after its
# ITERATION_COMPLETED: the step never waits on the device.
FIRING_ORDER = ("STARTED", "EPOCH_STARTED", "GET_BATCH_STARTED", "OPTIMIZER_STEP",
                "STEP_SKIPPED", "GET_BATCH_COMPLETED", "ITERATION_STARTED",
                "ITERATION_COMPLETED", "EPOCH_COMPLETED", "COMPLETED", "TERMINATE",
                "TERMINATE_SINGLE_EPOCH", "INTERRUPT", "EXCEPTION_RAISED")


def handler_name(handler: Any) -> str:
    """A readable name: ``Class.method`` for bound methods, the class of a callable object,
    the function's qualified name otherwise; event filters are seen through."""
    parent = getattr(handler, "_parent", None)  # Ignite wraps filtered handlers
    if parent is not None:
        return handler_name(parent()) + " (filtered)"
    owner = getattr(handler, "__self__", None)
    if owner is not None:
        return f"{type(owner).__name__}.{handler.__name__}"
    if hasattr(handler, "__qualname__"):
        return handler.__qualname__.replace(".<locals>", "")
    wrapped = getattr(handler, "__wrapped__", None)  # a callable object around a function
    if wrapped is not None:
        return f"{type(handler).__name__}({handler_name(wrapped)})"
    return type(handler).__name__


def _firing_rank(event: Any) -> int:
    name = getattr(event, "name", str(event))
    return FIRING_ORDER.index(name) if name in FIRING_ORDER else len(FIRING_ORDER)


def wiring_table(engines: Mapping[str, Engine]) -> str:
    """Each engine's events in firing order, each with its handlers in the order they run."""
    lines = []
    for engine_name, engine in engines.items():
        lines.append(f"{engine_name}:")
        for event in sorted(engine._event_handlers, key=_firing_rank):  # a stable sort
            handlers = engine._event_handlers[event]
            if handlers:
                lines.append(f"  {getattr(event, 'name', event)}")
                lines += [f"    {handler_name(handler)}" for handler, _, _ in handlers]
    return "\n".join(lines)
