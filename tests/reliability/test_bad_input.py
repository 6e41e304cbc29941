"""Bad input against a run that already holds checkpoints: exit 2 with one ``error:`` line
naming the problem, and not one byte of what is already saved changes (sha256 of every file
before and after). tests/recipes/test_cli.py covers the messages; this covers "untouched".

The command line runs in this process (``recipes.__main__.main``): every case fails before
training starts, and a subprocess would spend most of its time importing torch.
"""

import json
import os

import pytest
import torch
from torchvision.io import encode_jpeg, write_file

from recipes.__main__ import main

pytestmark = [pytest.mark.reliability,
              pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")]


@pytest.fixture
def runs_root(tmp_path, reference, harness, monkeypatch):
    """``tmp_path`` as the working directory, holding ``runs/existing`` (a copy of the
    finished reference run) and, for CIFAR, ``runs/existing-jpeg``, the same run relabelled
    as one trained on the image folders in ``tmp_path/images``, whose first training JPEG is
    corrupt, and left unfinished."""
    monkeypatch.chdir(tmp_path)
    harness.copy_run(reference.run_dir, tmp_path / "runs" / "existing")
    for name, content in CONFIG_FILES.items():
        (tmp_path / name).write_text(content)
    (tmp_path / "device.toml").symlink_to(os.devnull)
    if harness.recipe != "cifar":
        return tmp_path
    jpeg_run = harness.copy_run(reference.run_dir, tmp_path / "runs" / "existing-jpeg")
    images = tmp_path / "images"
    generator = torch.Generator().manual_seed(0)
    for split, count in (("train", 4), ("test", 2)):
        for name in ("cat", "dog"):
            (images / split / name).mkdir(parents=True)
            for index in range(count):
                pixels = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8,
                                       generator=generator)
                write_file(str(images / split / name / f"{index}.jpg"), encode_jpeg(pixels))
    (images / "train" / "cat" / "0.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a JPEG")
    saved = json.loads((jpeg_run / "config.json").read_text())
    saved["config"].update(dataset="cifar10", data_dir=str(images))
    (jpeg_run / "config.json").write_text(json.dumps(saved))
    # Unfinished (killed before its summary): a start continues it and reads its data. A
    # finished one would be reported complete, its data unread.
    (jpeg_run / "summary.json").unlink()
    return tmp_path


EXISTING = ("--run-dir", "runs/existing")
CONFIG_FILES = {"malformed.toml": "epochs = 4\nlr = \n", "malformed.json": '{"epochs": 4,}',
                "list.json": "[4]", "negative-lr.toml": "lr = -0.1\n", "seed.toml": "seed = 9\n",
                "nul.json": '{"run_dir": "runs/\\u0000"}',
                "deep.json": '{"lr": ' + "[" * 100_000 + "]" * 100_000 + "}"}
BAD_INPUTS = {
    "run_name_with_dotdot": (("--run-name", "../existing"), "--run-name"),
    "run_name_with_slash": (("--run-name", "runs/existing"), "--run-name"),
    "run_name_over_64_chars": (("--run-name", "r" * 65), "--run-name"),
    "run_name_empty": (("--run-name", ""), "--run-name"),
    "unknown_key": ((*EXISTING, "--learning-rate", "0.1"), "--learning-rate"),
    "negative_lr": ((*EXISTING, "--lr", "-0.1"), "--lr"),
    "accum_steps_0": ((*EXISTING, "--accum-steps", "0"), "--accum-steps"),
    "max_grad_norm_0": ((*EXISTING, "--max-grad-norm", "0"), "--max-grad-norm"),
    "max_grad_norm_negative": ((*EXISTING, "--max-grad-norm", "-1"), "--max-grad-norm"),
    "negative_patience": ((*EXISTING, "--patience", "-1"), "--patience"),
    "config_missing": ((*EXISTING, "--config", "missing.toml"), "missing.toml: no such file"),
    "config_a_folder": ((*EXISTING, "--config", "runs/existing"), "is a folder"),
    "config_malformed_toml": ((*EXISTING, "--config", "malformed.toml"),
                              "malformed.toml:2: not valid TOML"),
    "config_malformed_json": ((*EXISTING, "--config", "malformed.json"),
                              "malformed.json:1: not valid JSON"),
    "config_not_a_table": ((*EXISTING, "--config", "list.json"), "must be an object of keys"),
    "config_negative_lr": ((*EXISTING, "--config", "negative-lr.toml"),
                           "negative-lr.toml:1: --lr: must be > 0"),
    "config_changes_a_fixed_key": ((*EXISTING, "--config", "seed.toml"),
                                   "--seed: cannot change on resume"),
    "config_a_device": ((*EXISTING, "--config", "device.toml"), "not a regular file"),
    "config_nested_too_deeply": ((*EXISTING, "--config", "deep.json"), "nested too deeply"),
    "config_nul_byte": (("--config", "nul.json"), "--run-dir: must not hold a NUL byte"),
    "run_dir_not_utf8": (("--run-dir", "runs/\udcff"), "--run-dir: must be UTF-8 text"),
    "seed_over_2_64": ((*EXISTING, "--seed", "99999999999999999999"),
                       "--seed: must be <= 18446744073709551615"),
    "profile_window_reversed": ((*EXISTING, "--profile", "10:5"), "--profile"),
    "profile_window_past_the_run": ((*EXISTING, "--profile", "0:100000"), "--profile"),
    # With MLflow: the store is a file; without: MLflow is missing. Both name --tracker.
    "tracker_uri_a_file": ((*EXISTING, "--tracker", "mlflow", "--tracker-uri",
                            "runs/existing/config.json"), "--tracker"),
}
CIFAR_DATA_INPUTS = {
    "data_dir_missing": (("--run-dir", "runs/existing-jpeg", "--data-dir", "no-such-dir"),
                         "no-such-dir"),
    "corrupt_jpeg": (("--run-dir", "runs/existing-jpeg"), "0.jpg"),
}


@pytest.mark.parametrize("case", [*BAD_INPUTS, *CIFAR_DATA_INPUTS])
def test_bad_input_exits_2_with_one_line_and_touches_nothing(case, runs_root, harness, capsys):
    if case in CIFAR_DATA_INPUTS and harness.recipe != "cifar":
        pytest.skip("CIFAR's image-folder data")
    args, named = {**BAD_INPUTS, **CIFAR_DATA_INPUTS}[case]
    before = harness.file_digests(runs_root)

    code = main([harness.recipe, *args])

    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert named in lines[0]
    assert harness.file_digests(runs_root) == before
