"""The run's history in plain numbers: what ``summary.json`` and the curves PNG are made of."""

import time
from collections.abc import Mapping
from typing import Any

import torch
from ignite.engine import Engine, Events

from engine.trainer import Trainer
from handlers.arguments import check_int
from handlers.goal import STANDARD_MODES, best_of, check_mode
from handlers.grad_telemetry import GradientTelemetry, TelemetryReport


class RunHistory:
    """Keeps the curves (train loss and LR per telemetry report, every validation
    metric per evaluation) and the run's totals (epochs, training time and samples),
    so the summary and the plot cover the whole run across resumes.

    ``attach(trainer, evaluator=None)`` listens to ``telemetry``'s reports, the trainer's
    ``Events.EPOCH_STARTED`` and ``Events.EPOCH_COMPLETED``, and the evaluator's
    ``Events.COMPLETED`` (when given).
    It reads nothing from the device: the telemetry already did, and validation
    metrics are Python numbers once per evaluation.

    Example::

        history = RunHistory(batch_size=512, modes={"accuracy": "max", "loss": "min"},
                             telemetry=telemetry)
        history.attach(trainer, evaluator)
        trainer.run(batches, max_epochs=3)
        print(history.summary(trainer))
    """

    def __init__(self, batch_size: int, modes: Mapping[str, str] | None = None, *,
                 telemetry: GradientTelemetry) -> None:
        check_int("batch_size", batch_size, 1)
        modes = dict(STANDARD_MODES if modes is None else modes)
        for name, mode in modes.items():
            check_mode(mode, f"modes[{name!r}]")
        self.batch_size, self.modes, self.telemetry = batch_size, modes, telemetry
        self.train: dict[str, list[float]] = {"step": [], "loss": [], "lr": []}
        self.val: dict[str, list[float]] = {"step": []}
        self.epochs_completed = 0
        self.train_time_sec = 0.0  # epoch loops only, validation excluded
        self.train_samples = 0
        self.wall_time_sec = 0.0  # all sessions of the run, resumes included
        self.stopped_early = False
        self._session_start = time.monotonic()
        self._wall_before_session = 0.0
        self._trainer: Trainer | None = None
        self._epoch_start: tuple[int, float] | None = None  # (iteration, monotonic) while open

    def attach(self, trainer: Trainer, evaluator: Engine | None = None) -> None:
        self._trainer = trainer
        self.telemetry.add_listener(self._on_report)
        if evaluator is not None:
            evaluator.add_event_handler(Events.COMPLETED, self._on_validation, trainer)
        trainer.add_event_handler(Events.EPOCH_STARTED, self._on_epoch_started)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self._on_epoch_completed)

    def _on_report(self, report: TelemetryReport) -> None:
        self.train["step"].append(report.step)
        self.train["loss"].append(report.stats["loss_mean"])
        self.train["lr"].append(report.stats["lr"])

    def _on_validation(self, evaluator: Engine, trainer: Trainer) -> None:
        self.val["step"].append(trainer.state.optimizer_step)
        for name, value in evaluator.state.metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()  # once per evaluation
            if isinstance(value, int | float):
                self.val.setdefault(name, []).append(float(value))

    def _on_epoch_started(self, trainer: Trainer) -> None:
        # After a mid-epoch resume this is the resumed iteration: the epoch's earlier part
        # came in with the checkpoint (see ``state_dict``).
        self._epoch_start = (trainer.state.iteration, time.monotonic())

    def _on_epoch_completed(self, trainer: Trainer) -> None:
        seconds, samples = self._open_epoch()
        self.epochs_completed = trainer.state.epoch
        self.train_time_sec += seconds
        self.train_samples += samples
        self._epoch_start = None

    def _open_epoch(self) -> tuple[float, int]:
        """Training seconds and samples of the epoch in progress, in this session."""
        if self._epoch_start is None or self._trainer is None:
            return 0.0, 0
        iteration, started = self._epoch_start
        samples = (self._trainer.state.iteration - iteration) * self.batch_size
        return time.monotonic() - started, samples

    def wall_time(self) -> float:
        """The run's wall time so far, every session's (``--max-time`` spends it)."""
        return self._wall_before_session + time.monotonic() - self._session_start

    def summary(self, trainer: Trainer) -> dict[str, Any]:
        """``summary.json``: ``best_val_<name>`` and ``final_val_<name>`` of every metric in
        ``modes`` (best by its direction), steps, skipped steps, times."""
        seconds, samples = self._open_epoch()  # an interrupted run's partial epoch counts
        train_time, samples = self.train_time_sec + seconds, self.train_samples + samples
        metrics: dict[str, float | None] = {}
        for name, mode in self.modes.items():
            values = self.val.get(name, [])
            metrics[f"best_val_{name}"] = best_of(values, mode)
            metrics[f"final_val_{name}"] = values[-1] if values else None
        return {
            **metrics,
            "epochs_completed": self.epochs_completed,
            "stopped_early": self.stopped_early,
            "optimizer_steps": trainer.state.optimizer_step,
            "skipped_steps": trainer.state.skipped_steps,
            "wall_time_sec": round(self.wall_time(), 3),
            "train_time_sec": round(train_time, 3),
            "samples_per_sec": round(samples / train_time, 2) if train_time else None,
        }

    def state_dict(self) -> dict[str, Any]:
        """Totals include the epoch in progress: a checkpoint taken mid-epoch carries the
        samples and seconds trained so far, and the resumed session adds the rest."""
        seconds, samples = self._open_epoch()
        return {
            "train": {key: list(values) for key, values in self.train.items()},
            "val": {key: list(values) for key, values in self.val.items()},
            "epochs_completed": self.epochs_completed,
            "train_time_sec": self.train_time_sec + seconds,
            "train_samples": self.train_samples + samples,
            "wall_time_sec": self.wall_time(),
            "stopped_early": self.stopped_early,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train = {key: list(values) for key, values in state["train"].items()}
        self.val = {key: list(values) for key, values in state["val"].items()}
        self.epochs_completed = state["epochs_completed"]
        self.train_time_sec = state["train_time_sec"]
        self.train_samples = state["train_samples"]
        self.stopped_early = state["stopped_early"]
        self._wall_before_session = state["wall_time_sec"]
        self._session_start = time.monotonic()
