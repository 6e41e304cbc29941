"""Resume through the command line on tiny data: ``--resume`` is a request for one start,
a refused one writes nothing, the run id outlives a lost config.json, a save error is exit 4
with one line, and a changed --epochs keeps every param group's own LR."""

import json
from pathlib import Path

import torch

from handlers.checkpoint.formats import read_checkpoint
from recipes.__main__ import main
from recipes.cifar.config import Config
from tests.helpers import CHARLM, CIFAR, digests, one_error_line, write_text

CIFAR_MUON = [*CIFAR, "--optimizer", "muon", "--scheduler", "none", "--lookahead", "false",
              "--device", "cpu"]


def charlm_run(tmp_path: Path, name: str = "run") -> list[str]:
    text = tmp_path / "corpus.txt"
    if not text.exists():
        write_text(text)
    return [*CHARLM, "--text", str(text), "--run-dir", str(tmp_path / name),
            "--checkpoint-every", "2"]


def history_checkpoints(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "checkpoints").glob("step-*.pt"))


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(run_dir / "checkpoints" / "last.pt")["model"]


# --- resume is a request --------------------------------------------------------------------


def test_a_refused_resume_file_writes_nothing_and_the_plain_command_still_resumes(
        tmp_path, capsys):
    run = charlm_run(tmp_path)
    other = charlm_run(tmp_path, "other")
    assert main([*run, "--epochs", "1"]) == 0
    assert main([*other, "--epochs", "1"]) == 0
    capsys.readouterr()
    before = digests(tmp_path / "run")

    foreign = tmp_path / "other" / "checkpoints" / "last.pt"
    code = main([*run, "--epochs", "2", "--resume", str(foreign)])
    one_error_line(code, capsys.readouterr().err, "from another run")
    assert digests(tmp_path / "run") == before  # config.json and no new TensorBoard file

    assert main([*run, "--epochs", "2"]) == 0
    assert "resumed from" in capsys.readouterr().out


def test_a_resume_from_a_file_is_not_remembered_by_the_next_plain_start(tmp_path, capsys):
    run = charlm_run(tmp_path)
    assert main([*run, "--epochs", "1"]) == 0
    first_save = history_checkpoints(tmp_path / "run")[0]
    assert main([*run, "--epochs", "2", "--resume", str(first_save)]) == 0
    assert "resume" not in json.loads((tmp_path / "run" / "config.json").read_text())["config"]
    capsys.readouterr()

    assert main([*run, "--epochs", "3"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / 'last.pt'} (epoch 2" in out


def test_a_resume_file_into_a_new_run_name_is_refused_before_the_data_and_leaves_no_folder(
        tmp_path, capsys, monkeypatch):
    run = charlm_run(tmp_path)
    assert main([*run, "--epochs", "1"]) == 0
    capsys.readouterr()
    last = tmp_path / "run" / "checkpoints" / "last.pt"

    def no_data(*args, **kwargs):
        raise AssertionError("the data were loaded before the resume file was checked")

    monkeypatch.setattr("recipes.charlm.recipe.split_text", no_data)
    code = main([*CHARLM, "--text", str(tmp_path / "corpus.txt"), "--run-dir",
                 str(tmp_path / "new"), "--resume", str(last)])
    one_error_line(code, capsys.readouterr().err, str(last), "from another run")
    assert not (tmp_path / "new").exists()


# --- the run id outlives config.json --------------------------------------------------------


def test_a_lost_config_json_takes_the_run_id_from_the_newest_good_checkpoint(tmp_path, capsys):
    run = charlm_run(tmp_path)
    assert main([*run, "--epochs", "1"]) == 0
    config_path = tmp_path / "run" / "config.json"
    run_id = json.loads(config_path.read_text())["run_id"]
    config_path.unlink()
    capsys.readouterr()

    assert main([*run, "--epochs", "2"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert json.loads(config_path.read_text())["run_id"] == run_id


# --- a failed save --------------------------------------------------------------------------


def test_a_save_that_torch_fails_with_a_runtime_error_exits_4_with_one_line(
        tmp_path, capsys, monkeypatch):
    """torch.save reports a full disk or ``ulimit -f`` as a RuntimeError of its zip writer."""
    run = charlm_run(tmp_path)
    assert main([*run, "--epochs", "1"]) == 0
    last = read_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["meta"]["iteration"]
    capsys.readouterr()

    def disk_full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", disk_full)
    assert main([*run, "--epochs", "2"]) == 4
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "could not save" in errors[0], errors
    assert "inline_container.cc" in errors[0]
    monkeypatch.undo()
    assert read_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["meta"]["iteration"] \
        == last


# --- a new run length keeps every param group's own LR ------------------------------------


def test_a_longer_muon_run_resumed_ends_bit_identical_to_a_straight_one(tmp_path, capsys):
    """Under --scheduler none only the SGD groups follow --lr: a resume with a new --epochs
    must leave the Muon group at its own peak (--muon-lr), as the straight run has it."""
    straight = [*CIFAR_MUON, "--run-dir", str(tmp_path / "straight")]
    resumed = [*CIFAR_MUON, "--run-dir", str(tmp_path / "resumed")]
    assert main([*straight, "--epochs", "2"]) == 0
    assert main([*resumed, "--epochs", "1"]) == 0
    capsys.readouterr()
    assert main([*resumed, "--epochs", "2"]) == 0
    assert "resumed from" in capsys.readouterr().out

    state = read_checkpoint(tmp_path / "resumed" / "checkpoints" / "last.pt")
    groups = {group["name"]: group["lr"] for group in state["optimizer"]["param_groups"]}
    assert groups["muon"] == Config().muon_lr, groups
    expected = final_weights(tmp_path / "straight")
    for name, tensor in final_weights(tmp_path / "resumed").items():
        assert torch.equal(tensor, expected[name]), name


def test_a_finished_run_given_more_epochs_says_how_far_its_lr_goes_back_up(tmp_path, capsys):
    """--epochs 1 -> 2 after the schedule has decayed: the LR line names the change and the
    LR the next step takes, the one a fresh 2-epoch run holds at that step (stopped there by
    --max-steps)."""
    run = [*CIFAR, "--device", "cpu", "--warmup-epochs", "0.5"]
    assert main([*run, "--run-dir", str(tmp_path / "fresh"), "--epochs", "2",
                 "--max-steps", "4"]) == 0
    assert main([*run, "--run-dir", str(tmp_path / "run"), "--epochs", "1"]) == 0
    decayed = read_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    capsys.readouterr()

    assert main([*run, "--run-dir", str(tmp_path / "run"), "--epochs", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("LR schedule:")]
    fresh = read_checkpoint(tmp_path / "fresh" / "checkpoints" / "last.pt")
    before, after = (state["optimizer"]["param_groups"][0]["lr"] for state in (decayed, fresh))
    assert before < after / 2  # the 1-epoch schedule had decayed: the LR goes back up
    assert lines == [f"LR schedule: --epochs 1 -> 2: from step 4 on, lr {before:.4g} -> "
                     f"{after:.4g} (where a fresh run with these values would be)"]
