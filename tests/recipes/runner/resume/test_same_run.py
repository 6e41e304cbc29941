"""The same command again continues its run: a run without ``--run-name`` is found again by
its keys, a finished one is reported, ``--resume never`` starts anew, a stop prints the
command that continues it, and ``make train`` takes such a stop for no error. Also where a
run's folder is (``resolve_run_dir``) and which ``--run-name`` values are allowed."""

import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recipes.__main__ import main
from recipes.runner.config.run_keys import check_run_name
from recipes.runner.resume.plan import CONTINUE, FRESH, plan_resume
from recipes.runner.resume.same_run import continue_command, resolve_run_dir
from recipes.runner.training.group import join_group
from recipes.runner.training.lock import RunLock
from tests.helpers import (
    CHARLM_IN_FOLDER,
    REPO,
    RUN_RECIPE,
    charlm_config,
    digests,
    write_text,
)

TIMEOUT_SEC = 600
STAMPED = re.compile(r"\d{8}-\d{6}")


def run_command(command: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {key: value for key, value in os.environ.items()
             if not key.startswith(("RELIABILITY_", "CKPT_TEST_"))}
    return subprocess.run(command, cwd=cwd, env=clean | env, capture_output=True, text=True,
                          timeout=TIMEOUT_SEC)


def run_folders(cwd: Path) -> list[str]:
    root = cwd / "runs" / "charlm"
    return sorted(path.name for path in root.iterdir()) if root.is_dir() else []


def test_a_stopped_run_prints_the_command_that_continues_it_in_the_same_folder(tmp_path):
    write_text(tmp_path / "text.txt")
    command = [sys.executable, str(RUN_RECIPE), *CHARLM_IN_FOLDER]
    stopped = run_command(command, tmp_path, RELIABILITY_SIGNAL_AT="SIGTERM:iteration:5")
    assert stopped.returncode == 143, stopped.stderr
    # One count of epochs: the one in progress, 1-based, as the progress lines say.
    assert "\ninterrupted by SIGTERM: epoch 1/2, 5 steps in " in stopped.stdout
    [folder] = run_folders(tmp_path)
    assert STAMPED.fullmatch(folder)
    last_line = stopped.stdout.strip().splitlines()[-1]
    assert last_line == f"stopped; to continue this run: {shlex.join(command)}"

    printed = shlex.split(last_line.partition(": ")[2])
    continued = run_command(printed, tmp_path)
    assert continued.returncode == 0, continued.stderr
    assert f"continuing runs/charlm/{folder} " in continued.stdout
    assert "(epoch 1, iteration 5, step 5)\n" in continued.stdout
    assert run_folders(tmp_path) == [folder]
    summary = json.loads((tmp_path / "runs" / "charlm" / folder / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["epochs_completed"] == 2


def test_a_finished_run_is_reported_until_resume_never_starts_a_new_one(tmp_path):
    write_text(tmp_path / "text.txt")
    command = [sys.executable, "-m", "recipes", *CHARLM_IN_FOLDER]
    assert run_command(command, tmp_path).returncode == 0
    [first] = run_folders(tmp_path)
    before = digests(tmp_path)

    again = run_command(command, tmp_path)
    assert again.returncode == 0, again.stderr
    best = json.loads((tmp_path / "runs" / "charlm" / first / "summary.json").read_text())[
        "best_val_loss"]
    assert again.stdout.splitlines() == [
        f"the run is already complete: runs/charlm/{first} (best validation loss {best:.4g}; "
        f"runs/charlm/{first}/summary.json)",
        "to train it again from the start, give --resume never (a new timestamped folder) or "
        "a --run-name"]
    assert digests(tmp_path) == before  # nothing written, not even a lock file

    fresh = run_command([*command, "--resume", "never"], tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    assert "continuing" not in fresh.stdout and "resumed from" not in fresh.stdout
    [_, second] = run_folders(tmp_path)  # in the same second as the first, it is <first>-2
    reported = run_command(command, tmp_path)  # the newest run of the command
    assert f"the run is already complete: runs/charlm/{second} " in reported.stdout


# --- choosing the folder, in this process (nothing trained) --------------------------------


def fake_run(cwd: Path, name: str, config, status: str | None = None) -> Path:
    """A run folder as a start of ``config`` leaves it: config.json, and a summary."""
    folder = cwd / "runs" / "charlm" / name
    folder.mkdir(parents=True)
    saved = dataclasses.asdict(config) | {"run_dir": f"runs/charlm/{name}"}
    (folder / "config.json").write_text(json.dumps({"run_id": name, "config": saved}))
    if status is not None:
        (folder / "summary.json").write_text(json.dumps({"status": status,
                                                         "best_val_loss": 1.5}))
    return folder


def test_the_newest_run_with_the_same_keys_is_continued(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe, config, given = charlm_config()
    _, other, _ = charlm_config("--lr", "0.01")
    fake_run(tmp_path, "20260101-000000", config, "interrupted by SIGTERM")
    fake_run(tmp_path, "20260102-000000", config, "interrupted by SIGTERM")
    fake_run(tmp_path, "20260103-000000", other)  # newer, other keys
    (tmp_path / "runs" / "charlm" / "20260104-000000").mkdir()  # no config.json: unknown
    fake_run(tmp_path, "named", config)  # not a timestamp: only --run-name continues it

    plan = plan_resume("charlm", recipe.best, config, given)
    assert plan.action == CONTINUE and plan.config.run_dir == "runs/charlm/20260102-000000"
    assert plan.notes[0].startswith("continuing runs/charlm/20260102-000000 ")


@pytest.mark.parametrize("extra", [("--resume", "never"), ("--lr", "0.01")])
def test_resume_never_or_other_keys_make_a_new_folder(extra, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe, config, given = charlm_config(*extra)
    fake_run(tmp_path, "20260101-000000", charlm_config()[1], "interrupted by SIGTERM")

    plan = plan_resume("charlm", recipe.best, config, given)
    assert plan.action == FRESH and plan.notes == ()
    assert STAMPED.fullmatch(plan.run_dir.name) and plan.config.run_dir != (
        "runs/charlm/20260101-000000")
    assert run_folders(tmp_path) == ["20260101-000000"]  # choosing creates nothing


def test_a_new_folder_never_reuses_a_timestamp_taken_in_the_same_second(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda _: "20260101-000000")
    recipe, config, given = charlm_config("--resume", "never")
    fake_run(tmp_path, "20260101-000000", config)
    fake_run(tmp_path, "20260101-000000-2", config)
    assert plan_resume("charlm", recipe.best, config, given).config.run_dir == (
        "runs/charlm/20260101-000000-3")


def test_keys_from_a_runs_config_json_never_find_that_run_itself(tmp_path, monkeypatch):
    """``--config runs/<run>/config.json`` gives that run's keys: the newest run of those keys
    is the run itself, which this start must not continue or report (its note says it takes
    the keys, not the run); an older run of the same keys, or the run this command started
    before, is found as usual."""
    monkeypatch.chdir(tmp_path)
    recipe, config, given = charlm_config()
    fake_run(tmp_path, "20260101-000000", config, "interrupted by SIGTERM")
    fake_run(tmp_path, "20260102-000000", config, "completed")  # the config.json given

    plan = plan_resume("charlm", recipe.best, config, given, keys_from="20260102-000000")
    assert plan.action == CONTINUE and plan.config.run_dir == "runs/charlm/20260101-000000"
    _, config, _ = charlm_config()
    assert plan_resume("charlm", recipe.best, config, given,
                       keys_from="20260101-000000").action == "complete"


def test_a_named_run_is_left_to_the_run_layer(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe, config, given = charlm_config("--run-name", "mine")
    fake_run(tmp_path, "20260101-000000", charlm_config()[1], "completed")
    plan = plan_resume("charlm", recipe.best, config, given)
    assert plan.action == FRESH and plan.run_dir == Path("runs/charlm/mine")
    assert plan.config.run_dir == "runs/charlm/mine" and config.run_dir == ""


def test_a_run_in_use_by_another_process_is_refused_by_its_lock(tmp_path, monkeypatch,
                                                                capsys):
    monkeypatch.chdir(tmp_path)
    write_text(tmp_path / "text.txt")
    _, config, _ = charlm_config()
    folder = fake_run(tmp_path, "20260101-000000", config, "interrupted by SIGTERM")
    with RunLock(folder):  # another process is continuing it
        code = main(CHARLM_IN_FOLDER)
    out, err = capsys.readouterr()
    assert code == 2 and "is in use by" in err and "runs/charlm/20260101-000000" in err
    assert out.startswith("continuing runs/charlm/20260101-000000 ")


def test_a_finished_runs_config_json_as_config_trains_a_run_of_its_own(tmp_path, monkeypatch,
                                                                       capsys):
    """The first start trains a new folder, leaving the source run as it was; the same
    command again reports that new run complete, not the source."""
    monkeypatch.chdir(tmp_path)
    write_text(tmp_path / "text.txt")
    assert main(CHARLM_IN_FOLDER) == 0
    (source,) = run_folders(tmp_path)
    before = digests(tmp_path / "runs" / "charlm" / source)
    config_json = f"runs/charlm/{source}/config.json"
    capsys.readouterr()

    assert main(["charlm", "--config", config_json]) == 0
    out, err = capsys.readouterr()
    (new,) = set(run_folders(tmp_path)) - {source}
    run_id = json.loads(Path(config_json).read_text())["run_id"]
    assert err.splitlines()[0] == (
        f"note: {config_json} is run {run_id}'s config.json: taking its keys, not its run "
        "(ignoring data, environment, recipe, run_id, run_dir, run_name); to continue that run "
        f"itself: --run-dir runs/charlm/{source}")
    assert "completed: epoch 2/2" in out and "already complete" not in out
    assert digests(tmp_path / "runs" / "charlm" / source) == before

    assert main(["charlm", "--config", config_json]) == 0
    assert capsys.readouterr().out.startswith(
        f"the run is already complete: runs/charlm/{new} ")
    assert sorted(run_folders(tmp_path)) == sorted([source, new])


def test_the_continue_command_leaves_out_the_resume_request(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", str(tmp_path / ".venv" / "bin" / "python"))
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "recipes", "cifar", "--resume",
                                           "never", "--epochs", "3", "--resume=old.pt",
                                           "--run-name", "a b"])
    # the interpreter that ran it, not the `python` of an activated venv
    assert continue_command() == ".venv/bin/python -m recipes cifar --epochs 3 --run-name 'a b'"


# --- make train --------------------------------------------------------------------------


def _outside_make() -> dict[str, str]:
    """The environment of a terminal: under `make test` the parent make's variables would make
    the child report itself as make[1]."""
    return {key: value for key, value in os.environ.items()
            if key not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}


@pytest.mark.parametrize("exit_code, an_error", [(0, False), (130, False), (143, False),
                                                 (2, True), (1, True)])
def test_make_train_takes_a_stop_by_signal_for_no_error(exit_code, an_error, tmp_path):
    """A stand-in for the interpreter exits with the code given as the recipe's name."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit $3\n")  # $1 $2 are -m recipes
    python.chmod(0o755)
    done = subprocess.run(["make", "--no-print-directory", "train", f"PY={python}", "STAMP=",
                           f"RECIPE={exit_code}"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=_outside_make())
    assert done.returncode == (2 if an_error else 0)  # make's own code for a failed recipe
    error = re.fullmatch(rf"make: \*\*\* \[Makefile:\d+: train\] Error {exit_code}\n", done.stderr)
    assert bool(error) if an_error else done.stderr == "", done.stderr


def _ctrl_c_as_in_a_terminal() -> None:
    """SIGINT's default disposition in the child: a job started in the background (``cmd &``,
    nohup) inherits SIGINT ignored, and make and the run would then never see the Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_under_make_train_saves_the_run_and_make_reports_the_interrupt(tmp_path):
    """Ctrl-C goes to the terminal's whole process group: make as well as the run. The run
    saves and prints its continue line; make, interrupted itself, ends by SIGINT (a shell's
    exit status 130), as docs/usage.md says. A tiny run long enough to be mid-training."""
    write_text(tmp_path / "text.txt")
    args = shlex.join([*CHARLM_IN_FOLDER[1:-4], "--epochs", "200", "--checkpoint-every", "1",
                       "--run-name", "ctrl-c"])
    make = subprocess.Popen(["make", "--no-print-directory", "-f", str(REPO / "Makefile"),
                             "train", f"PY={sys.executable}", "STAMP=", "RECIPE=charlm",
                             f"ARGS={args}"], cwd=tmp_path, start_new_session=True,
                            preexec_fn=_ctrl_c_as_in_a_terminal,
                            env=_outside_make() | {"PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in make.stdout:  # the first training step has run
            if line.startswith("check: first loss"):
                break
        os.killpg(make.pid, signal.SIGINT)
        out, err = make.communicate(timeout=TIMEOUT_SEC)
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
    assert make.returncode == -signal.SIGINT, err
    assert "stopped; to continue this run: " in out, err
    summary = json.loads((tmp_path / "runs" / "charlm" / "ctrl-c" / "summary.json").read_text())
    assert summary["status"] == "interrupted by SIGINT"
    usage = " ".join((REPO / "docs" / "usage.md").read_text().split())
    assert "make itself is interrupted too and exits 130" in usage


# --- torchrun: rank 0 chooses, every rank follows ---------------------------------------


def test_under_torchrun_rank_zero_reports_a_finished_run_and_the_group_trains_nothing(
        tmp_path, monkeypatch, capsys):
    """``join_group`` without a group (rank 0 of one): no text.txt, so loading data fails."""
    monkeypatch.chdir(tmp_path)
    recipe, config, given = charlm_config()
    folder = fake_run(tmp_path, "20260101-000000", config, "completed")
    before = digests(folder)
    assert join_group(recipe, config, given) == 0
    assert capsys.readouterr().out.startswith(
        "the run is already complete: runs/charlm/20260101-000000 ")
    assert digests(folder) == before and run_folders(tmp_path) == ["20260101-000000"]


@pytest.mark.slow
def test_the_same_torchrun_command_again_continues_its_run_then_reports_it_complete(tmp_path):
    write_text(tmp_path / "text.txt")
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", "--nproc-per-node=2", str(RUN_RECIPE),
               *CHARLM_IN_FOLDER]
    env = {"PYTHONPATH": str(REPO)}
    stopped = run_command(command, tmp_path, RELIABILITY_SIGNAL_AT="SIGTERM:iteration:5", **env)
    assert stopped.returncode != 0
    [folder] = run_folders(tmp_path)
    assert STAMPED.fullmatch(folder)
    assert stopped.stdout.count("stopped; to continue this run, run the same torchrun command "
                                f"again (or add --run-dir {tmp_path.resolve()}/runs/charlm/"
                                f"{folder})") == 1, stopped.stdout + stopped.stderr

    continued = run_command(command, tmp_path, **env)
    assert continued.returncode == 0, continued.stderr
    assert continued.stdout.count(f"continuing runs/charlm/{folder} ") == 1
    assert "(epoch 1, iteration 5, step 5)\n" in continued.stdout
    assert run_folders(tmp_path) == [folder]
    run_dir = tmp_path / "runs" / "charlm" / folder
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["epochs_completed"] == 2

    before = digests(run_dir)
    reported = run_command(command, tmp_path, **env)
    assert reported.returncode == 0, reported.stderr
    assert reported.stdout.count(f"the run is already complete: runs/charlm/{folder} ") == 1
    assert digests(run_dir) == before and run_folders(tmp_path) == [folder]


@pytest.mark.parametrize("name", ["", "r1", "lr-0.2_bs512", "A" * 64, "2024.01.01", "x.."])
def test_good_run_names(name):
    assert check_run_name(name) is None


@pytest.mark.parametrize("name, problem", [
    ("..", "must start with a letter or digit"),
    ("a/b", "may only hold"),
    ("../escape", "must start with a letter or digit"),
    ("/abs", "must start with a letter or digit"),
    (".hidden", "must start with a letter or digit"),
    ("-flag", "must start with a letter or digit"),
    ("has space", "may only hold"),
    ("tab\there", "may only hold"),
    ("new\nline", "may only hold"),
    ("ümlaut", "may only hold"),
    ("A" * 65, "at most 64 characters, got 65"),
])
def test_bad_run_names_are_explained(name, problem):
    message = check_run_name(name)
    assert message is not None and problem in message


def test_the_run_folder_is_runs_recipe_name():
    assert resolve_run_dir("cifar", "r1", "") == Path("runs/cifar/r1")


def test_an_empty_run_name_is_a_timestamp():
    run_dir = resolve_run_dir("cifar", "", "")
    assert run_dir.parent == Path("runs/cifar")
    assert re.fullmatch(r"\d{8}-\d{6}", run_dir.name)


def test_run_dir_wins_over_run_name_and_expands_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_run_dir("cifar", "r1", "/elsewhere/x") == Path("/elsewhere/x")
    assert resolve_run_dir("cifar", "r1", "~/x") == tmp_path / "x"


def test_resolving_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    resolve_run_dir("cifar", "r1", "")
    assert list(tmp_path.iterdir()) == []
