"""``python -m recipes <name> [--key value ...]``: run a recipe from the command line.

``<name>`` is any folder ``recipes/<name>/`` whose ``recipe.py`` declares
``RECIPE = Recipe(...)``, or the path of such a file. ``--help`` lists the keys;
``--describe`` prints the run's wiring (every event and its handlers) without training or
writing anything; ``--lr-find`` runs an LR range test on the run's data and step and
suggests a peak ``--lr``.

User mistakes (a bad key or value, missing data, no usable checkpoint) end with
one ``error:`` line and exit code 2, before anything is written to disk.
A run that stops on its own also ends with one ``error:`` line (or a summary):
3 when gradients stay non-finite, 4 when a checkpoint cannot be written (disk
full, permission denied, read-only folder; the previous checkpoint is intact),
143 after SIGTERM and 130 after Ctrl-C (each once the current step is saved).
"""

import logging
import sys
from collections.abc import Sequence

from recipes.runner.config import ConfigError, help_text, parse_args
from recipes.runner.errors import USER_ERRORS
from recipes.runner.registry import find_recipes, load_recipe
from recipes.runner.run import describe_run, find_lr_run, run


def _usage() -> str:
    lines = ["usage: python -m recipes <recipe> [--key value ...] "
             "[--help | --describe | --lr-find]", "", "recipes:"]
    lines += [f"  {name:<10} {summary}" for name, summary in find_recipes().items()]
    lines += ["", "<recipe> may also be the path of a recipe file (my_task.py).",
              "`python -m recipes <recipe> --help` lists every key with its default;",
              "`python -m recipes <recipe> --describe` prints the run's events and handlers;",
              "`python -m recipes <recipe> --lr-find` suggests a peak --lr (LR range test)."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    # Ignite logs every exception that leaves a run; the ones we handle get their own line.
    logging.getLogger("ignite.engine.engine").setLevel(logging.CRITICAL)
    try:
        recipe = load_recipe(name)
        if rest and not rest[0].startswith("-"):  # a command: evaluate, predict, generate
            from recipes.runner.commands import run_command
            return run_command(recipe, rest[0], rest[1:])
        if "-h" in rest or "--help" in rest:
            print(help_text(recipe.config, f"python -m recipes {name}", recipe.summary,
                            recipe.name))
            return 0
        commands = {"--describe", "--lr-find"} & set(rest)
        if len(commands) > 1:
            raise ConfigError("--describe and --lr-find: give one of them")
        config, given = parse_args(recipe.config, [arg for arg in rest if arg not in commands])
        if "--describe" in commands:
            print(describe_run(recipe, config))
            return 0
        if "--lr-find" in commands:
            return find_lr_run(recipe, config)
        return run(recipe, config, given)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
