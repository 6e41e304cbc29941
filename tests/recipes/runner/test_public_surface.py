"""The run layer's public surface is ``recipes.runner`` (its ``__init__.py``): a recipe, the
shared recipe parts, the tools and ``python -m recipes`` import from it and never from its
folders (``config/``, ``training/``, ``commands/``), which are free to change."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import recipes
import recipes.runner

RECIPES = Path(recipes.__file__).parent
RUNNER = RECIPES / "runner"


def runner_imports(path: Path) -> list[str]:
    """The modules of the run layer that ``path`` imports, at any depth of its code."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                 else [alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [])
        found += [name for name in names if name.startswith("recipes.runner")]
    return found


def test_recipes_import_the_run_layer_only_through_its_facade():
    outside = [path for path in RECIPES.rglob("*.py") if RUNNER not in path.parents]
    assert len(outside) > 20  # every recipe, common/, tools/ and __main__.py
    private = {str(path.relative_to(RECIPES)): names for path in outside
               if (names := [name for name in runner_imports(path)
                             if name != "recipes.runner"])}
    assert private == {}


def test_the_search_sees_a_private_import(tmp_path):
    module = tmp_path / "module.py"
    module.write_text("def f():\n    from recipes.runner.training.run import run\n")
    assert runner_imports(module) == ["recipes.runner.training.run"]


def test_every_public_name_loads():
    for name in recipes.runner.__all__:
        assert getattr(recipes.runner, name) is not None, name
    module = importlib.import_module("recipes.runner")
    assert not hasattr(module, "no_such_name")


def test_the_config_names_load_without_torch():
    """``python -m recipes`` checks its command line before torch loads (test_cli.py)."""
    code = ("import sys, recipes.runner as r; r.ConfigError, r.field, r.RunConfig, "
            "r.parse_command_line, r.recipe_keys, r.help_text, r.find_recipes; "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout == "False\n"
