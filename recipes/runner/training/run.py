"""The run layer: everything a run does besides its task, the same for every recipe.

``run(recipe, config, given)`` checks the config and the data, locks and writes the run
folder, starts the processes (one here, ``--nproc`` spawned, or joins torchrun's group),
builds the recipe's parts, attaches the standard handlers, resumes, trains, and writes
``summary.json`` and the curves. Exit codes: 0 done, 2 user error (nothing written),
3 non-finite gradients or loss spikes that a rollback did not cure, 4 a checkpoint could
not be written, 130/143 after Ctrl-C/SIGTERM.
"""

import dataclasses
import itertools
import json
import math
import random
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events

from engine import (
    NonFiniteGradientError,
    Trainer,
    create_evaluator,
    create_trainer,
    new_run_id,
    resolve_precision,
)
from handlers import CheckpointError, continue_with_new_settings, optimizer_steps_per_epoch
from handlers.graceful_stop import EXIT_CODES as STOP_EXIT_CODES
from handlers.lr_finder import find_lr, plot_lr_find
from handlers.lr_scheduling import set_new_peak_lr
from handlers.spike_guard import LossSpikeError
from recipes.runner.api import Context, Parts, Recipe, RunPlan
from recipes.runner.config.command_line import ConfigError, resume_overrides
from recipes.runner.config.errors import USER_ERRORS
from recipes.runner.config.registry import load_recipe, recipe_ref
from recipes.runner.config.run_keys import RunConfig
from recipes.runner.console import say, warn
from recipes.runner.training.checkpoint_strategy import refuse_other_format
from recipes.runner.training.continue_run import choose_run, continue_command
from recipes.runner.training.cost import check_recipe_keys, cost_meter
from recipes.runner.training.curves import plot_curves
from recipes.runner.training.elastic import prepare_start
from recipes.runner.training.environment import environment_record
from recipes.runner.training.fingerprint import describe_change
from recipes.runner.training.folder import read_saved_config, resolve_run_dir, write_json_atomic
from recipes.runner.training.init_from import applies, load_init_weights, plan_init_from
from recipes.runner.training.launch import (
    exit_process,
    launched_by_torchrun,
    plan_launch,
    process_device,
    rank_zero_exit_code,
    share_machine,
    spawn,
)
from recipes.runner.training.lock import RunLock
from recipes.runner.training.profiling import attach_profiler, check_profile_window
from recipes.runner.training.report import print_closing, print_header
from recipes.runner.training.resume_request import (
    check_resume_file,
    saved_in_checkpoints,
    stored_config,
    without_requests,
)
from recipes.runner.training.standard_handlers import (
    TRAIN_DATA,
    Evaluation,
    RunSite,
    StandardHandlers,
    attach_standard_handlers,
    attach_weight_averaging,
)
from recipes.runner.training.strategy import (
    check_strategy,
    distributor,
    evaluate_unsharded,
    is_sharded,
    strategy_line,
)
from recipes.runner.training.trackers import check_tracker
from recipes.runner.training.tracking import close_tracker, open_tracker, tracker_sinks
from recipes.runner.training.wiring import wiring_table

LR_FIND_STEPS = 200  # optimizer steps of the LR range test
OVERFIT_ITERATIONS = 200  # micro-batches of --overfit-batches
OVERFIT_TARGET = 0.05  # "near zero": the last pass's mean loss at most this share of the first


@dataclass
class Started:
    """A checked run: its folder (written), id, the data fingerprint and the data."""

    run_dir: Path
    run_id: str
    fingerprint: dict[str, Any]
    data: Any


def run(recipe: Recipe, config: RunConfig, given: set[str]) -> int:
    """Train here, in ``--nproc`` spawned processes, or as one of the processes of torchrun."""
    check_recipe_keys(recipe, config)
    if config.overfit_batches:
        return overfit_run(recipe, config)
    if launched_by_torchrun():
        prepare_start(config)  # a group that torchrun restarted resumes its run
        with idist.Parallel(backend=_launch(config).backend):  # joins torchrun's group
            exit_code = _join_group(recipe, config, given)
        exit_process(exit_code)
    finished = choose_run(recipe.name, recipe.best, config, given)
    if finished is not None:
        say(finished)
        return 0
    with _locked_setup(recipe, config, given) as started:
        if config.nproc == 1:
            exit_code = train(recipe, config, started)
        else:
            exit_code = spawn(train_process, recipe_ref(recipe), dataclasses.asdict(config),
                              started.run_dir, started.run_id, started.fingerprint,
                              nproc=config.nproc, backend=_launch(config).backend)
    if exit_code in STOP_EXIT_CODES.values():  # stopped by a signal once its step was saved
        say(f"stopped; to continue this run: {continue_command()}")
    return exit_code


def _launch(config: RunConfig):
    return plan_launch(config.nproc, config.backend, config.device, config.batch_size)


@contextmanager
def _locked_setup(recipe: Recipe, config: RunConfig, given: set[str]) -> Iterator[Started]:
    """``setup`` under the run folder's lock, held until the run ends (the whole group's)."""
    lock = RunLock(resolve_run_dir(recipe.name, config.run_name, config.run_dir))
    try:
        yield setup(recipe, config, given, lock)
    finally:
        lock.release()


def _check_run(recipe: Recipe, config: RunConfig, given: set[str]) -> tuple[Path, dict | None]:
    """The checks that need no data: keys against each other and against the launch."""
    if "run_name" in given and not config.run_name:
        raise ConfigError("--run-name: must not be empty; leave it out for a timestamp")
    run_dir = resolve_run_dir(recipe.name, config.run_name, config.run_dir)
    saved = read_saved_config(run_dir)
    if config.resume == "never" and any(path.suffix in (".pt", ".dcp")
                                        for path in (run_dir / "checkpoints").glob("*")):
        raise ConfigError(f"--resume never: {run_dir} already holds checkpoints; use --resume auto "
                          "to continue it or another --run-name to start anew")
    if config.resume == "never":
        return run_dir, None
    return run_dir, without_requests(saved or saved_in_checkpoints(run_dir / "checkpoints"))


def setup(recipe: Recipe, config: RunConfig, given: set[str], lock: RunLock | None) -> Started:
    """Check the config and the data, take the run folder's lock, then write the folder and
    its config.json: a user error (exit 2) leaves nothing on disk."""
    run_dir, saved = _check_run(recipe, config, given)
    overrides = resume_overrides(saved["config"], config, given) if saved else []
    check_tracker(config, run_dir)
    run_id = saved["run_id"] if saved else new_run_id()
    refuse_other_format(config.strategy, run_dir, config.resume)
    check_resume_file(config.resume, run_id)
    launch = _launch(config)
    if launched_by_torchrun() and launch.backend != idist.backend():
        raise ConfigError(f"--backend: this run resolves to {launch.backend}, but the group "
                          f"was started with {idist.backend()}; give --device and --backend")
    try:
        resolve_precision(config.precision, config.device)
    except ValueError as error:
        raise ConfigError(f"--device/--precision: {error}") from None
    check_strategy(recipe, config)
    if config.scheduler == "warmup_cosine" and config.warmup() >= config.epochs:
        raise ConfigError(f"--warmup-epochs: must be < --epochs {config.epochs} for "
                          f"warmup_cosine, got {config.warmup()}")
    if lock is not None and run_dir.is_dir():
        lock.acquire()  # an existing run: refuse a second writer before loading the data
    data = recipe.load_data(config)  # a DataError here leaves nothing on disk
    n_train, n_val = recipe.sample_counts(data)
    if config.batch_size > n_train:
        raise ConfigError(f"--batch-size {config.batch_size} exceeds the {n_train} training "
                          "samples")
    check_profile_window(config, n_train)
    # Every process needs a validation sample: the first evaluation forward of a DDP model
    # is a collective (it broadcasts rank 0's BatchNorm statistics to all).
    if n_val < launch.world_size:
        raise ConfigError(f"{n_val} validation samples cannot be shared by "
                          f"{launch.world_size} processes")
    fingerprint = recipe.fingerprint(data)
    overrides += _data_change(saved, fingerprint, config.allow_data_change)
    for line in overrides:
        say(line)
    init_from = plan_init_from(recipe, config, given, run_dir, data, saved)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # not writable, or a file in the way
        raise ConfigError(f"--run-dir/--run-name: cannot create {run_dir}: {error.strerror}"
                          ) from None
    if lock is not None and not lock.held:
        lock.acquire()
    environment = environment_record(process_device(config.device), launch.world_size)
    write_json_atomic(run_dir / "config.json", {"run_id": run_id, "data": fingerprint,
                                                "config": stored_config(config),
                                                "environment": environment,
                                                **({"init_from": init_from} if init_from
                                                   else {})})
    return Started(run_dir, run_id, fingerprint, data)


def _data_change(saved: dict | None, fingerprint: dict[str, Any], allowed: bool) -> list[str]:
    """Refuse to resume on other data than the run started with, unless ``allowed``."""
    if saved is None or "data" not in saved:
        return []
    changes = (describe_change(saved["data"].get(split, {}), new, split)
               for split, new in fingerprint.items())
    change = "; ".join(line for line in changes if line)
    if not change:
        return []
    if not allowed:
        raise ConfigError(f"the data changed since this run was saved ({change}); resume with "
                          "--allow-data-change true to continue on the new data, or start a "
                          "new run (another --run-name)")
    return [f"override: data changed ({change}), allowed by --allow-data-change"]


def _join_group(recipe: Recipe, config: RunConfig, given: set[str]) -> int:
    """Rank 0 chooses the run folder (the same command again continues its run), checks
    everything, locks and writes the folder, then tells every rank the run (or that it is
    already complete, so that all exit 0, or the user error, so that all exit 2); each trains."""
    started, lock = "", None
    if idist.get_rank() == 0:
        try:
            finished = choose_run(recipe.name, recipe.best, config, given)  # sets run_dir
            if finished is not None:
                started = json.dumps({"complete": finished})
            else:
                lock = RunLock(resolve_run_dir(recipe.name, config.run_name, config.run_dir))
                ready = setup(recipe, config, given, lock)
                started = json.dumps({"run_dir": str(ready.run_dir), "run_id": ready.run_id,
                                      "data": ready.fingerprint,
                                      "config": dataclasses.asdict(config)})
        except USER_ERRORS as error:
            started = json.dumps({"error": str(error)})
    started = json.loads(idist.broadcast(started, src=0))
    if "error" in started:
        raise ConfigError(started["error"])
    if "complete" in started:
        if idist.get_rank() == 0:
            say(started["complete"])
        return 0
    try:
        exit_code = train_process(idist.get_local_rank(), recipe_ref(recipe), started["config"],
                                  Path(started["run_dir"]), started["run_id"], started["data"])
        if exit_code in STOP_EXIT_CODES.values():  # rank 0's: the others return 0
            # sys.orig_argv here is this worker's, not the torchrun command that started it
            say("stopped; to continue this run, run the same torchrun command again "
                  f"(or add --run-dir {started['run_dir']})")
        return exit_code
    finally:
        if lock is not None:
            lock.release()


def train_process(local_rank: int, ref: str, config: dict[str, Any], run_dir: Path,
                  run_id: str, fingerprint: dict[str, Any]) -> int:
    """One process of a group: it loads the data itself (loading is deterministic, so all
    hold the same data) and trains on its rank's slice of each batch."""
    recipe = load_recipe(ref)
    resolved = recipe.config(**config)
    share_machine(process_device(resolved.device))
    data = recipe.load_data(resolved)
    return rank_zero_exit_code(train(recipe, resolved, Started(run_dir, run_id, fingerprint,
                                                               data)))


def build_parts(recipe: Recipe, config: RunConfig, data: Any, run_dir: Path
                ) -> tuple[Context, Parts, Trainer]:
    """Seed, build the recipe's parts for this process and its trainer (no handlers)."""
    device, world_size = process_device(config.device), idist.get_world_size()
    distribute = distributor(config.strategy, recipe.blocks,
                             resolve_precision(config.precision, device), world_size)
    ctx = Context(device, idist.get_rank(), world_size, run_dir, distribute)
    torch.manual_seed(config.seed)
    random.seed(config.seed)  # its state is in every checkpoint (RngState)
    parts = recipe.build(config, data, ctx)
    if applies(config, run_dir):  # a fresh run: before averaging copies the weights
        load_init_weights(parts.model, config.init_from)
    trainer = create_trainer(parts.train_model or parts.model, parts.optimizer, parts.loss_fn,
                             forward=parts.forward, device=ctx.device,
                             precision=config.precision, accum_steps=config.accum_steps,
                             max_grad_norm=config.max_grad_norm,
                             prepare_batch=parts.prepare_batch, compile=config.compile)
    return ctx, parts, trainer


def build_run(recipe: Recipe, config: RunConfig, started: Started,
              sinks: Mapping[str, Any] | None = None
              ) -> tuple[Trainer, Engine, Parts, StandardHandlers]:
    """Build the parts and the engines and attach every handler; ``sinks`` get every scalar
    besides TensorBoard and metrics.jsonl. Returns (trainer, evaluator, parts, standard
    handlers)."""
    ctx, parts, trainer = build_parts(recipe, config, started.data, started.run_dir)
    train_model = parts.train_model or parts.model
    evaluator = create_evaluator(train_model, parts.metrics, device=ctx.device,
                                 precision=config.precision, predict=parts.predict,
                                 prepare_batch=parts.prepare_batch)
    trainer.run_id = started.run_id
    plan = RunPlan(optimizer_steps_per_epoch(len(parts.train_batches), config.accum_steps),
                   config.epochs)
    extra = dict(parts.attach_extra(trainer, evaluator, plan) if parts.attach_extra else {})
    if hasattr(parts.train_batches, "state_dict"):  # a loader's position (workers, sampler)
        extra[TRAIN_DATA] = parts.train_batches
    if is_sharded(train_model):
        evaluate_unsharded(evaluator, train_model)
    if config.averaging != "none":
        replay = getattr(parts.train_batches, "epoch_batches", None)
        extra["averaging"] = attach_weight_averaging(
            config, parts.model, trainer, evaluator,
            bn_batches=(lambda: replay(1)) if replay else None,
            bn_input=lambda batch: parts.prepare_batch(batch, ctx.device, True)[0])
    site = RunSite(started.run_dir, started.run_id, recipe.metrics, recipe.best, plan,
                   rank=ctx.rank, model=parts.model,
                   checkpoint_meta={"data": started.fingerprint}, num_classes=parts.num_classes,
                   cost=cost_meter(config, ctx, parts), sinks=sinks or {})
    evaluation = Evaluation(parts.val_batches, config.eval_every, config.epochs,
                            before=parts.before_evaluation, forwards=parts.evaluation_forwards)
    handlers = attach_standard_handlers(trainer, evaluator, config, site, evaluation, extra)
    if ctx.rank == 0:  # one trace: the other ranks run the same steps
        attach_profiler(config, trainer, started.run_dir, ctx.device)
    return trainer, evaluator, parts, handlers


def train(recipe: Recipe, config: RunConfig, started: Started) -> int:
    rank, world = idist.get_rank(), idist.get_world_size()
    tracker = (open_tracker(recipe.name, config, started.run_dir, started.run_id)
               if rank == 0 else None)
    trainer, _, parts, handlers = build_run(recipe, config, started, tracker_sinks(tracker))
    if rank == 0:
        print_header(recipe, config, started.run_dir, started.data, parts.model)
        if config.strategy == "fsdp":
            say(strategy_line(resolve_precision(config.precision, config.device), world))
    info = handlers.checkpointer.resume(config.resume) if rank == 0 else None
    if world > 1:  # rank 0 picked the file (and cleared stale temp files); all load that one
        chosen = idist.broadcast(str(info.path) if info is not None else "never", src=0)
        info = handlers.checkpointer.resume(chosen) if rank > 0 else info
    if info is not None and rank == 0:
        for name, reason in info.rejected:
            warn(f"skipped checkpoint {name}: {reason}")
        say(f"resumed from {info.path} (epoch {trainer.state.epoch}, "
              f"iteration {trainer.state.iteration}, step {trainer.state.optimizer_step})")
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
            trainer.run(batches, max_epochs=config.epochs)
    except (NonFiniteGradientError, LossSpikeError) as error:  # every rank, the same step
        status, exit_code = f"stopped: {error}", 3
        if rank == 0:
            warn(f"error: {error}")
    except CheckpointError as error:  # a save failed (disk full, permission, read-only folder)
        status, exit_code = f"stopped: {error}", 4  # not a usage error: 2 is for those
        if rank == 0:  # every rank raises it (RankZeroSave); rank 0 has the cause
            warn(f"error: {error}")
    finally:
        handlers.stop.restore()
        if handlers.logger is not None:  # flushes what an exception left unwritten
            handlers.logger.close()
    stop = handlers.stop
    if stop.exit_code is not None and exit_code == 0:  # a failed save outranks the signal
        status, exit_code = f"interrupted by {stop.received.name}", stop.exit_code
    if rank == 0:
        environment = environment_record(process_device(config.device), world)
        exit_code = _write_summary(recipe, trainer, handlers, started, status,
                                   environment) or exit_code
        close_tracker(tracker, status, started.run_dir)
    return exit_code


def _follow_new_lr_and_length(config: RunConfig, saved: dict, trainer: Trainer,
                              handlers: StandardHandlers, epoch_length: int) -> None:
    """The resume rule for ``--lr`` and ``--epochs`` (README, "Resuming"): the LR schedule
    becomes the one a fresh run with the new values would follow, from the step reached."""
    trainer.state.max_epochs = config.epochs  # else Ignite restarts a run that was done
    if (saved.get("lr"), saved.get("epochs")) == (config.lr, config.epochs):
        return
    if handlers.scheduler is None:
        set_new_peak_lr(trainer.optimizer, old_lr=saved.get("lr", config.lr), new_lr=config.lr)
        return
    continue_with_new_settings(handlers.scheduler, handlers.make_scheduler,
                               old_lr=saved.get("lr", config.lr), new_lr=config.lr,
                               optimizer_steps=trainer.state.optimizer_step,
                               epochs_completed=trainer.state.iteration // epoch_length)


def _write_summary(recipe: Recipe, trainer: Trainer, handlers: StandardHandlers,
                   started: Started, status: str, environment: dict[str, Any]) -> int:
    """Print the closing lines, write ``summary.json`` (with the environment record) and the
    curves; 4 when the disk refuses them."""
    history, early_stopping = handlers.history, handlers.early_stopping
    history.stopped_early = bool(early_stopping and early_stopping.stopped_early)
    summary = {"status": status, "run_id": started.run_id, **history.summary(trainer)}
    if handlers.spike_guard is not None:
        summary |= handlers.spike_guard.summary()
    summary |= handlers.cost.summary(summary["samples_per_sec"])
    print_closing(recipe.name, summary, started.run_dir, handlers)
    summary["environment"] = environment
    try:  # the disk that failed a checkpoint may fail these too: the checkpoints matter
        write_json_atomic(started.run_dir / "summary.json", summary)
        plot_curves(history, started.run_dir / "curves.png",
                    title=f"{recipe.name} {started.run_dir.name}")
    except OSError as error:
        warn(f"error: could not write the summary or curves in {started.run_dir}: "
              f"{error.strerror or error}")
        return 4
    return 0


def find_lr_run(recipe: Recipe, config: RunConfig) -> int:
    """``--lr-find``: an LR range test on the run's data and step (accumulation, precision and
    clipping as configured); prints the suggested peak LR and writes ``lr_find.png`` in the
    run folder. Trains nothing and leaves no checkpoint or config.json."""
    check_recipe_keys(recipe, config)
    check_strategy(recipe, config)
    run_dir = resolve_run_dir(recipe.name, config.run_name, config.run_dir)
    data = recipe.load_data(config)  # a DataError here leaves nothing on disk
    with RunLock(run_dir):
        _, parts, trainer = build_parts(recipe, config, data, run_dir)
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
    _, parts, trainer = build_parts(recipe, config, recipe.load_data(config), Path("."))
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
        started = Started(Path(folder), "describe", {}, data)
        trainer, evaluator, _, handlers = build_run(recipe, config, started)
        handlers.stop.restore()
        text = wiring_table({"trainer": trainer, "evaluator": evaluator})
        handlers.logger.close()  # before its folder goes
    return text
