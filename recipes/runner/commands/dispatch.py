"""Commands next to training: ``python -m recipes <recipe> <command> <run or checkpoint> ...``.

Every recipe has ``evaluate``, ``consolidate`` (``commands.consolidate``) and ``sweep``
(``recipes.runner.sweep``: a search of its keys, trials trained as runs); a recipe adds
its own in the module ``Recipe.commands`` names (every recipe: ``export``,
``commands.export``; cifar and images: ``predict``, charlm: ``generate``). Each loads the
trained model through
``recipes.runner.commands.trained.load_trained`` (``consolidate``: the checkpoint alone) and writes
nothing in the run folder except ``evaluate``'s JSON in ``<run>/evaluations/`` and
``export``'s and ``consolidate``'s files in ``<run>/export/``. A write the disk refuses (a
read-only folder, a full disk) ends the command with one ``error:`` line naming the file and
exit 4, as a failed checkpoint save ends training.
"""

import time
from collections.abc import Callable

from engine.trainer import create_evaluator
from handlers.atomic_write import write_json_atomic
from recipes.runner.api import Recipe
from recipes.runner.commands.command_parser import CommandParser, writing
from recipes.runner.commands.consolidate import consolidate
from recipes.runner.commands.trained import Trained, load_trained
from recipes.runner.config.command_line import ConfigError, ExitCode
from recipes.runner.console import say, warn
from recipes.runner.sweep import sweep_command

VALIDATION = "validation"


def commands_of(recipe: Recipe) -> dict[str, Callable[[Recipe, list[str]], int]]:
    return {"evaluate": evaluate, "consolidate": consolidate, "sweep": sweep_command,
            **recipe.extra_commands()}


def run_command(recipe: Recipe, name: str, args: list[str]) -> int:
    """Run the command ``name`` of ``recipe`` with the rest of the command line."""
    commands = commands_of(recipe)
    if name not in commands:
        raise ConfigError(f"unknown command {name!r} for {recipe.name}; commands: "
                          f"{', '.join(commands)} (training takes --key value flags only)")
    try:
        return commands[name](recipe, args)
    except BrokenPipeError:
        raise  # the reader of stdout has gone: the command line ends quietly (141)
    except OSError as error:  # what the disk refused (``writing`` names the output file)
        where = f"{error.filename}: " if error.filename else ""
        warn(f"error: {name}: {where}{error.strerror or error}")
        return ExitCode.DISK


def evaluate(recipe: Recipe, args: list[str]) -> int:
    """The recipe's metrics for a checkpoint on a split, with the evaluation that scored it
    (its test-time augmentation included): printed and written to
    ``<run>/evaluations/<checkpoint>-<split>.json``."""
    parser = CommandParser(recipe, "evaluate", evaluate.__doc__)
    parser.add_argument("--split", choices=(VALIDATION, *recipe.eval_splits()),
                        default=VALIDATION,
                        help="the data to evaluate on (default: the run's validation split)")
    options = parser.parse_args(args)
    trained = load_trained(recipe, options.source, options.checkpoint, options.device,
                           split=options.split)
    started = time.perf_counter()
    metrics = run_evaluation(trained)
    seconds = time.perf_counter() - started
    # The run recorded its metrics on the validation split only.
    meta, recorded = trained.meta, trained.recorded if options.split == VALIDATION else {}
    samples = recipe.sample_counts(trained.data)[1]
    evaluation = evaluation_name(trained)
    say(f"{recipe.name} {trained.checkpoint} (epoch {meta['epoch']}, step "
        f"{meta['optimizer_step']}): {options.split} split, {samples} samples, "
        f"{evaluation}, {trained.device}, {seconds:.1f} s")
    say(f"{'metric':<12} {'value':>10} {'recorded':>10}")
    for name, value in metrics.items():
        was = recorded.get(name)
        say(f"{name:<12} {value:>10.4f} {'' if was is None else f'{was:.4f}':>10}")
    out = trained.run_dir / "evaluations" / f"{trained.checkpoint.stem}-{options.split}.json"
    with writing(out):
        out.parent.mkdir(exist_ok=True)
        write_json_atomic(out, {
            "recipe": recipe.name, "checkpoint": str(trained.checkpoint),
            "split": options.split, "samples": samples, "evaluation": evaluation,
            "device": str(trained.device), "epoch": meta["epoch"],
            "iteration": meta["iteration"], "optimizer_step": meta["optimizer_step"],
            "metrics": metrics, "recorded": recorded or None, "seconds": round(seconds, 3)})
    say(f"wrote {out}")
    return 0


def run_evaluation(trained: Trained) -> dict[str, float]:
    """The recipe's metrics over ``trained``'s validation batches, as the run's evaluator
    computes them (its ``predict`` and ``prepare_batch`` hooks, precision and device)."""
    parts = trained.parts
    evaluator = create_evaluator(parts.model, parts.metrics, device=trained.device,
                                 precision=trained.config.precision, predict=parts.predict,
                                 prepare_batch=parts.prepare_batch)
    state = evaluator.run(parts.val_batches)
    return {name: float(state.metrics[name]) for name in trained.recipe.metrics}


def evaluation_name(trained: Trained) -> str:
    """Which of the run's evaluations this is: the final one (after the last epoch, e.g. with
    ``--final-tta``) or a per-epoch one, as for the checkpoint's epoch."""
    tta = getattr(trained.parts.predict, "name", None)
    which = "final evaluation" if trained.final_evaluation else "per-epoch evaluation"
    return which + (f", tta {tta}" if tta else "")
