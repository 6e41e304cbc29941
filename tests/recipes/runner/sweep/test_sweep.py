"""The sweep command end to end on the tiny charlm job: each trial an ordinary run that the
study and the other commands read, pruning, and every refusal before anything is written."""

import json
import sqlite3

import optuna
import pytest
from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.trial import TrialState
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from recipes.__main__ import main
from recipes.runner.config.command_line import parse_args
from recipes.runner.config.registry import load_recipe
from recipes.runner.sweep.pruning import TrialPruning, with_pruning
from recipes.runner.sweep.study import PRUNERS
from recipes.runner.training.run import run
from tests.helpers import CHARLM, one_error_line, write_text

BASE = ["charlm", "sweep", *CHARLM[1:], "--text", "text.txt"]
SWEEP = [*BASE, "--epochs", "1"]
SEARCH = ["--search", "lr=1e-3:1e-1:log"]


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A working folder holding the corpus: runs/ goes there."""
    monkeypatch.chdir(tmp_path)
    write_text(tmp_path / "text.txt")
    return tmp_path


def study_of(sweep_dir):
    return optuna.load_study(study_name=sweep_dir.name,
                             storage=f"sqlite:///{sweep_dir / 'study.db'}")


def test_each_trial_is_a_run_the_study_and_evaluate_read_and_the_same_command_adds_none(
        folder, capsys):
    command = [*SWEEP, "--trials", "2", *SEARCH, "--sweep-name", "s"]
    assert main(command) == 0
    sweep_dir = folder / "runs" / "charlm" / "sweeps" / "s"
    trials = study_of(sweep_dir).trials
    assert [trial.state for trial in trials] == [TrialState.COMPLETE] * 2
    for trial in trials:
        run_dir = sweep_dir / f"trial-{trial.number:04d}"
        assert json.loads((run_dir / "config.json").read_text())["config"]["lr"] == \
            trial.params["lr"]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and trial.value == summary["best_val_loss"]
    out = capsys.readouterr().out
    assert "2 of 2 trials finished or pruned (minimize loss)" in out
    for trial in trials:  # each trial's closing lines name its recipe, as any run's do
        assert f"-m recipes charlm evaluate runs/charlm/sweeps/s/trial-{trial.number:04d}" in out
    best = min(trials, key=lambda trial: trial.value)
    assert f"best     trial {best.number}, loss {best.value:.4g}" in out
    assert main(["charlm", "evaluate", str(sweep_dir / "trial-0000")]) == 0
    capsys.readouterr()

    assert main(command) == 0  # done: nothing trained again
    out = capsys.readouterr().out
    assert "charlm run in" not in out and "2 of 2 trials finished" in out
    assert len(study_of(sweep_dir).trials) == 2
    assert main(["charlm", "sweep", "--status", "--sweep-dir", str(sweep_dir)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split() == ["trial", "--lr", "loss", "state", "time"]
    assert [line.split()[3] for line in table[2:4]] == ["finished", "finished"]


class AlwaysPrunes(optuna.pruners.BasePruner):
    def prune(self, study, trial) -> bool:
        return True


def test_a_pruned_trial_stops_saved_at_its_first_evaluation_and_says_so(folder, capsys,
                                                                       monkeypatch):
    monkeypatch.setitem(PRUNERS, "median", AlwaysPrunes)
    assert main([*BASE, "--epochs", "2", "--trials", "1", *SEARCH, "--sweep-name", "p"]) == 0
    sweep_dir = folder / "runs" / "charlm" / "sweeps" / "p"
    (trial,) = study_of(sweep_dir).trials
    assert trial.state == TrialState.PRUNED
    run_dir = sweep_dir / "trial-0000"
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = summary["optimizer_steps"]  # one epoch of two
    assert summary["status"] == f"pruned at step {steps}" and trial.last_step == steps
    assert json.loads((run_dir / "checkpoints" / "last.pt.json").read_text())[
        "optimizer_step"] == steps
    events = EventAccumulator(str(run_dir))
    events.Reload()  # the sweep's TensorBoard has the pruned trial in HParams too
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")
    out = capsys.readouterr().out
    assert f"pruned at step {steps}: epoch 1/2" in out  # the run's closing line
    assert f"trial 0: pruned at step {steps}" in out

    # Its worker killed before Optuna heard of it, the trial starts again: it ends at once.
    recipe = load_recipe("charlm")
    config, given = parse_args(recipe.config, [*BASE[2:], "--epochs", "2", "--lr",
                                               str(trial.params["lr"]), "--run-dir", str(run_dir)])
    assert run(with_pruning(recipe, TrialPruning(None, "loss")), config, given) == 0
    again = json.loads((run_dir / "summary.json").read_text())
    assert again["status"] == f"pruned at step {steps}" and again["optimizer_steps"] == steps


@pytest.mark.parametrize(("args", "fragments"), [
    ([*SEARCH, "--search", "lrr=1:2"], ("unknown key --lrr",)),
    (["--search", "lr=-1:1"], ("--lr: must be > 0",)),
    ([*SEARCH, "--run-name", "x"], ("--run-name is set by the sweep",)),
    ([*SEARCH, "--nproc", "2"], ("--nproc 2: a sweep trains each trial in one process",)),
    ([*SEARCH, "--lr", "0.1"], ("--lr: given both as a flag and in --search",)),
    (["--trials", "0", *SEARCH], ("--trials: must be an integer >= 1",)),
    (["--metric", "accuracy", *SEARCH], ("--metric: invalid choice: 'accuracy'",)),
    ([*SEARCH, "--storage", "redis://x"], ("not a storage URL",)),
])
def test_a_bad_command_is_one_line_exit_2_and_writes_nothing(folder, capsys, args, fragments):
    trials = [] if "--trials" in args else ["--trials", "2"]
    code = main([*SWEEP, *trials, *args])
    one_error_line(code, capsys.readouterr().err, *fragments)
    assert [path.name for path in folder.iterdir()] == ["text.txt"]


def test_no_search_or_no_trials_says_what_to_give(folder, capsys):
    one_error_line(main([*SWEEP, *SEARCH]), capsys.readouterr().err, "give --trials N")
    one_error_line(main([*SWEEP, "--trials", "2"]), capsys.readouterr().err,
                   "at least one --search KEY=SPEC")


def test_a_damaged_or_foreign_study_database_is_one_line_and_stays_as_it_was(folder, capsys):
    sweep_dir = folder / "sweep"
    sweep_dir.mkdir()
    database = sweep_dir / "study.db"
    database.write_bytes(b"not a database" * 100)
    command = [*SWEEP, "--trials", "2", *SEARCH, "--sweep-dir", str(sweep_dir)]
    one_error_line(main(command), capsys.readouterr().err, "is not a readable study database")
    assert database.read_bytes() == b"not a database" * 100
    database.unlink()
    with sqlite3.connect(database) as connection:
        connection.execute("CREATE TABLE runs (id INTEGER)")
    one_error_line(main(command), capsys.readouterr().err,
                   "a database of something else than an Optuna study (tables runs)")
    with sqlite3.connect(database) as connection:
        tables = connection.execute("SELECT name FROM sqlite_master").fetchall()
    assert tables == [("runs",)]
    assert sorted(path.name for path in sweep_dir.iterdir()) == ["study.db"]


def test_another_search_under_the_same_sweep_name_is_refused(folder, capsys):
    sweep_dir = folder / "sweep"
    sweep_dir.mkdir()
    storage = f"sqlite:///{sweep_dir / 'study.db'}"
    optuna.create_study(storage=storage, study_name="sweep").set_user_attr(
        "sweep", {"recipe": "charlm", "metric": "loss", "search": {"lr": "0.1:0.2"},
                  "fixed": {}})
    code = main([*SWEEP, "--trials", "2", *SEARCH, "--sweep-dir", str(sweep_dir)])
    one_error_line(code, capsys.readouterr().err, "was started with other fixed, search",
                   "give another --sweep-name")
    assert not (sweep_dir / "trial-0000").exists()


def test_status_of_no_sweep_is_one_line(folder, capsys):
    code = main(["charlm", "sweep", "--status", "--sweep-dir", str(folder / "none")])
    one_error_line(code, capsys.readouterr().err, "no sweep in")
    assert list(folder.iterdir()) == [folder / "text.txt"]


def test_a_journal_file_holds_the_study_where_storage_names_it(folder, capsys):
    journal = folder / "study.journal"
    assert main([*SWEEP, "--trials", "1", *SEARCH, "--sweep-name", "j", "--storage",
                 f"journal:{journal}"]) == 0
    study = optuna.load_study(study_name="j",
                              storage=JournalStorage(JournalFileBackend(str(journal))))
    assert [trial.state for trial in study.trials] == [TrialState.COMPLETE]
    assert not (folder / "runs" / "charlm" / "sweeps" / "j" / "study.db").exists()
    assert "1 of 1 trials finished" in capsys.readouterr().out
