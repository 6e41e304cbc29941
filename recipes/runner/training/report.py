"""What a run prints besides its progress: a header at the start (what runs, where, on
what) and the end (how it ended, the best checkpoint, the summary, the next commands).
The raw numbers stay in ``summary.json``; these lines are for the person watching."""

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from engine.precision import resolve_precision
from handlers.checkpoint.files import checkpoint_in
from handlers.progress import best_so_far, divergence, format_duration
from recipes.runner.api import Recipe
from recipes.runner.config.interpreter import recipes_command
from recipes.runner.config.run_keys import RunConfig
from recipes.runner.console import say
from recipes.runner.training.standard_handlers import StandardHandlers

TENSORBOARD = "make tensorboard (then open http://127.0.0.1:6006)"
# The recipe keys that say where the data comes from, when a recipe has them.
DATA_KEYS = ("dataset", "data_dir", "text")


def print_header(recipe: Recipe, config: RunConfig, run_dir: Path, data: Any,
                 model: nn.Module) -> None:
    source = recipe.data_source(config) if recipe.data_source is not None else None
    say("\n".join(header(recipe.name, config, run_dir, recipe.sample_counts(data), model,
                         source, _init_from(run_dir))), flush=True)


def _init_from(run_dir: Path) -> dict[str, Any] | None:
    """The ``--init-from`` record of the run's config.json (kept on resumes), if any."""
    try:
        return json.loads((run_dir / "config.json").read_text()).get("init_from")
    except (OSError, ValueError, AttributeError):
        return None


def print_closing(recipe_name: str, summary: dict[str, Any], run_dir: Path,
                  handlers: StandardHandlers) -> None:
    say("\n".join(closing(recipe_name, summary, run_dir, handlers)), flush=True)


def header(recipe_name: str, config: RunConfig, run_dir: Path, samples: tuple[int, int],
           model: nn.Module, source: str | None = None,
           init_from: dict[str, Any] | None = None) -> list[str]:
    """The run's first lines: recipe, run folder, data (from ``source``, else the config's
    data keys), model (and the checkpoint whose weights it began with, ``init_from``'s
    record), device and precision, and how to watch it."""
    if source is None:
        source = ", ".join(f"--{key.replace('_', '-')} {getattr(config, key)}"
                           for key in DATA_KEYS
                           if hasattr(config, key))
    parameters = sum(parameter.numel() for parameter in model.parameters())
    # fully_shard swaps a model's class for an FSDP<Name> subclass: name the recipe's own.
    own_class = next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))
    name = getattr(config, "model", own_class.__name__)
    precision = resolve_precision(config.precision, config.device)
    device = str(precision.device)
    if precision.device.type == "cuda":
        device += f" ({torch.cuda.get_device_name(precision.device)})"
    epochs = f"{config.epochs} epoch{'s' if config.epochs > 1 else ''}"
    init = [] if not init_from else [
        f"  init     --init-from: began with the weights of {init_from['path']} (epoch "
        f"{init_from.get('epoch')}, step {init_from.get('optimizer_step')})"]
    return [
        f"{recipe_name} run in {run_dir}",
        f"  data     {samples[0]:,} training, {samples[1]:,} validation samples"
        + (f" from {source}" if source else ""),
        f"  model    {name}, {parameters:,} parameters",
        *init,
        f"  device   {device}, {precision.name}; {epochs} of batch {_batch(config)}",
        f"  watch    {TENSORBOARD}",
    ]


def _batch(config: Any) -> str:
    """The samples of an optimizer step, and its micro-batches when there are several."""
    if config.accum_steps == 1:
        return str(config.batch_size)
    return (f"{config.batch_size * config.accum_steps} ({config.accum_steps} micro-batches of "
            f"{config.batch_size} a step)")


def closing(recipe_name: str, summary: dict[str, Any], run_dir: Path,
            handlers: StandardHandlers) -> list[str]:
    """The run's last lines: how it ended (and a warning when its validation loss diverged),
    the best checkpoint with its metric and epoch, the summary's path and the commands that
    come next."""
    status, epochs = summary["status"], handlers.evaluation.epochs
    evaluations = handlers.progress.evaluations
    # The epoch in progress, 1-based, as the progress lines count it (a stop mid-epoch 1 is
    # in epoch 1, not after epoch 0).
    epoch = max(1, math.ceil(summary["optimizer_steps"] / evaluations.steps_per_epoch))
    early = (" (stopped early: no better validation for --patience evaluations)"
             if status == "completed" and summary["stopped_early"] else "")
    lines = [f"{status}: epoch {epoch}/{epochs}, "
             f"{summary['optimizer_steps']:,} steps in "
             f"{format_duration(summary['wall_time_sec'])}{early}"]
    diverged = divergence(handlers.history)
    if diverged is not None:  # a run can complete every epoch and still have diverged
        lines.append(f"  warning  {diverged}: the run diverged; try a lower --lr (a third "
                     "or a tenth)")
    best_file = checkpoint_in(run_dir / "checkpoints", "best")  # best.pt, or best.dcp
    found = best_so_far(evaluations.history, evaluations.best, evaluations.steps_per_epoch)
    has_best = found is not None and best_file is not None
    if has_best:
        lines.append(f"  best     {best_file}: {evaluations.best.metric} {found[0]:.4g} "
                     f"(epoch {found[1]})")
    lines.append(f"  summary  {run_dir / 'summary.json'}")
    lines.append(f"  curves   {TENSORBOARD}")
    if has_best:
        lines.append(f"  evaluate {recipes_command(recipe_name)} evaluate {run_dir}")
    if status.startswith("stopped by --max-"):  # a budget: the same run goes on with more
        key = status.removeprefix("stopped by ").split()[0]
        lines.append(f"  continue {recipes_command(recipe_name)} --run-dir {run_dir} {key} "
                     "<more, or none> (continues this run)")
    if status == "completed" and not summary["stopped_early"]:  # a stopped run: run.py's line
        lines.append(f"  longer   {recipes_command(recipe_name)} --run-dir {run_dir} "
                     f"--epochs {2 * epochs} (continues this run, its LR schedule "
                     f"re-planned for {2 * epochs} epochs)")
    return lines
