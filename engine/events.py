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
    gradient norm was not finite, or because the trainer's step veto (see
    ``Trainer.set_step_veto``) held it back; ``engine.state.skipped_steps`` counts them.
    ``STEP_VETOED`` follows ``STEP_SKIPPED`` for a step the veto held back, so the veto's
    owner acts once every handler of the skip has run.
    """

    OPTIMIZER_STEP = "optimizer_step"
    STEP_SKIPPED = "step_skipped"
    STEP_VETOED = "step_vetoed"


EVENT_TO_ATTR = {
    TrainEvents.OPTIMIZER_STEP: "optimizer_step",
    TrainEvents.STEP_SKIPPED: "skipped_steps",
}
