import io
import re

import pytest
import torch
from ignite.engine import Engine, Events
from torch import nn

import handlers.progress as progress_module
from engine.events import TrainEvents
from engine.trainer import create_trainer
from handlers.cost import CostMeter
from handlers.goal import Goal
from handlers.grad_telemetry import GradientTelemetry
from handlers.history import RunHistory
from handlers.progress import Evaluations, Progress, divergence, format_duration
from handlers.time_left import EvaluationSchedule

PLAIN_LINE = re.compile(
    r"epoch (\d)/2 step (\d+) it (\d)/6 loss (\S+) lr 0.1 grad_norm (\S+) "
    r"eta (\d+h\d\dm|\d+m\d\ds|\d+s)"
)

TELEMETRY = GradientTelemetry(log_every=1)  # for a Progress that is never attached


def train(**options):
    """Two epochs of 6 batches shown by ``Progress(**options)``, telemetry every 3 steps;
    returns the telemetry reports."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, optimizer, nn.functional.mse_loss)
    telemetry = GradientTelemetry(log_every=3)
    telemetry.attach(trainer)
    reports = []
    telemetry.add_listener(reports.append)
    Progress(**options, telemetry=telemetry).attach(trainer)
    trainer.run([(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(6)], max_epochs=2)
    return reports


def test_plain_lines_carry_epoch_step_iteration_loss_lr_grad_norm_and_eta(capsys):
    reports = train(mode="plain")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch")]

    matches = [PLAIN_LINE.fullmatch(line) for line in lines]
    assert all(matches), lines
    fields = [(m[1], m[2], m[3], m[4], m[5]) for m in matches]
    assert fields == [
        (e, str(r.step), i, f"{r.stats['loss_mean']:.4g}", f"{r.stats['grad_norm_mean']:.3g}")
        for (e, i), r in zip([("1", "3"), ("1", "6"), ("2", "3"), ("2", "6")], reports, strict=True)
    ]
    assert lines[-1].endswith("eta 0s")  # the last step of the run


def test_auto_picks_plain_when_the_stream_is_not_a_terminal(capsys):
    assert Progress(telemetry=TELEMETRY).mode == "plain"  # pytest captures stderr

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert Progress(stream=Terminal(), telemetry=TELEMETRY).mode == "bar"


def test_bar_mode_draws_one_bar_for_the_run_and_prints_no_lines(capsys):
    stream = io.StringIO()
    train(mode="bar", stream=stream)

    drawn = stream.getvalue()
    assert "epoch 2/2" in drawn
    assert "12/12" in drawn
    assert re.search(r"loss \S+ lr 0.1 grad_norm \S+", drawn)
    assert not any(line.startswith("epoch") for line in capsys.readouterr().out.splitlines())


def test_off_mode_shows_nothing(capsys):
    train(mode="off")
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch")] == []


def test_duration_format():
    assert [format_duration(s) for s in (0.4, 12, 252, 3720.2)] == ["0s", "12s", "4m12s", "1h02m"]


def test_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="mode='fancy'.*'auto', 'bar', 'plain', 'off'"):
        Progress(mode="fancy", telemetry=TELEMETRY)


# --- evaluation lines and the time left -------------------------------------------------

EPOCHS, BATCHES, EVAL_BATCHES = 3, 4, 2
LOSSES, ACCURACIES = [2.0, 1.5, 7.0], [0.5, 0.6, 0.55]  # the third evaluation diverges
EVAL_LINE = re.compile(r"eval epoch (\d)/3 accuracy (\S+) loss (\S+) \| best accuracy (\S+) "
                       r"\(epoch (\d)\) \| elapsed (\S+) eta (\S+)")


class ScriptedClock:
    """A training iteration takes 1 s, an evaluation batch 0.5 s."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scripted_run(mode="plain", stream=None, resume_from_epoch=0, cost=None, inside_at=0,
                 log_every=2):
    """``EPOCHS`` epochs of ``BATCHES`` iterations, an evaluation after each (the final one
    declared 3 forwards per sample, the others 1) whose metrics are ``LOSSES`` and
    ``ACCURACIES``, on ``ScriptedClock``'s time; optionally resumed after an epoch; with
    ``cost``, a ``CostMeter``; with ``inside_at``, one more evaluation after that optimizer
    step (as ``--eval-every-steps`` adds)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             nn.functional.mse_loss)
    clock = ScriptedClock()
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda _: setattr(
        clock, "now", clock.now + 1.0))
    evaluator = Engine(lambda engine, batch: setattr(clock, "now", clock.now + 0.5))

    @evaluator.on(Events.COMPLETED)
    def scripted_metrics(engine):
        index = trainer.state.epoch - 1
        engine.state.metrics = {"accuracy": ACCURACIES[index], "loss": LOSSES[index]}

    telemetry = GradientTelemetry(log_every=log_every)
    history = RunHistory(batch_size=4, modes={"accuracy": "max", "loss": "min"},
                         telemetry=telemetry)
    schedule = EvaluationSchedule(due=lambda epoch: True,
                                  forwards=lambda final: 3.0 if final else 1.0)
    progress = Progress(mode, stream, telemetry=telemetry, clock=clock, evaluations=Evaluations(
        history, Goal("accuracy", "max"), BATCHES, schedule), cost=cost)
    for handler in (telemetry, history, cost, progress):
        if handler is None:
            continue
        handler.attach(trainer, evaluator)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: evaluator.run(
        range(EVAL_BATCHES)))
    if inside_at:
        trainer.add_event_handler(TrainEvents.OPTIMIZER_STEP(once=inside_at),
                                  lambda _: evaluator.run(range(EVAL_BATCHES)))
    batches = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(BATCHES)]
    if resume_from_epoch:
        trainer.state.iteration = trainer.state.epoch = resume_from_epoch  # as a checkpoint
        trainer.state.iteration *= BATCHES
        trainer.state.optimizer_step = trainer.state.iteration
        trainer.state.epoch_length, trainer.state.max_epochs = BATCHES, EPOCHS
        history.val = {"step": [BATCHES * epoch for epoch in range(1, resume_from_epoch + 1)],
                       "accuracy": ACCURACIES[:resume_from_epoch],
                       "loss": LOSSES[:resume_from_epoch]}
    trainer.run(batches, max_epochs=EPOCHS)


def test_a_line_per_evaluation_with_the_metrics_the_best_and_the_time_left(capsys):
    scripted_run()
    lines = capsys.readouterr().out.splitlines()
    evals = [EVAL_LINE.fullmatch(line) for line in lines if line.startswith("eval ")]
    assert all(evals), lines
    # After epoch 1: 4 s of training for 4 iterations, 1 s for an evaluation of 1 forward:
    # 8 iterations (8 s) and evaluations of 1 and 3 forwards (4 s) are left.
    assert [match.groups() for match in evals] == [
        ("1", "0.5", "2", "0.5", "1", "5s", "12s"),
        ("2", "0.6", "1.5", "0.6", "2", "10s", "7s"),
        ("3", "0.55", "7", "0.6", "2", "15s", "0s"),
    ]


def test_an_evaluation_inside_an_epoch_names_its_step(capsys):
    scripted_run(inside_at=2)
    evals = [line for line in capsys.readouterr().out.splitlines() if line.startswith("eval ")]
    assert evals[0].startswith("eval epoch 1/3 step 2 accuracy 0.5 loss 2 | "), evals
    assert evals[1].startswith("eval epoch 1/3 accuracy 0.5 loss 2 | "), evals


def test_the_runs_last_evaluation_comes_after_its_last_steps_line(capsys):
    """Reports of 5 steps over 12: the last interval (steps 11-12) is reported as the run
    completes, after its final evaluation has run; its line still comes first."""
    scripted_run(log_every=5)
    lines = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith(("epoch ", "eval "))]
    assert lines[-2].startswith("epoch 3/3 step 12 it 4/4 "), lines
    assert lines[-1].startswith("eval epoch 3/3 accuracy 0.55 "), lines
    assert [line[:12] for line in lines].count("eval epoch 3") == 1


def test_with_a_cost_meter_each_evaluation_line_shows_the_epochs_cost(capsys):
    scripted_run(cost=CostMeter(4, 1, torch.device("cpu"), flops_per_sample=1.0))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("eval ")]
    assert len(lines) == EPOCHS
    for line in lines:
        assert re.search(r" \| best accuracy \S+ \(epoch \d\) \| per device: \S+ samples/s, "
                         r"MFU n/a, peak mem (\d+ MB|\d+\.\d GB) \| elapsed ", line), line


def test_training_lines_count_the_evaluations_once_one_is_measured(capsys):
    scripted_run()
    etas = [line.rsplit(" ", 1)[1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("epoch ")]
    # Before the first evaluation its time is unknown; from then on it is counted.
    assert etas[0] == "10s+eval" and all("+eval" not in eta for eta in etas[2:])


def test_a_diverging_validation_loss_gets_one_warning(capsys):
    scripted_run()
    warnings = [line for line in capsys.readouterr().out.splitlines()
                if line.startswith("warning:")]
    # The first training loss reported (1.132, MSE on random data) is the smaller reference.
    assert warnings == ["warning: the validation loss rose to 7, over 3x the first training "
                        "loss 1.132: the training is diverging; try a lower --lr (a third "
                        "or a tenth)"]


def history_of(train_losses: list[float], val_losses: list[float]) -> RunHistory:
    history = RunHistory(batch_size=4, telemetry=GradientTelemetry(log_every=1))
    history.train["loss"] = train_losses
    history.val = {"step": list(range(len(val_losses))), "loss": val_losses}
    return history


def test_a_first_evaluation_already_diverged_is_measured_against_the_training_loss():
    """The images recipe at too high an LR: ln(3) at the start, 613.6 at the first
    evaluation, 1532 at the second (2.5x the first, under the ratio)."""
    assert divergence(history_of([1.1], [613.6])) == (
        "the validation loss rose to 613.6, over 3x the first training loss 1.1")
    assert divergence(history_of([1.1], [613.6, 1532.0])).startswith(
        "the validation loss rose to 1532, over 3x the first training loss 1.1")


@pytest.mark.parametrize("train, val, expected", [
    ([1.9], [2.0, 1.5, 6.0], "the validation loss rose to 6, over 3x the first training "
                             "loss 1.9"),
    ([9.0], [2.0, 7.0], "the validation loss rose to 7, over 3x the first evaluation's 2"),
    ([2.3], [2.0, float("nan")], "the validation loss rose to nan, over 3x the first "
                                 "evaluation's 2"),
    ([], [float("inf")], "the validation loss is inf"),
    ([2.3], [2.0, 1.5, 6.0], None),  # under 3x both
    ([2.3], [6.8], None),
    ([], [], None),
])
def test_divergence_takes_the_smaller_sane_reference(train, val, expected):
    assert divergence(history_of(train, val)) == expected


def test_after_a_resume_the_time_left_is_measured_anew_and_the_best_kept(capsys):
    scripted_run(resume_from_epoch=1)
    evals = [EVAL_LINE.fullmatch(line) for line in capsys.readouterr().out.splitlines()
             if line.startswith("eval ")]
    # This process trained 4 iterations in 4 s and measured one evaluation: the same 7 s
    # as without the resume, elapsed counted from the restart.
    assert [match.groups() for match in evals] == [
        ("2", "0.6", "1.5", "0.6", "2", "5s", "7s"),
        ("3", "0.55", "7", "0.6", "2", "10s", "0s"),
    ]


def test_the_bar_shows_the_same_time_left_as_the_plain_lines(capsys):
    stream = io.StringIO()
    scripted_run(mode="bar", stream=stream, resume_from_epoch=1)
    drawn = stream.getvalue()
    assert "eval epoch 2/3 accuracy 0.6 loss 1.5 | best accuracy 0.6 (epoch 2) | elapsed 5s " \
        "eta 7s" in drawn
    # The bar's own remaining time is not tqdm's but ours, from the reports and evaluations.
    bar_etas = re.findall(r"grad_norm \S+, eta (\S+)\]", drawn)
    scripted_run(mode="plain", resume_from_epoch=1)
    plain_etas = [line.rsplit(" ", 1)[1] for line in capsys.readouterr().out.splitlines()
                  if line.startswith(("epoch ", "eval "))]
    assert bar_etas and set(bar_etas) <= set(plain_etas)


def test_a_long_evaluation_shows_its_progress_in_plain_lines(capsys, monkeypatch):
    monkeypatch.setattr(progress_module, "EVAL_QUIET_SEC", 0.4)
    monkeypatch.setattr(progress_module, "EVAL_LINE_EVERY_SEC", 0.1)
    scripted_run()
    lines = capsys.readouterr().out.splitlines()
    # Batch 1 of 2 ends 0.5 s in, past the quiet time; batch 2 is the last: no line.
    assert lines.count("evaluating 1/2 eta 0s") == 3 and "evaluating 2/2" not in lines
