import math

import pytest
import torch
from ignite.engine import Engine, Events
from torch import nn

from handlers.early_stopping import EarlyStopping
from handlers.goal import Goal

NAN = math.nan


def make_run(
    scores, *, patience=2, mode="min", restore_best=False, fail_at_epoch=None, error=None,
    attach=True, **options
):
    """A trainer whose model weight equals the epoch number after each epoch (it raises
    ``error`` in epoch ``fail_at_epoch``), and an evaluator that reports
    ``scores[epoch - 1]`` as metric 'loss', run at each epoch's end; the early stopping is
    attached to both unless ``attach=False``."""
    model = nn.Linear(1, 1, bias=False)

    def train_step(engine: Engine, batch) -> None:
        if engine.state.epoch == fail_at_epoch:
            raise error
        with torch.no_grad():
            model.weight.fill_(engine.state.epoch)

    trainer = Engine(train_step)
    evaluator = Engine(lambda engine, batch: None)

    @evaluator.on(Events.COMPLETED)
    def report_score(engine: Engine) -> None:
        engine.state.metrics["loss"] = scores[trainer.state.epoch - 1]

    es = EarlyStopping(
        Goal("loss", mode), patience, restore_best=restore_best,
        model=model if restore_best else None, **options,
    )
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: evaluator.run([0]))
    if attach:
        es.attach(trainer, evaluator)
    return trainer, evaluator, es, model


def weight(model: nn.Module) -> float:
    return model.weight.item()


def test_stops_after_patience_evaluations_without_improvement():
    # The count runs across evaluations: attach() does not reset it at each one, as
    # Ignite's EarlyStopping.attach(evaluator) would (it would never stop).
    trainer, _, es, _ = make_run([1.0, 0.8, 0.9, 0.85, 0.7, 0.6])
    trainer.run([0], max_epochs=6)
    assert trainer.state.epoch == 4
    assert es.stopped_early and es.best_score == 0.8 and es.counter == 2


def test_an_improvement_resets_the_count():
    trainer, _, es, _ = make_run([1.0, 1.1, 0.9, 1.0, 0.8, 0.9])
    trainer.run([0], max_epochs=6)
    assert trainer.state.epoch == 6
    assert not es.stopped_early and es.best_score == 0.8 and es.counter == 1


def test_improvements_smaller_than_min_delta_do_not_count():
    trainer, _, es, _ = make_run([1.0, 0.95, 0.92, 0.5], min_delta=0.1)
    trainer.run([0], max_epochs=4)
    assert trainer.state.epoch == 3 and es.stopped_early and es.best_score == 1.0


def test_max_mode_needs_a_strictly_higher_score():
    trainer, _, es, _ = make_run([0.5, 0.6, 0.6, 0.55, 0.9], mode="max")
    trainer.run([0], max_epochs=5)
    assert trainer.state.epoch == 4 and es.best_score == 0.6


def test_a_nan_score_is_no_improvement():
    trainer, _, es, _ = make_run([NAN, 1.0, NAN, NAN, 0.1])
    trainer.run([0], max_epochs=5)
    assert trainer.state.epoch == 4 and es.stopped_early and es.best_score == 1.0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"patience": 0}, "patience"),
        ({"patience": -1}, "patience"),
        ({"patience": 1.5}, "patience"),
        ({"patience": True}, "patience"),
        ({"goal": "loss"}, "goal must be a Goal"),
        ({"min_delta": -0.1}, "min_delta"),
        ({"min_delta": math.inf}, "min_delta"),
        ({"restore_best": True}, "model"),
        ({"restore_best": 1}, "restore_best must be True or False"),
    ],
)
def test_bad_arguments_are_refused_by_name(options, message):
    args = {"goal": Goal("loss", "min"), "patience": 2} | options
    with pytest.raises(ValueError, match=message):
        EarlyStopping(**args)


@pytest.mark.parametrize(
    ("metric", "mode", "message"),
    [("loss", "avg", "mode='avg' is not known; allowed: 'min', 'max'"), ("", "min", "metric")],
)
def test_a_bad_goal_is_refused_by_name(metric, mode, message):
    with pytest.raises(ValueError, match=message):
        Goal(metric, mode)


def test_attach_needs_the_evaluator_it_listens_to():
    es = EarlyStopping(Goal("loss", "min"), 2)
    with pytest.raises(ValueError, match="attach\\(trainer, evaluator\\)"):
        es.attach(Engine(lambda e, b: None))


def test_a_missing_metric_names_the_available_ones():
    trainer = Engine(lambda e, b: None)
    evaluator = Engine(lambda e, b: None)
    EarlyStopping(Goal("loss", "min"), 2).attach(trainer, evaluator)
    evaluator.add_event_handler(Events.STARTED, lambda e: e.state.metrics.update(acc=0.5))
    with pytest.raises(KeyError, match=r"'loss'.*\['acc'\]"):
        evaluator.run([0])


def test_restore_best_after_an_early_stop():
    trainer, _, es, model = make_run([1.0, 0.5, 0.7, 0.8, 0.1], restore_best=True)
    trainer.run([0], max_epochs=5)
    assert trainer.state.epoch == 4 and weight(model) == 2.0


def test_restore_best_after_the_last_epoch():
    trainer, _, es, model = make_run([1.0, 0.5, 0.7], patience=5, restore_best=True)
    trainer.run([0], max_epochs=3)
    assert not es.stopped_early and weight(model) == 2.0


@pytest.mark.parametrize("skip_completed", [False, True])
def test_restore_best_after_terminate_from_elsewhere(skip_completed):
    trainer, evaluator, es, model = make_run([1.0, 0.5, 0.7, 0.8], patience=5,
                                             restore_best=True, attach=False)
    trainer.add_event_handler(  # what a time limit does
        Events.EPOCH_COMPLETED(once=3), lambda: trainer.terminate(skip_completed=skip_completed)
    )
    es.attach(trainer, evaluator)  # after the trainer's other handlers
    trainer.run([0], max_epochs=4)
    assert trainer.state.epoch == 3 and weight(model) == 2.0


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_restore_best_after_an_exception_which_still_propagates(error):
    trainer, evaluator, es, model = make_run(
        [1.0, 0.5, 0.7], patience=5, restore_best=True, fail_at_epoch=4, error=error,
        attach=False,
    )
    seen = []
    trainer.add_event_handler(Events.EXCEPTION_RAISED, lambda engine, e: seen.append(e))
    es.attach(trainer, evaluator)
    with pytest.raises(type(error)):
        trainer.run([0], max_epochs=6)
    # A handler attached earlier still ran. (Ignite fires EXCEPTION_RAISED again, from its
    # outer loop, when a handler re-raises an exception from inside an iteration.)
    assert seen and all(e is error for e in seen)
    assert weight(model) == 2.0


def test_state_roundtrip_through_weights_only_load_resumes_the_count(tmp_path):
    trainer, _, es, _ = make_run([0.5, 0.7, 0.8], patience=4, restore_best=True)
    trainer.run([0], max_epochs=3)
    torch.save(es.state_dict(), tmp_path / "es.pt")
    state = torch.load(tmp_path / "es.pt", weights_only=True)

    resumed_trainer, _, resumed, model = make_run([0.9, 0.95, 0.1], patience=4,
                                                  restore_best=True)
    resumed.load_state_dict(state)
    assert resumed.best_score == 0.5 and resumed.counter == 2 and not resumed.stopped_early
    resumed_trainer.run([0], max_epochs=3)
    assert resumed_trainer.state.epoch == 2 and resumed.stopped_early
    assert weight(model) == 1.0  # the best weights from before the checkpoint


def test_state_without_restore_best_holds_no_weights():
    trainer, _, es, _ = make_run([1.0, 2.0])
    trainer.run([0], max_epochs=2)
    assert es.state_dict() == {"best_score": 1.0, "counter": 1, "stopped_early": False}
