"""The run's header and closing lines (``recipes.runner.training.report``)."""

import shlex
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from handlers.goal import Goal
from handlers.grad_telemetry import GradientTelemetry
from handlers.history import RunHistory
from recipes.__main__ import main
from recipes.charlm.recipe import Config
from recipes.runner.training.report import closing, header

GUIDE = Path(__file__).parents[4] / "docs" / "writing-a-recipe.md"


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.block(x))


def test_the_model_line_names_the_recipes_class_under_fsdp_too(tmp_path):
    config = Config(device="cpu", epochs=1)
    model = TinyNet()
    assert "  model    TinyNet, 30 parameters" in header("charlm", config, tmp_path, (8, 2), model)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        fully_shard(model.block)
        fully_shard(model)  # FSDP2 turns the class into FSDPTinyNet
        assert type(model).__name__ == "FSDPTinyNet"
        lines = header("charlm", config, tmp_path, (8, 2), model)
    finally:
        dist.destroy_process_group()
    assert "  model    TinyNet, 30 parameters" in lines


def test_the_device_line_gives_the_steps_samples_and_its_micro_batches(tmp_path):
    lines = header("charlm", Config(device="cpu", epochs=8, batch_size=512, accum_steps=2),
                   tmp_path, (8, 2), TinyNet())
    assert "  device   cpu, fp32; 8 epochs of batch 1024 (2 micro-batches of 512 a step)" in lines
    lines = header("charlm", Config(device="cpu", epochs=1, batch_size=64), tmp_path, (8, 2),
                   TinyNet())
    assert "  device   cpu, fp32; 1 epoch of batch 64" in lines


def _two_evaluations(losses: list[float], epochs: int, stopped_early: bool):
    """(handlers, summary) of an images run of 3 steps an epoch with two evaluations."""
    history = RunHistory(batch_size=32, telemetry=GradientTelemetry(log_every=1))
    history.train["loss"] = [1.1]
    history.val = {"step": [3, 6], "loss": losses, "accuracy": [0.33, 0.33]}
    evaluations = SimpleNamespace(history=history, best=Goal("accuracy", "max"),
                                  steps_per_epoch=3)
    handlers = SimpleNamespace(history=history, evaluation=SimpleNamespace(epochs=epochs),
                               progress=SimpleNamespace(evaluations=evaluations))
    summary = {"status": "completed", "epochs_completed": 2, "optimizer_steps": 6,
               "wall_time_sec": 5.0, "stopped_early": stopped_early}
    return handlers, summary


def test_a_run_that_completed_with_a_diverged_loss_says_so_at_the_end(tmp_path):
    """The images recipe at too high an LR completed its epochs; the closing lines say that
    it diverged (ln(3) at the start, 613.6 and 1532 at the evaluations)."""
    handlers, summary = _two_evaluations([613.6, 1532.0], epochs=2, stopped_early=False)
    lines = closing("images", summary, tmp_path, handlers)
    assert lines[1] == ("  warning  the validation loss rose to 1532, over 3x the first training "
                        "loss 1.1: the run diverged; try a lower --lr (a third or a tenth)")
    handlers.history.val["loss"] = [1.0, 0.9]
    assert not any("warning" in line for line in closing("images", summary, tmp_path, handlers))


def test_a_run_ended_by_early_stopping_says_so_in_its_first_closing_line(tmp_path):
    handlers, summary = _two_evaluations([1.0, 1.2], epochs=50, stopped_early=True)
    lines = closing("images", summary, tmp_path, handlers)
    assert lines[0] == ("completed: epoch 2/50, 6 steps in 5s (stopped early: no better "
                        "validation for --patience evaluations)")
    assert not any(line.startswith("  longer") for line in lines)


def test_a_recipe_run_by_its_file_path_prints_next_commands_that_run(tmp_path, monkeypatch,
                                                                      capsys):
    """The closing lines name the recipe as it was given, its file's path: the ``evaluate``
    and ``longer`` commands they print work as printed."""
    monkeypatch.chdir(tmp_path)
    example = GUIDE.read_text().split("<!-- recipe-example -->\n```python\n")[1].split("```")[0]
    Path("spirals.py").write_text(example)
    assert main(["spirals.py", "--epochs", "1", "--run-name", "s", "--progress", "off",
                 "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    commands = {line.split()[0]: shlex.split(line)[1:] for line in lines
                if line.startswith(("  evaluate ", "  longer "))}
    assert commands["evaluate"][1:4] == ["-m", "recipes", "spirals.py"], commands
    assert main(commands["evaluate"][3:]) == 0
    assert main(commands["longer"][3:commands["longer"].index("(continues")]) == 0
    assert "completed: epoch 2/2" in capsys.readouterr().out
