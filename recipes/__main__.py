"""``python -m recipes <name> [--key value ...]``: run a recipe from the command line.

``<name>`` is any folder ``recipes/<name>/`` whose ``recipe.py`` declares
``RECIPE = Recipe(...)`` (its keys in a torch-free ``config.py``, so that the command line
is checked before torch loads), or the path of such a file. ``--help`` lists the keys;
``--describe`` prints the run's wiring (every event and its handlers) without training or
writing anything; ``--lr-find`` runs an LR range test on the run's data and step and
suggests a peak ``--lr``. ``--config FILE`` reads keys from a TOML or JSON file (the
command line's override them); ``--print-config`` prints the resolved config as TOML
(``recipes.runner.config.file``).

User mistakes (a bad key or value, missing data, no usable checkpoint) end with
one ``error:`` line and exit code 2, before anything is written to disk. Every exit code is
``recipes.runner.config.command_line.ExitCode``, tabled in docs/reference.md (#exit-codes).
"""

import os
import shutil
import sys
from collections.abc import Callable, Sequence
from typing import Any

from recipes.runner.config.command_line import ConfigError, ExitCode, help_text
from recipes.runner.config.file import config_toml, parse_start
from recipes.runner.config.registry import (
    find_recipes,
    load_recipe,
    recipe_keys,
    uncollected_imports,
)
from recipes.runner.console import speak_for_libraries


def _usage() -> str:
    lines = ["usage: python -m recipes <recipe> [--config FILE] [--key value ...] "
             "[--help | --describe | --lr-find | --print-config]", "", "recipes:"]
    lines += [f"  {name:<10} {summary}" for name, summary in find_recipes().items()]
    lines += ["", "<recipe> may also be the path of a recipe file (my_task.py).",
              "`python -m recipes <recipe> --help` lists every key with its default;",
              "`python -m recipes <recipe> --describe` prints the run's events and handlers;",
              "`python -m recipes <recipe> --lr-find` suggests a peak --lr (LR range test).",
              "`--config FILE` reads keys from a TOML or JSON file (a run's config.json too);",
              "`--print-config` prints the resolved config as such a TOML file.",
              "", "after training, and searching keys (each with --help):",
              "  python -m recipes <recipe> evaluate|export|consolidate <run or checkpoint>",
              "  python -m recipes <recipe> sweep --trials N --search KEY=SPEC [--key value ...]",
              "  python -m recipes cifar|images predict <run> FILE_OR_FOLDER...",
              "  python -m recipes charlm generate <run> --prompt TEXT"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    rank = os.environ.get("RANK", "0")  # a torchrun worker's; the spawned ones set their own
    speak_for_libraries(int(rank) if rank.isdigit() else 0)
    # The command line is checked before torch loads (seconds): a mistake is answered at once.
    try:
        if rest and not rest[0].startswith("-"):  # a command: evaluate, predict, sweep, ...
            return _with_torch(_run_command, name, rest)
        keys = recipe_keys(name)
        if "-h" in rest or "--help" in rest:
            print(help_text(keys.config, f"python -m recipes {name}", keys.summary, keys.name,
                            width=shutil.get_terminal_size((100, 24)).columns))
            return 0
        commands = {"--describe", "--lr-find", "--print-config"} & set(rest)
        if len(commands) > 1:
            raise ConfigError(f"{' and '.join(sorted(commands))}: give one of them")
        argv = [arg for arg in rest if arg not in commands]
        config, given, keys_from = parse_start(keys.config, argv)
    except ConfigError as err:
        return _user_error(err)
    if "--print-config" in commands:  # before torch loads: nothing is run or written
        print(config_toml(config, keys.name), end="")
        return 0
    return _with_torch(_train, name, config, given, commands, keys_from)


def _with_torch(action: Callable[..., int], *args: Any) -> int:
    """``action(*args)``, with exit code 2 and one line for what it refuses as the user's
    mistake. Torch loads from here on."""
    with uncollected_imports():
        from recipes.runner.training.launch import USER_ERRORS

    try:
        return action(*args)
    except USER_ERRORS as err:
        return _user_error(err)


def _run_command(name: str, rest: list[str]) -> int:
    with uncollected_imports():
        from recipes.runner.commands.dispatch import run_command

    return run_command(load_recipe(name), rest[0], rest[1:])


def _train(name: str, config: Any, given: set[str], commands: set[str], keys_from: str
           ) -> int:
    with uncollected_imports():
        from recipes.runner.training.modes import describe_run, find_lr_run
        from recipes.runner.training.run import run

    recipe = load_recipe(name)
    if "--describe" in commands:
        print(describe_run(recipe, config))
        return 0
    if "--lr-find" in commands:
        return find_lr_run(recipe, config)
    return run(recipe, config, given, keys_from)


def _user_error(err: Exception) -> int:
    print(f"error: {err}", file=sys.stderr)
    return ExitCode.USER_ERROR


def _main_quiet_on_closed_pipe() -> int:
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader has gone: stop without a traceback. Python flushes stdout once more
        # at exit and would report that failure too, so stdout now points at /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.BROKEN_PIPE  # as if SIGPIPE had killed it: 128 + 13
    return code


if __name__ == "__main__":
    sys.exit(_main_quiet_on_closed_pipe())
