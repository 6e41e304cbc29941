"""The checkpointer's folder: which checkpoints it keeps (last, history, best), its links,
when it saves once attached, what a save records, and an eviction that fails."""

import errno
import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path

import pytest
import torch
from ignite.engine import Engine, Events

import handlers.checkpoint.files as checkpoint_files_module
from handlers.checkpoint.files import CheckpointError
from handlers.checkpoint.formats import read_checkpoint
from handlers.goal import Goal
from tests.handlers.checkpoint.checkpoint_run import (
    DATA,
    InterruptAt,
    Interrupted,
    _build,
    _evaluate,
    _in_an_epoch_of_10,
    _move_trainer_to,
    _names,
    _save_every_step,
)


def test_history_keeps_the_last_n_and_last_pt_is_the_newest(tmp_path, monkeypatch):
    saves = []
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f: saves.append(1) or real_save(obj, f))
    run = _save_every_step(_build(tmp_path, keep_last=2, config={"lr": 0.1, "tags": ["a"]}))
    run.trainer.run(DATA[:3], max_epochs=1)
    run.trainer.run(DATA[:3], max_epochs=2)  # 6 steps; each epoch end is the step just saved

    assert len(saves) == 6
    assert _names(tmp_path) == {"step-00000005.pt", "step-00000005.pt.json", "step-00000006.pt",
                                "step-00000006.pt.json", "last.pt", "last.pt.json"}
    assert (tmp_path / "last.pt").samefile(tmp_path / "step-00000006.pt")
    assert (tmp_path / "last.pt.json").samefile(tmp_path / "step-00000006.pt.json")
    loaded = torch.load(tmp_path / "last.pt", weights_only=True)
    for name, tensor in run.model.state_dict().items():
        assert torch.equal(loaded["model"][name], tensor)
    meta = loaded["meta"]
    position = (meta["epoch"], meta["iteration"], meta["optimizer_step"])
    assert (meta["run_id"], meta["kind"], position) == ("run-a", "last", (2, 6, 6))
    assert meta["config"] == {"lr": 0.1, "tags": ["a"]} and meta["format_version"] == 1
    sidecar = json.loads((tmp_path / "last.pt.json").read_text())
    assert sidecar["sha256"] == hashlib.sha256((tmp_path / "last.pt").read_bytes()).hexdigest()
    assert sidecar["size_bytes"] == (tmp_path / "last.pt").stat().st_size
    for path in tmp_path.iterdir():
        assert path.stat().st_mode & 0o777 == 0o640, path


def test_file_mode_0600_is_applied(tmp_path):
    run = _build(tmp_path, file_mode=0o600)
    _move_trainer_to(run, 1)
    run.ckpt.save_last(run.trainer)
    assert {path.stat().st_mode & 0o777 for path in tmp_path.iterdir()} == {0o600}


def test_best_keeps_the_top_k_and_best_pt_is_the_best(tmp_path, caplog):
    run = _build(tmp_path, keep_best=2, best=Goal("acc", "max"))
    with caplog.at_level(logging.WARNING, logger="handlers.checkpoint.checkpointer"):
        for step, score in enumerate([0.1, 0.5, 0.3, float("nan"), 0.7, 0.2, 0.5], start=1):
            _evaluate(run, step, score)

    assert "acc=nan is not finite" in caplog.text
    assert sorted(name for name in _names(tmp_path) if name.startswith("best-")) == [
        "best-step-00000002.pt", "best-step-00000002.pt.json",
        "best-step-00000005.pt", "best-step-00000005.pt.json",
    ]  # step 7 ties with step 2 and ranks below it
    assert (tmp_path / "best.pt").samefile(tmp_path / "best-step-00000005.pt")
    assert (tmp_path / "last.pt").samefile(tmp_path / "best-step-00000005.pt")  # newest written
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    assert best["model"]["0.weight"][0, 0] == 5
    assert best["meta"]["metric"] == {"name": "acc", "value": 0.7}
    assert [entry["score"] for entry in run.ckpt.state_dict()["best"]] == [0.7, 0.5]


def test_mode_min_and_a_nan_first_score_is_never_best(tmp_path):
    run = _build(tmp_path, best=Goal("loss", "min"))
    _evaluate(run, 1, float("nan"), metric="loss")
    assert not list(tmp_path.iterdir())
    for step, score in [(2, 3.0), (3, 1.0), (4, 2.0)]:
        _evaluate(run, step, score, metric="loss")
    assert read_checkpoint(tmp_path / "best.pt")["meta"]["optimizer_step"] == 3
    assert not (tmp_path / "best-step-00000002.pt").exists()


def test_retention_and_best_tracking_survive_a_resume(tmp_path):
    run = _save_every_step(_build(tmp_path, keep_last=2, best=Goal("acc", "max")))
    run.trainer.run(DATA[:3], max_epochs=1)
    evaluator = Engine(lambda engine, batch: None)
    evaluator.state.metrics = {"acc": 0.9}
    run.ckpt.save_best(evaluator)  # best at step 3, after last saved it: a new, newer file

    resumed = _save_every_step(_build(tmp_path, seed=5, keep_last=2, best=Goal("acc", "max")))
    assert resumed.ckpt.resume("auto").path.name == "last.pt"
    assert resumed.ckpt.state_dict() == run.ckpt.state_dict()
    resumed.trainer.run(DATA[:3], max_epochs=2)
    evaluator.state.metrics = {"acc": 0.8}  # worse than the best before the resume
    resumed.ckpt.save_best(evaluator)

    assert _names(tmp_path) == {"step-00000005.pt", "step-00000005.pt.json", "step-00000006.pt",
                                "step-00000006.pt.json", "best-step-00000003.pt",
                                "best-step-00000003.pt.json", "best.pt", "best.pt.json",
                                "last.pt", "last.pt.json"}


def test_a_save_at_the_iteration_just_saved_is_skipped(tmp_path):
    run = _build(tmp_path)
    _move_trainer_to(run, 4)
    run.ckpt.save_last(run.trainer)
    first = (tmp_path / "last.pt").stat().st_ino
    run.ckpt.save_last(run.trainer)
    assert (tmp_path / "last.pt").stat().st_ino == first


def test_after_a_resume_a_save_at_the_resumed_iteration_is_skipped_for_last_and_best(tmp_path):
    run = _save_every_step(_build(tmp_path, best=Goal("acc", "max")))
    run.trainer.run(DATA[:3], max_epochs=1)
    evaluator = Engine(lambda engine, batch: None)
    evaluator.state.metrics = {"acc": 0.9}
    run.ckpt.save_best(evaluator)
    inodes = {name: (tmp_path / name).stat().st_ino for name in ("last.pt", "best.pt")}

    resumed = _build(tmp_path, seed=5, best=Goal("acc", "max"))
    resumed.ckpt.resume("auto")
    resumed.ckpt.save_last(resumed.trainer)
    evaluator.state.metrics = {"acc": 0.95}  # better, but the iteration was saved as best
    resumed.ckpt.save_best(evaluator)
    assert {name: (tmp_path / name).stat().st_ino for name in inodes} == inodes


def test_the_checkpointers_state_dict_carries_the_iterations_it_saved_last_and_best(tmp_path):
    run = _build(tmp_path, best=Goal("acc", "max"))
    _move_trainer_to(run, 2)
    run.ckpt.save_last(run.trainer)
    _evaluate(run, 3, 0.5)  # a best save is also the newest save
    state = run.ckpt.state_dict()
    assert (state["last_iteration"], state["best_iteration"]) == (3, 3)


def test_each_checkpoint_records_whether_it_was_saved_as_last_or_as_best_and_its_score(tmp_path):
    run = _build(tmp_path, best=Goal("acc", "max"))
    _move_trainer_to(run, 2)
    run.ckpt.save_last(run.trainer)
    _move_trainer_to(run, 3)
    _evaluate(run, 3, 0.5)
    metas = {name: read_checkpoint(tmp_path / name)["meta"]
             for name in ("step-00000002.pt", "best-step-00000003.pt")}
    assert {name: (meta["kind"], meta["metric"]) for name, meta in metas.items()} == {
        "step-00000002.pt": ("last", None),
        "best-step-00000003.pt": ("best", {"name": "acc", "value": 0.5})}


def test_a_resume_finishes_the_eviction_an_interrupted_save_left_halfway(tmp_path):
    run = _build(tmp_path, keep_last=1)
    state = run.trainer.state
    state.epoch, state.epoch_length, state.max_epochs = 1, 10, 1
    _move_trainer_to(run, 1)
    run.ckpt.save_last(run.trainer)
    run.ckpt._crash = InterruptAt("during_eviction")
    _move_trainer_to(run, 2)
    with pytest.raises(Interrupted):
        run.ckpt.save_last(run.trainer)  # step 1's .pt deleted, its sidecar not yet
    assert "step-00000001.pt.json" in _names(tmp_path)

    _build(tmp_path, seed=5, keep_last=1).ckpt.resume("auto")
    assert {name for name in _names(tmp_path) if name.startswith("step-")} == {
        "step-00000002.pt", "step-00000002.pt.json"}


def test_a_first_save_interrupted_before_its_sidecar_leaves_a_fresh_start(tmp_path):
    run = _build(tmp_path)
    _move_trainer_to(run, 1)
    run.ckpt._crash = InterruptAt("before_sidecar")
    with pytest.raises(Interrupted):
        run.ckpt.save_last(run.trainer)
    assert _names(tmp_path) == {"step-00000001.pt"}  # never committed
    assert _build(tmp_path, seed=5).ckpt.resume() is None  # the default source is "auto"


def test_a_checkpoint_from_another_folder_restores_the_run_but_not_its_retention(tmp_path):
    run = _save_every_step(_build(tmp_path / "a", keep_last=2))
    run.trainer.run(DATA[:3], max_epochs=1)

    other = _build(tmp_path / "b", seed=5, keep_last=2)
    info = other.ckpt.resume(tmp_path / "a" / "last.pt")
    assert info.rejected == [] and other.trainer.state.iteration == 3
    assert other.ckpt.state_dict()["history"] == []  # "a"'s files are not "b"'s to evict


def test_a_checkpoint_entry_this_run_does_not_restore_is_named_in_a_warning(tmp_path, caplog):
    run = _save_every_step(_build(tmp_path, with_rng=True))
    run.trainer.run(DATA[:1], max_epochs=1)
    with caplog.at_level(logging.WARNING, logger="handlers.checkpoint.checkpointer"):
        _build(tmp_path, seed=5, with_rng=False).ckpt.resume("auto")
    assert "also holds ['rng'], which this run does not restore" in caplog.text


def test_a_checkpointer_state_without_its_keys_is_refused_naming_them(tmp_path):
    with pytest.raises(ValueError, match=r"checkpointer state is missing "
                                         r"\['best', 'best_iteration', 'evict'"):
        _build(tmp_path).ckpt.load_state_dict({"history": []})


def test_attach_saves_on_the_cadence_at_each_epoch_end_and_at_each_evaluation(tmp_path):
    calls = []

    def recorded(save):
        def record_then_save(engine):
            calls.append((save.__name__, run.trainer.state.optimizer_step))
            save(engine)
        return record_then_save

    run = _build(tmp_path, best=Goal("acc", "max"), save_every=3, wrap_save=recorded)
    scores = iter([0.5, 0.4])
    evaluator = Engine(lambda engine, batch: None)
    evaluator.add_event_handler(Events.COMPLETED,
                                lambda engine: engine.state.metrics.update(acc=next(scores)))
    run.trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: evaluator.run([0]))
    run.ckpt.attach(run.trainer, evaluator)
    run.trainer.run(DATA, max_epochs=2)  # 4 steps an epoch
    # Step 3 and 6 on the cadence; 4 and 8 end an epoch, saved after its evaluation.
    assert calls == [("save_last", 3), ("save_best", 4), ("save_last", 4), ("save_last", 6),
                     ("save_best", 8), ("save_last", 8)]
    # Step 4's best checkpoint is also its last: that save_last is skipped.
    assert {name for name in _names(tmp_path) if name.endswith(".pt")} == {
        "step-00000003.pt", "step-00000006.pt", "step-00000008.pt", "last.pt",
        "best-step-00000004.pt", "best.pt"}


def test_a_cadence_step_that_ends_an_epoch_is_saved_once_by_the_epochs_save(tmp_path):
    calls = []

    def recorded(save):
        def record_then_save(engine):
            calls.append(run.trainer.state.optimizer_step)
            save(engine)
        return record_then_save

    run = _build(tmp_path, save_every=2, wrap_save=recorded)
    run.ckpt.attach(run.trainer)
    run.trainer.run(DATA, max_epochs=2)  # 4 steps an epoch: steps 4 and 8 end one
    assert calls == [2, 4, 6, 8]


def test_attach_without_an_evaluator_or_a_goal_saves_no_best(tmp_path):
    for options in ({"best": Goal("acc", "max")}, {}):
        run = _build(tmp_path / str(len(options)), **options)
        evaluator = Engine(lambda engine, batch: None)
        run.ckpt.attach(run.trainer, None if options else evaluator)
        assert not evaluator.has_event_handler(run.ckpt.best_handler, Events.COMPLETED)
        run.trainer.run(DATA, max_epochs=1)
        assert "best.pt" not in _names(run.ckpt.dirname) and "last.pt" in _names(run.ckpt.dirname)


def test_attach_to_another_trainer_is_refused(tmp_path):
    run, other = _build(tmp_path / "a"), _build(tmp_path / "b")
    with pytest.raises(ValueError, match="trainer in its to_save"):
        run.ckpt.attach(other.trainer)


def test_without_readable_sidecars_last_pt_ranks_first_then_the_steps_then_best_pt(tmp_path):
    """Only an order of what to verify first; a step-0 file (an epoch whose every step was
    skipped) still ranks above best.pt."""
    names = ["best.pt", "step-00000000.pt", "last.pt", "step-00000002.pt"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
        (tmp_path / f"{name}.json").write_text("not json")
    ranked = sorted((tmp_path / name for name in names), key=checkpoint_files_module
                    .claimed_position, reverse=True)
    assert [path.name for path in ranked] == [
        "last.pt", "step-00000002.pt", "step-00000000.pt", "best.pt"]


def test_without_readable_sidecars_last_dcp_ranks_first_as_last_pt_does(tmp_path):
    """The sharded format's link names rank as the single file's: last first, best last."""
    names = ["best.dcp", "step-00000001.dcp", "last.dcp"]
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / f"{name}.json").write_text("not json")
    ranked = sorted((tmp_path / name for name in names), key=checkpoint_files_module
                    .claimed_position, reverse=True)
    assert [path.name for path in ranked] == ["last.dcp", "step-00000001.dcp", "best.dcp"]


def test_resume_tries_last_pt_then_history_before_best_at_the_same_step_then_best_pt(tmp_path):
    run = _build(tmp_path, best=Goal("acc", "max"))
    _move_trainer_to(run, 3)
    run.ckpt.save_last(run.trainer)
    _evaluate(run, 3, 0.5)  # best-step-00000003.pt, which last.pt and best.pt now link to
    names = ["last.pt", "step-00000003.pt", "best-step-00000003.pt", "best.pt"]
    for name in names:  # each its own bad file
        (tmp_path / name).unlink()
        (tmp_path / name).write_bytes(b"garbage")
    with pytest.raises(CheckpointError) as error:
        _build(tmp_path, seed=5, best=Goal("acc", "max")).ckpt.resume("auto")
    tried = re.findall(r"([\w.-]+\.pt): ", str(error.value).partition("no usable checkpoint")[2])
    assert tried == names


def test_a_save_records_when_it_was_made_and_its_sidecar_names_its_file(tmp_path):
    run = _build(tmp_path)
    _move_trainer_to(run, 1)
    before = time.time()
    run.ckpt.save_last(run.trainer)
    after = time.time()
    meta = read_checkpoint(tmp_path / "last.pt")["meta"]
    assert before <= meta["saved_at_unix"] <= after
    sidecar = json.loads((tmp_path / "last.pt.json").read_text())
    assert sidecar["saved_at_unix"] == meta["saved_at_unix"]
    assert sidecar["file"] == "step-00000001.pt"


def test_a_resume_after_a_finished_eviction_leaves_nothing_pending(tmp_path, caplog):
    """The checkpoint lists what its save was about to evict; by the resume both files of
    step 1 are long gone, which is no failure to delete them."""
    run = _in_an_epoch_of_10(_build(tmp_path, keep_last=1))
    for step in (1, 2):
        _move_trainer_to(run, step)
        run.ckpt.save_last(run.trainer)
    assert read_checkpoint(tmp_path / "last.pt")["checkpointer"]["evict"] == ["step-00000001.pt"]

    resumed = _build(tmp_path, seed=5, keep_last=1)
    with caplog.at_level(logging.WARNING, logger="handlers.checkpoint.checkpointer"):
        resumed.ckpt.resume("auto")
    assert resumed.ckpt.state_dict()["evict"] == []
    assert "could not delete" not in caplog.text


def test_an_evicted_checkpoint_that_cannot_be_deleted_is_retried_at_the_next_save(
    tmp_path, monkeypatch, caplog
):
    run = _build(tmp_path, keep_last=1)
    _move_trainer_to(run, 1)
    run.ckpt.save_last(run.trainer)
    real_unlink, refused = os.unlink, []

    def unlink_refusing_step_1_once(path, *args, **kwargs):
        if Path(path).name == "step-00000001.pt" and not refused:
            refused.append(path)
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink_refusing_step_1_once)
    _move_trainer_to(run, 2)
    with caplog.at_level(logging.WARNING, logger="handlers.checkpoint.checkpointer"):
        run.ckpt.save_last(run.trainer)
    assert refused and "could not delete evicted checkpoint step-00000001.pt" in caplog.text
    assert run.ckpt.state_dict()["evict"] == ["step-00000001.pt"]
    assert {"step-00000001.pt", "step-00000001.pt.json"} <= _names(tmp_path)

    _move_trainer_to(run, 3)
    run.ckpt.save_last(run.trainer)
    assert run.ckpt.state_dict()["evict"] == []
    assert {name for name in _names(tmp_path) if name.startswith("step-")} == {
        "step-00000003.pt", "step-00000003.pt.json"}


def test_of_two_checkpoints_of_one_step_the_later_iteration_is_resumed_first(tmp_path):
    """A spike-guard rollback repeats a step number at a later iteration: step 3 saved at
    iteration 3, then its best at iteration 5."""
    run = _in_an_epoch_of_10(_build(tmp_path, best=Goal("acc", "max")))
    _move_trainer_to(run, 3)
    run.ckpt.save_last(run.trainer)
    run.trainer.state.iteration = 5
    evaluator = Engine(lambda engine, batch: None)
    evaluator.state.metrics = {"acc": 0.5}
    run.ckpt.save_best(evaluator)
    (tmp_path / "last.pt").unlink()
    (tmp_path / "last.pt").write_bytes(b"garbage")

    info = _build(tmp_path, seed=5, best=Goal("acc", "max")).ckpt.resume("auto")
    assert (info.path.name, info.meta["iteration"]) == ("best-step-00000003.pt", 5)
