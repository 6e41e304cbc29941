"""``python -m recipes <recipe> evaluate|predict|generate`` end to end on tiny runs of every
recipe: evaluate reproduces the recorded metrics exactly (same device, same code: equal
floats, not a tolerance), predict gives the evaluator's probabilities for the same images,
generate repeats itself per seed, and every bad run or checkpoint is one line and exit 2
with the run folder untouched (but for evaluate's JSON).

The runs and the commands call ``recipes.__main__.main`` in this process (no interpreter
start-up); ``test_cli.py`` covers the real process's exit status and stderr.
"""

import builtins
import dataclasses
import errno
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch
from ignite.engine import Events
from PIL import Image

from engine.trainer import create_evaluator
from recipes.__main__ import main
from recipes.cifar.data import make_synthetic
from recipes.runner.commands.dispatch import run_command
from recipes.runner.commands.trained import load_trained
from recipes.runner.config.registry import load_recipe
from tests.helpers import (
    CIFAR,
    CIFAR_RUN,
    copy_run,
    digests,
    evaluated,
    one_error_line,
    recorded,
    train,
)

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


def evaluator_probabilities(recipe: str, run_dir: Path) -> torch.Tensor:
    """Softmax of the evaluator's outputs over the validation batches, in their order."""
    trained = load_trained(load_recipe(recipe), str(run_dir))
    parts = trained.parts
    evaluator = create_evaluator(parts.model, {}, device=trained.device,
                                 precision=trained.config.precision, predict=parts.predict,
                                 prepare_batch=parts.prepare_batch)
    outputs: list[torch.Tensor] = []
    evaluator.add_event_handler(Events.ITERATION_COMPLETED, lambda engine: outputs.append(
        engine.state.output[0].float().softmax(-1)))
    evaluator.run(parts.val_batches)
    return torch.cat(outputs)


# --- evaluate --------------------------------------------------------------------------------


@pytest.mark.parametrize("run", ["cifar_run", "images_run", "charlm_run"])
def test_evaluate_best_reproduces_the_recorded_best_exactly(run, request, capsys):
    run_dir = request.getfixturevalue(run)
    recipe = run.removesuffix("_run")
    before = digests(run_dir, "evaluations")
    assert main([recipe, "evaluate", str(run_dir)]) == 0
    result = evaluated(run_dir)
    best = load_recipe(recipe).best
    assert result["metrics"][best] == recorded(run_dir)[best]
    assert result["recorded"] == result["metrics"]  # every metric, at the best's step
    assert result["split"] == "validation" and result["checkpoint"].endswith("best.pt")
    out = capsys.readouterr().out
    assert best in out and "wrote" in out
    assert digests(run_dir, "evaluations") == before  # nothing else in the run folder changed


def test_evaluate_uses_the_tta_of_the_evaluation_that_scored_the_checkpoint(cifar_run):
    """The last checkpoint, after the final epoch, was scored with --final-tta
    (mirror_translate), unlike the per-epoch ones (mirror)."""
    assert main(["cifar", "evaluate", str(cifar_run), "--checkpoint", "last"]) == 0
    result = evaluated(cifar_run, "last-validation")
    assert "mirror_translate" in result["evaluation"]
    summary = json.loads((cifar_run / "summary.json").read_text())
    assert result["metrics"]["accuracy"] == summary["final_val_accuracy"]
    assert result["metrics"]["loss"] == summary["final_val_loss"]


def test_evaluate_with_ema_scores_the_averaged_weights(tmp_path):
    run_dir = train([*CIFAR_RUN, "--averaging", "ema", "--ema-decay", "0.5", "--lookahead",
                     "false", "--tta", "none", "--final-tta", "none"], tmp_path / "ema")
    payload = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert payload["averaging"]["num_updates"] > 0
    assert main(["cifar", "evaluate", str(run_dir)]) == 0
    result = evaluated(run_dir)
    assert result["metrics"]["accuracy"] == recorded(run_dir)["accuracy"]
    assert result["metrics"] == result["recorded"]


def test_evaluate_on_the_training_split_names_it_and_records_nothing_to_compare(cifar_run,
                                                                               capsys):
    assert main(["cifar", "evaluate", str(cifar_run / "checkpoints" / "best.pt"),
                 "--split", "training"]) == 0
    result = evaluated(cifar_run, "best-training")
    assert result["samples"] == 128 and result["recorded"] is None
    code = main(["charlm", "evaluate", "x", "--split", "training"])
    one_error_line(code, capsys.readouterr().err, "--split", "invalid choice")


def test_evaluate_on_the_test_split_is_for_a_run_that_held_its_validation_out_of_train(
        cifar_run, tmp_path, capsys):
    """A --val-fraction run validated on training images: ``--split test`` measures the test
    split it never saw. A run
    that validated on the test split refuses it in one line and writes nothing."""
    before = digests(cifar_run)
    code = main(["cifar", "evaluate", str(cifar_run), "--split", "test"])
    one_error_line(code, capsys.readouterr().err, "--split test", "no --val-fraction")
    assert digests(cifar_run) == before

    run_dir = train([*CIFAR, "--epochs", "1", "--val-fraction", "0.25"], tmp_path / "held")
    assert main(["cifar", "evaluate", str(run_dir), "--split", "test"]) == 0
    assert evaluated(run_dir, "best-test")["recorded"] is None  # nothing recorded on it
    official = make_synthetic(128, 32, seed=0)  # --train-subset 128 --val-subset 32
    cifar = load_recipe("cifar")
    test, validation = (load_trained(cifar, str(run_dir), split=split).data
                        for split in ("test", "validation"))
    assert torch.equal(test.test_images, official.test_images)
    assert torch.equal(validation.test_images, official.train_images[96:])  # the last 25%


# --- predict ---------------------------------------------------------------------------------


def test_cifar_predict_gives_the_evaluators_probabilities_for_the_same_images(cifar_run,
                                                                             tmp_path):
    """The validation images written as PNG (lossless) and predicted from their files get the
    probabilities the evaluator computes for them: decoded and normalised as in training."""
    trained = load_trained(load_recipe("cifar"), str(cifar_run))
    images = trained.data.test_images[:5]
    for index, image in enumerate(images):
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(tmp_path / f"{index}.png")
    out = tmp_path / "predictions.json"
    assert main(["cifar", "predict", str(cifar_run), str(tmp_path), "--top-k", "10",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["predictions"]
    reference = evaluator_probabilities("cifar", cifar_run)[:5]
    classes = trained.data.classes
    for row, expected in zip(rows, reference, strict=True):
        got = torch.tensor([next(p["probability"] for p in row["top"] if p["class"] == name)
                            for name in classes])
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_images_predict_on_png_and_jpeg_files_skips_a_non_image(images_run, image_tree,
                                                                tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "fake.jpg").write_text("not an image either")
    val = sorted((image_tree / "val").rglob("*.*"))
    assert {path.suffix for path in val} == {".png", ".jpg"}
    out = tmp_path / "predictions.csv"
    code = main(["images", "predict", str(images_run), str(image_tree / "val"),
                 str(tmp_path / "notes.txt"), str(tmp_path / "fake.jpg"), "--out", str(out)])
    assert code == 0
    captured = capsys.readouterr()
    skipped = captured.err.strip().splitlines()
    assert len(skipped) == 2 and "notes.txt" in skipped[0] and "fake.jpg" in skipped[1]
    lines = out.read_text().splitlines()
    assert lines[0] == "path,rank,class,probability" and len(lines) == 1 + 3 * len(val)
    reference = evaluator_probabilities("images", images_run)  # val/ in file order
    top = reference.max(-1)
    for index, path in enumerate(val):
        first = lines[1 + 3 * index].split(",")
        assert first[0] == str(path) and first[1] == "1"
        assert abs(float(first[3]) - float(top.values[index])) < 1e-5
        assert first[2] == ("cat", "dog", "eel")[int(top.indices[index])]


def test_predict_without_any_image_is_exit_2(cifar_run, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not an image")
    code = main(["cifar", "predict", str(cifar_run), str(tmp_path / "notes.txt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: no image") and len(err) == 2
    code = main(["cifar", "predict", str(cifar_run), str(tmp_path / "missing")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "missing: no such file or folder" in err[0] and len(err) == 2
    code = main(["cifar", "predict", str(cifar_run), str(tmp_path), "--out", "x.txt"])
    one_error_line(code, capsys.readouterr().err, "--out x.txt", ".csv or .json")


# --- generate --------------------------------------------------------------------------------


def test_generate_is_the_same_text_for_the_same_seed(charlm_run, capsys):
    def generate(*extra: str) -> str:
        assert main(["charlm", "generate", str(charlm_run), "--prompt", "def ",
                     "--max-new-bytes", "40", "--num-samples", "2", *extra]) == 0
        return capsys.readouterr().out

    first, again, other = generate("--seed", "3"), generate("--seed", "3"), generate("--seed", "4")
    assert first == again and first != other
    samples = first.split("-" * 40 + "\n")
    assert len(samples) == 2 and all(sample.startswith("def ") for sample in samples)
    assert generate("--seed", "3", "--top-k", "1") == generate("--seed", "9", "--top-k", "1")


def test_generate_refuses_bad_arguments_in_one_line(charlm_run, capsys):
    for args, fragment in ((["--prompt", ""], "--prompt must not be empty"),
                           (["--prompt", "x", "--temperature", "0"],
                            "--temperature: must be a number > 0, got '0'"),
                           (["--prompt", "x", "--top-k", "0"],
                            "--top-k: must be an integer >= 1, got '0'"),
                           (["--prompt", "x", "--seed", "99999999999999999999"],
                            "--seed: must be an integer from 0 to 18446744073709551615, got "
                            "'99999999999999999999'"),
                           (["--prompt", "x", "--seed", "-1"], "--seed: must be an integer"),
                           # the bytes 0xff 0xfe on a command line, as Python holds them
                           (["--prompt", "\udcff\udcfe"],
                            "--prompt: must be UTF-8 text, got the bytes b'\\xff\\xfe'"),
                           ([], "--prompt")):
        code = main(["charlm", "generate", str(charlm_run), *args])
        one_error_line(code, capsys.readouterr().err, fragment)


# --- what every command refuses --------------------------------------------------------------


@pytest.mark.parametrize("command", [["evaluate"], ["predict", "x.png"]])
def test_bad_runs_and_checkpoints_are_one_line_and_exit_2(command, cifar_run, charlm_run,
                                                          tmp_path, capsys):
    best = cifar_run / "checkpoints" / "best.pt"
    bad = copy_run(cifar_run, tmp_path / "bad", lambda path: path.startswith("checkpoints/"),
                   hard_links=False)
    corrupt, truncated = bad / "checkpoints" / "best.pt", bad / "checkpoints" / "last.pt"
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:1000])
    no_best = copy_run(cifar_run, tmp_path / "no_best",
                       lambda path: path.startswith("checkpoints/") and "best" not in path)
    (tmp_path / "empty").mkdir()
    Image.new("RGB", (32, 32)).save(tmp_path / "x.png")
    cases = [
        ("cifar", str(tmp_path / "nowhere"), "no such run folder or checkpoint file"),
        ("cifar", str(tmp_path / "empty"), "not a run folder"),
        ("images", str(best), "not a checkpoint of the images recipe"),
        ("cifar", str(charlm_run), "not a checkpoint of the cifar recipe"),
        ("cifar", str(corrupt), "checksum mismatch"),
        ("cifar", str(truncated), "truncated"),
        ("cifar", str(no_best), "best.pt: no such checkpoint"),
    ]
    before = digests(cifar_run, "evaluations")
    for recipe, source, fragment in cases:
        code = main([recipe, command[0], source, *[str(tmp_path / a) for a in command[1:]]])
        one_error_line(code, capsys.readouterr().err, fragment)
    assert digests(cifar_run, "evaluations") == before


@pytest.fixture
def read_only(monkeypatch):
    """``read_only(folder)``: creating or writing a file or folder under ``folder`` fails
    with EROFS, as on a read-only mount (root writes through chmod): a temp file
    (``tempfile.mkstemp``), a folder (``os.mkdir``), a file opened to write (``open``)."""
    folders: list[Path] = []
    real_mkstemp, real_mkdir, real_open = tempfile.mkstemp, os.mkdir, builtins.open

    def refused(path) -> OSError | None:
        if any(Path(path).resolve().is_relative_to(folder) for folder in folders):
            return OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return None

    def mkstemp(suffix=None, prefix=None, dir=None, text=False):
        if dir is not None and (error := refused(Path(dir) / f"{prefix}XXXXXX{suffix}")):
            raise error
        return real_mkstemp(suffix, prefix, dir, text)

    def mkdir(path, mode=0o777, *, dir_fd=None):
        if error := refused(path):
            raise error
        return real_mkdir(path, mode, dir_fd=dir_fd)

    def open_(file, mode="r", *args, **kwargs):
        if isinstance(file, str | Path) and set(mode) & set("wax+") and (
                error := refused(file)):
            raise error
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(builtins, "open", open_)
    return lambda folder: folders.append(folder.resolve())


@pytest.mark.parametrize("command, written", [
    (["evaluate"], "evaluations/best-validation.json"),
    (["export"], "export/best.pt2"),
    (["export", "--format", "safetensors", "--out", "{run}/w.safetensors"], "w.safetensors"),
    (["consolidate"], "export/best.pt"),
    (["predict", "{tmp}/x.png", "--out", "{run}/p.csv"], "p.csv"),
])
def test_a_read_only_run_folder_is_one_line_naming_the_file_and_exit_4(
        command, written, cifar_run, tmp_path, read_only, capsys):
    Image.new("RGB", (32, 32)).save(tmp_path / "x.png")
    before = digests(cifar_run)
    read_only(cifar_run)
    name, *args = (arg.format(run=cifar_run, tmp=tmp_path) for arg in command)

    code = main(["cifar", name, str(cifar_run), *args])

    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 4 and lines == [f"error: {name}: {cifar_run / written}: Read-only file system"]
    assert digests(cifar_run) == before


def with_command(failure: BaseException, monkeypatch):
    def command(recipe, args):
        raise failure

    module = types.ModuleType("failing_commands")
    module.COMMANDS = {"fails": command}
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return dataclasses.replace(load_recipe("charlm"), commands=module.__name__)


def test_a_refused_write_that_reaches_the_command_line_is_exit_4_naming_the_file(capsys,
                                                                               monkeypatch):
    refused = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "out/x.json")
    assert run_command(with_command(refused, monkeypatch), "fails", []) == 4
    assert capsys.readouterr().err == "error: fails: out/x.json: No space left on device\n"


def test_a_closed_stdout_is_left_to_the_command_line_not_called_a_disk_error(monkeypatch):
    with pytest.raises(BrokenPipeError):  # python -m recipes ends it quietly, exit 141
        closed = BrokenPipeError(errno.EPIPE, "Broken pipe")
        run_command(with_command(closed, monkeypatch), "fails", [])


FULL_DISK_EXPORT = """
import resource, signal, sys
from recipes.__main__ import main
from recipes.cifar.data import make_synthetic
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))  # smaller than the program
sys.exit(main(["charlm", "export", sys.argv[1], "--out", sys.argv[2]]))
"""


def test_export_on_a_disk_that_refuses_the_program_is_one_line_and_exit_4(charlm_run,
                                                                         tmp_path):
    """A real failed write (``ulimit -f``): torch's archive writer, given the file, ended the
    process with std::terminate (exit 134, a C++ stack) when a write failed."""
    out = tmp_path / "model.pt2"
    done = subprocess.run([sys.executable, "-c", FULL_DISK_EXPORT, str(charlm_run), str(out)],
                          cwd=Path(__file__).resolve().parents[4], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 4, done.stderr
    assert done.stderr.strip().splitlines() == [f"error: export: {out}: File too large"]
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_command_names_the_recipes_commands(capsys):
    code = main(["charlm", "predict", "x"])
    one_error_line(code, capsys.readouterr().err, "unknown command 'predict'", "generate")
