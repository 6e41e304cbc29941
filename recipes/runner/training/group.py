"""A run on several processes: what each process runs (``train_process``, for ``--nproc``'s
spawned processes and torchrun's alike) and the protocol of a torchrun group, where rank 0
plans and checks the start and tells every rank the outcome, the run folder's absolute path
among it."""

import dataclasses
import json
from pathlib import Path
from typing import Any

import ignite.distributed as idist

from handlers.graceful_stop import EXIT_CODES as STOP_EXIT_CODES
from recipes.runner.api import Recipe
from recipes.runner.config.command_line import ConfigError, ExitCode
from recipes.runner.config.registry import load_recipe, recipe_ref
from recipes.runner.config.run_keys import RunConfig
from recipes.runner.console import say, speak_for_libraries, warn
from recipes.runner.resume.plan import COMPLETE, plan_resume
from recipes.runner.training.launch import (
    USER_ERRORS,
    process_device,
    rank_zero_exit_code,
    share_machine,
)
from recipes.runner.training.lock import RunLock
from recipes.runner.training.start_checks import FolderWriteError, Started, setup
from recipes.runner.training.train import train


def join_group(recipe: Recipe, config: RunConfig, given: set[str], keys_from: str = ""
               ) -> int:
    """Rank 0 plans the start (the same command again continues its run), checks everything,
    locks and writes the folder, then tells every rank the run (or that it is already
    complete, so that all exit 0, or the user error, so that all exit 2); each trains."""
    started, lock = "", None
    if idist.get_rank() == 0:
        try:
            plan = plan_resume(recipe.name, recipe.best, config, given, keys_from)
            for line in plan.notes:
                say(line)
            if plan.action == COMPLETE:
                started = json.dumps({"complete": plan.report})
            else:
                lock = RunLock(plan.run_dir)
                ready = setup(recipe, plan, lock)
                # Absolute: each machine's processes run in a working folder of their own,
                # where a relative path would name another folder (the shards they write, the
                # checkpoint rank 0 picks for them to load).
                started = json.dumps({"run_dir": str(ready.run_dir.absolute()),
                                      "run_id": ready.run_id,
                                      "data": ready.fingerprint, "init_from": ready.init_from,
                                      "config": dataclasses.asdict(plan.config)})
        except USER_ERRORS as error:
            started = json.dumps({"error": str(error)})
        except FolderWriteError as error:
            started = json.dumps({"disk": str(error)})
    started = json.loads(idist.broadcast(started, src=0))
    if "error" in started:
        raise ConfigError(started["error"])
    if "disk" in started:
        if idist.get_rank() == 0:
            warn(f"error: {started['disk']}")
        return ExitCode.DISK
    if "complete" in started:
        if idist.get_rank() == 0:
            say(started["complete"])
        return 0
    try:
        exit_code = train_process(idist.get_local_rank(), recipe_ref(recipe), started["config"],
                                  Path(started["run_dir"]), started["run_id"], started["data"],
                                  started["init_from"])
        if exit_code in STOP_EXIT_CODES.values():  # rank 0's: the others return 0
            # sys.orig_argv here is this worker's, not the torchrun command that started it
            say("stopped; to continue this run, run the same torchrun command again "
                f"(or add --run-dir {started['run_dir']})")
        return exit_code
    finally:
        if lock is not None:
            lock.release()


def train_process(local_rank: int, ref: str, config: dict[str, Any], run_dir: Path,
                  run_id: str, fingerprint: dict[str, Any], init_from: str = "") -> int:
    """One process of a group: it loads the data itself (loading is deterministic, so all
    hold the same data) and trains on its rank's slice of each batch."""
    speak_for_libraries(idist.get_rank())
    recipe = load_recipe(ref)
    resolved = recipe.config(**config)
    share_machine(process_device(resolved.device))
    data = recipe.load_data(resolved)
    return rank_zero_exit_code(train(recipe, resolved, Started(run_dir, run_id, fingerprint,
                                                               data, init_from)))
