"""The end of a run, on rank 0: the closing lines, ``summary.json`` (with the environment
record) and the training curves (``curves.png``)."""

from pathlib import Path
from typing import Any

# A Figure of its own, not pyplot: no backend or display to pick (servers, CI), no global
# state to close, and a run in a sweep's process leaves nothing behind.
from matplotlib.figure import Figure

from engine.trainer import Trainer
from handlers.history import RunHistory
from recipes.runner.api import Recipe
from recipes.runner.config.command_line import ExitCode
from recipes.runner.config.registry import recipe_ref
from recipes.runner.console import warn
from recipes.runner.training.folder import write_json_atomic
from recipes.runner.training.report import print_closing
from recipes.runner.training.standard_handlers import StandardHandlers
from recipes.runner.training.start_checks import Started


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
    fig = Figure(figsize=(5 * (2 + len(others)), 4))
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
    fig.tight_layout()
    fig.savefig(path, dpi=90)
