"""Crash-safe checkpoints: the newest, the best by a metric, and a short history.

The ``Checkpointer`` decides what is saved when, what retention keeps, and which file a run
resumes from; the format it is given (``handlers.checkpoint.formats``) writes and reads one
checkpoint. The policy is the same for both formats.
A save writes the .pt, then its sidecar, then switches ``last.pt``/``best.pt``, and only then
deletes what retention evicts: a crash at any instant leaves the previous checkpoint and its
sidecar untouched, and a half-written or half-switched pair fails verification, so the resume
falls back to the previous checkpoint. ``crash_points`` can kill a save at each of those
phases (test-only).

Written behind training (``asynchronous=True``, ``--async-checkpoint``), a save keeps that
order on a background thread (``background``): the step waits only for a copy of the state,
the write, its fsyncs, the sidecar, the link switch and the eviction follow behind it, and
the next save (or the run's end) first waits for them. A crash before the sidecar leaves the
previous checkpoint as ``last``, as it does a synchronous save.
"""

import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ignite.engine import Engine, Events

from engine.events import TrainEvents
from engine.trainer import Trainer
from handlers.arguments import check_int
from handlers.checkpoint.background import Background
from handlers.checkpoint.crash_points import CrashPoints
from handlers.checkpoint.files import (
    CHECKPOINT_NAME,
    FORMAT_VERSION,
    RESERVED_KEYS,
    CheckpointError,
    SingleFile,
    claimed_position,
    committed_checkpoints,
    sidecar_of,
    unloadable_entry,
)
from handlers.checkpoint.formats import CheckpointFormat
from handlers.goal import Goal

logger = logging.getLogger(__name__)
SaveHandler = Callable[[Engine], None]


class Committed(NamedTuple):
    """What a save, once committed, makes the checkpointer's own state."""

    history: list[str]
    best: list[dict[str, Any]]
    evict: list[str]
    last_iteration: int
    best_iteration: int


@dataclass(frozen=True)
class ResumeInfo:
    """What ``Checkpointer.resume`` loaded: the file, its ``meta``, and every newer
    candidate it passed over as ``(file, reason)``."""

    path: Path
    meta: dict[str, Any]
    rejected: list[tuple[str, str]]


class Checkpointer:
    """Writes ``last``, ``best`` and history checkpoints of everything in ``to_save``.

    ``to_save`` maps names to objects with ``state_dict``/``load_state_dict``; it must
    hold the ``"model"`` (whose weights are checked for NaN/inf before every save) and
    the ``"trainer"`` (its epoch, iteration and optimizer step name the files). Each
    checkpoint is ``{name: state_dict, ..., "checkpointer": retention state, "meta":
    {run_id, config, kind, epoch, iteration, optimizer_step, metric, saved_at_unix,
    format_version}}`` and loads with ``torch.load(path, weights_only=True)``.

    ``attach(trainer, evaluator=None)`` registers ``save_last`` on the trainer's
    ``TrainEvents.OPTIMIZER_STEP`` every ``save_every`` optimizer steps (when given; not at
    an epoch's last iteration: that one is saved at ``Events.EPOCH_COMPLETED``, after the
    epoch's evaluation, so a resumed run never skips an evaluation) and on
    ``Events.EPOCH_COMPLETED``, and, with a ``best`` goal and an evaluator, ``save_best``
    on the evaluator's ``Events.COMPLETED``. ``wrap_save`` wraps each save it registers
    (the run layer's makes a save a collective across processes); ``last_handler`` is the
    wrapped ``save_last``, for a handler that saves at other moments (a graceful stop).
    A save of the iteration just saved is skipped; so is one whose weights are not
    finite (with a warning). ``checkpoint_format`` writes and reads each checkpoint
    (default ``SingleFile()``: ``.pt`` files; ``ShardedFolder()``: ``.dcp`` folders, whose
    saves every process of the group makes together). A disk error (ENOSPC, EACCES,
    read-only folder) raises ``CheckpointError`` with the path and the OS reason, leaving
    the previous checkpoint intact and no temp file: training stops rather than run on
    without checkpoints.

    With ``asynchronous`` each save returns once the state is copied (into CPU memory; on the
    CPU, a copy of the tensors, which the next steps may then change) and is written and
    committed on a background thread; one save is in flight at a time: a new save first waits
    for the previous one to be committed, and ``wait()`` waits for it (``attach`` registers
    ``wait_handler``, the wrapped ``wait``, at the trainer's ``Events.COMPLETED``, so a run,
    stopped or not, ends with its last save committed). A disk error in the background is
    raised by the next save or ``wait()``: the same ``CheckpointError`` a synchronous save
    raises, the previous checkpoint still ``last``. ``checkpointer`` state (``state_dict()``)
    counts a save once it is committed.

    Example::

        ckpt = Checkpointer("runs/cifar/r1/checkpoints", {"model": model, "optimizer": opt,
                            "trainer": trainer, "rng": RngState()}, run_id=run_id,
                            best=Goal("accuracy", "max"), save_every=500)
        ckpt.resume("auto")  # None on a fresh folder
        ckpt.attach(trainer, evaluator)
    """

    def __init__(
        self,
        dirname: str | os.PathLike,
        to_save: Mapping[str, Any],
        *,
        run_id: str,
        config: dict[str, Any] | None = None,
        keep_last: int = 3,
        keep_best: int = 1,
        best: Goal | None = None,
        save_every: int | None = None,
        wrap_save: Callable[[SaveHandler], SaveHandler] | None = None,
        file_mode: int = 0o640,
        checkpoint_format: CheckpointFormat | None = None,
        asynchronous: bool = False,
    ) -> None:
        _check_to_save(to_save)
        if not isinstance(run_id, str) or not run_id:
            raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
        if config is not None and not isinstance(config, dict):
            raise ValueError(f"config must be a dict or None, got {type(config).__name__}")
        unloadable_config = None if config is None else unloadable_entry(config, "config")
        if unloadable_config:
            raise ValueError(f"config must hold plain values: {unloadable_config}")
        check_int("keep_last", keep_last, 1, "checkpoints")
        check_int("keep_best", keep_best, 1, "checkpoints")
        if best is not None and not isinstance(best, Goal):
            raise ValueError(f"best must be a Goal(metric, mode) or None, got {best!r}")
        if save_every is not None:
            check_int("save_every", save_every, 1, "optimizer steps")
        if isinstance(file_mode, bool) or not isinstance(file_mode, int) or (
            file_mode & ~0o777 or file_mode & 0o600 != 0o600
        ):
            raise ValueError(f"file_mode must be a permission such as 0o640 or 0o600 that lets "
                             f"the owner read and write, got {file_mode!r}")
        if not isinstance(asynchronous, bool):
            raise ValueError(f"asynchronous must be True or False, got {asynchronous!r}")
        self.dirname = Path(dirname)
        self.dirname.mkdir(parents=True, exist_ok=True)
        self.to_save, self.trainer = dict(to_save), to_save["trainer"]
        self.run_id, self.config = run_id, config
        self.keep_last, self.keep_best, self.best, self.save_every = (
            keep_last, keep_best, best, save_every)
        self.metric, self.mode = (best.metric, best.mode) if best else (None, None)
        wrap = wrap_save or (lambda save: save)
        self.last_handler, self.best_handler = wrap(self.save_last), wrap(self.save_best)
        self.wait_handler = wrap(self._wait_at_end)
        self.file_mode = file_mode
        self.format = checkpoint_format or SingleFile()
        self.asynchronous = asynchronous
        self._behind = Background()  # the save being written behind training
        self._saving: tuple[int, int] | None = None  # its (last, best) iterations once committed
        self._crash = CrashPoints()  # test-only fault injection, off unless its variable is set
        self._history: list[str] = []  # oldest first
        self._best: list[dict[str, Any]] = []  # {"file", "score"}, best first
        self._evict: list[str] = []  # committed as evicted, deletion not yet confirmed
        self._last_iteration = self._best_iteration = -1

    def attach(self, trainer: Engine, evaluator: Engine | None = None) -> None:
        """Register the saves; see the class docstring for the events."""
        if trainer is not self.trainer:
            raise ValueError("attach the Checkpointer to the trainer in its to_save")
        if evaluator is not None and self.best is not None:
            evaluator.add_event_handler(Events.COMPLETED, self.best_handler)
        if self.save_every is not None:
            trainer.add_event_handler(TrainEvents.OPTIMIZER_STEP, self._save_on_cadence)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self.last_handler)
        if self.asynchronous:
            trainer.add_event_handler(Events.COMPLETED, self.wait_handler)

    def _save_on_cadence(self, engine: Engine) -> None:
        """A plain test rather than an Ignite event filter, whose wrapper costs about three
        times as much at every step."""
        state = engine.state
        if state.optimizer_step % self.save_every == 0 and (
                state.iteration % state.epoch_length != 0):
            self.last_handler(engine)

    def save_last(self, engine: Engine) -> None:
        """Save the trainer's current state as ``step-<optimizer_step>.pt`` and ``last.pt``
        (``.dcp`` folders in the sharded format)."""
        if engine is not self.trainer:
            raise ValueError("save_last is a trainer handler; attach it to the trainer in to_save")
        if self._saved_as("last"):
            return  # e.g. OPTIMIZER_STEP(every=N) and EPOCH_COMPLETED at the same iteration
        self.wait()  # the retention lists below are those of the last committed save
        name = f"step-{self.trainer.state.optimizer_step:08d}{self.format.suffix}"
        history = [kept for kept in self._history if kept != name] + [name]
        self._commit(name, "last", history[-self.keep_last:], self._best,
                     evicted=history[:-self.keep_last], score=None)

    def save_best(self, evaluator: Engine) -> None:
        """Save the trainer's state as ``best-step-<optimizer_step>.pt`` when
        ``evaluator.state.metrics[metric]`` is among the ``keep_best`` best; a
        non-finite score never is."""
        if self.best is None:
            raise ValueError("save_best needs Checkpointer(best=Goal(...)) to rank checkpoints")
        score = self.best.score(evaluator)  # once per evaluation
        if self._saved_as("best"):
            return
        if not math.isfinite(score):
            logger.warning("%s=%s is not finite: not a best checkpoint", self.metric, score)
            return
        self.wait()  # the ranking below is that of the last committed save
        name = f"best-step-{self.trainer.state.optimizer_step:08d}{self.format.suffix}"
        ranked = [entry for entry in self._best if entry["file"] != name]
        ranked.append({"file": name, "score": score})
        # A stable sort: a score equal to an earlier one ranks below it.
        ranked.sort(key=lambda entry: entry["score"], reverse=self.mode == "max")
        kept = ranked[:self.keep_best]
        if all(entry["file"] != name for entry in kept):
            return
        self._commit(name, "best", self._history, kept,
                     evicted=[entry["file"] for entry in ranked[self.keep_best:]], score=score)

    def wait(self) -> None:
        """Wait for the save being written behind training (``asynchronous``) to be committed;
        raise its ``CheckpointError`` if it failed (or, for a format whose saves every process
        makes, a ``CheckpointError`` saying that another process's failed). At once when none
        is in flight; every process calls it at the same points, as it does the saves."""
        if not self.asynchronous:
            return
        error = None
        try:
            self._behind.wait()
        except CheckpointError as raised:
            error = raised
        finally:
            self._saving = None
        if self.format.failed_anywhere(error is not None) and error is None:
            error = CheckpointError(self.dirname, "another process could not save it")
        if error is not None:
            raise error

    def _wait_at_end(self, engine: Engine) -> None:
        """``wait()`` as a trainer handler (``wait_handler``, wrapped as the saves are)."""
        if self._behind.busy:
            self._crash.reach("final_wait")
        self.wait()

    def _saved_as(self, kind: str) -> bool:
        """Whether the trainer's iteration is already saved, or being saved, as ``kind`` (a
        best checkpoint is the newest too: it also counts as ``last``)."""
        last, best = self._saving or (self._last_iteration, self._best_iteration)
        return self.trainer.state.iteration == (last if kind == "last" else best)

    def resume(
        self, source: str | os.PathLike = "auto", *, require_same_run: bool = True
    ) -> ResumeInfo | None:
        """Load a verified checkpoint into every ``to_save`` object (and this checkpointer).

        ``"never"``: load nothing, return None. A path: exactly that file, or
        ``CheckpointError``. ``"auto"``: the newest good one in the folder, trying
        ``last.pt``, then history and best files newest first, then ``best.pt``;
        each rejected one is logged with its reason; None when the folder holds no
        checkpoint, or only .pt files without a sidecar (a first save that was killed
        before its commit), ``CheckpointError`` when it holds only bad ones. With
        ``require_same_run`` a checkpoint whose run id is not ``run_id`` is refused.
        """
        if source == "never":
            return None
        expected = {"expected_run_id": self.run_id if require_same_run else None,
                    "required_keys": tuple(self.to_save)}
        if source != "auto":
            path = Path(source)
            return self._restore(path, self.format.read(path, **expected), rejected=[])
        self._remove_stale_temp_files()  # left by a save that was killed
        candidates = self._candidates_newest_first()
        self._refuse_other_format(candidates)
        if not candidates:
            logger.debug("no checkpoint in %s: starting fresh", self.dirname)
            return None
        if not committed_checkpoints(self.dirname):
            # A run killed inside its first save: the .pt was never committed (its sidecar is
            # written after it) and last.pt never linked, so no checkpoint exists yet. With
            # last.pt or any sidecar present something was committed: a bad file is an error.
            logger.warning("no committed checkpoint in %s (%s never got its sidecar: the first "
                           "save was interrupted): starting fresh", self.dirname,
                           ", ".join(path.name for path in candidates))
            return None
        rejected: list[tuple[str, str]] = []
        for path in candidates:
            try:
                payload = self.format.read(path, **expected)
            except CheckpointError as err:
                logger.warning("checkpoint %s rejected: %s; trying an older one", path, err.reason)
                rejected.append((str(path), err.reason))
                continue
            return self._restore(path, payload, rejected)
        reasons = "; ".join(f"{Path(name).name}: {reason}" for name, reason in rejected)
        raise CheckpointError(self.dirname, f"no usable checkpoint ({reasons})")

    def state_dict(self) -> dict[str, Any]:
        return self._state(self._history, self._best, self._evict, self._last_iteration,
                           self._best_iteration)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = {"history", "best", "evict", "last_iteration", "best_iteration", "metric",
                   "mode"} - state.keys()
        if missing:
            raise ValueError(f"checkpointer state is missing {sorted(missing)}")
        if state["best"] and (state["metric"], state["mode"]) != (self.metric, self.mode):
            raise ValueError(f"the checkpoint ranked best by metric={state['metric']!r} "
                             f"mode={state['mode']!r}, this run by metric={self.metric!r} "
                             f"mode={self.mode!r}; keep them or start a new run")
        self._history, self._evict = list(state["history"]), list(state["evict"])
        self._best = [dict(entry) for entry in state["best"]]
        self._last_iteration = state["last_iteration"]
        self._best_iteration = state["best_iteration"]

    def _state(self, history, best, evict, last_iteration, best_iteration) -> dict[str, Any]:
        return {"history": list(history), "best": [dict(entry) for entry in best],
                "evict": list(evict), "last_iteration": last_iteration,
                "best_iteration": best_iteration, "metric": self.metric, "mode": self.mode}

    def _commit(self, name: str, kind: str, history: list[str], best: list[dict[str, Any]],
                evicted: list[str], score: float | None) -> None:
        state, path = self.trainer.state, self.dirname / name
        try:  # a state_dict may write: the logger's appends metrics.jsonl, which a disk refuses
            payload = self.format.snapshot(self.to_save)
        except OSError as err:
            raise CheckpointError(path, f"could not save: {err}") from err
        if not self.asynchronous:  # behind training, the format checks (write_behind)
            bad_tensor = self.format.first_non_finite(payload["model"])
            if bad_tensor is not None:
                _warn_not_finite(path, bad_tensor, state.iteration)
                return
        best_iteration = state.iteration if kind == "best" else self._best_iteration
        # Deletion happens after the commit: the pending list goes into the checkpoint, so
        # a crash mid-eviction is finished by the next save after resuming from it.
        evict = [old for old in dict.fromkeys(self._evict + evicted) if old != name]
        payload["checkpointer"] = self._state(history, best, evict, state.iteration, best_iteration)
        meta = {"format_version": FORMAT_VERSION, "run_id": self.run_id, "kind": kind,
                "epoch": state.epoch, "iteration": state.iteration,
                "optimizer_step": state.optimizer_step,
                "metric": None if score is None else {"name": self.metric, "value": score},
                "saved_at_unix": time.time()}
        payload["meta"] = {**meta, "config": self.config}
        unloadable = self.format.unloadable(payload)
        if unloadable:
            raise CheckpointError(path, unloadable)
        self._crash.save_started()
        last, best_link = (self.dirname / link for link in self._link_names)
        links = [last, *([best_link] if best and best[0]["file"] == name else [])]
        committed = Committed(history, best, evict, state.iteration, best_iteration)
        if not self.asynchronous:
            self._write_and_commit(path, links, committed, lambda: self.format.write(
                path, payload, meta, file_mode=self.file_mode, crash=self._crash))
            return
        try:
            write = self.format.write_behind(path, payload, meta, file_mode=self.file_mode,
                                             crash=self._crash)
        except OSError as err:
            raise CheckpointError(path, f"could not save: {err}") from err
        self._crash.reach("after_copy")
        self._saving = (state.iteration, best_iteration)
        self._behind.start(lambda: self._write_and_commit(path, links, committed, write))

    def _write_and_commit(self, path: Path, links: list[Path], committed: Committed,
                          write: Callable[[], str | None]) -> None:
        """``write()`` the checkpoint (file or folder, then its sidecar), switch ``links`` to
        it, take on ``committed`` (the retention lists and iterations it holds) and delete
        what retention evicted; on the background thread when ``asynchronous``, where
        ``write()`` returns the name of a model tensor that is not finite, having written
        nothing."""
        if self.asynchronous:
            self._crash.reach("background_start")
        try:
            bad_tensor = write()
            if bad_tensor is not None:
                _warn_not_finite(path, bad_tensor, committed.last_iteration)
                return
            self._crash.reach("before_link")
            self.format.link(path, links)
        except OSError as err:
            raise CheckpointError(path, f"could not save: {err}") from err
        (self._history, self._best, self._evict, self._last_iteration,
         self._best_iteration) = committed
        self._delete_evicted()

    @property
    def _link_names(self) -> tuple[str, str]:
        return f"last{self.format.suffix}", f"best{self.format.suffix}"

    def _delete_evicted(self) -> None:
        still_pending = []
        for name in self._evict:
            try:
                self.format.delete(self.dirname / name, self._crash)
            except OSError as err:
                logger.warning("could not delete evicted checkpoint %s (retrying at the next "
                               "save): %s", name, err)
                still_pending.append(name)
        self._evict = still_pending

    def _candidates_newest_first(self) -> list[Path]:
        ranked = []
        last, best = self._link_names
        for path in self.dirname.iterdir():
            named = CHECKPOINT_NAME.match(path.name)
            if path.name in (last, best) or (named and path.suffix == self.format.suffix):
                kind_order = 2 if path.name.startswith("best-") else 1  # history before best
                order = {last: 0, best: 3}.get(path.name, kind_order)
                step, iteration = claimed_position(path)
                ranked.append((-step, -iteration, order, path))
        return [path for *_, path in sorted(ranked)]

    def _refuse_other_format(self, candidates: list[Path]) -> None:
        """A folder of the other format's checkpoints (a run that saved sharded folders
        resumed as single files, or the other way round) is an error, not a fresh start."""
        other = sorted(path.name for path in self.dirname.iterdir()
                       if CHECKPOINT_NAME.match(path.name)
                       and path.suffix != self.format.suffix and sidecar_of(path).exists())
        if other and not candidates:
            raise CheckpointError(self.dirname, f"holds checkpoints of another format ({other[-1]}"
                                                f"), this run reads {self.format.suffix} ones")

    def _remove_stale_temp_files(self) -> None:
        for path in self.format.stale_temps(self.dirname):
            logger.info("removing %s, left by an interrupted save", path)
            self.format.remove(path)

    def _restore(self, path: Path, payload: dict[str, Any], rejected: list[tuple[str, str]]
                 ) -> ResumeInfo:
        targets = dict(self.to_save)
        same_folder = path.parent.resolve() == self.dirname.resolve()
        if payload["meta"]["run_id"] == self.run_id and same_folder:
            targets["checkpointer"] = self  # retention and best ranking go on where they were
        self.format.restore(path, payload, targets)
        if targets.get("checkpointer") is self:
            self._delete_evicted()  # finish the eviction of a save that was killed midway
        unused = sorted(payload.keys() - targets.keys() - set(RESERVED_KEYS))
        if unused:
            logger.warning("%s also holds %s, which this run does not restore", path, unused)
        meta = payload["meta"]
        logger.info("resumed from %s (epoch %d, iteration %d, step %d)", path,
                    meta["epoch"], meta["iteration"], meta["optimizer_step"])
        return ResumeInfo(path, meta, rejected)


def _warn_not_finite(path: Path, tensor: str, iteration: int) -> None:
    logger.warning("not saving %s: model tensor %r is not finite (NaN/inf) at iteration %d",
                   path, tensor, iteration)


def _check_to_save(to_save: Mapping[str, Any]) -> None:
    if not isinstance(to_save, Mapping) or "model" not in to_save or "trainer" not in to_save:
        raise ValueError("to_save must be a dict holding at least 'model' and 'trainer'")
    if not isinstance(to_save["trainer"], Trainer):
        raise ValueError(f"to_save['trainer'] must be the Trainer from create_trainer, got "
                         f"{type(to_save['trainer']).__name__}")
    for key, obj in to_save.items():
        if not isinstance(key, str) or key in RESERVED_KEYS:
            raise ValueError(f"to_save key {key!r} is not allowed: use a string other than "
                             f"{', '.join(RESERVED_KEYS)}")
        if not (callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))):
            raise ValueError(f"to_save[{key!r}] has no state_dict()/load_state_dict()")
