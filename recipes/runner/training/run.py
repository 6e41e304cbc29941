"""The run layer's entry: ``run(recipe, config, given)`` trains here, in ``--nproc`` spawned
processes, or as one process of torchrun's group.

One start, in order (a file each): the resume plan decides what this start does
(``resume/plan.py``); the start checks refuse what cannot run before anything is written,
then lock and write the run folder (``start_checks.py``); the processes start (``launch.py``,
``group.py``); each builds the parts and trains (``build.py``, ``train.py``); rank 0 writes
the summary and curves (``report.py``). The modes that train no run are in ``modes.py``. Exit codes:
``ExitCode`` (``recipes.runner.config.command_line``; docs/reference.md#exit-codes).
"""

import dataclasses

from handlers.graceful_stop import EXIT_CODES as STOP_EXIT_CODES
from recipes.runner.api import Recipe
from recipes.runner.config.command_line import ExitCode
from recipes.runner.config.registry import recipe_ref
from recipes.runner.config.run_keys import RunConfig
from recipes.runner.console import say, warn
from recipes.runner.resume.plan import COMPLETE, plan_resume
from recipes.runner.resume.same_run import continue_command
from recipes.runner.training.group import join_group, train_process
from recipes.runner.training.launch import (
    exit_process,
    how_to_continue,
    launched_by_torchrun,
    spawn,
    torchrun_group,
    warn_if_store_shared,
)
from recipes.runner.training.modes import overfit_run
from recipes.runner.training.peers import unless_peer_lost
from recipes.runner.training.start_checks import (
    FolderWriteError,
    check_recipe_keys,
    launch_of,
    locked_setup,
)
from recipes.runner.training.train import train


def run(recipe: Recipe, config: RunConfig, given: set[str], keys_from: str = "") -> int:
    """Train here, in ``--nproc`` spawned processes, or as one of the processes of torchrun.
    ``keys_from``: the run whose config.json gave the keys (``config.file.parse_start``)."""
    check_recipe_keys(recipe, config)
    if config.overfit_batches:
        return overfit_run(recipe, config)
    if launched_by_torchrun():
        warn_if_store_shared()
        with torchrun_group(launch_of(config).backend, config.collective_timeout):
            exit_code = unless_peer_lost(lambda: join_group(recipe, config, given, keys_from),
                                         config.collective_timeout, how_to_continue())
        exit_process(exit_code)
    plan = plan_resume(recipe.name, recipe.best, config, given, keys_from)
    for line in plan.notes:
        say(line)
    if plan.action == COMPLETE:
        say(plan.report)
        return 0
    config = plan.config
    try:
        with locked_setup(recipe, plan) as (started, lock):
            if config.nproc == 1:
                exit_code = train(recipe, config, started)
            else:  # every process holds the lock too: it outlives this one if this is killed
                exit_code = spawn(train_process, recipe_ref(recipe), dataclasses.asdict(config),
                                  started.run_dir, started.run_id, started.fingerprint,
                                  started.init_from, nproc=config.nproc,
                                  backend=launch_of(config).backend,
                                  collective_timeout=config.collective_timeout, lock=lock)
    except FolderWriteError as error:  # raised by the setup only: nothing has trained
        warn(f"error: {error}")
        return ExitCode.DISK
    if exit_code in STOP_EXIT_CODES.values():  # stopped by a signal once its step was saved
        say(f"stopped; to continue this run: {continue_command()}")
    return exit_code
