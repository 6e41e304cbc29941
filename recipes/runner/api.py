"""What a recipe declares: its task. Everything else a run needs comes from the run layer.

A recipe module ``recipes/<name>/recipe.py`` holds one value, ``RECIPE = Recipe(...)``:

- ``config``: a dataclass that extends ``RunConfig`` with the task's own keys (and may
  change the defaults of run keys, e.g. ``epochs``);
- ``load_data(config) -> data``: anything; it runs once per process, before the run
  folder is written, so a ``DataError`` or ``ConfigError`` there leaves nothing on disk;
- ``build(config, data, ctx) -> Parts``: model, optimizer, loss (or ``forward``),
  metrics and batches for this process (``ctx`` says which device, rank and world);
- ``metrics``: every validation metric by name with its direction (``"min"`` or
  ``"max"``), and ``best``: the one that ranks checkpoints and early stopping;
- ``sample_counts(data) -> (train, val)``: checked against the batch size and the
  number of processes before anything is written;
- ``fingerprint(data) -> {split name: fingerprint}``: cheap facts about each split
  (counts, hashes; ``recipes.runner.training.fingerprint``) stored with the run: a resume on
  different data is refused, naming what changed;
- optional: ``commands`` (the module whose ``COMMANDS``, by name, ``command(recipe, args) ->
  exit code``, are what ``python -m recipes <name> <command> <run> ...`` runs besides training
  and ``evaluate``, ``recipes.runner.commands.dispatch``, and whose ``EVAL_SPLITS`` are the
  splits besides validation that ``evaluate --split`` can name) and ``blocks(model) ->
  [module]`` (the repeated blocks that ``--strategy fsdp`` shards one by one,
  ``recipes.runner.training.strategy``).

``run(RECIPE, config, given)`` (``recipes.runner.training.run``) does the rest
(``python -m recipes <name>`` calls it).
"""

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from ignite.engine import Engine
from ignite.metrics import Metric
from torch import nn

from engine.batch import Forward, Predict, PrepareBatch, move_to_device, supervised_predict
from engine.trainer import Trainer
from handlers.goal import check_mode


def _whole(model: nn.Module) -> nn.Module:
    return model


@dataclass(frozen=True)
class Context:
    """Where this process trains: its device, its rank among ``world_size`` processes, and
    the run folder (only rank 0 writes there). ``distribute(model)`` returns the model as
    the step calls it under the run's ``--strategy`` (a DDP wrapper, or the model itself
    sharded in place by FSDP2); call it before building the optimizer."""

    device: torch.device
    rank: int
    world_size: int
    run_dir: Path
    distribute: Callable[[nn.Module], nn.Module] = _whole


@dataclass(frozen=True)
class RunPlan:
    """The run's length in optimizer steps, known once the batches exist."""

    steps_per_epoch: int
    epochs: int

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.epochs


# attach(trainer, evaluator, plan) -> {name: handler with state_dict/load_state_dict}
AttachExtra = Callable[[Trainer, Engine, RunPlan], Mapping[str, Any]]


@dataclass
class Parts:
    """What ``build`` returns for one process.

    ``model`` is the module that is checkpointed (its ``state_dict`` keys are the
    checkpoint's); ``train_model`` is what the step calls, e.g. a DDP or compiled wrapper
    around it (default: ``model``). ``train_batches`` must be sized and, for an exact
    mid-epoch resume, have ``bind(engine)`` (see ``recipes.common.data_order``); if they have a
    ``state_dict`` (a ``StatefulDataLoader``'s workers and sampler), it is checkpointed.
    ``attach_extra`` attaches the recipe's own handlers before the standard ones (so a
    checkpoint sees their work of the same step) and returns those whose state must be
    checkpointed; one of those that ends the run before its last epoch by request
    (``trainer.terminate()``) says why in its ``stop_status`` (None until then), which
    becomes the run's status in summary.json and its closing line (a sweep's pruned trial:
    ``pruned at step N``). ``before_evaluation(final)`` runs before each evaluation; ``final`` is
    True for the one after the last epoch. ``num_classes`` (classifiers) lets the start-up
    checks test the labels' range and the first loss against ln(num_classes).
    ``model_flops`` and ``tokens_per_sample`` feed the throughput, MFU and memory telemetry.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    metrics: Mapping[str, Metric]
    train_batches: Iterable[Any]
    val_batches: Iterable[Any]
    loss_fn: Callable[..., torch.Tensor] | None = None
    forward: Forward | None = None
    train_model: nn.Module | None = None
    predict: Predict = supervised_predict
    prepare_batch: PrepareBatch = move_to_device
    attach_extra: AttachExtra | None = None
    before_evaluation: Callable[[bool], None] | None = None
    # Forwards per validation sample of an evaluation (final or not), when
    # before_evaluation changes them: the time left scales the measured evaluations by it.
    evaluation_forwards: Callable[[bool], float] | None = None
    num_classes: int | None = None  # a classifier's: the start-up checks use it
    # Cost telemetry (handlers.cost): model FLOPs of forward + backward per training sample,
    # and the tokens a sample holds (a language model's); None where they do not apply.
    model_flops: float | None = None
    tokens_per_sample: int | None = None


@dataclass(frozen=True)
class Recipe:
    name: str
    summary: str
    config: type
    load_data: Callable[[Any], Any]
    build: Callable[[Any, Any, Context], Parts]
    metrics: Mapping[str, str]
    best: str
    sample_counts: Callable[[Any], tuple[int, int]]  # data -> (training, validation) samples
    fingerprint: Callable[[Any], dict[str, dict[str, str | int]]]
    # config -> where the data comes from (e.g. the folder "auto" resolved to), for the
    # run's first lines; without it they name the config's data keys.
    data_source: Callable[[Any], str] | None = None
    # config -> a stand-in for the data with the same shapes and classes (random samples),
    # on which --describe builds the run's wiring without reading or downloading the data.
    stand_in_data: Callable[[Any], Any] | None = None
    # The module (a dotted name) of the commands besides training and evaluate
    # (recipes.runner.commands.dispatch): its ``COMMANDS`` maps a name to
    # command(recipe, args) -> exit code (predict, generate, export); its ``EVAL_SPLITS``, if
    # it has them, the splits besides validation that ``evaluate --split`` can name, each
    # mapping the data to the same data with that split in the validation split's place. A
    # name, imported by ``extra_commands`` and ``eval_splits``: a training start never
    # loads that code.
    commands: str | None = None
    # Whether build honours --activation-checkpointing: a model of repeated blocks whose
    # forward may run again in the backward with the same result (no BatchNorm, whose
    # running statistics a second forward would update twice).
    activation_checkpointing: bool = False
    # model -> its repeated blocks (a transformer's layers, a conv net's stages), which
    # --strategy fsdp shards one by one; None: the recipe runs under --strategy ddp only.
    blocks: Callable[[nn.Module], list[nn.Module]] | None = None

    def extra_commands(self) -> Mapping[str, Callable[["Recipe", list[str]], int]]:
        """The ``COMMANDS`` of the module ``commands`` names."""
        return {} if self.commands is None else importlib.import_module(self.commands).COMMANDS

    def eval_splits(self) -> Mapping[str, Callable[[Any], Any]]:
        """The ``EVAL_SPLITS`` of the module ``commands`` names, if it has them."""
        if self.commands is None:
            return {}
        return getattr(importlib.import_module(self.commands), "EVAL_SPLITS", {})

    def __post_init__(self) -> None:
        for name, mode in self.metrics.items():
            check_mode(mode, f"metrics[{name!r}]")
        if self.best not in self.metrics:
            raise ValueError(f"best={self.best!r} must be one of the metrics "
                             f"{sorted(self.metrics)}")
