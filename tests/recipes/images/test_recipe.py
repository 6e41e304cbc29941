"""``python -m recipes images`` end to end on tiny generated image trees: a run, every bad
input (exit 2, one line, nothing written), and kill -9 or SIGTERM at a random moment with
DataLoader workers, after which the same command finishes bit-identically.

Training runs go through a subprocess (cwd = a temporary folder, so ``runs/`` lands
there); bad inputs call ``recipes.__main__.main`` in this process (no interpreter start).
"""

import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn

from recipes.__main__ import main
from recipes.common import paths
from recipes.images.recipe import build_classifier

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

CLASSES = ("cat", "dog", "eel")
TIMEOUT_SEC = 300  # a hung run fails its test instead of hanging the suite
# 3 classes x 16 images / batch 8: 6 steps per epoch, 18 in all, a checkpoint at every one.
# squeezenet1_1 is the quickest torchvision model here, and its dropout draws from the
# training process's random stream, which the resume must restore too.
RUN = ["--model", "squeezenet1_1", "--batch-size", "8", "--epochs", "3", "--lr", "0.02",
       "--warmup-epochs", "0.5", "--checkpoint-every", "1", "--log-every", "1",
       "--progress", "plain"]
STEPS = 18


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recipes", "images", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=TIMEOUT_SEC)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]


def assert_same_weights(run_dir: Path, reference: dict[str, torch.Tensor]) -> None:
    weights = final_weights(run_dir)
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[key], reference[key]) for key in reference)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, make_image_tree_once) -> Path:
    """A tree (with a README to skip) and an uninterrupted reference run with 2 workers."""
    folder = tmp_path_factory.mktemp("images")
    make_image_tree_once(folder / "tree", {"train": 16, "val": 2})
    (folder / "tree" / "train" / "dog" / "README.md").write_text("not an image")
    reference = run_cli(["--data-dir", "tree", "--num-workers", "2", "--run-dir", "reference",
                         *RUN], folder)
    assert reference.returncode == 0, reference.stderr
    return folder


@pytest.fixture
def quiet_ignite_logger():
    """``main`` quiets Ignite's engine logger for the process; restore it for other tests."""
    engine_logger = logging.getLogger("ignite.engine.engine")
    level = engine_logger.level
    yield
    engine_logger.setLevel(level)


def test_a_run_trains_on_png_and_jpeg_of_two_sizes_and_skips_a_readme(workspace):
    run_dir = workspace / "reference"
    assert (run_dir / "summary.json").is_file() and (run_dir / "curves.png").is_file()
    log = (run_dir / "config.json").read_text()
    assert '"count:dog": 16' in log and '"source": "val"' in log
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert saved["trainer"]["iteration"] == STEPS
    assert saved["train_data"]["_snapshot"]["_main_snapshot"]["_index_sampler_state"] == {
        "epoch": 3, "next_batch": 6}


def test_help_says_which_normalisation_statistics_are_used(capsys, quiet_ignite_logger):
    assert main(["images", "--help"]) == 0
    text = capsys.readouterr().out
    words = " ".join(text.split())  # --help wraps long meanings
    assert "measured on up to 256 training images" in words and "imagenet = ImageNet's" in words
    assert "--num-workers" in text and f" {len(os.sched_getaffinity(0))} " in text


def test_small_images_get_a_cifar_style_stem():
    net = build_classifier("resnet18", 3, small_images=True)
    assert net.conv1.kernel_size == (3, 3) and net.conv1.stride == (1, 1)
    assert isinstance(net.maxpool, nn.Identity)
    assert net(torch.zeros(2, 3, 8, 8)).shape == (2, 3)
    large = build_classifier("resnet18", 3, small_images=False)
    assert large.conv1.stride == (2, 2) and isinstance(large.maxpool, nn.MaxPool2d)


def _break(tree: Path, how: str) -> None:
    if how == "val class not in train":
        (tree / "val" / "fox").mkdir()
        Image.new("RGB", (8, 8)).save(tree / "val" / "fox" / "a.png")
    elif how == "empty class":
        (tree / "train" / "gnu").mkdir()
    elif how == "no images":
        for path in (tree / "train").rglob("*.*"):
            path.rename(path.with_suffix(".txt"))
    elif how == "no validation split":
        (tree / "val").rename(tree / "validation")
    elif how == "corrupt image":
        (tree / "train" / "cat" / "003.png").write_bytes(b"\x89PNG not really")


@pytest.mark.parametrize("how, message", [
    ("val class not in train", "train/ lacks: ['fox']"),
    ("empty class", "no images"),
    ("no images", "no images"),
    ("no validation split", "no val/ or test/ folder"),
    ("corrupt image", "cannot read image tree/train/cat/003.png"),
    ("missing folder", "--data-dir nowhere is not a folder"),
])
def test_bad_trees_exit_2_with_one_line_and_write_nothing(how, message, tmp_path, monkeypatch,
                                                          capsys, quiet_ignite_logger,
                                                          make_image_tree):
    make_image_tree(tmp_path / "tree", {"train": 2, "val": 1})
    _break(tmp_path / "tree", how)
    monkeypatch.chdir(tmp_path)
    data_dir = "nowhere" if how == "missing folder" else "tree"
    assert main(["images", "--data-dir", data_dir, "--batch-size", "2", "--num-workers",
                 "0"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and message in error and error.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def test_no_shared_cifar_folders_exit_2_saying_what_layout_is_expected(
        tmp_path, monkeypatch, capsys, quiet_ignite_logger):
    monkeypatch.setattr(paths, "SHARED_DATA", tmp_path / "absent")
    monkeypatch.chdir(tmp_path)
    assert main(["images"]) == 2
    error = capsys.readouterr().err
    assert (f"no CIFAR-10 folders in {tmp_path / 'absent' / 'cifar10'} (no such folder) and "
            "data/cifar10 (no such folder)") in error and error.endswith("with --data-dir\n")
    assert "train/<class>/<image> and val/<class>/<image>" in error
    assert not (tmp_path / "runs").exists()


def test_a_corrupt_image_met_by_a_worker_names_its_file_in_one_line(tmp_path, make_image_tree):
    """With ImageNet's statistics nothing decodes the files before training: the worker
    that meets the broken one reports it."""
    make_image_tree(tmp_path / "tree", {"train": 4, "val": 1})
    (tmp_path / "tree" / "train" / "eel" / "001.png").write_bytes(b"garbage")
    result = run_cli(["--data-dir", "tree", "--normalize", "imagenet", "--num-workers", "2",
                      "--batch-size", "4", "--epochs", "1", "--model", "squeezenet1_1",
                      "--progress", "off"], tmp_path)
    assert result.returncode == 2, result.stderr
    assert "error: cannot read image tree/train/eel/001.png" in result.stderr
    assert "Traceback" not in result.stderr


def run_and_signal(args: list[str], cwd: Path, signum: int, after_lines: int,
                   delay_sec: float, whole_group: bool = False) -> subprocess.CompletedProcess:
    """Start the run, send ``signum`` ``delay_sec`` after its ``after_lines``-th progress
    line (to the training process, or to its whole process group, workers included, as
    Ctrl-C and job schedulers do), and wait for it to end."""
    process = subprocess.Popen([sys.executable, "-m", "recipes", "images", *args], cwd=cwd,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=whole_group)
    lines = 0
    for line in process.stdout:
        lines += line.startswith("epoch ")
        if lines == after_lines:
            time.sleep(delay_sec)
            if whole_group:
                os.killpg(process.pid, signum)
            else:
                process.send_signal(signum)
            break
    stdout, stderr = process.communicate(timeout=TIMEOUT_SEC)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.mark.slow
def test_sigterm_to_the_whole_process_group_stops_gracefully_with_workers(workspace, tmp_path):
    """The workers ignore it: the training process saves, ends them and exits 143."""
    args = ["--data-dir", str(workspace / "tree"), "--num-workers", "2",
            "--run-dir", str(tmp_path / "run"), *RUN]
    stopped = run_and_signal(args, tmp_path, signal.SIGTERM, 3, 0.0, whole_group=True)
    assert stopped.returncode == 143, stopped.stderr
    assert "\ninterrupted by SIGTERM: epoch " in stopped.stdout
    assert "Traceback" not in stopped.stderr and "killed by signal" not in stopped.stderr
    resumed = run_cli(args, tmp_path)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr


def _trial(seed: int, workers: int, signum: int, slow: bool):
    marks = [pytest.mark.slow] if slow else []
    return pytest.param(seed, workers, signum, marks=marks,
                        id=f"{signal.Signals(signum).name}-workers{workers}-seed{seed}")


@pytest.mark.parametrize("seed, workers, signum", [
    _trial(0, 2, signal.SIGKILL, slow=False),
    *(_trial(seed, 2, signal.SIGKILL, slow=True) for seed in range(1, 6)),
    *(_trial(seed, 0, signal.SIGKILL, slow=True) for seed in range(2)),
    *(_trial(seed, workers, signal.SIGTERM, slow=True) for seed in range(2) for workers in (0, 2)),
])
def test_a_run_stopped_at_a_random_moment_then_rerun_finishes_identically(seed, workers, signum,
                                                                         workspace, tmp_path):
    """The reference ran with 2 workers: with 0 the weights must be the same too."""
    moment = random.Random(seed)
    # A progress line per step: after the 2nd, step 1 is saved; after the 10th at most, 8
    # steps (their saves) and 2 validations remain, more than the delay even on an idle CPU.
    after_lines, delay_sec = moment.randint(2, STEPS - 8), moment.uniform(0.0, 0.2)
    args = ["--data-dir", str(workspace / "tree"), "--num-workers", str(workers),
            "--run-dir", str(tmp_path / "run"), *RUN]
    stopped = run_and_signal(args, tmp_path, signum, after_lines, delay_sec)
    expected_code = -signal.SIGKILL if signum == signal.SIGKILL else 143
    assert stopped.returncode == expected_code, stopped.stderr
    if signum == signal.SIGKILL:  # killed before the end, else the trial tests nothing
        assert not (tmp_path / "run" / "summary.json").exists()

    resumed = run_cli(args, tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    assert_same_weights(tmp_path / "run", final_weights(workspace / "reference"))
