"""The run layer end to end on tiny data: one writer per run folder, a resume that knows its
data, ``--describe``, and recipes found by name or path."""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from recipes.__main__ import main
from recipes.runner.config.registry import find_recipes, load_recipe
from recipes.runner.training import lock as lock_module
from recipes.runner.training import report as report_module
from recipes.runner.training import start_checks
from recipes.runner.training.lock import RunLock
from tests.helpers import CHARLM, RUN_RECIPE, digests, one_error_line, write_text

TIMEOUT_SEC = 600


# --- recipes by name ----------------------------------------------------------------------


def test_every_recipe_file_is_found_and_loads():
    found = find_recipes()
    assert {"cifar", "charlm"} <= set(found)
    for name in found:
        recipe = load_recipe(name)
        assert recipe.name == name and recipe.best in recipe.metrics


def test_an_unknown_recipe_names_the_available_ones(capsys):
    one_error_line(main(["nosuch"]), capsys.readouterr().err, "unknown recipe 'nosuch'",
                   "cifar", "charlm")


# --- one writer per run folder ------------------------------------------------------------


def test_a_second_writer_is_refused_and_touches_nothing(tmp_path, capsys):
    text = write_text(tmp_path / "corpus.txt")
    run_dir = tmp_path / "run"
    with RunLock(run_dir):  # another process's run, as far as the command line can tell
        before = digests(run_dir)
        started = time.monotonic()
        code = main([*CHARLM, "--text", str(text), "--run-dir", str(run_dir)])
        one_error_line(code, capsys.readouterr().err, str(run_dir), "is in use by process")
        assert time.monotonic() - started < 5
        assert digests(run_dir) == before


def test_two_concurrent_starts_one_trains_like_a_lone_run_the_other_exits_2(tmp_path):
    """The first start stops itself (SIGSTOP) at its 3rd iteration, holding the lock, so
    the second surely starts while it runs; then it goes on and must end like a lone run."""
    text = write_text(tmp_path / "corpus.txt", words=3000)
    args = [*CHARLM, "--text", str(text), "--epochs", "1"]

    def start(run_dir: Path, **faults: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(RUN_RECIPE), *args, "--run-dir",
                                 str(run_dir)], cwd=tmp_path, env={**os.environ, **faults},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    lone = start(tmp_path / "lone")  # the run to compare with, beside the rest
    first = start(tmp_path / "shared", RELIABILITY_SIGNAL_AT="SIGSTOP:iteration:3")
    deadline = time.monotonic() + TIMEOUT_SEC
    while not _stopped(first.pid):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)
    before = digests(tmp_path / "shared")
    second = start(tmp_path / "shared")
    _, second_err = second.communicate(timeout=TIMEOUT_SEC)
    assert second.returncode == 2 and "is in use by process" in second_err, second_err
    assert len(second_err.strip().splitlines()) == 1
    assert digests(tmp_path / "shared") == before
    os.kill(first.pid, signal.SIGCONT)
    assert first.wait(timeout=TIMEOUT_SEC) == 0
    assert lone.wait(timeout=TIMEOUT_SEC) == 0

    def weights(run_dir: Path) -> dict[str, torch.Tensor]:
        return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]

    shared, alone = weights(tmp_path / "shared"), weights(tmp_path / "lone")
    assert all(torch.equal(shared[name], alone[name]) for name in alone)


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (state T in /proc/<pid>/stat)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "T"


# --- a resume that knows its data ---------------------------------------------------------


def test_a_resume_on_changed_text_is_refused_then_allowed_with_the_override(tmp_path, capsys):
    text = write_text(tmp_path / "corpus.txt")
    run = [*CHARLM, "--text", str(text), "--run-dir", str(tmp_path / "run")]
    assert main([*run, "--epochs", "1"]) == 0
    text.write_text(text.read_text() + " return value")
    capsys.readouterr()
    before = digests(tmp_path / "run")

    code = main([*run, "--epochs", "2"])
    one_error_line(code, capsys.readouterr().err, "the data changed", "--allow-data-change")
    assert digests(tmp_path / "run") == before

    assert main([*run, "--epochs", "2", "--allow-data-change", "true"]) == 0
    assert "override: data changed" in capsys.readouterr().out


# --- --describe ---------------------------------------------------------------------------


def test_describe_prints_each_event_with_its_handlers_in_order_and_writes_nothing(tmp_path):
    text = write_text(tmp_path / "corpus.txt")
    done = subprocess.run([sys.executable, "-m", "recipes", *CHARLM, "--text", str(text),
                           "--describe"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=TIMEOUT_SEC)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "trainer:" and "evaluator:" in lines
    events = [line.strip() for line in lines if line.startswith("  ") and
              not line.startswith("    ")]
    assert {"STARTED", "EPOCH_COMPLETED", "OPTIMIZER_STEP", "COMPLETED"} <= set(events)
    trainer = lines[:lines.index("evaluator:")]
    epoch_end = trainer[trainer.index("  EPOCH_COMPLETED") + 1:]
    epoch_end = [line.strip() for line in epoch_end[:next(
        (i for i, line in enumerate(epoch_end) if not line.startswith("    ")), None)]]
    # The evaluation runs before the epoch's 'last' save, so a resume never skips it.
    evaluate = epoch_end.index("Evaluation.run_if_due")
    assert evaluate < epoch_end.index("RankZeroSave(Checkpointer.save_last)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]


# --- start-up checks and --overfit-batches ------------------------------------------------


def test_overfit_batches_reports_near_zero_and_writes_nothing(tmp_path, monkeypatch, capsys):
    text = write_text(tmp_path / "corpus.txt")
    monkeypatch.chdir(tmp_path)
    code = main([*CHARLM, "--text", str(text), "--lr", "0.02",
                 "--overfit-batches", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "overfit 1 batch(es) for 200 iterations" in out
    assert "near zero (<= 5%): yes" in out
    assert [path.name for path in tmp_path.iterdir()] == ["corpus.txt"]


def test_start_up_checks_print_one_line_and_can_be_turned_off(tmp_path, capsys):
    text = write_text(tmp_path / "corpus.txt")
    run = [*CHARLM, "--text", str(text), "--epochs", "1"]
    assert main([*run, "--run-dir", str(tmp_path / "on")]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("check:")]
    assert lines == [line for line in lines if "near ln(256) = 5.545: ok" in line] and lines
    assert main([*run, "--run-dir", str(tmp_path / "off"), "--checks", "off"]) == 0
    assert "check:" not in capsys.readouterr().out


@pytest.mark.slow
def test_under_nproc_2_the_parent_and_its_ranks_hold_the_lock_for_the_whole_group(tmp_path):
    """While the two ranks run (held with SIGSTOP once both exist), a second start is refused
    naming the spawning parent (and its ranks), which share its lock (one lock, not one each:
    they would refuse each other), and the group then finishes."""
    text = write_text(tmp_path / "corpus.txt", words=3000)
    command = [sys.executable, "-m", "recipes", *CHARLM, "--text", str(text), "--epochs", "1",
               "--nproc", "2", "--run-dir", str(tmp_path / "run")]
    group = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + TIMEOUT_SEC
    while len(_descendants(group.pid)) < 2 or not (tmp_path / "run" / "config.json").exists():
        assert group.poll() is None and time.monotonic() < deadline, group.communicate()
        time.sleep(0.05)
    for pid in _descendants(group.pid):
        os.kill(pid, signal.SIGSTOP)

    second = subprocess.run([*command[:-2], "--run-dir", str(tmp_path / "run")], cwd=tmp_path,
                            capture_output=True, text=True, timeout=TIMEOUT_SEC)
    # The ranks hold the lock from their creation; each adds its PID to the message once
    # it has read its arguments, which a rank stopped this early may not have done yet.
    assert second.returncode == 2, second.stderr
    assert re.search(rf"in use by (process|processes) {group.pid}[ ,]", second.stderr)

    for pid in _descendants(group.pid):
        os.kill(pid, signal.SIGCONT)
    _, err = group.communicate(timeout=TIMEOUT_SEC)
    assert group.returncode == 0, err
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "completed"


def _descendants(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    found = [int(child) for child in children.read_text().split()] if children.exists() else []
    return found + [grandchild for child in found for grandchild in _descendants(child)]


@pytest.mark.parametrize("module, writer, file", [
    (lock_module, "_write_holder", ".lock"),
    (start_checks, "write_json_atomic", "config.json"),
])
def test_a_full_disk_at_the_start_is_one_line_exit_4_and_the_saved_run_intact(
        module, writer, file, tmp_path, monkeypatch, capsys):
    """The start's first writes, the lock's holder line and config.json, on a disk that
    refuses them: a run to be continued keeps every file as it was."""
    run_dir = tmp_path / "run"
    run = [*CHARLM, "--text", str(write_text(tmp_path / "corpus.txt")), "--run-dir",
           str(run_dir)]
    assert main([*run, "--epochs", "1"]) == 0
    before = digests(run_dir)
    capsys.readouterr()

    def full(*_args) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(module, writer, full)
    code = main([*run, "--epochs", "2"])
    assert code == 4
    assert capsys.readouterr().err.splitlines() == [
        f"error: cannot write {run_dir / file}: No space left on device"]
    assert digests(run_dir) == before


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("save_every, refused_by", [
    ("50", "could not write the run's logs"),  # the flush at the epoch's end, before its save
    ("3", "{run}/checkpoints/step-00000003.pt: could not save"),  # the checkpoint's snapshot
])
def test_a_full_disk_under_metrics_jsonl_is_one_line_and_exit_4(save_every, refused_by,
                                                                 tmp_path, capsys):
    """``metrics.jsonl`` is appended at each evaluation, epoch end and checkpoint: a disk
    that refuses it stops the run with one line, not a traceback of the flush and another
    of the close."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").symlink_to("/dev/full")  # every write fails with ENOSPC

    code = main([*CHARLM, "--text", str(write_text(tmp_path / "corpus.txt")), "--run-dir",
                 str(run_dir), "--epochs", "1", "--log-every", "2",
                 "--checkpoint-every", save_every])

    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 4 and lines == [
        f"error: {refused_by.format(run=run_dir)}: [Errno 28] No space left on device: "
        f"'{run_dir / 'metrics.jsonl'}'"], lines
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"].startswith("stopped: ")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_that_refuses_the_summary_too_is_still_one_line(tmp_path, monkeypatch,
                                                                     capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").symlink_to("/dev/full")
    write_json_atomic = report_module.write_json_atomic

    def full_for_the_summary(path: Path, data: dict) -> None:
        if path.name == "summary.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        write_json_atomic(path, data)

    monkeypatch.setattr(report_module, "write_json_atomic", full_for_the_summary)
    code = main([*CHARLM, "--text", str(write_text(tmp_path / "corpus.txt")), "--run-dir",
                 str(run_dir), "--epochs", "1"])

    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 4 and len(lines) == 1, lines
    assert lines[0].startswith("error: could not write the run's logs: [Errno 28]")
