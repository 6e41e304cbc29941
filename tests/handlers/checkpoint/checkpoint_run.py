"""Tiny checkpointed runs and the damage done to their files, shared by the checkpointer's
tests (test_checkpoint_*.py)."""

import errno
import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from ignite.engine import Engine, Events
from torch import nn

from engine.events import TrainEvents
from engine.run_state import RngState
from engine.trainer import Trainer, create_trainer
from handlers.checkpoint.checkpointer import Checkpointer
from handlers.checkpoint.files import CheckpointError
from handlers.checkpoint.formats import read_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[3]


def _batches(n_batches: int, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=generator), torch.randint(0, 3, (4,), generator=generator))
            for _ in range(n_batches)]


DATA = _batches(4)


@dataclass
class Run:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    trainer: Trainer
    ckpt: Checkpointer


def _build(dirname, seed=0, run_id="run-a", with_rng=True, **ckpt_kwargs) -> Run:
    """A tiny model whose Dropout makes the result depend on torch's global RNG."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = create_trainer(model, optimizer, nn.CrossEntropyLoss())
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer}
    if with_rng:
        to_save["rng"] = RngState()
    ckpt = Checkpointer(dirname, to_save, run_id=run_id, **ckpt_kwargs)
    return Run(model, optimizer, trainer, ckpt)


def _save_every_step(run: Run) -> Run:
    run.trainer.add_event_handler(TrainEvents.OPTIMIZER_STEP(every=1), run.ckpt.save_last)
    run.trainer.add_event_handler(Events.EPOCH_COMPLETED, run.ckpt.save_last)
    return run


def _move_trainer_to(run: Run, step: int) -> None:
    """Script the trainer's position, as if it had run ``step`` iterations and steps."""
    run.trainer.state.iteration = run.trainer.state.optimizer_step = step


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def _names(dirname: Path) -> set[str]:
    return {path.name for path in dirname.iterdir()}


def _evaluate(run: Run, step: int, score: float, metric: str = "acc") -> None:
    """A scripted evaluation at ``step``; the model's first weight is tagged with the step."""
    _move_trainer_to(run, step)
    with torch.no_grad():
        run.model[0].weight[0, 0] = step
    evaluator = Engine(lambda engine, batch: None)
    evaluator.state.metrics = {metric: score}
    run.ckpt.save_best(evaluator)


class Interrupted(BaseException):
    """Stops a save where a kill would, without being caught as an OSError."""


class InterruptAt:
    """Stands in for ``CrashPoints``: interrupts the save at ``phase``."""

    def __init__(self, phase: str) -> None:
        self.phase = phase

    def save_started(self) -> None:
        pass

    def reach(self, phase: str) -> None:
        if phase == self.phase:
            raise Interrupted(phase)


def _three_saves(dirname: Path) -> Run:
    run = _save_every_step(_build(dirname, keep_last=3))
    run.trainer.run(DATA[:3], max_epochs=1)
    return run


def _truncate_to_zero(path: Path) -> None:
    path.write_bytes(b"")


def _truncate_to_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _append_junk(path: Path) -> None:
    with open(path, "ab") as file:
        file.write(b"junk")


def _garble_sidecar(path: Path) -> None:
    path.with_name(path.name + ".json").write_text("{not json")  # last.pt.json is the same file


def _remove_sidecars(path: Path) -> None:
    path.with_name(path.name + ".json").unlink()
    (path.parent / "last.pt.json").unlink()


class _WritesAFileWhenUnpickled:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _read_only(*args, **kwargs):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS))


def _permission_denied(*args, **kwargs):
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))


def _zip_writer_failure(*args, **kwargs):
    """What torch.save raises when a write fails under its zip writer (a full disk, a
    file-size limit): a RuntimeError, not an OSError."""
    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


FILE_SIZE_LIMIT_SCRIPT = """
import resource, signal, sys
sys.path.insert(0, "tests/handlers/checkpoint")
import checkpoint_run as t
from handlers.checkpoint.files import CheckpointError
from handlers.checkpoint.formats import read_checkpoint
run = t._build(sys.argv[1])
t._move_trainer_to(run, 1)
run.ckpt.save_last(run.trainer)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))  # smaller than a checkpoint
t._move_trainer_to(run, 2)
try:
    run.ckpt.save_last(run.trainer)
except CheckpointError as error:
    print(error)
print(read_checkpoint(t.Path(sys.argv[1]) / "last.pt")["meta"]["iteration"])
"""


def _run_until_killed(dirname: Path, phase: str, asynchronous: bool = False) -> None:
    """Three steps, each saved, in a child process killed at ``phase``; with
    ``asynchronous`` the saves are written behind training and the run's end waits for the
    last (``wait_handler``, as ``attach`` registers it)."""
    script = (
        "import sys; sys.path.insert(0, 'tests/handlers/checkpoint'); import checkpoint_run as t; "
        f"run = t._save_every_step(t._build({str(dirname)!r}, keep_last=1, "
        f"asynchronous={asynchronous})); "
        "run.trainer.add_event_handler(t.Events.COMPLETED, run.ckpt.wait_handler); "
        "run.trainer.run(t.DATA[:3], max_epochs=1)"
    )
    env = {**os.environ, "CKPT_TEST_CRASH_PHASE": phase}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, timeout=300)
    assert done.returncode == 137


def _exactly(message: str) -> str:
    return f"^{re.escape(message)}$"


class _OnlyStateDict:
    def state_dict(self):
        return {}


class _OnlyLoadStateDict:
    def load_state_dict(self, state):
        pass


def _in_an_epoch_of_10(run: Run) -> Run:
    """Give the scripted trainer an epoch, so that a checkpoint of it restores."""
    state = run.trainer.state
    state.epoch, state.epoch_length, state.max_epochs = 1, 10, 1
    return run


def _one_save(dirname: Path) -> Path:
    run = _in_an_epoch_of_10(_build(dirname))
    _move_trainer_to(run, 1)
    run.ckpt.save_last(run.trainer)
    return dirname / "step-00000001.pt"


def _reason(path: Path, **kwargs) -> str:
    with pytest.raises(CheckpointError) as error:
        read_checkpoint(path, **kwargs)
    assert error.value.path == path
    return error.value.reason


def _commit_by_hand(path: Path, **changes) -> None:
    """Write ``path``'s sidecar as a save would, so that the file verifies."""
    data = path.read_bytes()
    sidecar = {"format_version": 1, "run_id": "run-a", "iteration": 1, "optimizer_step": 1,
               "size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), **changes}
    path.with_name(path.name + ".json").write_text(json.dumps(sidecar))


def _sharded_checkpoint(dirname: Path, name: str, committed: bool = True) -> None:
    """A ``.dcp`` checkpoint folder as ``ShardedFolder`` leaves it; only its name and sidecar
    matter to a single-file run."""
    (dirname / name).mkdir(parents=True)
    if committed:
        (dirname / f"{name}.json").write_text("{}")
