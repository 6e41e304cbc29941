import pytest
from ignite.engine import Engine, Events

from recipes.runner.standard_handlers import Evaluation


def test_evaluation_runs_every_n_epochs_and_after_the_last_with_its_hook_first():
    trainer, evaluator = Engine(lambda engine, batch: None), Engine(lambda engine, batch: None)
    seen = []
    evaluator.add_event_handler(Events.COMPLETED,
                                lambda: seen.append(("evaluated", trainer.state.epoch)))
    evaluation = Evaluation([0], every=2, epochs=5,
                            before=lambda final: seen.append(("before", final)))
    evaluation.attach(trainer, evaluator)
    trainer.run([0], max_epochs=5)
    assert seen == [("before", False), ("evaluated", 2), ("before", False), ("evaluated", 4),
                    ("before", True), ("evaluated", 5)]


def test_evaluation_needs_the_evaluator_it_runs():
    with pytest.raises(ValueError, match=r"attach\(trainer, evaluator\)"):
        Evaluation([0], every=1, epochs=1).attach(Engine(lambda engine, batch: None))
