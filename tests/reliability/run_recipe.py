"""``python tests/reliability/run_recipe.py <recipe> --key value ...``: the recipe command
line, run exactly as ``python -m recipes`` runs it, with test-only faults switched on by
environment variables. The reliability tests start every training run through this file.
The faults wrap the run layer's ``create_trainer``/``create_evaluator``, so they work the
same for every recipe.

Always: CIFAR's airbench net is built with narrow conv groups (``TEST_WIDTHS``), so that a
24-iteration CPU run takes seconds, not a minute; everything else (whitening layer,
BatchNorm running statistics, checkpoint contents, data order) is the real recipe's.

Faults, each off unless its variable is set:

``RELIABILITY_NAN_ITERATIONS="5,6,7"``
    the training loss of those trainer iterations (1-based) is multiplied by NaN after the
    forward pass, so the forward (and BatchNorm statistics) is clean and every gradient NaN.
``RELIABILITY_SPIKE_ITERATIONS="10,12"``
    the training loss of those trainer iterations is multiplied by 1e3 after the forward
    pass (a loss spike: every gradient 1e3 times its size, for ``--spike-guard``).
``RELIABILITY_SNAPSHOT_ITERATIONS="4,5"`` with ``RELIABILITY_SNAPSHOT_DIR``
    after those iterations, ``it-<N>.pt`` holds the model's and optimizer's state dicts.
``RELIABILITY_SIGNAL_AT="SIGKILL:iteration:13"``
    the process sends itself the signal when that trainer iteration starts;
    ``SIGTERM:iteration:N``, ``SIGINT:...`` likewise; ``SIGKILL:validation:E`` when the
    first validation batch of the E-th evaluation completes.
``RELIABILITY_SIGNAL_RANK="1"`` with ``RELIABILITY_SIGNAL_AT``
    under torchrun, only the process of that rank sends it, and only in the group's first
    start (``TORCHELASTIC_RESTART_COUNT`` 0): the group that torchrun restarts runs through.
``RELIABILITY_DISK_ERROR="ENOSPC:4"``
    from the 4th checkpoint file on, saving fails like that disk error: ``ENOSPC`` after
    half of the file is written (a full disk), ``EACCES`` and ``EROFS`` when the temp
    file is created in the checkpoint folder (permission denied, read-only file system).
"""

import errno
import io
import os
import runpy
import signal
import sys
import tempfile
from pathlib import Path

import torch
from ignite.engine import Events

import recipes.cifar.recipe
import recipes.runner.training.build
from engine.batch import supervised_forward
from recipes.cifar.model import AirbenchNet

TEST_WIDTHS = (16, 32, 32)  # the recipe's airbench uses (64, 256, 256): ~2M parameters


def _iterations(name: str) -> set[int]:
    return {int(item) for item in os.environ.get(name, "").split(",") if item}


def _narrow_build_model(name: str, num_classes: int = 10) -> torch.nn.Module:
    if name != "airbench":
        raise ValueError(f"the reliability tests run the airbench net only, got {name!r}")
    return AirbenchNet(num_classes, widths=TEST_WIDTHS)


def _signals_here() -> bool:
    """Whether this process sends ``RELIABILITY_SIGNAL_AT`` (every process, unless
    ``RELIABILITY_SIGNAL_RANK`` names one rank of torchrun's first start)."""
    rank = os.environ.get("RELIABILITY_SIGNAL_RANK")
    return rank is None or (os.environ.get("RANK") == rank
                            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")


def _install_trainer_hooks() -> None:
    """Wrap the run layer's ``create_trainer`` to add the NaN, spike, snapshot and signal
    faults."""
    real_create_trainer = recipes.runner.training.build.create_trainer
    nan_iterations = _iterations("RELIABILITY_NAN_ITERATIONS")
    spike_iterations = _iterations("RELIABILITY_SPIKE_ITERATIONS")
    snapshot_iterations = _iterations("RELIABILITY_SNAPSHOT_ITERATIONS")
    signal_name, _, where = os.environ.get("RELIABILITY_SIGNAL_AT", "").partition(":")
    signal_event, _, signal_count = where.partition(":")

    def create_trainer(model, optimizer, loss_fn=None, *, forward=None, **options):
        trainer = None
        clean_forward = forward or supervised_forward(loss_fn)

        def faulty_forward(model, batch):
            loss = clean_forward(model, batch)
            if trainer.state.iteration in nan_iterations:
                loss = loss * float("nan")
            if trainer.state.iteration in spike_iterations:
                loss = loss * 1e3
            return loss

        trainer = real_create_trainer(model, optimizer, loss_fn, forward=faulty_forward,
                                      **options)

        @trainer.on(Events.ITERATION_COMPLETED)
        def snapshot(engine):
            if engine.state.iteration in snapshot_iterations:
                engine.settle()  # the step of this iteration, with its LR schedule
                folder = Path(os.environ["RELIABILITY_SNAPSHOT_DIR"])
                folder.mkdir(parents=True, exist_ok=True)
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                           folder / f"it-{engine.state.iteration}.pt")

        if signal_event == "iteration" and _signals_here():
            @trainer.on(Events.ITERATION_STARTED(once=int(signal_count)))
            def send_signal(engine):
                os.kill(os.getpid(), signal.Signals[signal_name])
        return trainer

    recipes.runner.training.build.create_trainer = create_trainer
    if signal_event == "validation" and _signals_here():
        real_create_evaluator = recipes.runner.training.build.create_evaluator
        evaluations = {"count": 0}

        def create_evaluator(*args, **options):
            evaluator = real_create_evaluator(*args, **options)

            @evaluator.on(Events.ITERATION_COMPLETED(once=1))
            def kill_during_validation(engine):
                evaluations["count"] += 1
                if evaluations["count"] == int(signal_count):
                    os.kill(os.getpid(), signal.Signals[signal_name])
            return evaluator

        recipes.runner.training.build.create_evaluator = create_evaluator


def _install_disk_error() -> None:
    code_name, _, first_failing = os.environ.get("RELIABILITY_DISK_ERROR", "").partition(":")
    if not code_name:
        return
    code, first_failing = getattr(errno, code_name), int(first_failing)
    counter = {"checkpoint_files": 0}
    real_save, real_mkstemp = torch.save, tempfile.mkstemp

    def failing(where: str | None = None) -> OSError:
        return OSError(code, os.strerror(code), *([where] if where else []))

    def mkstemp(suffix=None, prefix=None, dir=None, text=False):
        # Counts the .pt files the Checkpointer writes (".step-00000003.pt.<random>.tmp"),
        # not their sidecars (".step-00000003.pt.json.<random>.tmp").
        if dir is not None and Path(dir).name == "checkpoints" and (prefix or "").endswith(".pt."):
            counter["checkpoint_files"] += 1
            if code != errno.ENOSPC and counter["checkpoint_files"] >= first_failing:
                raise failing(str(Path(dir) / f"{prefix}XXXX{suffix}"))
        return real_mkstemp(suffix, prefix, dir, text)

    def save(obj, f, *args, **kwargs):
        if code == errno.ENOSPC and counter["checkpoint_files"] >= first_failing:
            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            raise failing()  # a failed write(2) names no file
        return real_save(obj, f, *args, **kwargs)

    tempfile.mkstemp, torch.save = mkstemp, save


if __name__ == "__main__":
    recipes.cifar.recipe.build_model = _narrow_build_model
    _install_trainer_hooks()
    _install_disk_error()
    sys.argv = ["python -m recipes", *sys.argv[1:]]
    runpy.run_module("recipes", run_name="__main__", alter_sys=True)
