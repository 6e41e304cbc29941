import logging
import math

import pytest
import torch
from torch import nn

from engine.trainer import create_trainer
from handlers.first_step_checks import FirstStepCheckError, FirstStepChecks


def _trainer(model: nn.Module):
    return create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          nn.functional.cross_entropy)


def _run(model, batches, num_classes=4, epochs=1, trainer=None, trained_weights=False):
    trainer = trainer or _trainer(model)
    checks = FirstStepChecks(num_classes, trained_weights=trained_weights)
    checks.attach(trainer)
    trainer.run(batches, max_epochs=epochs)
    return checks, trainer


def test_an_untrained_classifier_passes_with_one_line(make_mlp, make_batches):
    checks, _ = _run(make_mlp(), make_batches(3), epochs=2)
    assert len(checks.findings) == 1  # once, not per epoch or iteration
    assert checks.findings[0].startswith("first loss") and checks.findings[0].endswith(": ok")
    assert f"ln(4) = {math.log(4):.3f}" in checks.findings[0]


def test_a_first_loss_far_from_ln_classes_is_named(make_mlp, make_batches):
    model = make_mlp()
    with torch.no_grad():
        model[-1].weight.mul_(100)  # a large initialisation: confident, mostly wrong
    checks, _ = _run(model, make_batches(2))
    assert len(checks.findings) == 1 and "is far from ln(4)" in checks.findings[0]


def test_a_fine_tunes_first_loss_is_said_to_come_from_trained_weights(make_mlp, make_batches):
    """--init-from: a loss below ln(classes) is what trained weights give, not "near" it;
    far above it the classes may not match the weights' run."""
    checks, _ = _run(make_mlp(), make_batches(2), trained_weights=True)
    [line] = checks.findings
    assert line.startswith("first loss ") and line.endswith(
        f" from trained weights (untrained: ln(4) = {math.log(4):.3f}): ok")
    model = make_mlp()
    with torch.no_grad():
        model[-1].weight.mul_(100)
    checks, _ = _run(model, make_batches(2), trained_weights=True)
    [line] = checks.findings
    assert "from trained weights is far above ln(4)" in line and "do the classes match" in line


def test_nan_in_the_first_batch_is_named(make_mlp, make_batches):
    batches = make_batches(2)
    batches[0][0][1, 3] = float("nan")
    checks, _ = _run(make_mlp(), batches, num_classes=None)
    assert checks.findings == ["the first batch holds 1 NaN/Inf value(s) in batch[0] (8, 8): "
                               "every step on it would be skipped"]


def test_labels_outside_the_classes_stop_before_the_forward(make_mlp, make_batches):
    batches = make_batches(2)
    batches[0][1][0] = 7
    with pytest.raises(FirstStepCheckError, match=r"range over \[\d, 7\] but the model has 4 "
                                                r"classes: labels must lie in \[0, 4\)"):
        _run(make_mlp(), batches)


def test_a_resumed_run_checks_its_batch_but_not_its_first_loss(make_mlp, make_batches):
    model = make_mlp()
    with torch.no_grad():
        model[-1].weight.mul_(100)
    trainer = _trainer(model)
    trainer.load_state_dict({"iteration": 2, "epoch_length": 4, "max_epochs": 2,
                             "optimizer_step": 2, "skipped_steps": 0, "consecutive_skips": 0})
    batches = make_batches(4)
    batches[0][0][0, 0] = float("inf")  # Ignite restarts a plain list at its start
    checks, _ = _run(model, batches, epochs=2, trainer=trainer)
    assert len(checks.findings) == 1 and "NaN/Inf" in checks.findings[0]


def test_the_checks_leave_the_trainer_after_the_first_iteration_of_each_run(
        make_mlp, make_batches):
    from ignite.engine import Events
    trainer = _trainer(make_mlp())
    checks = FirstStepChecks(4)
    checks.attach(trainer)
    attached = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda engine: attached.append(
        (trainer.has_event_handler(checks._check_batch, Events.GET_BATCH_COMPLETED),
         trainer.has_event_handler(checks._check_loss, Events.ITERATION_COMPLETED))))
    trainer.run(make_batches(3))
    # The loss check runs after this handler at the first iteration, then is gone too.
    assert attached == [(False, True), (False, False), (False, False)]
    trainer.run(make_batches(2), max_epochs=1)  # a new run (iteration reset): checked again
    assert len(checks.findings) == 2 and attached[3:] == [(False, True), (False, False)]


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"num_classes": 1}, "num_classes"), ({"num_classes": True}, "num_classes"),
    ({"loss_tolerance": 0}, "loss_tolerance"), ({"loss_tolerance": 1.5}, "loss_tolerance"),
])
def test_bad_arguments_are_named(kwargs, named):
    with pytest.raises(ValueError, match=named):
        FirstStepChecks(**kwargs)


def test_a_problem_is_a_warning_and_a_first_loss_that_looks_right_is_info(
        make_mlp, make_batches, caplog):
    caplog.set_level(logging.INFO, logger="handlers")
    _run(make_mlp(), make_batches(1))
    wide = make_mlp()
    with torch.no_grad():
        wide[-1].weight.mul_(100)  # a first loss far from ln(4)
    _run(wide, make_batches(1))
    said = [(r.levelname, r.getMessage()) for r in caplog.records
            if r.name == "handlers.first_step_checks"]
    assert [level for level, _ in said] == ["INFO", "WARNING"], said
    assert said[0][1].startswith("check: first loss") and said[0][1].endswith(": ok")
    assert said[1][1].startswith("check: the first loss") and "far from ln(4)" in said[1][1]
