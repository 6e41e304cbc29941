"""Sweeps: a recipe's keys searched with Optuna, each trial an ordinary run
(``python -m recipes <recipe> sweep``; docs/sweeps.md).

- ``search_space.py``: ``--search KEY=SPEC``, typed and checked as the command line's keys;
- ``options.py``: the sweep command's options and every trial's fixed keys;
- ``study.py``: the Optuna study and its storage;
- ``claims.py``: which worker trains which trial (a dead worker's is taken over);
- ``trials.py``: a worker's loop, each trial trained by the run layer's ``run``;
- ``pruning.py``: each evaluation reported to Optuna, a pruned trial ended cleanly;
- ``status.py``: the table of trials and the best one;
- ``command.py``: the command itself.

This module imports no Optuna: ``sweep_command`` checks that the ``sweep`` extra is
installed, so that the other commands work without it.
"""

import importlib.util

from recipes.runner.api import Recipe
from recipes.runner.config.command_line import ConfigError
from recipes.runner.config.registry import uncollected_imports


def sweep_command(recipe: Recipe, args: list[str]) -> int:
    """``sweep``: its help and its checks, once Optuna is known to be installed."""
    if importlib.util.find_spec("optuna") is None:
        raise ConfigError("sweep needs Optuna: pip install -e '.[sweep]' (or make test, whose "
                          "dev extra installs it)")
    with uncollected_imports():  # Optuna, SQLAlchemy, the run layer
        from recipes.runner.sweep.command import sweep

    return sweep(recipe, args)
