"""The checkpointer's arguments: each refusal's exact message and the smallest values
allowed."""

from pathlib import Path

import pytest
from torch import nn

from handlers.checkpoint.checkpointer import Checkpointer
from handlers.goal import Goal
from tests.handlers.checkpoint.checkpoint_run import (
    _build,
    _evaluate,
    _exactly,
    _move_trainer_to,
    _OnlyLoadStateDict,
    _OnlyStateDict,
)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"run_id": ""}, "run_id must be a non-empty string, got ''"),
        ({"config": ["lr"]}, "config must be a dict or None, got list"),
        ({"config": {"root": Path("x")}}, "config must hold plain values: config['root'] is a "
                                          "PosixPath, which torch.load(weights_only=True) refuses"),
        ({"keep_last": 0}, "keep_last must be an int >= 1 (checkpoints), got 0"),
        ({"keep_best": 1.5}, "keep_best must be an int >= 1 (checkpoints), got 1.5"),
        ({"best": "acc"}, "best must be a Goal(metric, mode) or None, got 'acc'"),
        ({"save_every": 0}, "save_every must be an int >= 1 (optimizer steps), got 0"),
        ({"file_mode": 0o400}, "file_mode must be a permission such as 0o640 or 0o600 that lets "
                               "the owner read and write, got 256"),
        ({"file_mode": 0o1640}, "file_mode must be a permission such as 0o640 or 0o600 that "
                                "lets the owner read and write, got 928"),
        ({"file_mode": "0o640"}, "file_mode must be a permission such as 0o640 or 0o600 that "
                                 "lets the owner read and write, got '0o640'"),
        ({"file_mode": True}, "file_mode must be a permission such as 0o640 or 0o600 that lets "
                              "the owner read and write, got True"),
    ],
)
def test_each_bad_argument_is_refused_with_its_name_and_what_is_allowed(tmp_path, kwargs,
                                                                         message):
    run = _build(tmp_path / "run")
    to_save = {"model": run.model, "trainer": run.trainer}
    with pytest.raises(ValueError, match=_exactly(message)):
        Checkpointer(tmp_path / "refused", to_save, **{"run_id": "r", **kwargs})
    assert not (tmp_path / "refused").exists()  # nothing created before the checks passed


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({1: nn.Linear(1, 1)}, "to_save key 1 is not allowed: use a string other than meta, "
                               "checkpointer"),
        ({"half": _OnlyStateDict()}, "to_save['half'] has no state_dict()/load_state_dict()"),
        ({"half": _OnlyLoadStateDict()}, "to_save['half'] has no state_dict()/load_state_dict()"),
    ],
)
def test_each_to_save_entry_must_be_named_by_a_string_and_have_both_state_methods(
    tmp_path, extra, message
):
    run = _build(tmp_path)
    with pytest.raises(ValueError, match=_exactly(message)):
        Checkpointer(tmp_path, {"model": run.model, "trainer": run.trainer, **extra}, run_id="r")


def test_to_save_that_is_not_a_mapping_is_refused(tmp_path):
    with pytest.raises(ValueError, match=_exactly(
            "to_save must be a dict holding at least 'model' and 'trainer'")):
        Checkpointer(tmp_path, ("model", "trainer"), run_id="r")


def test_the_smallest_allowed_values_and_a_folder_whose_parents_do_not_exist_yet(tmp_path):
    run = _build(tmp_path / "run")
    to_save = {"model": run.model, "trainer": run.trainer}
    ckpt = Checkpointer(tmp_path / "new" / "deeper", to_save, run_id="r", keep_last=1,
                        keep_best=1, save_every=1, file_mode=0o600)
    assert ckpt.dirname.is_dir()
    assert (ckpt.keep_last, ckpt.keep_best, ckpt.save_every) == (1, 1, 1)


def test_any_mode_that_lets_the_owner_read_and_write_is_allowed(tmp_path):
    run = _build(tmp_path, file_mode=0o755)
    _move_trainer_to(run, 1)
    run.ckpt.save_last(run.trainer)
    assert {path.stat().st_mode & 0o777 for path in tmp_path.iterdir()} == {0o755}


def test_by_default_the_last_3_and_the_best_1_are_kept(tmp_path):
    run = _build(tmp_path, best=Goal("acc", "max"))
    for step in range(1, 5):
        _move_trainer_to(run, step)
        run.ckpt.save_last(run.trainer)
    for step, score in [(5, 0.5), (6, 0.7)]:
        _evaluate(run, step, score)
    state = run.ckpt.state_dict()
    assert state["history"] == ["step-00000002.pt", "step-00000003.pt", "step-00000004.pt"]
    assert [entry["file"] for entry in state["best"]] == ["best-step-00000006.pt"]
