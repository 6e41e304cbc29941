"""The console module: the run layer prints through it and nowhere else, and a printed command
names the interpreter that runs it."""

import ast
import io
import logging
import os
import sys
from pathlib import Path

from tqdm import tqdm

import recipes.runner
from recipes.runner.config.file import config_toml, parse_command_line
from recipes.runner.config.registry import recipe_keys
from recipes.runner.console import interpreter, recipes_command, say, speak_for_libraries, warn

RUN_LAYER = Path(recipes.runner.__file__).parent
CONSOLE = RUN_LAYER / "console.py"


def print_calls(path: Path) -> list[int]:
    """The lines of ``path`` that call the builtin ``print``."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "print"]


def writes(path: Path) -> list[int]:
    """The lines of ``path`` that call ``print`` or ``tqdm.write``."""
    return print_calls(path) + [
        node.lineno for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "write" and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "tqdm"]


def test_the_libraries_log_and_never_print():
    """engine/, handlers/ and the recipes' data speak through ``logging``, which the command
    line's voice says; the progress display is the one handler whose job is to write."""
    repo = RUN_LAYER.parents[1]
    libraries = [*repo.glob("engine/*.py"), *repo.glob("handlers/*.py"),
                 *repo.glob("recipes/*/data.py")]
    found = {str(path.relative_to(repo)): lines for path in libraries
             if path.name != "progress.py" and (lines := writes(path))}
    assert found == {}
    assert writes(repo / "handlers" / "progress.py")  # the search sees one where there is one


def test_no_module_of_the_run_layer_but_the_console_calls_print():
    found = {str(path.relative_to(RUN_LAYER)): lines for path in RUN_LAYER.rglob("*.py")
             if path != CONSOLE and (lines := print_calls(path))}
    assert found == {}
    assert print_calls(CONSOLE)  # the search sees a print where there is one


def test_say_writes_its_lines_to_stdout_and_warn_one_line_to_stderr(capsys):
    say("one", "two")
    warn("warning: three")
    assert capsys.readouterr() == ("one\ntwo\n", "warning: three\n")


def test_warn_writes_to_the_stderr_of_the_moment(capsys, monkeypatch):
    """A test or a process that swaps sys.stderr after the import still gets the line."""
    class Sink:
        text = ""

        def write(self, text: str) -> None:
            Sink.text += text

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Sink())
    warn("error: x", flush=True)
    assert Sink.text == "error: x\n"


def test_a_librarys_records_are_spoken_once_in_the_consoles_voice(capsys):
    speak_for_libraries(rank=0)
    speak_for_libraries(rank=0)  # installed once: every record is said once
    logging.getLogger("handlers.checkpoint.checkpointer").info("resumed from last.pt")
    logging.getLogger("engine.run_state").warning("rng state missing")
    logging.getLogger("recipes.cifar.data").error("cache unreadable")
    logging.getLogger("handlers.checkpoint.checkpointer").debug("no checkpoint: starting fresh")
    assert capsys.readouterr() == ("resumed from last.pt\n",
                                   "warning: rng state missing\nerror: cache unreadable\n")


def test_a_process_other_than_rank_zero_speaks_only_its_errors(capsys):
    try:
        speak_for_libraries(rank=1)
        logging.getLogger("handlers.checkpoint.checkpointer").warning("said by rank 0 already")
        logging.getLogger("handlers.checkpoint.checkpointer").error("this rank's own failure")
        assert capsys.readouterr() == ("", "error: this rank's own failure\n")
    finally:
        speak_for_libraries(rank=0)


def test_a_record_is_written_above_an_open_progress_bar(monkeypatch):
    """Through tqdm.write: the bar is cleared, the line written, the bar drawn again below;
    a plain print would write over the bar's line."""
    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stdout", terminal)
    bar = tqdm(total=10, file=terminal, ascii=True)
    bar.update(3)
    speak_for_libraries(rank=0)
    logging.getLogger("handlers.first_step_checks").info("check: first loss 1.386: ok")
    bar.close()
    written = terminal.getvalue()
    before, line, after = written.partition("check: first loss 1.386: ok\n")
    assert line, written
    assert before.endswith("\r") and "3/10" in after  # the bar cleared first, drawn again after


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
