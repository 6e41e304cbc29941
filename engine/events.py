"""Custom events the trainer fires from inside its process function."""

from ignite.engine import EventEnum


class TrainEvents(EventEnum):
    """Events on the optimizer-step clock.

    ``OPTIMIZER_STEP`` fires after every optimizer step that was applied, never
    for a skipped one, so handlers attached to it (LR schedulers, gradient
    telemetry, step-based checkpoints) count real updates rather than
    micro-batches. ``engine.state.optimizer_step`` is its counter, so event
    filters such as ``TrainEvents.OPTIMIZER_STEP(every=50)`` work as usual.

    ``STEP_SKIPPED`` fires when a window's update was skipped because its
    gradient norm was not finite; ``engine.state.skipped_steps`` counts them.
    """

    OPTIMIZER_STEP = "optimizer_step"
    STEP_SKIPPED = "step_skipped"


EVENT_TO_ATTR = {
    TrainEvents.OPTIMIZER_STEP: "optimizer_step",
    TrainEvents.STEP_SKIPPED: "skipped_steps",
}
