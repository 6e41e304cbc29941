"""What a run tells besides its progress: a header at the start (what runs, where, on what)
and the end (how it ended, the best checkpoint, the summary, the next commands), for the
person watching; and, on rank 0, the files that keep the raw numbers: ``summary.json``
(with the environment record) and the training curves (``curves.png``)."""

import json
import math
from pathlib import Path
from typing import Any

import torch

# A Figure of its own, not pyplot: no backend or display to pick (servers, CI), no global
# state to close, and a run in a sweep's process leaves nothing behind.
from matplotlib.figure import Figure
from torch import nn
from torch.distributed.fsdp import FSDPModule

from engine.precision import resolve_precision
from engine.trainer import Trainer
from handlers.atomic_write import write_json_atomic
from handlers.checkpoint.files import checkpoint_in
from handlers.history import RunHistory
from handlers.progress import best_so_far, divergence, format_duration
from recipes.runner.api import Recipe
from recipes.runner.config.command_line import ExitCode
from recipes.runner.config.registry import recipe_ref
from recipes.runner.config.run_keys import RunConfig
from recipes.runner.console import recipes_command, say, warn
from recipes.runner.training.standard_handlers import StandardHandlers
from recipes.runner.training.start_checks import Started

PANEL_INCHES = 5  # the width of each panel of curves.png
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


def write_summary(recipe: Recipe, trainer: Trainer, handlers: StandardHandlers,
                  started: Started, status: str, environment: dict[str, Any], *,
                  disk_error_told: bool = False) -> int:
    """Print the closing lines, write ``summary.json`` (with the environment record) and the
    curves; 4 when the disk refuses them, with an error line unless ``disk_error_told``: the
    run's one line already said that the disk refused a checkpoint or the logs."""
    if status == "completed":
        status = requested_stop(handlers) or status
    history, early_stopping = handlers.history, handlers.early_stopping
    history.stopped_early = bool(early_stopping and early_stopping.stopped_early)
    summary = {"status": status, "run_id": started.run_id, **history.summary(trainer)}
    if handlers.spike_guard is not None:
        summary |= handlers.spike_guard.summary()
    summary |= handlers.cost.summary(summary["samples_per_sec"])
    print_closing(recipe_ref(recipe), summary, started.run_dir, handlers)  # a file: its path
    summary["environment"] = environment
    try:  # the disk that failed a checkpoint may fail these too: the checkpoints matter
        write_json_atomic(started.run_dir / "summary.json", summary)
        plot_curves(history, started.run_dir / "curves.png",
                    title=f"{recipe.name} {started.run_dir.name}")
    except OSError as error:
        if not disk_error_told:
            warn(f"error: could not write the summary or curves in {started.run_dir}: "
                 f"{error.strerror or error}")
        return ExitCode.DISK
    return ExitCode.DONE


def requested_stop(handlers: StandardHandlers) -> str | None:
    """Why a handler of the recipe's own (``Parts.attach_extra``) ended the run before its
    last epoch, by request, when one did: its ``stop_status`` (a sweep's pruned trial says
    ``pruned at step N``). Read where the status is decided, so that summary.json and the
    closing line say it and a later start of the run, which the handler ends at once, says
    it again."""
    return next((status for handler in handlers.extra.values()
                 if (status := getattr(handler, "stop_status", None))), None)


def plot_curves(history: RunHistory, path: Path, title: str) -> None:
    """Panels on the optimizer-step axis: loss (train, and validation when the recipe
    reports a ``loss``), each other validation metric of ``history.modes``, learning rate."""
    train, val = history.train, history.val
    others = [name for name in history.modes if name != "loss"]
    width = PANEL_INCHES * (2 + len(others))
    fig = Figure(figsize=(width, 4))
    # Fixed margins in inches rather than tight_layout, which measures every tick label and
    # took 0.25 s of a run's 0.6 s of drawing (a sweep draws once a trial); 1 inch on the
    # left holds the log axis' widest labels ("2.05×10⁰").
    fig.subplots_adjust(left=1 / width, right=1 - 0.25 / width, bottom=0.13, top=0.84,
                        wspace=0.3)
    axes = fig.subplots(1, 2 + len(others))
    loss_ax, lr_ax = axes[0], axes[-1]
    loss_ax.plot(train["step"], train["loss"], label="train (interval mean)")
    if "loss" in val:
        loss_ax.plot(val["step"], val["loss"], "o-", label="validation")
    loss_ax.set(title="loss", xlabel="optimizer step", yscale="log")
    loss_ax.legend()
    for name, ax in zip(others, axes[1:-1], strict=True):
        if name in val:
            ax.plot(val["step"], val[name], "o-")
        better = "higher" if history.modes[name] == "max" else "lower"
        ax.set(title=f"validation {name} ({better} is better)", xlabel="optimizer step")
    lr_ax.plot(train["step"], train["lr"])
    lr_ax.set(title="learning rate", xlabel="optimizer step")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=90)
