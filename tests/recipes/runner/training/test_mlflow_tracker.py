"""``--tracker mlflow`` on charlm's tiny run, read back with MLflow's own client: the params,
tags, metric history and artifacts; a resume continues the same MLflow run; an unreachable
server costs one warning line; a store that cannot be written exits 2 with nothing written.
Everything but the missing-package test needs MLflow (the ``mlflow`` extra) and skips
without it."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from recipes.__main__ import main
from recipes.runner.training.trackers.mlflow import STATE_FILE, URI_VARIABLE, tracking_uri
from tests.helpers import (
    CHARLM,
    REPO,
    RUN_RECIPE,
    TINY_AIRBENCH_RUN,
    digests,
    one_error_line,
    scalar_steps,
    scalar_tags,
    write_text,
)

needs_mlflow = pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None,
    reason="MLflow is not installed (pip install -e '.[mlflow]'); CI installs only .[dev]")


def train(tmp_path, *args: str) -> int:
    text = tmp_path / "corpus.txt"
    if not text.exists():
        write_text(text, words=1200)
    return main([*CHARLM, "--text", str(text), "--run-dir", str(tmp_path / "run"),
                 "--tracker", "mlflow", "--eval-every", "1", "--log-every", "2", *args])


def only_run(store, experiment="charlm"):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=store.as_uri())
    experiment = client.get_experiment_by_name(experiment)
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    return client, runs[0]


def metric_steps(client, run, key):
    return sorted(metric.step for metric in client.get_metric_history(run.info.run_id, key))


@needs_mlflow
def test_the_mlflow_run_holds_the_config_tags_scalars_and_artifacts(tmp_path, monkeypatch,
                                                                    capsys):
    from recipes.runner.training.trackers.mlflow import metric_key

    monkeypatch.chdir(tmp_path)  # the default store: mlruns/ beside runs/
    assert train(tmp_path, "--epochs", "1") == 0
    client, run = only_run(tmp_path / "mlruns")
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert run.data.params == {key: str(value) for key, value in saved["config"].items()}
    assert run.data.tags["recipe"] == "charlm"
    assert run.data.tags["run_id"] == saved["run_id"]
    assert run.data.tags["git_revision"].startswith(saved["environment"]["git"]["commit"])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert set(run.data.metrics) == {metric_key(tag) for tag in scalar_tags(tmp_path / "run")}
    for tag in ("train/loss", "train/lr", "val/loss"):
        assert metric_steps(client, run, tag) == scalar_steps(tmp_path / "run", tag), tag
    artifacts = {item.path for item in client.list_artifacts(run.info.run_id)}
    assert {"curves.png", "checkpoints"} <= artifacts
    assert [item.path for item in client.list_artifacts(run.info.run_id, "checkpoints")] == [
        "checkpoints/best.pt"]
    state = json.loads((tmp_path / "run" / "mlflow.json").read_text())
    assert state == {"run_id": run.info.run_id, "tracking_uri": (tmp_path / "mlruns").as_uri()}
    # The run's last line says where the MLflow run went and how to browse it.
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"  mlflow   run {run.info.run_id} in {(tmp_path / 'mlruns').as_uri()} (browse: "
        f"MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {tmp_path / 'mlruns'})")


@needs_mlflow
@pytest.mark.parametrize(("uri", "browse"), [
    ("http://mlflow.example:5000", " (browse: http://mlflow.example:5000)"),
    ("sqlite:///runs/mlflow.db", " (browse: mlflow ui --backend-store-uri sqlite:///runs/mlflow.db)"),
    ("databricks", ""),
])
def test_the_closing_line_names_the_store_and_how_to_browse_it(uri, browse):
    from recipes.runner.training.trackers.mlflow import MlflowTracker

    class Client:
        tracking_uri = uri

    tracker = MlflowTracker(Client(), "abc123")
    assert tracker.closing_line() == f"  mlflow   run abc123 in {uri}{browse}"
    tracker.sink.failed = True  # the warning said so: no line
    assert tracker.closing_line() is None


@needs_mlflow
def test_a_resumed_run_continues_the_same_mlflow_run(tmp_path):
    store = tmp_path / "store"
    assert train(tmp_path, "--epochs", "1", "--tracker-uri", str(store)) == 0
    _, first = only_run(store)
    # The same run folder, one epoch longer, without --tracker-uri: the run keeps its store.
    assert main([*CHARLM, "--text", str(tmp_path / "corpus.txt"), "--run-dir",
                 str(tmp_path / "run"), "--epochs", "2"]) == 0
    client, run = only_run(store)
    assert run.info.run_id == first.info.run_id and run.info.status == "FINISHED"
    steps = metric_steps(client, run, "val/loss")
    assert len(steps) == 2 and steps == scalar_steps(tmp_path / "run", "val/loss")


@needs_mlflow
def test_a_run_killed_mid_way_continues_its_mlflow_run_each_step_once(tmp_path):
    args = [*CHARLM, "--text", str(write_text(tmp_path / "corpus.txt", words=1200)),
            "--run-dir", str(tmp_path / "run"), "--epochs", "1", "--tracker", "mlflow",
            "--tracker-uri", str(tmp_path / "store"), "--log-every", "2",
            "--checkpoint-every", "10"]
    killed = subprocess.run([sys.executable, str(RUN_RECIPE), *args], cwd=tmp_path,
                            env=os.environ | {"RELIABILITY_SIGNAL_AT": "SIGKILL:iteration:25"},
                            capture_output=True, text=True, timeout=600, check=False)
    assert killed.returncode == -9, killed.stderr
    started = json.loads((tmp_path / "run" / "mlflow.json").read_text())["run_id"]
    assert main(args) == 0
    client, run = only_run(tmp_path / "store")
    assert run.info.run_id == started and run.info.status == "FINISHED"
    # The sink sends at the logger's flushes, which come with each checkpoint: steps 22 and
    # 24, reported after the step-20 checkpoint, died unsent and came again after the resume.
    assert metric_steps(client, run, "train/loss") == [*range(2, 37, 2), 37] == scalar_steps(
        tmp_path / "run", "train/loss")


@needs_mlflow
def test_an_unreachable_server_costs_one_warning_line_and_the_run_goes_on(tmp_path, capsys):
    assert train(tmp_path, "--epochs", "1", "--tracker-uri", "http://127.0.0.1:9") == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning: MLflow")]
    assert len(warnings) == 1 and "http://127.0.0.1:9" in warnings[0]
    assert "  mlflow   run" not in captured.out
    assert (tmp_path / "run" / "summary.json").exists()
    assert not (tmp_path / "run" / "mlflow.json").exists()


@needs_mlflow
@pytest.mark.parametrize("where", ["file_in_the_way", "under_a_file", "file_uri_under_a_file"])
def test_a_store_that_cannot_be_written_exits_2_and_writes_nothing(tmp_path, capsys, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    uri = {"file_in_the_way": str(blocker), "under_a_file": str(blocker / "mlruns"),
           "file_uri_under_a_file": (blocker / "mlruns").as_uri()}[where]
    write_text(tmp_path / "corpus.txt")
    before = digests(tmp_path)
    code = train(tmp_path, "--tracker-uri", uri)
    one_error_line(code, capsys.readouterr().err, "--tracker-uri", "is not a folder")
    assert digests(tmp_path) == before and not (tmp_path / "run").exists()


def test_tracker_mlflow_without_mlflow_installed_exits_2_and_writes_nothing(
        tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` raises ImportError
    code = train(tmp_path)
    one_error_line(code, capsys.readouterr().err, "--tracker mlflow", "pip install -e "
                   "'.[mlflow]'")
    assert not (tmp_path / "run").exists() and not (tmp_path / "mlruns").exists()


def test_an_unknown_tracker_is_refused_with_the_known_ones(tmp_path, capsys):
    code = main([*CHARLM, "--text", str(tmp_path / "corpus.txt"), "--tracker", "comet"])
    one_error_line(code, capsys.readouterr().err, "--tracker", "none, mlflow, wandb")
    code = main([*CHARLM, "--text", str(tmp_path / "corpus.txt"), "--tracker", "tensorboard"])
    one_error_line(code, capsys.readouterr().err, "'tensorboard' is not allowed (every run "
                   "already writes TensorBoard's event file into its folder", "mlflow, wandb")


@needs_mlflow
def test_the_sink_sends_what_it_holds_in_one_batch_at_each_flush(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from recipes.runner.training.trackers.mlflow import MlflowSink

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(tmp_path / "store").as_uri())
    run_id = client.create_run("0").info.run_id
    batches = []
    log_batch = client.log_batch
    monkeypatch.setattr(client, "log_batch",
                        lambda *args, **kwargs: batches.append(1) or log_batch(*args, **kwargs))
    sink = MlflowSink(client, run_id)
    # A tag that is another's folder (a named parameter group's LR): train/lr.decayed.
    sink.write(4, 1, 100.0, {"train/loss": 2.5, "train/lr": 0.1, "train/lr/decayed": 0.1})
    sink.write(8, 1, 101.5, {"train/loss": 2.0, "train/lr": 0.2, "train/lr/decayed": 0.2})
    assert batches == [] and client.get_metric_history(run_id, "train/loss") == []
    sink.flush()
    sink.flush()  # nothing new: no call
    assert batches == [1]
    history = [(m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id,
                                                                                 "train/loss")]
    assert history == [(4, 2.5, 100000), (8, 2.0, 101500)]
    assert [m.value for m in client.get_metric_history(run_id, "train/lr.decayed")] == [0.1, 0.2]
    assert not sink.failed


@needs_mlflow
def test_a_sink_whose_server_fails_warns_once_then_drops_what_it_gets(capsys):
    from recipes.runner.training.trackers.mlflow import MlflowSink

    class DownServer:
        tracking_uri = "http://tracking.invalid"
        calls = 0

        def log_batch(self, run_id, metrics):
            self.calls += 1
            raise ConnectionError("Connection refused\nsecond line")

    client = DownServer()
    sink = MlflowSink(client, "run")
    for step in range(3):
        sink.write(step, 1, 1.0, {"train/loss": 1.0})
        sink.flush()
    sink.close()
    err = capsys.readouterr().err.splitlines()
    assert client.calls == 1 and sink.failed
    assert err == ["warning: MLflow: logging to http://tracking.invalid failed (ConnectionError: "
                   "Connection refused); the run goes on without MLflow"]


@needs_mlflow
@pytest.mark.slow
def test_under_two_processes_rank_zero_alone_logs_to_mlflow_and_profiles(tmp_path,
                                                                          monkeypatch):
    result = subprocess.run(
        [sys.executable, "-m", "recipes", "cifar", "--nproc", "2", *TINY_AIRBENCH_RUN,
         "--tracker", "mlflow", "--profile", "0:2"], cwd=tmp_path,
        env=os.environ | {"PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=600, check=False)
    assert result.returncode == 0, result.stderr
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the run set it for its own process
    client, run = only_run(tmp_path / "mlruns", "cifar")  # one MLflow run, not one a rank
    assert run.info.status == "FINISHED" and client.get_metric_history(run.info.run_id,
                                                                       "val/accuracy")
    headings = [line for line in result.stdout.splitlines() if line.startswith("profile: ")]
    assert len(headings) == 1 and "optimizer steps 1-2" in headings[0]
    assert sum(line.startswith("  mlflow   run ") for line in result.stdout.splitlines()) == 1
    assert list((tmp_path / "runs" / "cifar" / "r" / "profile").iterdir()) == [
        tmp_path / "runs" / "cifar" / "r" / "profile" / "trace-steps-1-2.json.gz"]


def test_the_store_is_the_flag_then_mlflows_variable_then_the_runs_own_then_mlruns(
        tmp_path, monkeypatch):
    """``MLFLOW_TRACKING_URI`` is MLflow's own way of naming the store: it ranks after
    --tracker-uri and before the store a run folder saved and the default. No MLflow
    needed: the URI is settled before it is imported."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(URI_VARIABLE, raising=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert tracking_uri("", run_dir) == (tmp_path / "mlruns").as_uri()
    (run_dir / STATE_FILE).write_text(json.dumps({"tracking_uri": "http://saved:5000",
                                                  "run_id": "x"}))
    assert tracking_uri("", run_dir) == "http://saved:5000"
    monkeypatch.setenv(URI_VARIABLE, (tmp_path / "somewhere" / "mlruns").as_uri())
    assert tracking_uri("", run_dir) == (tmp_path / "somewhere" / "mlruns").as_uri()
    monkeypatch.setenv(URI_VARIABLE, "elsewhere")  # a folder: an absolute file: URI
    assert tracking_uri("", run_dir) == (tmp_path / "elsewhere").as_uri()
    assert tracking_uri("http://given:5000", run_dir) == "http://given:5000"
