"""Recipes found by name: the folder ``recipes/<name>/`` holds one, its ``recipe.py`` declaring
``RECIPE = Recipe(...)``.

Listing reads the files without importing them (``python -m recipes --help`` stays quick
and a broken recipe cannot break the list); running imports the one asked for. A path to
a ``.py`` file anywhere works too, so a recipe can live outside this package.

A recipe folder's ``Config`` lives in its ``config.py``, which imports no torch:
``recipe_keys`` reads it without importing the recipe, so that the command line is checked
in a fraction of a second, before torch loads. What loads with torch (the run layer, a
command, Optuna) is imported under ``uncollected_imports``.
"""

import ast
import difflib
import gc
import importlib
import importlib.util
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from recipes.runner.config.command_line import ConfigError

if TYPE_CHECKING:
    from recipes.runner.api import Recipe

RECIPES_DIR = Path(__file__).resolve().parents[2]
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


@dataclass(frozen=True)
class RecipeKeys:
    """What parsing and ``--help`` need of a recipe: its name, summary and ``Config``."""

    name: str
    summary: str
    config: type


def recipe_keys(ref: str) -> RecipeKeys:
    """The keys of the recipe ``ref`` (as ``load_recipe`` takes it). A recipe folder's come
    from its ``config.py`` without importing torch; a recipe file (or a folder without a
    ``config.py``) is imported whole."""
    recipes = find_recipes()
    if ref in recipes and (RECIPES_DIR / ref / "config.py").is_file():
        config = importlib.import_module(f"recipes.{ref}.config").Config
        return RecipeKeys(name=ref, summary=recipes[ref], config=config)
    recipe = load_recipe(ref)
    return RecipeKeys(name=recipe.name, summary=recipe.summary, config=recipe.config)


def load_recipe(ref: str) -> "Recipe":
    """The ``RECIPE`` of ``recipes/<ref>/recipe.py``, or of the file ``ref`` when it ends in
    .py. ``ConfigError`` naming what is available (and the
    nearest name) when there is none."""
    if ref.endswith(".py"):
        path = Path(ref).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"recipe file {ref} does not exist")
        module = _import_file(path)
    elif ref in find_recipes():
        module = importlib.import_module(f"recipes.{ref}.recipe")
    else:
        raise ConfigError(_unknown_recipe(ref, list(find_recipes())))
    from recipes.runner.api import Recipe  # torch: the recipe has loaded it already

    recipe = getattr(module, "RECIPE", None)
    if not isinstance(recipe, Recipe):
        raise ConfigError(f"{ref}: defines no RECIPE = Recipe(...)")
    return recipe


def _unknown_recipe(ref: str, names: list[str]) -> str:
    """``unknown recipe 'CIFAR'; did you mean cifar? available: ...``: the nearest name
    ignoring case (``cifar10`` -> ``cifar``)."""
    by_lower = {name.lower(): name for name in names}
    close = difflib.get_close_matches(ref.lower(), by_lower, n=1)
    hint = f" did you mean {by_lower[close[0]]}?" if close else ""
    available = ", ".join(names) or "none"
    return (f"unknown recipe {ref!r};{hint} available: {available} "
            "(or the path of a recipe .py file)")


def recipe_ref(recipe: "Recipe") -> str:
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


@contextmanager
def uncollected_imports() -> Iterator[None]:
    """Import without Python's cyclic garbage collector, then, when the block imported
    anything, set every object there is aside from it for good (``gc.freeze``). Imports make
    few cycles, but the objects torch, Ignite and dynamo create are many, and the collector
    ran full passes over all of them as they grew: about 0.9 s of a start on the 2-core CPU,
    and as much again at the interpreter's exit. Frozen, they are not traversed again; what
    the run creates is collected as usual. (A block that imports nothing new, as in a test
    that calls ``main`` again, freezes nothing.)"""
    modules = len(sys.modules)
    gc.disable()
    try:
        yield
    finally:
        if len(sys.modules) > modules:
            gc.freeze()
        gc.enable()
