import io
import re

import pytest
import torch
from torch import nn

from engine import create_trainer
from handlers.grad_telemetry import GradientTelemetry
from handlers.progress import Progress, format_duration

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
