"""The run layer's public surface is a list of its modules (``recipes/runner/__init__.py``):
a recipe, the shared recipe parts, the tools and ``python -m recipes`` import from those and
never from the rest of its folders, which are free to change."""

import ast
import subprocess
import sys
from pathlib import Path

import recipes

RECIPES = Path(recipes.__file__).parent
RUNNER = RECIPES / "runner"
PUBLIC = {f"recipes.runner.{name}" for name in (
    "api", "console", "config.command_line", "config.file",
    "config.registry", "config.run_keys", "training.run", "training.modes",
    "training.fingerprint", "training.init_from", "training.launch", "training.strategy",
    "commands.command_parser", "commands.dispatch", "commands.export", "commands.trained")}


def runner_imports(path: Path) -> list[str]:
    """The modules of the run layer that ``path`` imports, at any depth of its code."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                 else [alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [])
        found += [name for name in names if name.startswith("recipes.runner")]
    return found


def test_recipes_import_only_the_run_layers_public_modules():
    outside = [path for path in RECIPES.rglob("*.py") if RUNNER not in path.parents]
    assert len(outside) > 20  # every recipe, common/, tools/ and __main__.py
    imported = {name for path in outside for name in runner_imports(path)}
    private = {str(path.relative_to(RECIPES)): names for path in outside
               if (names := [name for name in runner_imports(path) if name not in PUBLIC])}
    assert private == {}
    assert imported == PUBLIC  # a public module no recipe uses is not public


def test_the_search_sees_a_private_import(tmp_path):
    module = tmp_path / "module.py"
    module.write_text("def f():\n    from recipes.runner.training.build import build\n")
    assert runner_imports(module) == ["recipes.runner.training.build"]


def test_every_public_module_is_named_in_the_layers_docstring():
    doc = ast.get_docstring(ast.parse((RUNNER / "__init__.py").read_text()))
    assert all(f"``{name.removeprefix('recipes.runner.')}``" in doc for name in PUBLIC)


def test_the_config_modules_load_without_torch():
    """``python -m recipes`` checks its command line before torch loads (test_cli.py)."""
    code = ("import sys\n"
            "from recipes.runner.config.command_line import ConfigError, field, help_text\n"
            "from recipes.runner.config.file import parse_command_line\n"
            "from recipes.runner.config.registry import find_recipes, recipe_keys\n"
            "from recipes.runner.config.run_keys import RunConfig\n"
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout == "False\n"
