"""The console module: the run layer prints through it and nowhere else."""

import ast
import sys
from pathlib import Path

import recipes.runner
from recipes.runner.console import say, warn

RUN_LAYER = Path(recipes.runner.__file__).parent
CONSOLE = RUN_LAYER / "console.py"


def print_calls(path: Path) -> list[int]:
    """The lines of ``path`` that call the builtin ``print``."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "print"]


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
