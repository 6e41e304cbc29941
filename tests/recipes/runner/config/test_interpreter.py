"""A printed command names the interpreter that runs it (``recipes.runner.config.interpreter``)."""

import os
import sys

from recipes.runner.config.file import config_toml, parse_command_line
from recipes.runner.config.interpreter import interpreter, recipes_command
from recipes.runner.config.registry import recipe_keys


def test_the_projects_venv_is_named_relative_to_the_working_folder(tmp_path, monkeypatch):
    python = tmp_path / ".venv" / "bin" / "python"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", str(python))
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "recipes"])
    assert interpreter() == ".venv/bin/python"
    assert recipes_command("cifar") == ".venv/bin/python -m recipes cifar"


def test_the_word_typed_is_kept_when_it_finds_the_same_interpreter(tmp_path, monkeypatch):
    folder = tmp_path / "env" / "bin"
    folder.mkdir(parents=True)
    (folder / "python").write_text("")
    (folder / "python").chmod(0o755)
    monkeypatch.chdir(tmp_path / "env")
    monkeypatch.setattr(sys, "executable", str(folder / "python"))
    monkeypatch.setenv("PATH", str(folder))
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "recipes"])
    assert interpreter() == "bin/python"  # under the working folder: relative first
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert interpreter() == "python"  # an activated environment: what the user typed
    monkeypatch.setenv("PATH", os.defpath)  # `python` is another one now
    assert interpreter() == str(folder / "python")


def test_print_config_says_how_to_run_it_on_this_interpreter(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", str(tmp_path / ".venv" / "bin" / "python"))
    config, _ = parse_command_line(recipe_keys("cifar").config, [])
    lines = config_toml(config, "cifar").splitlines()
    assert lines[1] == ("# Run it with: .venv/bin/python -m recipes cifar --config FILE "
                        "[--key value ...]")
