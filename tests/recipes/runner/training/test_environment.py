"""The reproducibility record in config.json and summary.json: versions, git revision and
device; it describes a run and never stops one from resuming elsewhere."""

import json
import platform
import shutil
import subprocess

import pytest
import torch

from recipes.__main__ import main
from recipes.runner.training.environment import environment_record, git_revision
from tests.helpers import CHARLM, write_text


def test_a_run_records_its_environment_and_resumes_where_the_record_differs(tmp_path, capsys):
    text = write_text(tmp_path / "corpus.txt")
    run = [*CHARLM, "--text", str(text), "--run-dir", str(tmp_path / "run")]
    assert main([*run, "--epochs", "1"]) == 0
    config_path = tmp_path / "run" / "config.json"
    saved = json.loads(config_path.read_text())
    record = saved["environment"]
    assert record["python"] == platform.python_version()
    assert torch.__version__.startswith(record["packages"]["torch"])  # "2.x.y" of "2.x.y+cpu"
    assert set(record["packages"]) == {"torch", "torchvision", "pytorch-ignite"}
    assert all(record["packages"].values())
    assert record["device"]["type"] == "cpu" and record["device"]["processes"] == 1
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["environment"] == record

    # A resume on "another machine": the old record differs, the run goes on and the new
    # start writes its own record.
    saved["environment"] = {**record, "python": "2.7.18", "device": {"name": "elsewhere"}}
    config_path.write_text(json.dumps(saved))
    capsys.readouterr()
    assert main([*run, "--epochs", "2"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert json.loads(config_path.read_text())["environment"] == record


def _git(folder, *args):
    subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_revision_names_the_commit_and_whether_the_tree_changed(tmp_path):
    assert git_revision(tmp_path) is None  # not a checkout
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("a")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    assert git_revision(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "a.txt").write_text("changed")
    assert git_revision(tmp_path) == {"commit": head, "dirty": True}


def test_without_git_the_record_has_no_revision(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on it
    assert git_revision(tmp_path) is None
    assert environment_record(torch.device("cpu"), 1)["git"] is None
