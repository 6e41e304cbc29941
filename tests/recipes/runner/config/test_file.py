"""``--config FILE`` and ``--print-config``: keys from a TOML or JSON file under the command
line's, a run folder's config.json as a config file, the resolved config printed as TOML and
read back to the same config, and every mistake in a file as one line naming the file."""

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest

from recipes.__main__ import main
from recipes.runner.config.command_line import ConfigError, flag_name, help_text
from recipes.runner.config.file import (
    REQUESTS,
    config_toml,
    parse_command_line,
    parse_start,
)
from recipes.runner.config.registry import find_recipes, recipe_keys
from recipes.runner.console import interpreter
from recipes.runner.resume.request import REQUEST_KEYS
from tests.helpers import CHARLM, digests, one_error_line, write_text

CIFAR = recipe_keys("cifar").config


def parse(tmp_path: Path, name: str, content: str, *argv: str):
    (tmp_path / name).write_text(content)
    return parse_command_line(CIFAR, ["--config", str(tmp_path / name), *argv])


def as_dict(config) -> dict:
    return dataclasses.asdict(config)


# --- reading a file -----------------------------------------------------------------------


def test_the_command_line_overrides_the_file_which_overrides_the_defaults(tmp_path):
    config, given = parse(tmp_path, "f.toml", "epochs = 3\nlr = 0.5\n", "--lr", "0.25")
    assert (config.epochs, config.lr, config.batch_size) == (3, 0.25, CIFAR().batch_size)
    assert given == {"epochs", "lr"}  # the file's keys count as given, as if typed


def test_both_spellings_of_a_key_and_typed_values_are_read(tmp_path):
    config, _ = parse(tmp_path, "f.toml", 'batch-size = 64\nlookahead = false\nlr = 1\n'
                      'max_grad_norm = 2\ntrain_subset = "none"\nmodel = "resnet18"\n')
    assert (config.batch_size, config.lookahead, config.model) == (64, False, "resnet18")
    assert config.lr == 1.0 and isinstance(config.lr, float)  # an integer where a float goes
    assert config.max_grad_norm == 2.0 and config.train_subset is None


def test_json_is_read_with_null_as_no_value(tmp_path):
    config, given = parse(tmp_path, "f.json", '{"epochs": 2, "patience": null, "seed": 7}')
    assert (config.epochs, config.patience, config.seed) == (2, None, 7)
    assert given == {"epochs", "patience", "seed"}


def saved_run(tmp_path: Path, **keys) -> Path:
    """A run folder's config.json as the run layer writes it."""
    config = {key: value for key, value in as_dict(CIFAR(**keys)).items()
              if key not in REQUEST_KEYS}
    path = tmp_path / "runs" / "cifar" / "old" / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"run_id": "abc", "data": {"training": {"n": 64}},
                                "environment": {"torch": "2"}, "init_from": {"path": "x"},
                                "config": config}, indent=2))
    return path


def test_a_run_folders_config_json_gives_its_keys_and_one_note_on_what_it_ignores(tmp_path,
                                                                                   capsys):
    path = saved_run(tmp_path, epochs=3, lr=0.5, init_from="weights.pt",
                     run_name="old", run_dir="runs/cifar/old")

    config, given = parse_command_line(CIFAR, ["--config", str(path), "--seed", "1"])

    assert (config.epochs, config.lr, config.seed, config.init_from) == (3, 0.5, 1, "weights.pt")
    assert (config.run_name, config.run_dir) == ("", "")  # its folder is not this run's
    assert {"run_name", "run_dir"}.isdisjoint(given) and {"epochs", "seed"} <= given
    err = capsys.readouterr().err.splitlines()
    assert err == [f"note: {path} is run abc's config.json: taking its keys, not its run "
                   "(ignoring run_id, data, environment, init_from, run_name, run_dir); to "
                   f"continue that run itself: --run-dir {path.parent}"]
    assert parse_start(CIFAR, ["--config", str(path), "--seed", "1"])[2] == "abc"
    assert parse_start(CIFAR, ["--seed", "1"])[2] == ""


def test_a_key_beside_a_run_folders_config_table_is_still_checked(tmp_path):
    path = saved_run(tmp_path)
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "epoch": 3}))
    with pytest.raises(ConfigError, match=r"unknown key --epoch; did you mean --epochs"):
        parse_command_line(CIFAR, ["--config", str(path)])


# --- mistakes: the command line's one line, naming the file and the line --------------------

BAD_FILES = {
    "unknown key": ("f.toml", "epochs = 2\nepoch = 3\n",
                    "f.toml:2: unknown key --epoch; did you mean --epochs"),
    "no-switch": ("f.toml", "no-lookahead = true\n",
                  "f.toml:1: unknown key --no-lookahead; to turn --lookahead off, say "
                  "--lookahead false"),
    "text for an integer": ("f.toml", '\n\nepochs = "3"\n',
                            "f.toml:3: --epochs: expected an integer, got the string '3' (no "
                            "quotes for a number or true/false)"),
    "text for an optional integer": ("f.toml", 'val_subset = "500"\n',
                                     "f.toml:1: --val-subset: expected an integer or none, got "
                                     "the string '500' (no quotes for a number or true/false)"),
    "text for a switch": ("f.toml", 'lookahead = "true"\n',
                          "f.toml:1: --lookahead: expected true or false, got the string "
                          "'true' (no quotes for a number or true/false)"),
    "a word for a number": ("f.toml", 'lr = "fast"\n',
                            "f.toml:1: --lr: expected a number, got the string 'fast'"),
    "float for an integer": ("f.json", '{\n  "epochs": 1.5\n}',
                             "f.json:2: --epochs: expected an integer, got 1.5"),
    "number for a switch": ("f.json", '{"lookahead": 1}',
                            "f.json:1: --lookahead: expected true or false, got 1"),
    "number for a text": ("f.toml", "model = 18\n", "f.toml:1: --model: expected a string, got 18"),
    "null for a required key": ("f.json", '{"lr": null}',
                                "f.json:1: --lr: expected a number, got null"),
    "a list": ("f.toml", "lr = [1, 2]\n", "f.toml:1: --lr: expected a number, got a list"),
    "a table": ("f.toml", "seed = 1\n[run]\nepochs = 3\n",
                "f.toml:2: run: a table; a config file holds its keys at the top level "
                "(--print-config's groups are comments)"),
    "out of range": ("f.toml", "lr = 0.1\nbatch_size = 0\n",
                     "f.toml:2: --batch-size: must be >= 1, got 0"),
    "not a choice": ("f.toml", 'precision = "fp8"\n',
                     "f.toml:1: --precision: 'fp8' is not allowed; choose one of: auto, fp32"),
    "bad run name": ("f.toml", 'run_name = "a/b"\n', "f.toml:1: --run-name: 'a/b' may only"),
    "both spellings": ("f.toml", "batch_size = 1\nbatch-size = 2\n",
                       "f.toml:2: --batch-size: given twice"),
    "a repeated JSON key": ("f.json", '{"lr": 1, "lr": 2}', "f.json: --lr: given twice"),
    "resume": ("f.toml", 'resume = "never"\n',
               "f.toml:1: --resume: asks something of one start, not of the run; give it on "
               "the command line"),
    "malformed TOML": ("f.toml", "epochs = 2\nlr = \n",
                       "f.toml:2: not valid TOML: Invalid value (column 6)"),
    "malformed JSON": ("f.json", '{\n  "epochs": 2,\n}',
                       "f.json:3: not valid JSON: Expecting property name enclosed in double "
                       "quotes (column 1)"),
    "top level not a table": ("f.json", "[1, 2]",
                              "f.json: the top level must be an object of keys, got a list"),
    "not UTF-8": ("f.toml", b"lr = 0.1 # \xff\n", "--config {dir}/f.toml: not UTF-8 text"),
    "a NUL byte in a JSON text": ("f.json", '{"run_dir": "runs/a\\u0000b"}',
                                  "f.json:1: --run-dir: must not hold a NUL byte, got "
                                  "'runs/a\\x00b'"),
    "a NUL byte in a TOML text": ("f.toml", 'run_dir = "runs/a\\u0000b"\n',
                                  "f.toml:1: --run-dir: must not hold a NUL byte"),
    "a lone surrogate": ("f.json", '{"run_name": "\\ud800"}',
                         "f.json:1: --run-name: must be UTF-8 text, got '\\ud800'"),
    "a seed torch refuses": ("f.json", '{"seed": 99999999999999999999}',
                             "f.json:1: --seed: must be <= 18446744073709551615, got "
                             "99999999999999999999"),
    "JSON nested too deeply": ("f.json", '{"lr": ' + "[" * 100_000 + "]" * 100_000 + "}",
                               "f.json: arrays or tables nested too deeply to read as JSON"),
    "TOML nested too deeply": ("f.toml", "lr = " + "[" * 100_000 + "]" * 100_000 + "\n",
                               "f.toml: arrays or tables nested too deeply to read as TOML"),
    "over 1 MiB": ("f.toml", "#" * 2**20 + "\nlr = 0.1\n",
                   "--config {dir}/f.toml: larger than 1 MiB, the most a config file may hold"),
    "neither TOML nor JSON": ("f.yaml", "lr: 0.1\n",
                              "--config {dir}/f.yaml: expected a .toml or .json file"),
}


@pytest.mark.parametrize("name, content, message", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_a_mistake_in_a_file_is_one_line_naming_the_file(name, content, message, tmp_path):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError) as raised:
        parse_command_line(CIFAR, ["--config", str(path)])
    expected = message.format(dir=tmp_path)
    if not expected.startswith("--config"):
        expected = f"{tmp_path}/{expected}"
    assert str(raised.value).startswith(expected), str(raised.value)


@pytest.mark.parametrize("argv, message", [
    (["--config", "{dir}/missing.toml"], "--config {dir}/missing.toml: no such file"),
    (["--config", "{dir}"], "--config {dir}: is a folder, not a file (a run folder's config "
                            "is {dir}/config.json)"),
    (["--config"], "--config: missing value (a .toml or .json file)"),
    (["--config", "--lr", "1"], "--config: missing value"),
    (["--config={dir}/a.toml", "--config", "{dir}/b.toml"], "--config: given twice"),
])
def test_a_config_option_without_a_readable_file_is_refused(argv, message, tmp_path):
    with pytest.raises(ConfigError) as raised:
        parse_command_line(CIFAR, [arg.format(dir=tmp_path) for arg in argv])
    assert str(raised.value).startswith(message.format(dir=tmp_path))


def test_an_unreadable_file_names_the_reason(tmp_path, monkeypatch):
    path = tmp_path / "f.toml"
    path.write_text("lr = 1\n")
    real_open = os.open

    def refuse(file, *args, **kwargs):
        if Path(file) == path:
            raise PermissionError(13, "Permission denied")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)  # root reads a chmod 000 file anyway
    with pytest.raises(ConfigError, match=r"f.toml: cannot read it \(Permission denied\)$"):
        parse_command_line(CIFAR, ["--config", str(tmp_path / "f.toml")])


def test_a_link_to_a_device_is_refused_without_reading_it(tmp_path):
    # /dev/zero would never end (a MemoryError); /dev/null ends at once, read as no keys.
    (tmp_path / "null.toml").symlink_to(os.devnull)
    with pytest.raises(ConfigError) as raised:
        parse_command_line(CIFAR, ["--config", str(tmp_path / "null.toml")])
    assert str(raised.value) == (f"--config {tmp_path}/null.toml: not a regular file (a "
                                 "character device); give a .toml or .json file")


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "f.json"
    os.mkfifo(fifo)
    answered = threading.Event()

    def write_if_still_waiting() -> None:  # a read that waits for a writer gets one, late
        if not answered.wait(5):
            fifo.write_text('{"lr": 0.5}')

    threading.Thread(target=write_if_still_waiting, daemon=True).start()
    started = time.monotonic()
    try:
        with pytest.raises(ConfigError, match=r"f.json: not a regular file \(a FIFO\)"):
            parse_command_line(CIFAR, ["--config", str(fifo)])
    finally:
        answered.set()
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("content, fragments", [
    ("lr = -1\n", ["bad.toml:1: --lr: must be > 0, got -1.0"]),
    ("epochs = \n", ["bad.toml:1: not valid TOML"]),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(content, fragments, tmp_path,
                                                            monkeypatch, capsys):
    (tmp_path / "bad.toml").write_text(content)
    monkeypatch.chdir(tmp_path)
    before = digests(tmp_path)

    code = main(["cifar", "--config", "bad.toml", "--dataset", "synthetic"])

    captured = capsys.readouterr()
    one_error_line(code, captured.err, *fragments)
    assert captured.out == "" and digests(tmp_path) == before and not (tmp_path / "runs").exists()


# --- --print-config -----------------------------------------------------------------------


@pytest.mark.parametrize("recipe", sorted(find_recipes()))
def test_print_config_read_back_is_the_same_config(recipe, tmp_path):
    keys = recipe_keys(recipe).config
    argv = ["--epochs", "3", "--max-grad-norm", "2", "--run-name", "x", "--seed", "5",
            "--run-dir", 'a "run"\\dir\t\x7fé']  # a text that TOML must escape
    if recipe == "cifar":
        argv += ["--train-subset", "64", "--val-fraction", "0.1"]
    config, _ = parse_command_line(keys, argv)
    path = tmp_path / "printed.toml"
    path.write_text(config_toml(config, recipe))

    again, given = parse_command_line(keys, ["--config", str(path)])

    assert as_dict(again) == as_dict(config)
    unset = {name for name, value in as_dict(config).items() if value in (None, "")}
    assert given == set(as_dict(config)) - unset - set(REQUESTS)


def test_print_config_lists_every_key_in_the_groups_of_help_with_its_help(tmp_path):
    config, _ = parse_command_line(CIFAR, ["--epochs", "3"])
    text = config_toml(config, "cifar")
    lines = text.splitlines()

    # The header's commands name the interpreter, whose path may be of any length.
    assert all(len(line) <= 100 for line in lines if interpreter() not in line)
    headings = [line for line in lines if line.startswith("# ====")]
    assert headings == ["# ==== run ====", "# ==== schedule ====", "# ==== precision ====",
                        "# ==== checkpoints ====", "# ==== health ====", "# ==== spike ====",
                        "# ==== distributed ====", "# ==== tracking ====",
                        "# ==== cifar (the recipe's own keys) ===="]
    assert set(tomllib.loads(text)) == {
        name for name, value in as_dict(config).items()
        if value not in (None, "") and name not in REQUESTS}
    epochs = lines.index("epochs = 3")
    assert lines[epochs - 1] == "# epochs to train (default: 8)"
    assert "# run_name = \"\"" in lines and '# patience = "none"' in lines
    comments = " ".join(line[2:] for line in lines if line.startswith("# "))
    for spec in dataclasses.fields(CIFAR):
        if spec.name in REQUESTS:
            continue
        assert " ".join(spec.metadata["help"].split()) in comments, spec.name
    assert not any(line.startswith("resume") for line in lines)  # a request, not a setting


def test_the_requests_are_those_the_run_layer_keeps_out_of_config_json():
    assert REQUESTS == REQUEST_KEYS


def test_print_config_loads_no_torch_writes_nothing_and_exits_0(tmp_path):
    (tmp_path / "f.toml").write_text("epochs = 4\n")
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "recipes", "cifar",
                             "--config", "f.toml", "--lr", "0.5", "--print-config"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert result.returncode == 0
    assert "tomllib" in imported  # config/file.py read the file
    assert not {"torch", "torchvision", "ignite"} & imported
    assert "\nepochs = 4\n" in result.stdout and "\nlr = 0.5\n" in result.stdout
    assert sorted(path.name for path in tmp_path.iterdir()) == ["f.toml"]


def test_print_config_is_one_command_among_describe_and_lr_find(capsys):
    code = main(["cifar", "--print-config", "--describe"])
    one_error_line(code, capsys.readouterr().err, "--describe and --print-config: give one")


# --- end to end on tiny data --------------------------------------------------------------


def saved_keys(run_dir: Path) -> dict:
    return json.loads((run_dir / "config.json").read_text())["config"]


def tiny_args(recipe: str, folder: Path, make_image_tree) -> list[str]:
    """A one-epoch run of ``recipe`` on tiny data made in ``folder``, with a few keys off
    their defaults."""
    if recipe == "charlm":
        return [*CHARLM, "--text", str(write_text(folder / "corpus.txt")), "--lr", "0.003"]
    if recipe == "cifar":
        return ["cifar", "--dataset", "synthetic", "--train-subset", "64", "--val-subset", "32",
                "--batch-size", "32", "--warmup-epochs", "0.5", "--tta", "none",
                "--final-tta", "none", "--progress", "off", "--device", "cpu", "--lr", "0.2"]
    make_image_tree(folder / "tree", {"train": 4, "val": 2})
    return ["images", "--data-dir", str(folder / "tree"), "--model", "squeezenet1_1",
            "--batch-size", "4", "--warmup-epochs", "0.5", "--num-workers", "0",
            "--progress", "off", "--device", "cpu"]


@pytest.mark.parametrize("recipe", sorted(find_recipes()))
def test_print_config_fed_back_is_the_same_command_and_writes_the_same_config_json(
        recipe, tmp_path, monkeypatch, capsys, make_image_tree):
    monkeypatch.chdir(tmp_path)
    args = [*tiny_args(recipe, tmp_path, make_image_tree), "--epochs", "1"]
    assert main(args) == 0
    [typed] = (tmp_path / "runs" / recipe).iterdir()  # a timestamped folder
    capsys.readouterr()
    assert main([*args, "--print-config"]) == 0
    (tmp_path / "printed.toml").write_text(capsys.readouterr().out)

    # The file is the same command as the typed one: it finds that run, complete.
    assert main([recipe, "--config", "printed.toml"]) == 0
    complete = f"the run is already complete: {typed.relative_to(tmp_path)} "
    assert complete in capsys.readouterr().out
    assert main([recipe, "--config", "printed.toml", "--resume", "never"]) == 0

    [from_file] = [path for path in (tmp_path / "runs" / recipe).iterdir() if path != typed]
    assert saved_keys(from_file) == {**saved_keys(typed),
                                     "run_dir": str(from_file.relative_to(tmp_path))}


def test_a_run_folders_config_json_repeats_the_run_with_a_new_seed(tmp_path, monkeypatch,
                                                                    capsys):
    monkeypatch.chdir(tmp_path)
    text = write_text(tmp_path / "corpus.txt")
    assert main([*CHARLM, "--text", str(text), "--epochs", "1", "--run-name", "first"]) == 0
    first = tmp_path / "runs" / "charlm" / "first"
    before = digests(first)
    again = ["charlm", "--config", str(first / "config.json"), "--seed", "1"]
    capsys.readouterr()

    assert main(again) == 0

    out, err = capsys.readouterr()
    assert err.count("note: ") == 1 and "ignoring data, environment, recipe, run_id, " in err
    [second] = [path for path in (tmp_path / "runs" / "charlm").iterdir() if path != first]
    assert saved_keys(second) == {**saved_keys(first), "seed": 1, "run_name": "",
                                  "run_dir": str(second.relative_to(tmp_path))}
    assert digests(first) == before
    # The same command again is the same run: it is complete, and nothing is started.
    assert main(again) == 0
    complete = f"the run is already complete: {second.relative_to(tmp_path)} "
    assert complete in capsys.readouterr().out
    assert len(list((tmp_path / "runs" / "charlm").iterdir())) == 2


def test_a_file_key_on_a_resume_counts_as_given(tmp_path, monkeypatch, capsys):
    """A fixed key that the file changes is refused on resume, as on the command line."""
    monkeypatch.chdir(tmp_path)
    run = [*CHARLM, "--text", str(write_text(tmp_path / "corpus.txt")), "--run-name", "r"]
    assert main([*run, "--epochs", "1"]) == 0
    (tmp_path / "f.toml").write_text("epochs = 2\nseed = 3\n")
    before = digests(tmp_path / "runs")
    capsys.readouterr()

    code = main([*run, "--config", "f.toml"])

    one_error_line(code, capsys.readouterr().err, flag_name("seed"), "cannot change on resume")
    assert digests(tmp_path / "runs") == before


def test_help_names_config_files_under_the_example():
    lines = help_text(CIFAR, "prog", "", "cifar").splitlines()
    assert lines[2] == ("from a file: prog --config FILE.toml (or .json); --print-config "
                        "prints one")
    assert lines[3].startswith("also: --describe prints the run's wiring") and (
        "--lr-find runs an LR range test" in lines[3])
