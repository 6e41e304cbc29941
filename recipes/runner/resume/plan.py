"""Whether this start continues a run, from which checkpoint, with which overrides, or starts
afresh (from ``--init-from``'s weights or from scratch), and why: decided here and nowhere else.

``plan_resume`` reads the run folder (``config.json``, else its newest checkpoint that
verifies), the ``--resume`` request and torchrun's restart count, and returns a
``ResumePlan``: a value holding every decision, its reason, the lines that tell it and the
settled config (the caller's config is never written; the precedence of a key's values is
docs/reference.md#precedence). The rest of the run layer carries the plan out: the start
checks verify its checkpoint file and write its run id, every process loads the checkpoint
``plan.config.resume`` names (``Checkpointer.resume``: ``auto`` is the newest that
verifies) and the ``--init-from`` weights the plan names.

The rules (README, "Resuming"):

- torchrun restarted the group: ``--resume auto``, whatever the first start asked (a file
  would go back to an older step, ``never`` would start the run over;
  ``recipes.runner.training.launch``);
- a command that names no folder continues the newest run of the same keys
  (``same_run.py``); ``--resume never`` starts a new one; keys
  taken from a run folder's config.json never find that run itself (they start one of
  their own, which the same command then continues);
- ``--resume never`` refuses a folder that holds checkpoints (it would mix two runs);
- a folder whose summary.json says completed (found or named, ``--resume auto``) is
  reported complete before anything is built, loaded or written;
- a folder with a ``config.json`` (or a checkpoint that holds its copy) continues that run:
  its run id, its keys unless given again (``override:`` lines), its data;
- ``--init-from`` applies to a fresh run only: no committed checkpoint in the folder and no
  ``--resume <file>``.
"""

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.run_state import new_run_id
from handlers.checkpoint.files import committed_checkpoints
from recipes.runner.config.command_line import FOLDER_KEYS, ConfigError, resume_overrides
from recipes.runner.config.run_keys import RunConfig
from recipes.runner.resume.request import read_saved_config, saved_in_checkpoints, without_requests
from recipes.runner.resume.same_run import (
    RUN_REQUESTS,
    new_timestamp_folder,
    newest_same_run,
    report_if_complete,
    resolve_run_dir,
)
from recipes.runner.training.launch import launched_by_torchrun, restart_count

CONTINUE, FRESH, COMPLETE = "continue", "fresh", "complete"
TRAIN_AGAIN = "--resume never (a new timestamped folder) or a --run-name"


@dataclass(frozen=True)
class ResumePlan:
    """What this start does. ``action``: ``continue`` (the run in ``run_dir``, from the
    checkpoint ``config.resume`` names: ``auto`` is the newest that verifies, else a file),
    ``fresh`` (a new run, from ``init_from``'s weights when set) or ``complete`` (nothing to
    train: ``report`` says so and ends the command). ``reason`` says why, in words;
    ``config`` is the settled config the run trains with (its folder, the saved keys a
    continued run takes back, ``--resume auto`` after a torchrun restart); ``notes`` are
    the lines that tell the user what was chosen, printed by whoever carries the plan out."""

    action: str
    run_dir: Path
    reason: str
    config: RunConfig
    run_id: str = ""
    saved: dict[str, Any] | None = None  # the run's config.json (or its checkpoint's copy)
    notes: tuple[str, ...] = ()  # "continuing <folder>", "override: key old -> new", ...
    init_from: str = ""  # the weights a fresh run begins with
    init_ignored: str = ""  # the line that says why a given --init-from is not taken
    report: str = ""

    @property
    def source(self) -> str:
        """The checkpoint a continued run loads: ``auto``, ``never`` or a file."""
        return self.config.resume


def plan_resume(recipe: str, best: str, config: RunConfig, given: set[str],
                keys_from: str = "") -> ResumePlan:
    """Decide this start (see the module's rules) and return it with the settled config;
    ``config`` itself is not written. ``keys_from``: the id of the run whose config.json gave
    the keys, never continued unless named. Raises ``ConfigError`` for a start that cannot be
    carried out."""
    notes: list[str] = []
    if launched_by_torchrun() and restart_count() and config.resume != "auto":
        notes.append(f"torchrun restart {restart_count()}: --resume {config.resume} becomes "
                     "auto (the newest good checkpoint of the run)")
        config = dataclasses.replace(config, resume="auto")
    if "run_name" in given and not config.run_name:
        raise ConfigError("--run-name: must not be empty; leave it out for a timestamp")
    if config.run_dir or config.run_name or given & {"run_dir", "run_name"}:
        run_dir = resolve_run_dir(recipe, config.run_name, config.run_dir)
        where, train_again = "the folder named by --run-name or --run-dir", "another --run-name"
    else:
        found = None if config.resume == "never" else newest_same_run(recipe, config, keys_from)
        train_again = TRAIN_AGAIN
        if found is None:
            run_dir = new_timestamp_folder(recipe)
            where = ("--resume never: a new timestamped folder" if config.resume == "never"
                     else "no earlier run of these keys: a new timestamped folder")
        else:
            run_dir, where = found, "the newest run of these keys"
            notes.append(f"continuing {found} (the newest run of this command; --resume never "
                         "starts a new one)")
    config = dataclasses.replace(config, run_dir=str(run_dir))
    return _plan_in(recipe, best, run_dir, config, given, where, train_again, notes)


def _plan_in(recipe: str, best: str, run_dir: Path, config: RunConfig, given: set[str],
             where: str, train_again: str, notes: list[str]) -> ResumePlan:
    """The plan once the folder is known: report it complete, continue what it holds, or
    start afresh."""
    if config.resume == "never":
        if committed_checkpoints(run_dir / "checkpoints"):
            raise ConfigError(f"--resume never: {run_dir} already holds checkpoints; use "
                              "--resume auto to continue it or another --run-name to start "
                              "anew")
        return _fresh(run_dir, config, given, f"{where}; --resume never", notes)
    saved = without_requests(read_saved_config(run_dir)
                             or saved_in_checkpoints(run_dir / "checkpoints"))
    if saved is None:
        return _fresh(run_dir, config, given, f"{where} holds no run", notes)
    _refuse_another_recipe(recipe, run_dir, saved, config)
    settled, overrides = resume_overrides(saved["config"], config, given)
    report = _completed_report(run_dir, best, saved["config"], settled, train_again)
    if report is not None:  # nothing is continued: only the report is said
        return ResumePlan(COMPLETE, run_dir, f"{where}: its summary says completed", settled,
                          run_id=saved["run_id"], saved=saved, report=report)
    source = ("the checkpoint given by --resume" if config.resume != "auto"
              else "its newest checkpoint that verifies, if any")
    return ResumePlan(CONTINUE, run_dir, f"{where} holds run {saved['run_id']}: from {source}",
                      settled, run_id=saved["run_id"], saved=saved,
                      notes=(*notes, *overrides), **_init_from(run_dir, settled, given))


def _completed_report(run_dir: Path, best: str, saved: dict[str, Any], settled: RunConfig,
                      train_again: str) -> str | None:
    """The report of a run whose summary.json says it completed, for ``--resume auto`` with
    the keys it completed with: the one evidence of "complete", whether the folder was named
    or found by its keys. A changed key (``--epochs 20`` trains on, ``--lr`` re-plans) is a
    continuation; so is a run killed after its final checkpoint but before its summary: its
    loaded state has no step left, and it writes its end again."""
    changed = {key for key, value in saved.items()
               if key not in (*RUN_REQUESTS, *FOLDER_KEYS)
               and getattr(settled, key, value) != value}
    if settled.resume != "auto" or changed:
        return None
    return report_if_complete(run_dir, best, train_again)


def _refuse_another_recipe(recipe: str, run_dir: Path, saved: dict[str, Any],
                           config: RunConfig) -> None:
    """A folder of another recipe's run is an error, named as such, before anything in it is
    written: its config.json says whose it is (``recipe``), or for a folder written before
    it did, its keys that this recipe lacks do."""
    owner = saved.get("recipe")
    if owner is not None and owner != recipe:
        raise ConfigError(f"{run_dir} is a {owner} run; this is {recipe} (to continue it: "
                          f"python -m recipes {owner} --run-dir {run_dir}; or give another "
                          "--run-dir or --run-name)")
    extra = sorted(saved.get("config", {}).keys()
                   - {spec.name for spec in dataclasses.fields(config)})
    if owner is None and extra:
        raise ConfigError(f"{run_dir} is not a {recipe} run: its config has keys {recipe} "
                          f"lacks ({', '.join(extra[:5])}); give another --run-dir or "
                          "--run-name")


def _fresh(run_dir: Path, config: RunConfig, given: set[str], why: str, notes: list[str]
           ) -> ResumePlan:
    return ResumePlan(FRESH, run_dir, why, config, run_id=new_run_id(), notes=tuple(notes),
                      **_init_from(run_dir, config, given))


def _init_from(run_dir: Path, config: Any, given: set[str]) -> dict[str, str]:
    """``--init-from`` when this start takes it, else why a given one is ignored."""
    if fresh_init_from(config, run_dir):
        return {"init_from": config.init_from}
    if "init_from" in given and config.init_from:
        source = (f"--resume {config.resume}" if config.resume not in ("auto", "never")
                  else f"the checkpoints of {run_dir}, which already started")
        return {"init_ignored": f"--init-from ignored: this run resumes from {source}"}
    return {}


def fresh_init_from(config: Any, run_dir: Path) -> str:
    """The ``--init-from`` weights of a start in ``run_dir``, or "" when it does not take
    them: not given, ``--resume <file>``, or the folder holds a committed checkpoint
    (``last.pt``, ``last.dcp`` or a sidecar: a first save killed before its sidecar leaves
    none). The modes that train no run (``--lr-find``, ``--describe``) ask this alone."""
    started = bool(committed_checkpoints(run_dir / "checkpoints"))
    return config.init_from if (config.init_from and config.resume in ("auto", "never")
                                and not started) else ""
