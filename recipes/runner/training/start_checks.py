"""The checks of a start, before anything is written: the config against itself and the
launch (the ``--profile`` window against the run's length too), the data against the run's,
the checkpoint a resume names; then the lock and the run folder with its ``config.json``. A
user error (exit 2) here leaves nothing on disk; a disk that refuses those first writes
(full, a file size limit) is a ``FolderWriteError``, exit 4 as for a refused checkpoint save,
the folder's earlier files untouched (``config.json`` is written through a temp file)."""

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ignite.distributed as idist

from engine.precision import resolve_precision
from handlers.atomic_write import write_json_atomic
from recipes.runner.api import Recipe
from recipes.runner.config.command_line import ConfigError
from recipes.runner.config.run_keys import RunConfig, profile_window
from recipes.runner.console import say
from recipes.runner.resume.plan import ResumePlan
from recipes.runner.resume.request import check_resume_file, stored_config
from recipes.runner.training.environment import environment_record
from recipes.runner.training.fingerprint import describe_change
from recipes.runner.training.init_from import plan_init_from
from recipes.runner.training.launch import launched_by_torchrun, plan_launch, process_device
from recipes.runner.training.lock import RunLock
from recipes.runner.training.strategy import check_strategy, refuse_other_format
from recipes.runner.training.trackers import check_tracker


class FolderWriteError(Exception):
    """The disk refused the run folder's lock or ``config.json``; the message names the file."""


@contextmanager
def _folder_write(path: Path) -> Iterator[None]:
    try:
        yield
    except OSError as error:
        raise FolderWriteError(f"cannot write {path}: {error.strerror or error}") from None


@dataclass
class Started:
    """A checked run: its folder (written), id, the data fingerprint and the data, and the
    ``--init-from`` weights it begins with when its plan says so."""

    run_dir: Path
    run_id: str
    fingerprint: dict[str, Any]
    data: Any
    init_from: str = ""


def check_recipe_keys(recipe: Recipe, config: RunConfig) -> None:
    """Refuse ``--activation-checkpointing`` for a recipe whose build does not honour it."""
    if config.activation_checkpointing and not recipe.activation_checkpointing:
        raise ConfigError(f"--activation-checkpointing: the {recipe.name} recipe's model has "
                          "no blocks to recompute in the backward; it applies to charlm's "
                          "transformer blocks")


def launch_of(config: RunConfig):
    """The processes and backend that ``config`` asks for."""
    return plan_launch(config.nproc, config.backend, config.device, config.batch_size)


@contextmanager
def locked_setup(recipe: Recipe, plan: ResumePlan) -> Iterator[tuple[Started, RunLock]]:
    """``setup`` under the run folder's lock, held here until the run ends (the whole
    group's), and the lock, for the spawned processes to hold as well."""
    lock = RunLock(plan.run_dir)
    try:
        yield setup(recipe, plan, lock), lock
    finally:
        lock.release()


def setup(recipe: Recipe, plan: ResumePlan, lock: RunLock | None) -> Started:
    """Check the plan's config and the data, take the run folder's lock, then write the
    folder and its config.json: a user error (exit 2) leaves nothing on disk."""
    run_dir, config = plan.run_dir, plan.config
    check_tracker(config, run_dir)
    refuse_other_format(config.strategy, run_dir, plan.source)
    check_resume_file(plan.source, plan.run_id)
    launch = launch_of(config)
    if launched_by_torchrun() and launch.backend != idist.backend():
        raise ConfigError(f"--backend: this run resolves to {launch.backend}, but the group "
                          f"was started with {idist.backend()}; give --device and --backend")
    try:
        device = resolve_precision(config.precision, config.device).device
    except ValueError as error:
        raise ConfigError(f"--device/--precision: {error}") from None
    if config.cuda_graphs and not (config.compile and device.type == "cuda"):
        raise ConfigError(f"--cuda-graphs: needs --compile true and a CUDA device, got "
                          f"--compile {str(config.compile).lower()} on {device.type}")
    check_strategy(recipe, config)
    if config.scheduler == "warmup_cosine" and config.warmup() >= config.epochs:
        raise ConfigError(f"--warmup-epochs: must be < --epochs {config.epochs} for "
                          f"warmup_cosine, got {config.warmup()}")
    if lock is not None and run_dir.is_dir():
        with _folder_write(lock.path):  # an existing run: refuse a second writer first
            lock.acquire()
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
    for line in data_change(plan.saved, fingerprint, config.allow_data_change):
        say(line)
    if plan.init_ignored:
        say(plan.init_ignored)
    init_from = plan_init_from(recipe, config, plan, data)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # not writable, or a file in the way
        raise ConfigError(f"--run-dir/--run-name: cannot create {run_dir}: {error.strerror}"
                          ) from None
    if lock is not None and not lock.held:
        with _folder_write(lock.path):
            lock.acquire()
    environment = environment_record(process_device(config.device), launch.world_size)
    with _folder_write(run_dir / "config.json"):
        write_json_atomic(run_dir / "config.json", {
            "recipe": recipe.name, "run_id": plan.run_id, "data": fingerprint,
            "config": stored_config(config),
            "environment": environment, **({"init_from": init_from} if init_from else {})})
    return Started(run_dir, plan.run_id, fingerprint, data, plan.init_from)


def data_change(saved: dict | None, fingerprint: dict[str, Any], allowed: bool) -> list[str]:
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


def check_profile_window(config: RunConfig, train_samples: int) -> None:
    """Refuse a window that ends after the run's last optimizer step. The steps are counted
    from the training samples as ``ceil(samples / batch size)`` micro-batches an epoch: a
    recipe whose batches drop a short last one has up to one step fewer an epoch, and a
    window reaching into those closes with the run."""
    window = profile_window(config.profile)
    if window is None:
        return
    micro_batches = math.ceil(train_samples / config.batch_size)
    steps = math.ceil(micro_batches / config.accum_steps) * config.epochs
    if window[1] > steps:
        epochs = f"{config.epochs} epoch{'s' * (config.epochs != 1)}"
        raise ConfigError(f"--profile {config.profile}: the run has {steps} optimizer steps "
                          f"({epochs}); the window must end by step {steps}")
