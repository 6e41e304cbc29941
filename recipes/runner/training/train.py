"""The run itself, in each process: build it, load the checkpoint its plan names, train to
the end (or to a stop), and on rank 0 write the summary; returns an ``ExitCode``.

The run's experiment tracker (``--tracker``, ``recipes.runner.training.trackers``) is opened
on rank 0 before the handlers are built and finished once the summary and curves are
written."""

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import ignite.distributed as idist

from engine.nonfinite import NonFiniteGradientError
from engine.precision import resolve_precision
from engine.trainer import Trainer
from handlers.checkpoint.files import CheckpointError
from handlers.lr_scheduling import continue_with_new_settings, set_new_peak_lr
from handlers.spike_guard import LossSpikeError
from recipes.runner.api import Recipe
from recipes.runner.config.command_line import ExitCode
from recipes.runner.config.run_keys import RunConfig
from recipes.runner.console import say, warn
from recipes.runner.resume.request import stored_config
from recipes.runner.training.build import build_run
from recipes.runner.training.environment import REPO, environment_record, git_revision
from recipes.runner.training.launch import process_device
from recipes.runner.training.report import print_header, write_summary
from recipes.runner.training.standard_handlers import StandardHandlers
from recipes.runner.training.start_checks import Started
from recipes.runner.training.strategy import strategy_line
from recipes.runner.training.trackers import TrackedRun, Tracker, start_tracker

ARTIFACTS = ("checkpoints/best.pt", "curves.png")  # in the run folder and the tracker's run


def train(recipe: Recipe, config: RunConfig, started: Started) -> int:
    rank, world = idist.get_rank(), idist.get_world_size()
    tracker = (open_tracker(recipe.name, config, started.run_dir, started.run_id)
               if rank == 0 else None)
    trainer, _, parts, handlers = build_run(recipe, config, started, tracker_sinks(tracker))
    if rank == 0:
        print_header(recipe, config, started.run_dir, started.data, parts.model)
        if config.strategy == "fsdp":
            say(strategy_line(resolve_precision(config.precision, config.device), world))
    # config.resume is the plan's source (resume/plan.py): the checkpointer verifies it, or
    # for "auto" the candidates newest first, and loads the first that verifies.
    info = handlers.checkpointer.resume(config.resume) if rank == 0 else None
    if world > 1:  # rank 0 picked the file (and cleared stale temp files); all load that one
        chosen = idist.broadcast(str(info.path) if info is not None else "never", src=0)
        info = handlers.checkpointer.resume(chosen) if rank > 0 else info
    # The checkpointer has said which checkpoint it loaded and which it passed over.
    epoch_length = len(parts.train_batches)
    early_stopping = handlers.early_stopping
    # A run killed after its final save, or started again once done, has nothing left to
    # train: Ignite would restart a finished state at iteration 0, on the trained weights.
    finished = info is not None and (
        trainer.state.iteration >= config.epochs * epoch_length
        or bool(early_stopping and early_stopping.stopped_early))
    if finished and rank == 0:
        say("the run is already complete: nothing left to train")
        handlers.end_again(trainer)
    if info is not None and not finished:
        _follow_new_lr_and_length(config, info.meta.get("config") or {}, trainer, handlers,
                                  epoch_length)
    status, exit_code = "completed", 0
    batches = parts.train_batches
    batches = batches.bind(trainer) if hasattr(batches, "bind") else batches
    try:
        if not finished:
            _run_to_the_end(trainer, batches, config.epochs, handlers)
    except (NonFiniteGradientError, LossSpikeError) as error:  # every rank, the same step
        status, exit_code = f"stopped: {error}", ExitCode.NON_FINITE
        if rank == 0:
            warn(f"error: {error}")
    except CheckpointError as error:  # a save failed (disk full, permission, read-only folder)
        status, exit_code = f"stopped: {error}", ExitCode.DISK  # not a usage error (2)
        if rank == 0:  # every rank raises it (RankZeroSave); rank 0 has the cause
            warn(f"error: {error}")
    except BrokenPipeError:
        raise  # the reader of stdout has gone: the command line ends quietly (141)
    except OSError as error:  # rank 0's logs (metrics.jsonl) refused at an evaluation or end
        status, exit_code = f"stopped: could not write the run's logs: {error}", ExitCode.DISK
        warn(f"error: could not write the run's logs: {error}")
    finally:
        handlers.stop.restore()
        if handlers.logger is not None:  # flushes what an exception left unwritten
            handlers.logger.close()
    stop = handlers.stop
    if stop.exit_code is not None and exit_code == 0:  # a failed save outranks the signal
        status, exit_code = f"interrupted by {stop.received.name}", stop.exit_code
    elif handlers.budget is not None and handlers.budget.reason and exit_code == 0:
        status = f"stopped by {handlers.budget.reason}"  # by request: exit 0
    if rank == 0:
        environment = environment_record(process_device(config.device), world)
        exit_code = write_summary(recipe, trainer, handlers, started, status, environment,
                                  disk_error_told=exit_code == ExitCode.DISK) or exit_code
        close_tracker(tracker, status, started.run_dir)
    return exit_code


def _run_to_the_end(trainer: Trainer, batches: Iterable[Any], epochs: int,
                    handlers: StandardHandlers) -> None:
    """``trainer.run``, whose end (``Events.COMPLETED``, also after a stop) commits a save
    still being written behind training (``--async-checkpoint``). A run that stops on
    non-finite numbers ends without that event: the saves before the bad step stand, so it
    commits the one in flight too, or raises its ``CheckpointError``."""
    try:
        trainer.run(batches, max_epochs=epochs)
    except (NonFiniteGradientError, LossSpikeError):
        handlers.checkpointer.wait_handler(trainer)
        raise


def _follow_new_lr_and_length(config: RunConfig, saved: dict, trainer: Trainer,
                              handlers: StandardHandlers, epoch_length: int) -> None:
    """The resume rule for ``--lr`` and ``--epochs`` (docs/reliability.md, "Resuming"): the LR
    schedule becomes the one a fresh run with the new values would follow, from the step reached."""
    trainer.state.max_epochs = config.epochs  # else Ignite restarts a run that was done
    if (saved.get("lr"), saved.get("epochs")) == (config.lr, config.epochs):
        return
    reached = trainer.optimizer.param_groups[0]["lr"]
    if handlers.scheduler is None:
        set_new_peak_lr(trainer.optimizer, old_lr=saved.get("lr", config.lr), new_lr=config.lr)
        return
    continue_with_new_settings(handlers.scheduler, handlers.make_scheduler,
                               old_lr=saved.get("lr", config.lr), new_lr=config.lr,
                               optimizer_steps=trainer.state.optimizer_step,
                               epochs_completed=trainer.state.iteration // epoch_length)
    if idist.get_rank() == 0:
        say(replanned_line(saved, config, trainer.state.optimizer_step, reached,
                           trainer.optimizer.param_groups[0]["lr"], handlers.scheduler.clock))


def replanned_line(saved: dict, config: RunConfig, step: int, reached: float, now: float,
                   clock: str) -> str:
    """The line that says what a new ``--lr`` or ``--epochs`` did to the LR schedule: the
    ``override:`` line names the key, this one the LR the next step takes (a run extended
    after its schedule had decayed goes back up to where a longer run would be)."""
    changed = ", ".join(f"--{key} {saved.get(key)} -> {getattr(config, key)}"
                        for key in ("epochs", "lr") if saved.get(key) != getattr(config, key))
    how = ("the LR plateau had reached, times the new --lr over the old" if clock == "metric"
           else "where a fresh run with these values would be")
    return f"LR schedule: {changed}: from step {step} on, lr {reached:.4g} -> {now:.4g} ({how})"


def open_tracker(recipe: str, config: RunConfig, run_dir: Path, run_id: str
                 ) -> Tracker | None:
    """The tracker's run for this run folder; None for ``--tracker none`` or when the tracker
    cannot be reached (it said so in one line)."""
    if config.tracker == "none":
        return None
    return start_tracker(config, TrackedRun(run_dir, run_id, recipe, stored_config(config),
                                            git_revision(REPO)))


def tracker_sinks(tracker: Tracker | None) -> dict[str, Any]:
    """The scalar sinks the run's logger adds for the tracker (``RunSite.sinks``)."""
    return {} if tracker is None else {"tracker": tracker.sink}


def close_tracker(tracker: Tracker | None, status: str, run_dir: Path) -> None:
    """The best checkpoint and the curves as artifacts, and the run's end status; then the
    tracker's closing line under the run's (where its run went, how to browse it)."""
    if tracker is not None:
        tracker.finish(status, {name: run_dir / name for name in ARTIFACTS})
        line = tracker.closing_line()
        if line:
            say(line, flush=True)
