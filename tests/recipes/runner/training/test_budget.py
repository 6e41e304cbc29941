"""``--max-steps`` and ``--max-time`` end to end on charlm's tiny run: a clean stop that says
why, exit 0, a resume that trains nothing more at the same budget and goes on with a larger
one to the same weights as a run never stopped."""

import json

import torch

from recipes.__main__ import main
from tests.helpers import CHARLM, one_error_line, write_text

STEPS = 2 * 19  # 2 epochs of 19 micro-batches of 16 on write_text's 600 words


def charlm(tmp_path, name: str, *args: str) -> list[str]:
    text = tmp_path / "corpus.txt"
    if not text.exists():
        write_text(text)
    return [*CHARLM, "--text", str(text), "--epochs", "2", "--run-dir", str(tmp_path / name),
            *args]


def summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def last_weights(run_dir) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]


def test_max_steps_stops_cleanly_and_a_larger_budget_continues_to_the_same_weights(
        tmp_path, capsys):
    run_dir = tmp_path / "budget"
    assert main(charlm(tmp_path, "budget", "--max-steps", "5")) == 0
    out = capsys.readouterr().out
    assert "\nstopped by --max-steps 5: epoch 1/2, 5 steps in " in out
    assert f"--run-dir {run_dir} --max-steps <more, or none> (continues this run)" in out
    assert summary(run_dir)["status"] == "stopped by --max-steps 5"
    saved = sorted(path.name for path in (run_dir / "checkpoints").iterdir())

    # The same budget again: resumed at it, nothing trained, nothing saved.
    assert main(charlm(tmp_path, "budget", "--max-steps", "5")) == 0
    assert "\nstopped by --max-steps 5: epoch 1/2, 5 steps in " in capsys.readouterr().out
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == saved

    assert main(charlm(tmp_path, "budget", "--max-steps", "none")) == 0
    assert summary(run_dir)["status"] == "completed"
    assert summary(run_dir)["optimizer_steps"] == STEPS
    assert main(charlm(tmp_path, "whole")) == 0
    whole = last_weights(tmp_path / "whole")
    assert all(torch.equal(value, whole[key]) for key, value in last_weights(run_dir).items())


def test_a_max_time_spent_before_the_first_step_trains_nothing(tmp_path, capsys):
    """The run's time starts as it is built: a millisecond is gone before the first step
    (the stop mid-run is ``RunBudget``'s test, on a scripted clock)."""
    run_dir = tmp_path / "timed"
    assert main(charlm(tmp_path, "timed", "--max-time", "0.001")) == 0
    assert "\nstopped by --max-time 0.001: epoch 1/2, 0 steps in " in capsys.readouterr().out
    assert summary(run_dir)["optimizer_steps"] == 0


def test_a_malformed_max_time_is_one_error_line(tmp_path, capsys):
    code = main(charlm(tmp_path, "bad", "--max-time", "1h30"))
    one_error_line(code, capsys.readouterr().err, "--max-time: must be a duration such as 90s")
    assert not (tmp_path / "bad").exists()
