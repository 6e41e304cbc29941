"""``--resume`` as a request of one start, in-process and without a command: config.json
never keeps it, a lost config.json comes back from the newest checkpoint that verifies, and
a checkpoint of another run is refused in one line. (``test_resume.py`` drives the same
promises through whole commands.) And ``read_saved_config``: a new run has none, an
unreadable one is one line."""

import dataclasses
from pathlib import Path

import pytest
import torch
from ignite.engine import Engine
from torch import nn

from engine.trainer import create_trainer
from handlers.atomic_write import write_json_atomic
from handlers.checkpoint import sharded as sharded_checkpoint
from handlers.checkpoint.checkpointer import Checkpointer
from handlers.checkpoint.crash_points import CrashPoints
from handlers.checkpoint.files import FORMAT_VERSION
from handlers.checkpoint.sharded import ShardedFolder
from handlers.goal import Goal
from recipes.runner.config.command_line import ConfigError
from recipes.runner.resume.request import (
    check_resume_file,
    read_saved_config,
    saved_in_checkpoints,
    stored_config,
    without_requests,
)


@dataclasses.dataclass
class Config:
    lr: float = 0.1
    resume: str = "auto"
    epochs: int = 2


def save_steps(folder: Path, run_id: str, config: dict, steps: int) -> Checkpointer:
    """Checkpoints after optimizer steps 1..``steps`` of a tiny model, keeping all of them."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, optimizer, nn.MSELoss())
    ckpt = Checkpointer(folder, {"model": model, "optimizer": optimizer, "trainer": trainer},
                        run_id=run_id, config=config, keep_last=steps)
    state = trainer.state
    state.epoch, state.epoch_length, state.max_epochs = 1, 10, 1
    for step in range(1, steps + 1):
        state.iteration = state.optimizer_step = step
        ckpt.save_last(trainer)
    return ckpt


def test_the_stored_config_keeps_every_key_but_the_resume_request():
    assert stored_config(Config(lr=0.2, resume="never")) == {"lr": 0.2, "epochs": 2}


def test_a_resume_request_an_older_config_json_stored_is_dropped_and_the_rest_kept():
    saved = {"run_id": "r", "config": {"lr": 0.2, "resume": "last.pt"}, "data": {"n": 1}}
    assert without_requests(saved) == {"run_id": "r", "config": {"lr": 0.2}, "data": {"n": 1}}
    assert without_requests(None) is None
    assert without_requests({"run_id": "r"}) == {"run_id": "r"}


def test_a_lost_config_json_comes_from_the_newest_checkpoint_that_verifies(tmp_path, capsys):
    config = {"lr": 0.2, "data": {"fingerprint": "abc"}}
    save_steps(tmp_path, "run-a", config, steps=3)
    (tmp_path / "step-00000003.pt").write_bytes(b"torn")  # last.pt is the same file

    saved = saved_in_checkpoints(tmp_path)

    assert saved == {"run_id": "run-a", "config": {"lr": 0.2},
                     "data": {"fingerprint": "abc"}}
    assert capsys.readouterr().out == (
        f"config.json is missing: the run id and config come from "
        f"{tmp_path / 'step-00000002.pt'}\n")


def test_a_lost_config_json_comes_from_last_pt_when_its_step_file_is_gone(tmp_path, capsys):
    """last.pt (the newest step) is tried before the older step file it does not share."""
    save_steps(tmp_path, "run-a", {"lr": 0.2}, steps=2)
    for name in ("step-00000002.pt", "step-00000002.pt.json"):
        (tmp_path / name).unlink()
    assert saved_in_checkpoints(tmp_path)["run_id"] == "run-a"
    assert capsys.readouterr().out.endswith(f"come from {tmp_path / 'last.pt'}\n")


def test_a_lost_config_json_comes_from_best_pt_when_it_is_all_that_is_left(tmp_path, capsys):
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, optimizer, nn.MSELoss())
    ckpt = Checkpointer(tmp_path, {"model": model, "optimizer": optimizer, "trainer": trainer},
                        run_id="run-a", config={"lr": 0.2}, best=Goal("acc", "max"))
    trainer.state.iteration = trainer.state.optimizer_step = 1
    evaluator = Engine(lambda engine, batch: None)
    evaluator.state.metrics = {"acc": 0.5}
    ckpt.save_best(evaluator)
    for name in ("best-step-00000001.pt", "last.pt"):
        for path in (tmp_path / name, tmp_path / f"{name}.json"):
            path.unlink()
    assert saved_in_checkpoints(tmp_path) == {"run_id": "run-a", "config": {"lr": 0.2}}
    assert capsys.readouterr().out.endswith(f"come from {tmp_path / 'best.pt'}\n")


def test_a_checkpoint_config_without_data_gives_no_data_key(tmp_path):
    save_steps(tmp_path, "run-a", {"lr": 0.2}, steps=1)
    assert saved_in_checkpoints(tmp_path) == {"run_id": "run-a", "config": {"lr": 0.2}}


def test_no_checkpoint_folder_or_no_good_checkpoint_gives_none(tmp_path):
    assert saved_in_checkpoints(tmp_path / "missing") is None
    save_steps(tmp_path, "run-a", {"lr": 0.2}, steps=1)
    (tmp_path / "step-00000001.pt").write_bytes(b"torn")
    assert saved_in_checkpoints(tmp_path) is None


def test_a_resume_file_of_another_run_is_refused_in_one_line_naming_the_rule(tmp_path):
    save_steps(tmp_path, "run-a", {"lr": 0.2}, steps=1)
    path = str(tmp_path / "step-00000001.pt")
    check_resume_file(path, "run-a")  # its own run: accepted
    with pytest.raises(ConfigError) as refused:
        check_resume_file(path, "run-b")
    message = str(refused.value)
    assert message.startswith("--resume: ") and "run-b" in message and "\n" not in message
    assert message.endswith("a checkpoint resumes only in its own run folder (its --run-name "
                            "or --run-dir)")
    assert refused.value.__cause__ is None and refused.value.__suppress_context__


@pytest.mark.parametrize("request_", ["auto", "never"])
def test_the_auto_and_never_requests_are_not_files_to_verify(request_, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / request_).write_bytes(b"not a checkpoint")  # a file by that name is not read
    check_resume_file(request_, "run-a")


@pytest.fixture
def sharded_run(tmp_path, monkeypatch) -> Path:
    """A checkpoints folder holding one sharded checkpoint of run-a, whose shards must not be
    gathered: a resume check reads its meta alone (the whole model may not fit one process)."""
    folder = ShardedFolder()
    model = nn.Linear(3, 2)
    sidecar = {"format_version": FORMAT_VERSION, "run_id": "run-a", "epoch": 1, "iteration": 1,
               "optimizer_step": 1}
    meta = sidecar | {"config": {"lr": 0.2, "data": {"sha256": "abc"}}}
    payload = folder.snapshot({"model": model}) | {"meta": meta, "checkpointer": {}}
    folder.write(tmp_path / "step-00000001.dcp", payload, sidecar, file_mode=0o600,
                 crash=CrashPoints())

    def gather(path):
        raise AssertionError(f"the shards of {path} were gathered")

    monkeypatch.setattr(sharded_checkpoint, "_gather_shards", gather)
    return tmp_path


def test_a_sharded_checkpoints_config_is_read_without_gathering_its_shards(sharded_run):
    assert saved_in_checkpoints(sharded_run) == {
        "run_id": "run-a", "config": {"lr": 0.2}, "data": {"sha256": "abc"}}


def test_a_sharded_resume_folder_is_verified_without_gathering_its_shards(sharded_run):
    check_resume_file(str(sharded_run / "step-00000001.dcp"), "run-a")


def test_read_saved_config_of_a_new_run_is_none(tmp_path):
    assert read_saved_config(tmp_path / "missing") is None
    assert read_saved_config(tmp_path) is None


def test_read_saved_config_roundtrip(tmp_path):
    payload = {"run_id": "r-1", "config": {"lr": 0.2, "clip": None}}
    write_json_atomic(tmp_path / "config.json", payload)
    assert read_saved_config(tmp_path) == payload


def test_an_unreadable_saved_config_is_a_one_line_config_error(tmp_path):
    (tmp_path / "config.json").write_text('{"run_id": ')
    with pytest.raises(ConfigError) as error:
        read_saved_config(tmp_path)
    message = str(error.value)
    assert str(tmp_path / "config.json") in message and "unreadable" in message
    assert "\n" not in message
