"""How a printed command names the Python that runs it, so that it runs as printed.

``python -m recipes ...`` fails outside an activated virtual environment: the project's
packages are in ``.venv``. A printed next step names the interpreter this process runs on:
relative to the working folder when it lies under it (``.venv/bin/python``), the word the
user typed when that finds the same interpreter on PATH (an activated environment), else its
absolute path. No torch here: ``--print-config`` uses it before torch loads.
"""

import contextlib
import os
import shlex
import shutil
import sys
from pathlib import Path


def interpreter() -> str:
    """This process's Python as a command word that runs it again from this folder."""
    executable = Path(os.path.abspath(sys.executable))  # a venv's link, not its target
    try:
        return shlex.quote(str(executable.relative_to(Path.cwd())))
    except ValueError:
        pass
    typed = sys.orig_argv[0] if sys.orig_argv else ""
    found = shutil.which(typed) if typed else None
    if found is not None and Path(os.path.abspath(found)) == executable:
        return shlex.quote(typed)
    return shlex.quote(str(executable))


def recipes_command(recipe: str) -> str:
    """``<interpreter> -m recipes <recipe>``: the start of a printed command. ``recipe`` is a
    name, or the path of a recipe file (shown from the working directory when inside it)."""
    if recipe.endswith(".py"):
        with contextlib.suppress(ValueError):  # outside the working directory: as given
            recipe = str(Path(recipe).resolve().relative_to(Path.cwd()))
    return f"{interpreter()} -m recipes {shlex.quote(recipe)}"
