"""The modes that train no run: ``--lr-find`` (an LR range test), ``--overfit-batches``
(can the model memorise a few batches?) and ``--describe`` (the run's wiring: the events of
its engines and the handlers on each, in firing order, as fastai's ``show_training_loop``
shows a Learner's, so a reader sees the whole run without reading its code)."""

import itertools
import math
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ignite.engine import Engine, Events

from recipes.runner.api import Recipe
from recipes.runner.config.command_line import ConfigError
from recipes.runner.config.run_keys import RunConfig
from recipes.runner.console import say
from recipes.runner.resume.plan import fresh_init_from
from recipes.runner.resume.same_run import resolve_run_dir
from recipes.runner.training.build import build_parts, build_run
from recipes.runner.training.launch import launched_by_torchrun
from recipes.runner.training.lock import RunLock
from recipes.runner.training.start_checks import Started, check_recipe_keys
from recipes.runner.training.strategy import check_strategy

LR_FIND_STEPS = 200  # optimizer steps of the LR range test
OVERFIT_ITERATIONS = 200  # micro-batches of --overfit-batches
OVERFIT_TARGET = 0.05  # "near zero": the last pass's mean loss at most this share of the first


def find_lr_run(recipe: Recipe, config: RunConfig) -> int:
    """``--lr-find``: an LR range test on the run's data and step (accumulation, precision and
    clipping as configured); prints the suggested peak LR and writes ``lr_find.png`` in the
    run folder. Trains nothing and leaves no checkpoint or config.json."""
    from handlers.lr_finder import find_lr, plot_lr_find  # a training start never needs them

    check_recipe_keys(recipe, config)
    check_strategy(recipe, config)
    run_dir = resolve_run_dir(recipe.name, config.run_name, config.run_dir)
    data = recipe.load_data(config)  # a DataError here leaves nothing on disk
    with RunLock(run_dir):
        _, parts, trainer = build_parts(recipe, config, data, run_dir,
                                        fresh_init_from(config, run_dir))
        batches = parts.train_batches
        epochs = math.ceil(LR_FIND_STEPS * config.accum_steps / len(batches))
        # Whole epochs, one after another: each iteration starts the next epoch's order.
        result = find_lr(trainer, (batch for _ in range(epochs) for batch in batches),
                         num_steps=LR_FIND_STEPS)
        say(result.summary())
        if result.suggestion is not None:
            say(f"suggested peak lr: {result.suggestion:.3g} (--lr {result.suggestion:.3g})")
        say(f"wrote {plot_lr_find(result, run_dir / 'lr_find.png')}")
    return 0


def overfit_run(recipe: Recipe, config: RunConfig) -> int:
    """``--overfit-batches N``: train on the first N batches over and over (about
    ``OVERFIT_ITERATIONS`` micro-batches at the constant peak ``--lr``) and say whether the
    loss got near zero: a model and step that cannot memorise a few batches have a bug
    (Lightning's ``overfit_batches``). Writes nothing."""
    if config.nproc != 1 or launched_by_torchrun():
        raise ConfigError("--overfit-batches runs in one process: use --nproc 1")
    check_strategy(recipe, config)
    _, parts, trainer = build_parts(recipe, config, recipe.load_data(config), Path("."),
                                    fresh_init_from(config, Path(".")))
    fixed = list(itertools.islice(iter(parts.train_batches), config.overfit_batches))
    losses: list[float] = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED,
                              lambda engine: losses.append(float(engine.state.output["loss"])))
    trainer.run(fixed, max_epochs=max(1, math.ceil(OVERFIT_ITERATIONS / len(fixed))))
    first, last = losses[0], sum(losses[-len(fixed):]) / len(fixed)
    reached = last <= OVERFIT_TARGET * first
    say(f"overfit {len(fixed)} batch(es) for {len(losses)} iterations at lr {config.lr}: "
        f"loss {first:.4f} -> {last:.4f} ({last / first:.1%} of the first); near zero "
        f"(<= {OVERFIT_TARGET:.0%}): {'yes' if reached else 'no'}"
        + ("" if reached else " (a loss with a floor, e.g. label smoothing, never is)"))
    return 0


def describe_run(recipe: Recipe, config: RunConfig) -> str:
    """The run's wiring: every event of the trainer and evaluator with its handlers, in the
    order they run. Builds the run in a temporary folder (nothing is written to runs/), on
    the recipe's stand-in data when it has one (so the data set need not be there)."""
    check_recipe_keys(recipe, config)
    with tempfile.TemporaryDirectory() as folder:
        data = (recipe.stand_in_data or recipe.load_data)(config)
        started = Started(Path(folder), "describe", {}, data,
                          fresh_init_from(config, Path(folder)))
        trainer, evaluator, _, handlers = build_run(recipe, config, started)
        handlers.stop.restore()
        text = wiring_table({"trainer": trainer, "evaluator": evaluator})
        handlers.logger.close()  # before its folder goes
    return text


# The order events fire in within a run. A step's OPTIMIZER_STEP (or STEP_SKIPPED) settles
# at the next micro-batch's GET_BATCH_STARTED (or at the epoch's end), after its
# ITERATION_COMPLETED: the step never waits on the device.
FIRING_ORDER = ("STARTED", "EPOCH_STARTED", "GET_BATCH_STARTED", "OPTIMIZER_STEP",
                "STEP_SKIPPED", "GET_BATCH_COMPLETED", "ITERATION_STARTED",
                "ITERATION_COMPLETED", "EPOCH_COMPLETED", "COMPLETED", "TERMINATE",
                "TERMINATE_SINGLE_EPOCH", "INTERRUPT", "EXCEPTION_RAISED")


def handler_name(handler: Any) -> str:
    """A readable name: ``Class.method`` for bound methods, the class of a callable object,
    the function's qualified name otherwise; event filters are seen through."""
    parent = getattr(handler, "_parent", None)  # Ignite wraps filtered handlers
    if parent is not None:
        return handler_name(parent()) + " (filtered)"
    owner = getattr(handler, "__self__", None)
    if owner is not None:
        return f"{type(owner).__name__}.{handler.__name__}"
    if hasattr(handler, "__qualname__"):
        return handler.__qualname__.replace(".<locals>", "")
    wrapped = getattr(handler, "__wrapped__", None)  # a callable object around a function
    if wrapped is not None:
        return f"{type(handler).__name__}({handler_name(wrapped)})"
    return type(handler).__name__


def _firing_rank(event: Any) -> int:
    name = getattr(event, "name", str(event))
    return FIRING_ORDER.index(name) if name in FIRING_ORDER else len(FIRING_ORDER)


def wiring_table(engines: Mapping[str, Engine]) -> str:
    """Each engine's events in firing order, each with its handlers in the order they run."""
    lines = []
    for engine_name, engine in engines.items():
        lines.append(f"{engine_name}:")
        for event in sorted(engine._event_handlers, key=_firing_rank):  # a stable sort
            handlers = engine._event_handlers[event]
            if handlers:
                lines.append(f"  {getattr(event, 'name', event)}")
                lines += [f"    {handler_name(handler)}" for handler, _, _ in handlers]
    return "\n".join(lines)
