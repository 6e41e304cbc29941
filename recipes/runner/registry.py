"""Recipes found by name: the folder ``recipes/<name>/`` holds one, its ``recipe.py`` declaring
``RECIPE = Recipe(...)``.

Listing reads the files without importing them (``python -m recipes --help`` stays quick
and a broken recipe cannot break the list); running imports the one asked for. A path to
a ``.py`` file anywhere works too, so a recipe can live outside this package.
"""

import ast
import importlib
import importlib.util
import re
import sys
from pathlib import Path

from recipes.runner.api import Recipe
from recipes.runner.config import ConfigError

RECIPES_DIR = Path(__file__).resolve().parent.parent
_DECLARES_RECIPE = re.compile(r"^RECIPE\s*[:=]", re.MULTILINE)
_FILE_MODULE_PREFIX = "recipe_file_"


def find_recipes() -> dict[str, str]:
    """Every recipe folder of this package: name -> the first line of its recipe's docstring."""
    found = {}
    for path in sorted(RECIPES_DIR.glob("*/recipe.py")):
        source = path.read_text()
        if path.parent.name.startswith("_") or not _DECLARES_RECIPE.search(source):
            continue
        docstring = ast.get_docstring(ast.parse(source)) or ""
        found[path.parent.name] = docstring.strip().splitlines()[0] if docstring.strip() else ""
    return found


def load_recipe(ref: str) -> Recipe:
    """The ``RECIPE`` of ``recipes/<ref>/recipe.py``, or of the file ``ref`` when it ends in .py.
    ``ConfigError`` naming what is available when there is none."""
    if ref.endswith(".py"):
        path = Path(ref).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"recipe file {ref} does not exist")
        module = _import_file(path)
    elif ref in find_recipes():
        module = importlib.import_module(f"recipes.{ref}.recipe")
    else:
        available = ", ".join(find_recipes()) or "none"
        raise ConfigError(f"unknown recipe {ref!r}; available: {available} "
                          "(or the path of a recipe .py file)")
    recipe = getattr(module, "RECIPE", None)
    if not isinstance(recipe, Recipe):
        raise ConfigError(f"{ref}: defines no RECIPE = Recipe(...)")
    return recipe


def recipe_ref(recipe: Recipe) -> str:
    """What ``load_recipe`` needs to find ``recipe`` again in another process."""
    module = sys.modules[recipe.build.__module__]
    if module.__name__.startswith(_FILE_MODULE_PREFIX):
        return module.__file__
    return module.__name__.removeprefix("recipes.").removesuffix(".recipe")


def _import_file(path: Path):
    name = _FILE_MODULE_PREFIX + re.sub(r"\W", "_", path.stem)
    if name in sys.modules and sys.modules[name].__file__ == str(path):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(module)
    return module
