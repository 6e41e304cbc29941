"""The one way every handler here is attached: ``handler.attach(trainer, evaluator=None)``.

A handler takes what it needs (a telemetry to listen to, the state it rolls back, where it
writes) in its constructor; ``attach`` takes only the engines and registers on them. Each
handler's docstring names the events it listens to on the trainer and, when given, on the
evaluator (the engine whose ``Events.COMPLETED`` ends an evaluation). A handler that
listens only to the trainer accepts the evaluator and leaves it alone, so a list of
handlers attaches with one loop, in the list's order (the order their shared events fire
them in).
"""

from typing import Protocol

from ignite.engine import Engine

from engine.trainer import Trainer


class Handler(Protocol):
    def attach(self, trainer: Trainer, evaluator: Engine | None = None) -> None: ...
