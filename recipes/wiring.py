"""``--describe``: the events of a run's engines and the handlers on each, in firing order
(as fastai's ``show_training_loop`` shows a Learner's), so a reader sees the whole run
without reading its code."""

from collections.abc import Mapping
from typing import Any

from ignite.engine import Engine


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
    return type(handler).__name__


def wiring_table(engines: Mapping[str, Engine]) -> str:
    lines = []
    for engine_name, engine in engines.items():
        lines.append(f"{engine_name}:")
        for event, handlers in engine._event_handlers.items():
            if not handlers:
                continue
            lines.append(f"  {getattr(event, 'name', event)}")
            for handler, _, _ in handlers:
                lines.append(f"    {handler_name(handler)}")
    return "\n".join(lines)
