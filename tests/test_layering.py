"""The layering, read from the source with ``ast``: the engine imports neither handlers nor
recipes, the handlers import no recipe, the run layer (``recipes.runner``) imports no recipe and its
config neither its training nor its commands,
a recipe imports no other, and no two of the project's modules import each other, however
indirectly. Every import counts, those inside a function or under ``if TYPE_CHECKING:``
included: a deferred import still ties the two modules together. And, from a run: what a
training start imports before its first backward (its story, and nothing of the commands
after training)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "handlers", "recipes", "benchmarks")
RECIPES = ("recipes.cifar", "recipes.charlm", "recipes.images")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES
            for path in sorted((ROOT / package).rglob("*.py"))}


def imported(path: Path, modules: set[str]) -> set[str]:
    """The project's modules ``path`` imports anywhere in it: ``from a.b import c`` names the
    module ``a.b.c`` when there is one, else ``a.b``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules
                     else node.module for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported(path, set(modules)) - {name} for name, path in modules.items()}


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize(("layer", "forbidden"), [
    ("engine", ("handlers", "recipes")),
    ("handlers", ("recipes",)),
    ("recipes.runner", RECIPES),
    # The command line's config is read before anything runs: it imports no run or command.
    ("recipes.runner.config", ("recipes.runner.training", "recipes.runner.commands")),
    *((recipe, tuple(other for other in RECIPES if other != recipe)) for recipe in RECIPES),
])
def test_a_layer_imports_nothing_above_it(layer, forbidden):
    graph = import_graph()
    wrong = sorted(f"{name} imports {target}" for name, targets in graph.items()
                   if within(name, layer) for target in targets
                   if any(within(target, above) for above in forbidden))
    assert not wrong


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for target in graph[name]:
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == name:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def test_cycles_finds_a_two_module_cycle_and_a_longer_one():
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(cycles(graph)) == [["a", "b"], ["c", "d", "e"]]


def test_imported_counts_a_deferred_import_and_names_the_submodule(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x.y\n"
                      "def f():\n    from x import z, w\n")
    assert imported(source, {"x", "x.y", "x.z"}) == {"x", "x.y", "x.z"}


def test_no_module_of_the_project_imports_itself_through_others():
    assert cycles(import_graph()) == []


def imported_test_modules(path: Path) -> list[str]:
    """The test modules and conftests ``path`` imports: what they share belongs in
    tests/helpers.py (a conftest's fixtures reach the tests below it without an import)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found += [name for name in names if name.split(".")[0] == "tests"
                  and name.split(".")[-1].startswith(("test_", "conftest"))]
    return found


def test_imported_test_modules_finds_a_test_module_and_a_conftest(tmp_path):
    source = tmp_path / "test_m.py"
    source.write_text("import tests.helpers\nfrom tests.recipes.runner.test_run import x\n"
                      "def f():\n    from tests.reliability import conftest\n")
    assert imported_test_modules(source) == ["tests.recipes.runner.test_run",
                                             "tests.reliability.conftest"]


def test_no_test_module_imports_another():
    assert {str(path.relative_to(ROOT)): found for path in sorted((ROOT / "tests").rglob("*.py"))
            if (found := imported_test_modules(path))} == {}


# What a training start reads: the project's modules imported when its first backward runs.
FIRST_BACKWARD_PROBE = """
import os, runpy, sys
import torch

def first_backward(self, *args, **kwargs):
    with open(os.environ["MODULES_OUT"], "w") as out:
        out.write("\\n".join(sorted(name for name, module in list(sys.modules.items())
                                    if (getattr(module, "__file__", None) or "")
                                    .startswith(os.environ["PROJECT_ROOT"]))))
    os._exit(0)

torch.Tensor.backward = first_backward
sys.argv = ["recipes", *sys.argv[1:]]
runpy.run_module("recipes", run_name="__main__")
"""
# Loaded only by what a training start never does: a command after training, --lr-find,
# --profile, a sweep.
NOT_IN_A_START = ("recipes.runner.commands", "recipes.runner.sweep", "recipes.cifar.commands",
                  "recipes.common.predict", "handlers.lr_finder", "handlers.profiler")
# The files of recipes/ (package __init__ files aside) a CIFAR start imports: the run layer's
# story, the recipe and the parts recipes share. Measured: 34; a new room in the story has
# to make room.
START_FILES = 34


def test_a_cifar_start_reads_its_story_and_nothing_after_training(tmp_path):
    out = tmp_path / "modules.txt"
    result = subprocess.run(
        [sys.executable, "-c", FIRST_BACKWARD_PROBE, "cifar", "--dataset", "synthetic",
         "--train-subset", "64", "--val-subset", "32", "--batch-size", "32", "--accum-steps",
         "1", "--epochs", "1", "--progress", "off", "--device", "cpu", "--run-dir",
         str(tmp_path / "run")],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
        env={**os.environ, "MODULES_OUT": str(out),
             "PROJECT_ROOT": str(ROOT) + "/", "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    modules = out.read_text().split()
    assert "engine.trainer" in modules  # the probe saw the run
    assert [name for name in modules if name.startswith(NOT_IN_A_START)] == []
    paths = project_modules()
    files = [name for name in modules
             if name.startswith("recipes.") and paths[name].name != "__init__.py"]
    assert len(files) <= START_FILES, files
