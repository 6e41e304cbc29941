"""``python -m recipes <name> [--key value ...]``: run a recipe from the command line.

User mistakes (a bad key or value, missing data, no usable checkpoint) end with
one ``error:`` line and exit code 2, before anything is written to disk.
A run that stops on its own also ends with one ``error:`` line (or a summary):
3 when gradients stay non-finite, 4 when a checkpoint cannot be written (disk
full, permission denied, read-only folder; the previous checkpoint is intact),
143 after SIGTERM and 130 after Ctrl-C (each once the current step is saved).
"""

import importlib
import logging
import sys
from collections.abc import Sequence

from recipes.config import help_text, parse_args
from recipes.errors import USER_ERRORS

RECIPES = {
    "cifar": ("recipes.cifar", "CIFAR-10 image classification (airbench-style net or ResNet-18)"),
}


def _usage() -> str:
    lines = ["usage: python -m recipes <recipe> [--key value ...]", "", "recipes:"]
    lines += [f"  {name:<10} {summary}" for name, (_, summary) in RECIPES.items()]
    lines += ["", "`python -m recipes <recipe> --help` lists every key with its default."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in RECIPES:
        print(f"error: unknown recipe {name!r}; available: {', '.join(RECIPES)}", file=sys.stderr)
        return 2
    module = importlib.import_module(RECIPES[name][0])
    if "-h" in rest or "--help" in rest:
        print(help_text(module.Config, f"python -m recipes {name}", RECIPES[name][1]))
        return 0
    # Ignite logs every exception that leaves a run; the ones we handle get their own line.
    logging.getLogger("ignite.engine.engine").setLevel(logging.CRITICAL)
    try:
        config, given = parse_args(module.Config, rest)
        return module.main(config, given)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
