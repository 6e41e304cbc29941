"""The run layer: the same for every recipe, and not edited to add one.

This module is its public surface: a recipe (and ``python -m recipes``) imports from
``recipes.runner`` only, never from its folders, which are private and free to change:

- ``config/``: the typed keys of the command line and of ``--config`` files, the run keys,
  the recipes found by name and the user errors;
- ``training/``: the run itself (``run`` owns the run folder, resume, the standard handlers,
  the launch and the summary);
- ``commands/``: the commands next to training (evaluate, export, consolidate).

The names below load on first use: importing a torch-free module of this package (the
config, the run keys) must not import torch, so that ``python -m recipes`` checks the
command line before torch loads.
"""

import importlib
from typing import Any

_MODULE_OF = {
    # what a recipe declares
    "Context": "api", "Parts": "api", "Recipe": "api", "RunPlan": "api",
    # its config (torch-free)
    "ConfigError": "config.command_line", "ExitCode": "config.command_line",
    "field": "config.command_line",
    "help_text": "config.command_line",
    "config_toml": "config.file", "parse_command_line": "config.file",
    "parse_start": "config.file",
    "RunConfig": "config.run_keys",
    "find_recipes": "config.registry", "load_recipe": "config.registry",
    "recipe_keys": "config.registry",
    "DataError": "config.errors", "USER_ERRORS": "config.errors",
    "speak_for_libraries": "console",
    # the run
    "run": "training.run", "describe_run": "training.modes", "find_lr_run": "training.modes",
    "fingerprint_arrays": "training.fingerprint", "fingerprint_files": "training.fingerprint",
    "write_json_atomic": "training.folder",
    "first_mismatch": "training.init_from",
    "is_sharded": "training.strategy",
    # the commands next to training
    "CommandParser": "commands.command_parser", "output_path": "commands.command_parser",
    "positive_int": "commands.command_parser", "seed_int": "commands.command_parser",
    "utf8_text": "commands.command_parser", "writing": "commands.command_parser",
    "run_command": "commands.dispatch",
    "Exportable": "commands.export", "export_command": "commands.export",
    "Trained": "commands.trained", "load_trained": "commands.trained",
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
