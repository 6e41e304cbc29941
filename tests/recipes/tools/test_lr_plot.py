import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from handlers.lr_scheduling import SCHEDULER_NAMES, build_scheduler
from recipes.tools import lr_plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parents[3]


def test_writes_one_png_with_every_named_schedule(tmp_path):
    out = lr_plot.main(["--out", str(tmp_path / "plots" / "lr.png"), "--epochs", "4",
                        "--steps-per-epoch", "5"])
    assert out == tmp_path / "plots" / "lr.png"
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert out.stat().st_size > 20_000  # six panels with curves, not an empty canvas
    assert sorted(tmp_path.rglob("*")) == [tmp_path / "plots", out]
    assert set(lr_plot.PLOT_OPTIONS) == set(SCHEDULER_NAMES) - {"none"}


def test_runs_as_a_module_with_its_defaults_for_out(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "recipes.tools.lr_plot", "--epochs", "2", "--steps-per-epoch", "3"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "runs" / "lr_schedules.png").read_bytes()[:8] == PNG_MAGIC


def test_plateau_curve_follows_the_scripted_metric():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    handler = build_scheduler(
        "plateau", optimizer, steps_per_epoch=2, epochs=10, **lr_plot.PLOT_OPTIONS["plateau"]
    )
    lrs = lr_plot.lr_curve(handler, epochs=10, steps_per_epoch=2)
    assert len(lrs) == 20 and lrs[0] == 0.1 and lrs[-1] == 0.05  # stalls after epoch 5: one cut


@pytest.mark.parametrize(
    "argv",
    [["--epochs", "0"], ["--steps-per-epoch", "-3"], ["--epochs", "ten"], ["--colour", "red"]],
)
def test_bad_arguments_exit_with_status_2(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        lr_plot.main(["--out", str(tmp_path / "lr.png"), *argv])
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "lr.png").exists()
