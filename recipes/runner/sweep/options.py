"""The sweep command's own options, apart from the recipe's flags that fix the rest of every
trial's config (``--config FILE`` included); both checked before anything is written."""

import argparse
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from recipes.runner.api import Recipe
from recipes.runner.config.command_line import ConfigError, flag_name
from recipes.runner.config.file import parse_start
from recipes.runner.config.run_keys import check_run_name
from recipes.runner.resume.request import stored_config
from recipes.runner.resume.same_run import RUN_REQUESTS, resolve_run_dir
from recipes.runner.sweep.search_space import Search, parse_searches

PRUNER_NAMES = ("median", "none")
SAMPLER_NAMES = ("tpe", "random")
# Flags of the recipe that a sweep sets for each trial itself.
SET_BY_THE_SWEEP = ("run_dir", "run_name", "resume")


@dataclass(frozen=True)
class SweepOptions:
    """The command line of ``sweep``: its own options, the searched keys, and the fixed
    config (with the keys given)."""

    trials: int
    searches: tuple[Search, ...]
    metric: str
    sweep_dir: Path
    name: str
    pruner: str
    sampler: str
    storage: str
    status: bool
    config: Any
    given: frozenset[str]
    definition: dict[str, Any]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"sweep: {message}")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def parser(recipe: Recipe) -> argparse.ArgumentParser:
    goal = recipe.best
    parser = _Parser(
        prog=f"python -m recipes {recipe.name} sweep", allow_abbrev=False,
        description="Search the recipe's keys with Optuna: each trial is a run in "
        "<sweep-dir>/trial-NNNN; bad trials are pruned at their evaluations; the same "
        "command continues a sweep that was stopped or killed. Every other --key value (or "
        "--config FILE) fixes that key for every trial (see python -m recipes "
        f"{recipe.name} --help).",
        epilog=f"example: python -m recipes {recipe.name} sweep --trials 20 --search "
        "lr=1e-4:1e-1:log --search weight-decay=0,5e-5,5e-4 --epochs 5")
    parser.add_argument("--trials", type=_positive, help="finished or pruned trials to reach "
                        "(required to start; all workers together)")
    parser.add_argument("--search", action="append", default=[], metavar="KEY=SPEC",
                        help="a key and its values: LOW:HIGH (uniform), LOW:HIGH:log, or "
                        "A,B,C (choices); an integer key stays an integer; repeat for more keys")
    parser.add_argument("--metric", choices=tuple(recipe.metrics), default=goal,
                        help=f"the validation metric to optimize (default: {goal}, the "
                        "recipe's goal; maximized or minimized as the recipe ranks it)")
    parser.add_argument("--sweep-name", default="", help="the sweep's name and folder "
                        f"runs/{recipe.name}/sweeps/<name> (default: sweep-<hash of the "
                        "searched and fixed keys>, so the same command finds its sweep)")
    parser.add_argument("--sweep-dir", default="", help="any sweep folder (overrides "
                        "--sweep-name's)")
    parser.add_argument("--pruner", choices=PRUNER_NAMES, default="median",
                        help="stop a trial at an evaluation below the median of the "
                        "earlier trials at that step (Optuna's MedianPruner, from the 6th "
                        "trial on), or never (default: median)")
    parser.add_argument("--sampler", choices=SAMPLER_NAMES, default="tpe",
                        help="how values are chosen (default: tpe, Optuna's default)")
    parser.add_argument("--storage", default="", help="an Optuna storage URL shared by "
                        "workers: sqlite:///FILE, postgresql://..., mysql://..., or "
                        "journal:FILE (default: sqlite in the sweep folder)")
    parser.add_argument("--status", action="store_true", help="print the sweep's table and "
                        "end (trains nothing)")
    return parser


def parse_options(recipe: Recipe, args: list[str]) -> SweepOptions:
    """The sweep's options and the fixed config; ConfigError (one line) for any mistake."""
    known, rest = parser(recipe).parse_known_args(args)
    config, given, _ = parse_start(recipe.config, rest)
    for name in SET_BY_THE_SWEEP:
        if name in given:
            raise ConfigError(f"sweep: {flag_name(name)} is set by the sweep for each trial "
                              "(<sweep-dir>/trial-NNNN); give --sweep-name or --sweep-dir")
    if config.nproc != 1:
        raise ConfigError(f"--nproc {config.nproc}: a sweep trains each trial in one process; "
                          "leave --nproc out (start several workers instead: the same command "
                          "in another terminal)")
    if config.overfit_batches:
        raise ConfigError("--overfit-batches: a debug mode that trains no run; sweep without it")
    searches = tuple(parse_searches(recipe.config, known.search))
    for search in searches:
        if search.name in given:
            raise ConfigError(f"{flag_name(search.name)}: given both as a flag and in --search; "
                              "give one")
    if not known.status and (known.trials is None or not searches):
        raise ConfigError("sweep: give --trials N and at least one --search KEY=SPEC "
                          f"(e.g. --search lr=1e-4:1e-1:log); see python -m recipes "
                          f"{recipe.name} sweep --help")
    if problem := check_run_name(known.sweep_name):
        raise ConfigError(f"--sweep-name: {problem}")
    definition = _definition(recipe, config, searches, known.metric)
    name = known.sweep_name or Path(known.sweep_dir).name or f"sweep-{_digest(definition)}"
    sweep_dir = (Path(known.sweep_dir).expanduser() if known.sweep_dir
                 else resolve_run_dir(recipe.name, "unused", "").parent / "sweeps" / name)
    return SweepOptions(known.trials or 0, searches, known.metric, sweep_dir, name,
                        known.pruner, known.sampler, known.storage, known.status, config,
                        frozenset(given), definition)


def _definition(recipe: Recipe, config: Any, searches: tuple[Search, ...], metric: str
                ) -> dict[str, Any]:
    """What makes two sweep commands the same sweep: the searched keys and their SPECs, the
    fixed keys (but those that place a run or ask something of one start) and the metric."""
    fixed = {key: value for key, value in stored_config(config).items()
             if key not in RUN_REQUESTS and key not in {s.name for s in searches}}
    return json.loads(json.dumps({"recipe": recipe.name, "metric": metric,
                                  "search": {s.name: s.text for s in searches},
                                  "fixed": fixed}))


def _digest(definition: dict[str, Any]) -> str:
    text = json.dumps(definition, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:8]
