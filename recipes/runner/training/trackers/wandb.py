"""``--tracker wandb``: the run as a Weights & Biases run, offline by default.

Offline (W&B's ``mode="offline"``), W&B writes the run under ``<dir>/wandb/offline-run-*-<id>/``
and nothing leaves the machine; ``wandb sync <that folder>`` uploads it later. ``WANDB_MODE``
set by the user wins (``online`` logs to the server at once). ``<dir>`` is ``--tracker-uri``
(a folder), else ``WANDB_DIR``, else the folder an earlier start of this run folder used, else
the run folder itself. The W&B project is the recipe's name (``WANDB_PROJECT`` wins), the W&B
run's name the run folder's.

The W&B run holds the resolved config (with ``recipe``, ``run_id``, ``run_dir`` and
``git_revision`` under ``run``), every scalar TensorBoard gets, plotted against
``optimizer_step`` (a metric of its own rather than W&B's step, which must only grow: a
resume after a kill redoes the steps since its checkpoint and a spike-guard rollback goes
back), and at the end the best checkpoint and ``curves.png`` as run files. Scalars go out at
the logger's flushes (every checkpoint, evaluation and epoch end), as with MLflow.

A resumed run continues the same W&B run: ``wandb.json`` in the run folder keeps its id and
folder. Offline, each start of the run folder writes one more ``offline-run-*-<id>`` folder;
``wandb sync`` uploads them into the one W&B run, oldest first.

W&B's capture of the console is off (the run's own output, tqdm included, stays as it is),
and so is its reading of git (the run folder is no checkout; the revision is in the config).
"""

import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from handlers.atomic_write import write_json_atomic
from recipes.runner.config.command_line import ConfigError
from recipes.runner.console import warn
from recipes.runner.training.trackers import TrackedRun, saved_state, unwritable

STATE_FILE = "wandb.json"  # in the run folder: the W&B run that a resume continues
STEP_METRIC = "optimizer_step"  # the x axis of every scalar
DEFAULT_MODE = "offline"  # no account or network needed; `wandb sync` uploads later
MODES = ("offline", "online", "disabled")  # what WANDB_MODE may say here
# The run's status -> W&B's exit code: 255 is what W&B's own client gives a Ctrl-C (W&B
# shows the run killed: the same command continues it); anything else failed.
EXIT_CODES = {"completed": 0, "interrupted": 255}
# W&B's wait for its run to start (default 90 s); online against a closed port W&B still
# took about a minute to give up, in steps of its own.
INIT_TIMEOUT_S = 30


def check(config: Any, run_dir: Path) -> None:
    """W&B installed, ``WANDB_MODE`` one this tracker knows, and the folder W&B would write
    in writable (or creatable); nothing is written."""
    try:
        import wandb  # noqa: F401 - the run would import it next; a broken install fails here
    except ImportError:
        raise ConfigError("--tracker wandb: Weights & Biases is not installed; pip install -e "
                          "'.[wandb]', or leave --tracker at none") from None
    mode = os.environ.get("WANDB_MODE", DEFAULT_MODE)
    if mode not in MODES:
        raise ConfigError(f"--tracker wandb: WANDB_MODE={mode!r} is not one of "
                          f"{', '.join(MODES)}")
    folder = wandb_dir(config.tracker_uri, run_dir)
    problem = unwritable(folder)
    if problem:
        raise ConfigError(f"--tracker wandb: cannot write W&B's files in {folder}: {problem}")


def wandb_dir(given: str, run_dir: Path) -> Path:
    """The folder W&B writes its ``wandb/`` folder in: ``given``, else ``WANDB_DIR``, else
    the one in the run folder's ``wandb.json``, else the run folder (absolute: a resume from
    elsewhere finds the same one)."""
    chosen = (given or os.environ.get("WANDB_DIR") or saved_state(run_dir / STATE_FILE).get("dir")
              or str(run_dir))
    return Path(chosen).expanduser().resolve()


def start(run: TrackedRun) -> "WandbTracker | None":
    """Open the W&B run (or continue the one in ``wandb.json``) with the config, and record
    it in ``wandb.json``; None after one warning line when W&B refuses."""
    import wandb

    folder = wandb_dir(run.config.get("tracker_uri", ""), run.run_dir)
    saved = saved_state(run.run_dir / STATE_FILE)
    mode = os.environ.get("WANDB_MODE", DEFAULT_MODE)
    meta = {"recipe": run.recipe, "run_id": run.run_id, "run_dir": str(run.run_dir.resolve())}
    if run.git:
        meta["git_revision"] = run.git["commit"] + ("+dirty" if run.git.get("dirty") else "")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        wandb_run = wandb.init(
            dir=str(folder), mode=mode, project=os.environ.get("WANDB_PROJECT", run.recipe),
            name=run.run_dir.name, id=saved.get("run_id"), resume="allow",
            config={**run.config, "run": meta}, allow_val_change=True,
            settings=wandb.Settings(console="off", silent=True, disable_git=True,
                                    save_code=False, init_timeout=INIT_TIMEOUT_S))
        wandb_run.define_metric(STEP_METRIC, hidden=True)
        wandb_run.define_metric("*", step_metric=STEP_METRIC)
    except Exception as error:  # noqa: BLE001 - any failure of the tracker: the run goes on
        _warn(f"cannot start a run in {mode} mode ({_one_line(error)}); the run goes on "
              "without W&B")
        return None
    write_json_atomic(run.run_dir / STATE_FILE, {"dir": str(folder), "run_id": wandb_run.id})
    return WandbTracker(wandb_run, mode)


class WandbSink:
    """A scalar sink (``handlers.scalar_sink``) into one W&B run: ``write`` keeps the record
    as it came (nothing among the step's work), ``flush`` logs what it holds, one
    ``run.log`` a record (W&B's client hands each to its own process and returns). The first
    failure costs one warning line; the sink then drops what it gets."""

    def __init__(self, wandb_run: Any) -> None:
        self.run = wandb_run
        self.failed = False
        self._records: list[tuple[int, Mapping[str, float]]] = []

    def write(self, step: int, epoch: int, wall_time: float,
              scalars: Mapping[str, float]) -> None:
        if not self.failed:
            self._records.append((step, scalars))

    def flush(self) -> None:
        records, self._records = self._records, []
        if self.failed:
            return
        try:
            for step, scalars in records:
                self.run.log({**scalars, STEP_METRIC: step})
        except Exception as error:  # noqa: BLE001 - the run goes on without the tracker
            self.fail(error)

    def close(self) -> None:
        self.flush()

    def fail(self, error: Exception) -> None:
        self.failed = True
        self._records = []
        _warn(f"logging failed ({_one_line(error)}); the run goes on without W&B")


class WandbTracker:
    """An open W&B run: its scalar sink, and ``finish`` for the run files and exit code."""

    def __init__(self, wandb_run: Any, mode: str) -> None:
        self.run, self.mode = wandb_run, mode
        self.sink = WandbSink(wandb_run)

    def finish(self, status: str, artifacts: Mapping[str, Path]) -> None:
        """Add ``artifacts`` (path in the W&B run -> file; missing files are left out) to the
        run's files, the run's status to its summary, and end it with the status's exit
        code (``EXIT_CODES``; 1, failed, for any other)."""
        self.sink.close()
        if self.sink.failed:
            return
        try:
            files = Path(self.run.dir)
            for name, path in artifacts.items():
                if path.is_file():  # a link, not a copy: a checkpoint can be large
                    link = files / name
                    link.parent.mkdir(parents=True, exist_ok=True)
                    link.unlink(missing_ok=True)
                    link.symlink_to(path.resolve())
                    self.run.save(str(link), base_path=str(files), policy="end")
            self.run.summary["status"] = status
            self.run.finish(exit_code=next((code for key, code in EXIT_CODES.items()
                                            if status.startswith(key)), 1))
            # W&B's own process writes the run file; finish() returns before it is on disk,
            # and the run's process may end at once (os._exit): wait for that process.
            import wandb

            wandb.teardown()
        except Exception as error:  # noqa: BLE001 - the run's own files are written already
            self.sink.fail(error)

    def closing_line(self) -> str | None:
        """Where the W&B run went: offline, its folder and the command that uploads it;
        None when logging failed (a warning said so) or W&B was disabled."""
        if self.sink.failed or self.mode == "disabled":
            return None
        if self.mode == "offline":
            runs = Path(self.run.settings.sync_dir).parent
            return (f"  wandb    run {self.run.id} offline in {runs} (upload: wandb sync "
                    f"{shlex.quote(str(runs))}/offline-run-*-{self.run.id})")
        return f"  wandb    run {self.run.id} (browse: {self.run.url})"


def _one_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def _warn(message: str) -> None:
    warn(f"warning: W&B: {message}", flush=True)
