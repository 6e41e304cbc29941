import math

import pytest
import torch
from ignite.engine import Engine, Events
from torch import nn

from handlers.early_stopping import EarlyStopping

NAN = math.nan


def make_run(
    scores, *, patience=2, restore_best=False, fail_at_epoch=None, error=None, **options
):
    """A trainer whose model weight equals the epoch number after each epoch (it raises
    ``error`` in epoch ``fail_at_epoch``), and an evaluator that reports
    ``scores[epoch - 1]`` as metric 'loss'."""
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
        "loss", patience, trainer=trainer, restore_best=restore_best,
        model=model if restore_best else None, **options,
    )
    evaluator.add_event_handler(Events.COMPLETED, es)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: evaluator.run([0]))
    return trainer, es, model


def weight(model: nn.Module) -> float:
    return model.weight.item()


def test_stops_after_patience_evaluations_without_improvement():
    trainer, es, _ = make_run([1.0, 0.8, 0.9, 0.85, 0.7, 0.6])
    trainer.run([0], max_epochs=6)
    assert trainer.state.epoch == 4
    assert es.stopped_early and es.best_score == 0.8 and es.counter == 2


def test_an_improvement_resets_the_count():
    trainer, es, _ = make_run([1.0, 1.1, 0.9, 1.0, 0.8, 0.9])
    trainer.run([0], max_epochs=6)
    assert trainer.state.epoch == 6
    assert not es.stopped_early and es.best_score == 0.8 and es.counter == 1


def test_improvements_smaller_than_min_delta_do_not_count():
    trainer, es, _ = make_run([1.0, 0.95, 0.92, 0.5], min_delta=0.1)
    trainer.run([0], max_epochs=4)
    assert trainer.state.epoch == 3 and es.stopped_early and es.best_score == 1.0


def test_max_mode_needs_a_strictly_higher_score():
    trainer, es, _ = make_run([0.5, 0.6, 0.6, 0.55, 0.9], mode="max")
    trainer.run([0], max_epochs=5)
    assert trainer.state.epoch == 4 and es.best_score == 0.6


def test_a_nan_score_is_no_improvement():
    trainer, es, _ = make_run([NAN, 1.0, NAN, NAN, 0.1])
    trainer.run([0], max_epochs=5)
    assert trainer.state.epoch == 4 and es.stopped_early and es.best_score == 1.0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"patience": 0}, "patience"),
        ({"patience": -1}, "patience"),
        ({"patience": 1.5}, "patience"),
        ({"patience": True}, "patience"),
        ({"mode": "avg"}, "mode='avg' is not known; allowed: 'min', 'max'"),
        ({"min_delta": -0.1}, "min_delta"),
        ({"min_delta": math.inf}, "min_delta"),
        ({"metric": ""}, "metric"),
        ({"restore_best": True}, "model"),
        ({"trainer": None}, "trainer"),
    ],
)
def test_bad_arguments_are_refused_by_name(options, message):
    args = {"metric": "loss", "patience": 2, "trainer": Engine(lambda e, b: None)} | options
    with pytest.raises(ValueError, match=message):
        EarlyStopping(**args)


def test_a_missing_metric_names_the_available_ones():
    trainer = Engine(lambda e, b: None)
    evaluator = Engine(lambda e, b: None)
    evaluator.add_event_handler(Events.COMPLETED, EarlyStopping("loss", 2, trainer=trainer))
    evaluator.add_event_handler(Events.STARTED, lambda e: e.state.metrics.update(acc=0.5))
    with pytest.raises(KeyError, match=r"'loss'.*available: \['acc'\]"):
        evaluator.run([0])


def test_restore_best_after_an_early_stop():
    trainer, es, model = make_run([1.0, 0.5, 0.7, 0.8, 0.1], restore_best=True)
    es.attach_restore()
    trainer.run([0], max_epochs=5)
    assert trainer.state.epoch == 4 and weight(model) == 2.0


def test_restore_best_after_the_last_epoch():
    trainer, es, model = make_run([1.0, 0.5, 0.7], patience=5, restore_best=True)
    es.attach_restore()
    trainer.run([0], max_epochs=3)
    assert not es.stopped_early and weight(model) == 2.0


@pytest.mark.parametrize("skip_completed", [False, True])
def test_restore_best_after_terminate_from_elsewhere(skip_completed):
    trainer, es, model = make_run([1.0, 0.5, 0.7, 0.8], patience=5, restore_best=True)
    trainer.add_event_handler(  # what a time limit does
        Events.EPOCH_COMPLETED(once=3), lambda: trainer.terminate(skip_completed=skip_completed)
    )
    es.attach_restore()
    trainer.run([0], max_epochs=4)
    assert trainer.state.epoch == 3 and weight(model) == 2.0


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_restore_best_after_an_exception_which_still_propagates(error):
    trainer, es, model = make_run(
        [1.0, 0.5, 0.7], patience=5, restore_best=True, fail_at_epoch=4, error=error
    )
    seen = []
    trainer.add_event_handler(Events.EXCEPTION_RAISED, lambda engine, e: seen.append(e))
    es.attach_restore()
    with pytest.raises(type(error)):
        trainer.run([0], max_epochs=6)
    # A handler attached earlier still ran. (Ignite fires EXCEPTION_RAISED again, from its
    # outer loop, when a handler re-raises an exception from inside an iteration.)
    assert seen and all(e is error for e in seen)
    assert weight(model) == 2.0


def test_restore_best_without_attach_restore_fails_at_the_first_evaluation():
    trainer, _, _ = make_run([1.0], restore_best=True)
    with pytest.raises(RuntimeError, match="attach_restore"):
        trainer.run([0], max_epochs=1)


def test_state_roundtrip_through_weights_only_load_resumes_the_count(tmp_path):
    trainer, es, _ = make_run([0.5, 0.7, 0.8], patience=4, restore_best=True)
    es.attach_restore()
    trainer.run([0], max_epochs=3)
    torch.save(es.state_dict(), tmp_path / "es.pt")
    state = torch.load(tmp_path / "es.pt", weights_only=True)

    resumed_trainer, resumed, model = make_run([0.9, 0.95, 0.1], patience=4, restore_best=True)
    resumed.load_state_dict(state)
    resumed.attach_restore()
    assert resumed.best_score == 0.5 and resumed.counter == 2 and not resumed.stopped_early
    resumed_trainer.run([0], max_epochs=3)
    assert resumed_trainer.state.epoch == 2 and resumed.stopped_early
    assert weight(model) == 1.0  # the best weights from before the checkpoint


def test_state_without_restore_best_holds_no_weights():
    trainer, es, _ = make_run([1.0, 2.0])
    trainer.run([0], max_epochs=2)
    assert es.state_dict() == {"best_score": 1.0, "counter": 1, "stopped_early": False}
