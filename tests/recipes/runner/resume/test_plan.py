"""The resume plan: one test per branch of what a start does (continue, from which
checkpoint, with which overrides, start afresh, or report a completed run) and why."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from recipes.runner.config.command_line import ConfigError, parse_args
from recipes.runner.config.registry import load_recipe
from recipes.runner.resume import plan as resume_plan
from recipes.runner.resume.plan import (
    COMPLETE,
    CONTINUE,
    FRESH,
    fresh_init_from,
    plan_resume,
)

RECIPE = load_recipe("charlm")
STAMPED = re.compile(r"runs/charlm/\d{8}-\d{6}")


def start(*args: str):
    """A charlm command line parsed as ``python -m recipes charlm ...`` parses it."""
    return parse_args(RECIPE.config, ["--device", "cpu", *args])


def plan(*args: str):
    """The plan of a start and its settled config; the parsed config is never written."""
    config, given = start(*args)
    before = dataclasses.asdict(config)
    got = plan_resume("charlm", RECIPE.best, config, given)
    assert dataclasses.asdict(config) == before
    return got, got.config


def saved_run(name: str, run_id: str = "run-a", status: str | None = None, **keys) -> Path:
    """``runs/charlm/<name>`` as an earlier start of ``start()`` leaves it: config.json (and a
    summary); a name that is no timestamp was given as --run-name."""
    folder = Path("runs/charlm") / name
    folder.mkdir(parents=True)
    named = {} if STAMPED.fullmatch(str(folder)) else {"run_name": name}
    config = dataclasses.asdict(start()[0]) | {"run_dir": str(folder)} | named | keys
    (folder / "config.json").write_text(json.dumps({"run_id": run_id, "config": config}))
    if status is not None:
        (folder / "summary.json").write_text(json.dumps({"status": status,
                                                         "best_val_loss": 1.5}))
    return folder


def committed_checkpoint(folder: Path) -> None:
    (folder / "checkpoints").mkdir(parents=True, exist_ok=True)
    (folder / "checkpoints" / "step-00000004.pt").write_bytes(b"weights")
    (folder / "checkpoints" / "step-00000004.pt.json").write_text("{}")


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)


# --- a folder named by --run-name or --run-dir --------------------------------------------


def test_a_named_folder_without_a_run_starts_afresh_with_a_new_run_id(tmp_path):
    first, _ = plan("--run-name", "a")
    second, _ = plan("--run-name", "a")
    assert first.action == FRESH and first.run_dir == Path("runs/charlm/a")
    assert first.source == "auto" and first.saved is None and first.notes == ()
    assert first.run_id and first.run_id != second.run_id
    assert "holds no run" in first.reason


def test_a_named_folder_with_a_run_continues_it_with_the_given_keys_as_overrides(tmp_path):
    saved_run("a", epochs=1, lr=0.5)
    got, config = plan("--run-name", "a", "--lr", "0.01")
    assert (got.action, got.run_id, got.source) == (CONTINUE, "run-a", "auto")
    assert got.notes == ("override: lr 0.5 -> 0.01",)
    assert config.epochs == 1  # a key not given again is the run's
    assert "holds run run-a" in got.reason and "newest checkpoint" in got.reason


def test_a_run_without_config_json_continues_from_what_its_checkpoint_holds(monkeypatch):
    seen = []

    def from_checkpoint(folder: Path) -> dict:
        seen.append(folder)
        return {"run_id": "run-b", "config": dataclasses.asdict(start()[0])}

    monkeypatch.setattr(resume_plan, "saved_in_checkpoints", from_checkpoint)
    got, _ = plan("--run-name", "a")
    assert (got.action, got.run_id) == (CONTINUE, "run-b")
    assert seen == [Path("runs/charlm/a/checkpoints")]


def test_a_folder_of_another_recipe_is_refused_naming_both(tmp_path):
    folder = saved_run("a")
    record = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**record, "recipe": "cifar"}))
    with pytest.raises(ConfigError) as raised:
        plan("--run-name", "a", "--lr", "0.01")
    assert str(raised.value) == (
        "runs/charlm/a is a cifar run; this is charlm (to continue it: python -m recipes "
        "cifar --run-dir runs/charlm/a; or give another --run-dir or --run-name)")


def test_a_folder_written_before_runs_named_their_recipe_is_known_by_its_keys(tmp_path):
    saved_run("a", tta="mirror", final_tta="none")  # cifar's keys, no "recipe"
    with pytest.raises(ConfigError, match=r"^runs/charlm/a is not a charlm run: its config "
                                          r"has keys charlm lacks \(final_tta, tta\)"):
        plan("--run-name", "a")


def test_resume_with_a_file_continues_from_that_file(tmp_path):
    saved_run("a")
    Path("old.pt").touch()
    got, _ = plan("--run-name", "a", "--resume", "old.pt")
    assert (got.action, got.source) == (CONTINUE, "old.pt")
    assert "the checkpoint given by --resume" in got.reason


def test_resume_never_starts_an_empty_named_folder_afresh(tmp_path):
    saved_run("a")  # a config.json but no checkpoint
    got, _ = plan("--run-name", "a", "--resume", "never")
    assert (got.action, got.source, got.saved) == (FRESH, "never", None)
    assert got.run_id != "run-a" and "--resume never" in got.reason


def test_resume_never_refuses_a_folder_that_holds_checkpoints(tmp_path):
    committed_checkpoint(saved_run("a"))
    with pytest.raises(ConfigError, match="^--resume never: runs/charlm/a already holds "
                                          "checkpoints"):
        plan("--run-name", "a", "--resume", "never")


def test_never_and_auto_agree_on_a_first_save_killed_before_its_sidecar(tmp_path):
    """Not committed: both start the folder afresh (one predicate, ``committed_checkpoints``)."""
    folder = Path("runs/charlm/a/checkpoints")
    folder.mkdir(parents=True)
    (folder / "step-00000004.pt").write_bytes(b"half a save")
    assert plan("--run-name", "a", "--resume", "never")[0].action == FRESH
    assert plan("--run-name", "a")[0].action == FRESH
    (folder / "step-00000004.pt.json").write_text("{}")  # committed
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        plan("--run-name", "a", "--resume", "never")


def test_a_named_folder_whose_summary_says_completed_is_reported_before_anything_is_built(
        tmp_path):
    committed_checkpoint(saved_run("a", status="completed"))
    got, config = plan("--run-name", "a")
    assert (got.action, got.run_dir) == (COMPLETE, Path("runs/charlm/a"))
    assert got.report == ("the run is already complete: runs/charlm/a (best validation loss "
                          "1.5; runs/charlm/a/summary.json)\nto train it again from the start, "
                          "give another --run-name")


def test_a_named_folder_killed_before_its_summary_is_continued(tmp_path):
    """Its last checkpoint may be the final one: the run then trains nothing and writes its
    end again (the reliability suite's rerun of a finished run)."""
    committed_checkpoint(saved_run("a", status="interrupted by SIGTERM"))
    assert plan("--run-name", "a")[0].action == CONTINUE


def test_an_empty_run_name_is_refused():
    with pytest.raises(ConfigError, match="^--run-name: must not be empty"):
        plan("--run-name", "")


# --- a command that names no folder ------------------------------------------------------


def test_the_first_start_of_a_command_gets_a_new_timestamped_folder(tmp_path):
    got, config = plan()
    assert got.action == FRESH and STAMPED.fullmatch(config.run_dir)
    assert got.run_dir == Path(config.run_dir) and "no earlier run" in got.reason
    assert not (tmp_path / "runs").exists()  # planning writes nothing


def test_resume_never_gets_a_new_folder_beside_the_same_run(tmp_path):
    saved_run("20260101-000000")
    got, config = plan("--resume", "never")
    assert got.action == FRESH and config.run_dir != "runs/charlm/20260101-000000"
    assert "--resume never: a new timestamped folder" in got.reason


def test_the_newest_run_of_the_same_keys_is_continued(tmp_path, capsys):
    saved_run("20260101-000000", status="interrupted by SIGTERM")
    got, config = plan()
    assert (got.action, got.run_id) == (CONTINUE, "run-a")
    assert config.run_dir == "runs/charlm/20260101-000000"
    assert "the newest run of these keys" in got.reason
    assert got.notes[0].startswith("continuing runs/charlm/20260101-000000 ")
    assert capsys.readouterr().out == ""  # the plan tells; its caller says


def test_a_completed_run_is_reported_and_nothing_is_planned(tmp_path):
    saved_run("20260101-000000", status="completed")
    got, _ = plan()
    assert got.action == COMPLETE and got.notes == ()
    assert got.run_dir == Path("runs/charlm/20260101-000000")
    assert got.report.startswith("the run is already complete: runs/charlm/20260101-000000 "
                                 "(best validation loss 1.5;")
    assert "completed" in got.reason


# --- torchrun restarts --------------------------------------------------------------------


@pytest.mark.parametrize("resume", ["never", "step-00000004.pt"])
def test_a_restarted_torchrun_group_resumes_auto_whatever_resume_asked(resume, monkeypatch,
                                                                       tmp_path):
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                        "TORCHELASTIC_RESTART_COUNT": "2"}.items():
        monkeypatch.setenv(name, value)
    committed_checkpoint(saved_run("a"))
    Path("step-00000004.pt").touch()
    got, config = plan("--run-name", "a", "--resume", resume)
    assert (got.action, got.source, config.resume) == (CONTINUE, "auto", "auto")
    assert got.notes == (f"torchrun restart 2: --resume {resume} becomes auto (the newest "
                         "good checkpoint of the run)",)


def test_the_first_start_of_a_torchrun_group_keeps_its_resume(monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                        "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(name, value)
    got, config = plan("--run-name", "a", "--resume", "never")
    assert got.source == config.resume == "never" and got.notes == ()


# --- --init-from --------------------------------------------------------------------------


def test_a_fresh_run_takes_init_from():
    got, _ = plan("--run-name", "a", "--init-from", "source.pt")
    assert (got.action, got.init_from, got.init_ignored) == (FRESH, "source.pt", "")


def test_a_run_that_already_saved_ignores_init_from_and_says_why(tmp_path):
    committed_checkpoint(saved_run("a"))
    got, _ = plan("--run-name", "a", "--init-from", "source.pt")
    assert got.action == CONTINUE and got.init_from == ""
    assert got.init_ignored == ("--init-from ignored: this run resumes from the checkpoints "
                                "of runs/charlm/a, which already started")


def test_resume_with_a_file_ignores_init_from_and_says_why(tmp_path):
    saved_run("a")
    Path("old.pt").touch()
    got, _ = plan("--run-name", "a", "--resume", "old.pt", "--init-from", "source.pt")
    assert got.init_from == ""
    assert got.init_ignored == "--init-from ignored: this run resumes from --resume old.pt"


def test_a_continued_run_that_never_saved_still_takes_its_init_from(tmp_path):
    """Killed before its first save: the run's own init_from (config.json) applies again,
    silently when not given again."""
    saved_run("a", init_from="source.pt")
    got, _ = plan("--run-name", "a")
    assert (got.action, got.init_from, got.init_ignored) == (CONTINUE, "source.pt", "")


@pytest.mark.parametrize("layout, resume, expected", [
    ("none", "auto", "w.pt"), ("none", "never", "w.pt"), ("none", "x.pt", ""),
    ("sidecar", "auto", ""), ("last", "auto", ""), ("uncommitted", "auto", "w.pt")])
def test_fresh_init_from_is_given_and_no_committed_checkpoint_and_no_resume_file(
        layout, resume, expected, tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    Path("x.pt").touch()
    if layout == "sidecar":
        (folder / "step-00000001.pt.json").write_text("{}")
    if layout == "last":
        (folder / "last.pt").write_bytes(b"")
    if layout == "uncommitted":  # a first save killed before its sidecar
        (folder / "step-00000001.pt").write_bytes(b"")
    config, _ = start("--init-from", "w.pt", "--resume", resume)
    assert fresh_init_from(config, tmp_path) == expected
    assert fresh_init_from(start()[0], tmp_path) == ""
