"""``python -m recipes`` end to end: help, bad input, a tiny run's outputs, resume.

Successful runs go through a subprocess (cwd = a temporary folder, so ``runs/`` lands
there); the table of bad inputs calls ``recipes.__main__.main`` in this process, which is
the same code minus interpreter start-up (~4 s each here), and a few of them also run as a
subprocess to check the exit status and the real stderr.
"""

import dataclasses
import errno
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torchvision.io import encode_jpeg

from recipes.__main__ import main
from recipes.cifar.model import build_model
from recipes.cifar.recipe import Config
from recipes.common.paths import SHARED_DATA
from recipes.runner.config.command_line import shown_value
from recipes.runner.resume.request import REQUEST_KEYS
from recipes.runner.training import report

pytestmark = pytest.mark.filterwarnings(  # torchvision 0.29 deprecates its JPEG codecs
    "ignore:The image decoding and encoding capabilities:DeprecationWarning")

REPO = Path(__file__).resolve().parents[2]
CLI_TIMEOUT_SEC = 600  # a hung run fails its test instead of hanging the suite
# The tiny run whose outputs several tests inspect: 256 // 64 = 4 optimizer steps per epoch.
PYTHON = shlex.quote(sys.executable)  # what a subprocess's next steps name
TINY = ["--dataset", "synthetic", "--train-subset", "256", "--val-subset", "128",
        "--batch-size=64", "--accum-steps=1", "--epochs=2", "--warmup-epochs", "0.5",
        "--progress", "off"]
TINY_STEPS = 2 * (256 // 64)
# Half an epoch of warmup, no test-time augmentation, no progress display.
QUICK_EVAL = ["--warmup-epochs", "0.5", "--tta", "none", "--final-tta", "none",
              "--progress", "off"]
# Smaller still, for resume: 8 micro-batches an epoch, 4 optimizer steps (two micro-batches a
# step, the default), a checkpoint at every step, no TTA.
RESUMABLE = ["--dataset", "synthetic", "--train-subset", "256", "--val-subset", "32",
             "--batch-size", "32", "--epochs", "2", *QUICK_EVAL, "--checkpoint-every", "1"]
TAGS = ["train/loss", "train/lr", "train/grad_norm", "train/grad_norm_clipped",
        "train/clip_fraction", "train/skipped_steps", "val/loss", "val/accuracy",
        "perf/samples_per_sec", "perf/epoch_time_sec"]


def cli_env(**extra: str) -> dict[str, str]:
    """The test's environment without a crash fault or a terminal size (pytest-xdist's
    workers set COLUMNS=80): help is wrapped only where a test asks for a width."""
    unset = {"CKPT_TEST_CRASH_PHASE", "COLUMNS", "LINES"}
    env = {key: value for key, value in os.environ.items() if key not in unset}
    return env | extra


def run_cli(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recipes", *args], cwd=cwd, env=cli_env(**env),
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_SEC)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> sha256) and every folder (-> 'dir')."""
    found = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        found[key] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The last checkpoint's weights and optimizer state (momentum buffers)."""
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    optimizer_state = {f"optimizer/{index}/{key}": value
                       for index, state in saved["optimizer"]["state"].items()
                       for key, value in state.items()}
    return {**saved["model"], **optimizer_state}


def assert_bit_identical(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]):
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def write_image_folders(root: Path, train_per_class: int = 4, test_per_class: int = 2) -> None:
    """A CIFAR-shaped tree root/{train,test}/<class>/*.jpg: 10 classes of random 32x32 JPEGs."""
    generator = torch.Generator().manual_seed(0)
    for split, count in (("train", train_per_class), ("test", test_per_class)):
        for label in range(10):
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True)
            for index in range(count):
                image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=generator)
                (folder / f"{index}.jpg").write_bytes(encode_jpeg(image).numpy().tobytes())


def write_corrupt_image_folders(root: Path) -> Path:
    write_image_folders(root, train_per_class=1, test_per_class=1)
    bad = root / "train" / "class3" / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 this is not a JPEG")
    return bad


# --- help ---------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [[], ["--help"], ["-h"]])
def test_help_lists_the_recipes(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "usage: python -m recipes <recipe>" in out and "\n  cifar " in out


def help_entry(lines: list[str], flag: str) -> str | None:
    """The line of ``flag`` in ``--help`` joined with the lines its meaning wraps onto."""
    for index, line in enumerate(lines):
        if line.startswith(f"  {flag} "):
            wrapped = []
            for after in lines[index + 1:]:
                if not after.startswith(" " * 6):
                    break
                wrapped.append(after.strip())
            return " ".join([line, *wrapped])
    return None


def test_recipe_help_lists_every_key_with_its_default_and_meaning(tmp_path):
    result = run_cli(["cifar", "--help"], tmp_path)
    assert result.returncode == 0 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[1].startswith("example: python -m recipes cifar --epochs 2")
    for spec in dataclasses.fields(Config):
        entry = help_entry(lines, "--" + spec.name.replace("_", "-"))
        assert entry is not None, spec.name
        assert entry.split()[1] == shown_value(spec.default) or spec.default == "", entry
        assert " ".join(spec.metadata["help"].split()) in entry
    assert list(tmp_path.iterdir()) == []


def test_recipe_help_keeps_its_columns_at_the_terminals_width(tmp_path):
    """Each meaning starts in the same column, and wraps under itself within COLUMNS."""
    result = run_cli(["cifar", "--help"], tmp_path, COLUMNS="80")
    keys = [line for line in result.stdout.splitlines() if line.startswith(("  --", " " * 6))]
    assert len(keys) > len(dataclasses.fields(Config)) and all(len(k) <= 80 for k in keys)
    meaning_columns = {len(line) - len(line.split("  ")[-1]) for line in keys}
    starts = {len(line) - len(line.lstrip()) for line in keys if not line.startswith("  --")}
    assert len(starts) == 1 and starts <= meaning_columns


def test_help_into_a_closed_pipe_stops_quietly(tmp_path):
    """`python -m recipes cifar --help | head -1`: no BrokenPipeError traceback."""
    result = subprocess.run(f"{sys.executable} -m recipes cifar --help | head -1", shell=True,
                            cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                            timeout=CLI_TIMEOUT_SEC)
    assert result.stdout == "usage: python -m recipes cifar [--key value ...]\n"
    assert result.stderr == ""


@pytest.mark.parametrize("args", [["cifar", "--epochs-typo", "3"], ["CIFAR", "--epochs", "3"],
                                  ["charlm", "--lr", "fast"], ["images", "--no-seed", "1"]])
def test_a_mistake_on_the_command_line_is_answered_before_torch_loads(args, tmp_path):
    """The whole command line is checked with no torch in the process (importing it takes
    seconds): `-X importtime` lists every module the process imported."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "recipes", *args],
                            cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                            timeout=CLI_TIMEOUT_SEC)
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert "recipes.runner.config.registry" in imported  # the recipe was looked up
    assert not {"torch", "torchvision", "ignite"} & imported
    errors = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    expect_one_error_line(result.returncode, "\n".join(errors), [])


@pytest.mark.parametrize("recipe", ["cifar", "images"])
def test_describe_needs_no_data(recipe, tmp_path, monkeypatch, capsys):
    """--describe builds the run on the recipe's stand-in data: no data set, no download."""
    monkeypatch.chdir(tmp_path)
    assert main([recipe, "--data-dir", "nowhere", "--describe"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("trainer:\n") and "\nevaluator:\n" in out
    assert list(tmp_path.iterdir()) == []


def test_make_train_passes_recipe_and_args_through():
    # --no-print-directory and a clean MAKEFLAGS: under `make test` the outer make's flags
    # would add "Entering/Leaving directory" lines.
    result = subprocess.run(["make", "--no-print-directory", "-n", "train", "RECIPE=cifar",
                             "ARGS=--epochs 3 --lr 0.2"], cwd=REPO, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "MAKEFLAGS": ""})
    assert result.returncode == 0
    commands = [line for line in result.stdout.splitlines() if "-m recipes" in line]
    assert commands[0] == ".venv/bin/python -m recipes cifar --epochs 3 --lr 0.2"  # as shown
    assert "; .venv/bin/python -m recipes cifar --epochs 3 --lr 0.2 || " in commands[1]  # as run


# --- bad input: exit 2, one line, nothing on disk -----------------------------------------

BAD_INPUT = {
    "unknown recipe": (["imagenet"], ["unknown recipe 'imagenet'", "available:", "cifar"]),
    "recipe in capitals": (["CIFAR"], ["unknown recipe 'CIFAR'; did you mean cifar?"]),
    "recipe cifar10": (["cifar10"], ["unknown recipe 'cifar10'; did you mean cifar?"]),
    "unknown key": (["cifar", "--epoch", "3"], ["unknown key --epoch", "did you mean --epochs"]),
    "no-switch": (["cifar", "--no-lookahead"], ["unknown key --no-lookahead",
                                                "say --lookahead false"]),
    "lr negative": (["cifar", "--lr", "-1"], ["--lr", "must be > 0", "-1"]),
    "lr not a number": (["cifar", "--lr", "abc"], ["--lr", "expected a number", "'abc'"]),
    "accum steps 0": (["cifar", "--accum-steps", "0"], ["--accum-steps", ">= 1"]),
    "max grad norm 0": (["cifar", "--max-grad-norm", "0"], ["--max-grad-norm", "> 0"]),
    "max grad norm -1": (["cifar", "--max-grad-norm=-1"], ["--max-grad-norm", "> 0"]),
    "patience -1": (["cifar", "--patience", "-1"], ["--patience", ">= 1"]),
    "patience 0": (["cifar", "--patience", "0"], ["--patience", ">= 1"]),
    "batch size 0": (["cifar", "--batch-size", "0"], ["--batch-size", ">= 1"]),
    "epochs not an int": (["cifar", "--epochs", "1.5"], ["--epochs", "expected an integer"]),
    "scheduler": (["cifar", "--scheduler", "bogus"], ["--scheduler", "'bogus'", "warmup_cosine"]),
    "precision": (["cifar", "--precision", "fp8"], ["--precision", "'fp8'", "bf16"]),
    "device": (["cifar", "--device", "tpu"], ["--device", "tpu", "cuda:N"]),
    "bool word": (["cifar", "--lookahead", "maybe"], ["--lookahead", "true or false"]),
    "run name ..": (["cifar", "--run-name", ".."], ["--run-name", "'..'", "letters, digits"]),
    "run name /": (["cifar", "--run-name", "a/b"], ["--run-name", "'a/b'", "letters, digits"]),
    "run name -": (["cifar", "--run-name", "-x"], ["--run-name", "'-x'", "start with a letter"]),
    "run name .": (["cifar", "--run-name", ".x"], ["--run-name", "'.x'", "start with a letter"]),
    "run name long": (["cifar", "--run-name", "r" * 65], ["--run-name", "at most 64", "65"]),
    "given twice": (["cifar", "--lr", "1", "--lr=2"], ["--lr", "given twice"]),
    "missing value": (["cifar", "--lr"], ["--lr", "missing value"]),
    "stray word": (["cifar", "lr", "1"], ["unknown command 'lr'", "--key value"]),
    "resume file": (["cifar", "--resume", "gone.pt"], ["--resume", "'gone.pt' is not a file"]),
    "warmup too long": (["cifar", "--epochs", "2", "--warmup-epochs", "2"],
                        ["--warmup-epochs", "< --epochs 2"]),
    "batch above data": (["cifar", "--dataset", "synthetic", "--train-subset", "64",
                          "--val-subset", "8", "--batch-size", "128"],
                         ["--batch-size 128", "64 training samples"]),
    "val fraction of too few": (["cifar", "--dataset", "synthetic", "--train-subset", "1",
                                 "--val-fraction", "0.1", "--batch-size", "1"],
                                ["--val-fraction", "leaves 0 for validation"]),
    "missing data dir": (["cifar", "--data-dir", "nowhere/cifar10"],
                         ["no CIFAR-10 found in nowhere/cifar10", "train/<class>/*.jpg"]),
    "empty run name": (["cifar", "--run-name", ""], ["--run-name", "must not be empty"]),
    "cuda graphs eager": (["cifar", "--dataset", "synthetic", "--cuda-graphs", "true"],
                          ["--cuda-graphs", "needs --compile true", "--compile false"]),
    "cuda graphs on cpu": (["cifar", "--dataset", "synthetic", "--device", "cpu", "--compile",
                            "true", "--cuda-graphs", "true"],
                           ["--cuda-graphs", "a CUDA device", "on cpu"]),
}


def expect_one_error_line(code: int, err: str, fragments: list[str]) -> str:
    assert code == 2
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


@pytest.mark.parametrize("argv, fragments", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_exits_2_with_one_line_and_writes_nothing(argv, fragments, tmp_path,
                                                            monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(argv)
    captured = capsys.readouterr()
    expect_one_error_line(code, captured.err, fragments)
    assert captured.out == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["cifar", "--device", "cuda", "--dataset", "synthetic"])
    expect_one_error_line(code, capsys.readouterr().err, ["--device", "CUDA is not available"])
    assert list(tmp_path.iterdir()) == []


def test_a_corrupt_jpeg_is_named(tmp_path, monkeypatch, capsys):
    bad = write_corrupt_image_folders(tmp_path / "data")
    before = snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)
    code = main(["cifar", "--data-dir", "data", "--batch-size", "5"])
    expect_one_error_line(code, capsys.readouterr().err,
                          [f"cannot read image {bad.relative_to(tmp_path)}"])
    assert snapshot(tmp_path) == before


def test_a_run_dir_that_cannot_be_created_exits_2(tmp_path, monkeypatch, capsys):
    (tmp_path / "blocker").write_text("a file where the run folder's parent should be")
    before = snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)
    code = main(["cifar", "--run-dir", "blocker/run", "--dataset", "synthetic",
                 "--train-subset", "64", "--val-subset", "8", "--batch-size", "32"])
    expect_one_error_line(code, capsys.readouterr().err, ["cannot create blocker/run"])
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("args, fragments", [
    (["cifar", "--epoch", "3"], ["unknown key --epoch", "did you mean --epochs"]),
    (["cifar", "--data-dir", "data"], ["cannot read image data/train/class3/broken.jpg"]),
])
def test_bad_input_through_the_real_command_line(args, fragments, tmp_path):
    write_corrupt_image_folders(tmp_path / "data")
    before = snapshot(tmp_path)
    result = run_cli(args, tmp_path)
    expect_one_error_line(result.returncode, result.stderr, fragments)
    assert result.stdout == "" and snapshot(tmp_path) == before


# --- a tiny synthetic run -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    cwd = tmp_path_factory.mktemp("tiny")
    result = run_cli(["cifar", *TINY, "--run-name", "tiny"], cwd)
    return result, cwd / "runs" / "cifar" / "tiny"


def test_tiny_run_succeeds(tiny_run):
    result, run_dir = tiny_run
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert {path.name for path in run_dir.iterdir()} >= {
        "config.json", "summary.json", "curves.png", "checkpoints"}


def test_tiny_run_config_json_holds_the_resolved_config(tiny_run):
    _, run_dir = tiny_run
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["run_id"]
    expected = dataclasses.asdict(Config(
        dataset="synthetic", train_subset=256, val_subset=128, batch_size=64, accum_steps=1,
        epochs=2, warmup_epochs=0.5, progress="off", run_name="tiny",
        run_dir="runs/cifar/tiny"))  # the plan settles the folder the name resolves to
    assert saved["recipe"] == "cifar"
    assert saved["config"] == {key: value for key, value in expected.items()
                               if key not in REQUEST_KEYS}  # --resume asks of one start only


def test_tiny_run_logs_every_tag_to_tensorboard(tiny_run):
    _, run_dir = tiny_run
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(run_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert set(TAGS) <= tags, sorted(set(TAGS) - tags)
    assert [event.step for event in events.Scalars("val/accuracy")] == [4, 8]
    assert [event.step for event in events.Scalars("perf/epoch_time_sec")] == [4, 8]
    assert events.Scalars("train/loss")[-1].step == TINY_STEPS
    assert all(event.value == 0 for event in events.Scalars("train/skipped_steps"))


def test_tiny_run_checkpoints_load_with_weights_only(tiny_run):
    _, run_dir = tiny_run
    for name in ("last.pt", "best.pt"):
        payload = torch.load(run_dir / "checkpoints" / name, weights_only=True)
        model = build_model("airbench")
        model.load_state_dict(payload["model"])  # strict: every key and shape matches
        assert payload["meta"]["run_id"] == json.loads(
            (run_dir / "config.json").read_text())["run_id"]
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert last["meta"]["optimizer_step"] == TINY_STEPS and last["meta"]["epoch"] == 2


def test_tiny_run_summary_is_consistent(tiny_run):
    result, run_dir = tiny_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["epochs_completed"] == 2 and summary["stopped_early"] is False
    assert summary["optimizer_steps"] == TINY_STEPS and summary["skipped_steps"] == 0
    assert 0 <= summary["final_val_accuracy"] <= summary["best_val_accuracy"] <= 1
    assert 0 < summary["best_val_loss"] <= summary["final_val_loss"]
    assert summary["wall_time_sec"] >= summary["train_time_sec"] > 0
    assert summary["samples_per_sec"] == pytest.approx(
        TINY_STEPS * 64 / summary["train_time_sec"], rel=1e-2)
    best = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert best["meta"]["metric"]["value"] == pytest.approx(summary["best_val_accuracy"])


def test_tiny_run_console_opens_with_the_run_and_ends_with_the_best_and_what_next(tiny_run):
    result, run_dir = tiny_run
    lines, folder = result.stdout.splitlines(), Path("runs") / "cifar" / "tiny"
    parameters = sum(p.numel() for p in build_model("airbench").parameters())
    start = lines.index(f"cifar run in {folder}")
    assert lines[start + 1:start + 5] == [
        "  data     256 training, 128 validation samples from synthetic images (validation: "
        "the test split, which also picks best.pt; --val-fraction 0.1 holds out training "
        "images instead)",
        f"  model    airbench, {parameters:,} parameters",
        "  device   cpu, fp32; 2 epochs of batch 64",
        "  watch    make tensorboard (then open http://127.0.0.1:6006)"]
    best = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)["meta"]
    summary = json.loads((run_dir / "summary.json").read_text())
    end = lines[lines.index(next(line for line in lines if line.startswith("completed: "))):]
    assert end[0].startswith(f"completed: epoch 2/2, {TINY_STEPS} steps in ")
    assert end[1:] == [
        f"  best     {folder}/checkpoints/best.pt: accuracy "
        f"{summary['best_val_accuracy']:.4g} (epoch {best['epoch']})",
        f"  summary  {folder}/summary.json",
        "  curves   make tensorboard (then open http://127.0.0.1:6006)",
        f"  evaluate {PYTHON} -m recipes cifar evaluate {folder}",
        f"  longer   {PYTHON} -m recipes cifar --run-dir {folder} --epochs 4 (continues this "
        "run, its LR schedule re-planned for 4 epochs)"]
    assert "{" not in result.stdout  # the raw numbers stay in summary.json


def test_tiny_run_writes_its_json_files_as_open_would_under_the_umask(tiny_run):
    """config.json and summary.json as metrics.jsonl: readable by others under umask 022
    (the subprocess inherits this process's umask); checkpoints keep their 0o640."""
    _, run_dir = tiny_run
    mask = os.umask(0o022)
    os.umask(mask)
    modes = {name: (run_dir / name).stat().st_mode & 0o777
             for name in ("config.json", "summary.json", "metrics.jsonl")}
    assert modes == dict.fromkeys(modes, 0o666 & ~mask)
    assert (run_dir / "checkpoints" / "last.pt").stat().st_mode & 0o777 == 0o640


def test_tiny_run_draws_the_curves(tiny_run):
    _, run_dir = tiny_run
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("change, key", [
    (["--model", "resnet18"], "--model"),
    (["--batch-size", "32"], "--batch-size"),
    (["--momentum", "0.5"], "--momentum"),
])
def test_resume_refuses_to_change_a_fixed_key(tiny_run, change, key, capsys):
    _, run_dir = tiny_run
    before = snapshot(run_dir)
    code = main(["cifar", "--run-dir", str(run_dir), *change])
    expect_one_error_line(code, capsys.readouterr().err, [key, "cannot change on resume"])
    assert snapshot(run_dir) == before


def test_resume_refuses_a_fixed_key_through_the_real_command_line(tiny_run, tmp_path):
    _, run_dir = tiny_run
    before = snapshot(run_dir)
    result = run_cli(["cifar", "--run-dir", str(run_dir), "--model", "resnet18"], tmp_path)
    expect_one_error_line(result.returncode, result.stderr,
                          ["--model", "cannot change on resume ('airbench' -> 'resnet18')"])
    assert snapshot(run_dir) == before and list(tmp_path.iterdir()) == []


def test_resume_never_into_a_folder_with_checkpoints_exits_2(tiny_run, capsys):
    _, run_dir = tiny_run
    before = snapshot(run_dir)
    code = main(["cifar", *TINY, "--run-dir", str(run_dir), "--resume", "never"])
    expect_one_error_line(code, capsys.readouterr().err,
                          ["--resume never", "already holds checkpoints"])
    assert snapshot(run_dir) == before


def test_a_summary_the_disk_refuses_is_one_error_line_and_exit_4(tmp_path, monkeypatch,
                                                                  capsys):
    monkeypatch.chdir(tmp_path)
    write_json_atomic = report.write_json_atomic

    def disk_full_for_the_summary(path: Path, data: dict) -> None:
        if path.name == "summary.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        write_json_atomic(path, data)

    monkeypatch.setattr(report, "write_json_atomic", disk_full_for_the_summary)
    code = main(["cifar", *RESUMABLE, "--run-name", "full"])
    err = capsys.readouterr().err
    assert code == 4
    assert "error: could not write the summary or curves" in err and "No space left" in err
    assert (tmp_path / "runs/cifar/full/checkpoints/last.pt").exists()


# --- other data ---------------------------------------------------------------------------


def test_a_run_on_image_folders(tmp_path):
    write_image_folders(tmp_path / "images")  # 40 training and 20 test images
    result = run_cli(["cifar", "--data-dir", "images", "--batch-size", "20", "--accum-steps", "1",
                      "--epochs", "2",
                      *QUICK_EVAL, "--run-name", "folders"], tmp_path)
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "runs" / "cifar" / "folders"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epochs_completed"] == 2 and summary["optimizer_steps"] == 4
    assert round(20 * summary["final_val_accuracy"], 6).is_integer()  # 20 validation images
    assert json.loads((run_dir / "config.json").read_text())["config"]["data_dir"] == "images"


@pytest.mark.slow  # reads 50,000 JPEGs' file list and decodes a slice: about 20 s
@pytest.mark.skipif(not (SHARED_DATA / "cifar10").is_dir(), reason="no shared CIFAR-10")
def test_a_run_on_a_slice_of_the_real_set(tmp_path):
    """Decoding all 60k JPEGs takes ~12 s here (then the first 512/256 are kept)."""
    result = run_cli(["cifar", "--train-subset", "512", "--val-subset", "256", "--epochs", "1",
                      *QUICK_EVAL, "--run-name", "real"], tmp_path)
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "runs" / "cifar" / "real"
    summary = json.loads((run_dir / "summary.json").read_text())
    config = json.loads((run_dir / "config.json").read_text())["config"]
    # The counts follow the recipe's default step, whatever it is: since issue #46 two
    # micro-batches of 512, so the slice is one micro-batch (iteration) whose short last
    # window still makes the epoch's one optimizer step (the batch was 256 when this was
    # written: 2 steps).
    micro_batches = 512 // config["batch_size"]
    assert json.loads((run_dir / "checkpoints" / "last.pt.json").read_text())[
        "iteration"] == micro_batches
    assert summary["epochs_completed"] == 1
    assert summary["optimizer_steps"] == -(-micro_batches // config["accum_steps"])
    assert 0 <= summary["final_val_accuracy"] <= 1
    assert config["data_dir"] == "auto"
    assert not (tmp_path / "data").exists()  # the shared copy was used, nothing downloaded


# --- resume -------------------------------------------------------------------------------


# These resume cases run in `make test-slow`: `make test` covers a kill and a SIGTERM of the
# same command through tests/reliability (test_kill.py, test_signals.py).
@pytest.fixture(scope="module", params=["sgd", "muon"])
def uninterrupted(request, tmp_path_factory) -> tuple[list[str], dict[str, torch.Tensor]]:
    """(the run's arguments, its final weights), once per optimizer."""
    cwd = tmp_path_factory.mktemp("uninterrupted")
    args = [*RESUMABLE, "--optimizer", request.param]
    result = run_cli(["cifar", *args, "--run-name", "full"], cwd)
    assert result.returncode == 0, result.stderr
    return args, final_weights(cwd / "runs" / "cifar" / "full")


@pytest.mark.slow
def test_a_killed_run_rerun_with_the_same_command_ends_bit_identical(uninterrupted, tmp_path):
    """Killed (os._exit, like SIGKILL) as it starts its 3rd save, at step 3 of epoch 1; the
    same command then resumes from the step-2 checkpoint, mid-epoch."""
    resumable, uninterrupted = uninterrupted
    args = ["cifar", *resumable, "--run-name", "killed"]
    killed = run_cli(args, tmp_path, CKPT_TEST_CRASH_PHASE="before_temp:3")
    assert killed.returncode == 137
    run_dir = tmp_path / "runs" / "cifar" / "killed"
    assert torch.load(run_dir / "checkpoints" / "last.pt",
                      weights_only=True)["meta"]["optimizer_step"] == 2
    resumed = run_cli(args, tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    # The default step is two micro-batches (iterations): step 2 ends at iteration 4.
    assert "resumed from" in resumed.stdout and "iteration 4, step 2)" in resumed.stdout
    assert_bit_identical(final_weights(run_dir), uninterrupted)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["optimizer_steps"] == 8 and summary["epochs_completed"] == 2


@pytest.mark.slow
def test_sigterm_saves_and_stops_then_the_same_command_finishes_bit_identical(
    uninterrupted, tmp_path
):
    resumable, uninterrupted = uninterrupted
    args = ["cifar", *resumable, "--run-name", "stopped"]
    run_dir = tmp_path / "runs" / "cifar" / "stopped"
    process = subprocess.Popen([sys.executable, "-m", "recipes", *args], cwd=tmp_path,
                               env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        deadline = time.monotonic() + CLI_TIMEOUT_SEC
        while not (run_dir / "checkpoints" / "last.pt.json").exists():  # step 1 committed
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=CLI_TIMEOUT_SEC)
    finally:
        process.kill()
    assert process.returncode == 143, err
    assert "SIGTERM" in out
    stopped = json.loads((run_dir / "summary.json").read_text())
    assert stopped["status"] == "interrupted by SIGTERM"
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert last["meta"]["optimizer_step"] == stopped["optimizer_steps"]

    resumed = run_cli([*args, "--keep-last", "2"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "override: keep_last 3 -> 2" in resumed.stdout and "resumed from" in resumed.stdout
    assert_bit_identical(final_weights(run_dir), uninterrupted)
    assert len(list((run_dir / "checkpoints").glob("step-*.pt"))) <= 2


# --- on a GPU (skipped without one) ---------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("precision", ["auto", "fp16"])
def test_on_cuda_a_killed_run_resumes_bit_identical(precision, tmp_path):
    """On the GPU (auto: bf16; fp16: with its GradScaler, whose scale is in the checkpoint)
    the killed-and-resumed run ends with the uninterrupted run's weights, bit for bit."""
    args = ["cifar", *RESUMABLE, "--device", "cuda", "--precision", precision]
    full = run_cli([*args, "--run-name", "full"], tmp_path)
    assert full.returncode == 0, full.stderr
    full_dir = tmp_path / "runs" / "cifar" / "full"
    summary = json.loads((full_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["optimizer_steps"] == 8
    saved = json.loads((full_dir / "config.json").read_text())["config"]
    assert (saved["device"], saved["precision"]) == ("cuda", precision)

    killed_args = [*args, "--run-name", "killed"]
    killed = run_cli(killed_args, tmp_path, CKPT_TEST_CRASH_PHASE="before_temp:3")
    assert killed.returncode == 137
    resumed = run_cli(killed_args, tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "iteration 4, step 2)" in resumed.stdout
    assert_bit_identical(final_weights(tmp_path / "runs" / "cifar" / "killed"),
                         final_weights(full_dir))


@pytest.mark.parametrize(("change", "named"), [
    ("add", "training samples 40 -> 41; class 'class3' 4 -> 5 samples"),
    ("edit", "training images differ"),
])
def test_a_resume_on_changed_cifar_images_is_refused_naming_the_change(change, named, tmp_path,
                                                                       capsys):
    data = tmp_path / "images"
    write_image_folders(data)  # 4 training images per class
    run = ["cifar", "--data-dir", str(data), "--batch-size", "8", "--tta", "none",
           "--final-tta", "none", "--progress", "off", "--device", "cpu",
           "--run-dir", str(tmp_path / "run")]
    assert main([*run, "--epochs", "1"]) == 0
    image = torch.full((3, 32, 32), 7, dtype=torch.uint8)
    target = data / "train" / "class3" / ("extra.jpg" if change == "add" else "0.jpg")
    target.write_bytes(encode_jpeg(image).numpy().tobytes())
    capsys.readouterr()

    expect_one_error_line(main([*run, "--epochs", "2"]), capsys.readouterr().err, [named])
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["config"]["epochs"] == 1  # the refused start wrote nothing
