"""``--init-from``: a new run that begins with the model weights of an earlier run.

Only the model's weights are taken: the optimizer, step, schedule, data position and RNG
start as in any fresh run. The source is a checkpoint file or a run folder (its
``checkpoints/best.pt``, else ``last.pt``), verified as a resume verifies it (sidecar,
sha256, ``weights_only``). It applies to a fresh run only (``resume/plan.py`` decides): once
the run folder holds a committed checkpoint, the run resumes from it and ``--init-from`` is
ignored. The run records where its weights came from in ``config.json`` (``init_from``).
"""

import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from handlers.checkpoint.files import (
    CheckpointError,
    checkpoint_in,
    is_checkpoint,
    read_sidecar,
)
from handlers.checkpoint.formats import read_checkpoint
from recipes.runner.api import Context, Recipe
from recipes.runner.config.command_line import ConfigError
from recipes.runner.resume.plan import ResumePlan

EXPECTED = ("expected a run folder or one of its checkpoints (a .pt with its .pt.json, or a "
            ".dcp folder with its .dcp.json)")


@dataclass(frozen=True)
class InitWeights:
    """The verified model weights of a checkpoint and the record of where they came from."""

    weights: dict[str, torch.Tensor]
    record: dict[str, Any]


def resolve_checkpoint(source: str) -> Path:
    """The checkpoint ``source`` names: the file (or sharded folder) itself, or a run
    folder's (or its ``checkpoints`` folder's) ``best.pt``, else ``last.pt`` (``.dcp`` for
    a run that saved sharded checkpoints)."""
    path = Path(source).expanduser()
    if is_checkpoint(path):
        return path
    if not path.is_dir():
        raise ConfigError(f"--init-from {source}: no such file or folder; {EXPECTED}")
    for folder in (path / "checkpoints", path):
        for name in ("best", "last"):
            found = checkpoint_in(folder, name)
            if found is not None:
                return found
    raise ConfigError(f"--init-from {source}: no checkpoints/best.pt or last.pt in this "
                      f"folder; {EXPECTED}")


def read_init_weights(source: str) -> InitWeights:
    """Verify and read the model weights ``source`` names (``ConfigError`` otherwise)."""
    path = resolve_checkpoint(source)
    try:
        payload = read_checkpoint(path, required_keys=("model",))
        sidecar = read_sidecar(path)
    except CheckpointError as error:
        raise ConfigError(f"--init-from {error.path}: {error.reason}; {EXPECTED}") from None
    meta = payload["meta"]
    record = {"path": str(path.resolve()), "sha256": sidecar["sha256"],
              "run_id": meta.get("run_id"), "kind": meta.get("kind"),
              "epoch": meta.get("epoch"), "optimizer_step": meta.get("optimizer_step")}
    return InitWeights(payload["model"], record)


def first_mismatch(theirs: Mapping[str, torch.Tensor], ours: Mapping[str, torch.Tensor],
                   source: str = "the checkpoint") -> str | None:
    """The first key in which the weights ``theirs`` do not fit a model whose state is
    ``ours`` (missing, another shape, or extra), said in words; None when they fit."""
    for key, tensor in ours.items():
        if key not in theirs:
            return f"this model's {key!r} is not in {source} (another recipe or model?)"
        if theirs[key].shape != tensor.shape:
            return (f"{key!r} has shape {list(theirs[key].shape)} in {source}, "
                    f"{list(tensor.shape)} in this model (another model or size?)")
    extra = next((key for key in theirs if key not in ours), None)
    if extra is not None:
        return f"{source}'s {extra!r} is not in this model (another recipe or model?)"
    return None


def check_fits(init: InitWeights, model_state: Mapping[str, torch.Tensor]) -> None:
    """Refuse weights of another recipe or model, naming the first key that does not fit."""
    mismatch = first_mismatch(init.weights, model_state)
    if mismatch:
        raise ConfigError(f"--init-from {init.record['path']}: {mismatch}")


def load_init_weights(model: nn.Module, source: str) -> InitWeights:
    """Copy the verified weights of ``source`` into ``model`` (checked key by key first)."""
    init = read_init_weights(source)
    check_fits(init, model.state_dict())
    model.load_state_dict(init.weights)
    return init


def plan_init_from(recipe: Recipe, config: Any, plan: ResumePlan, data: Any
                   ) -> dict[str, Any] | None:
    """The ``init_from`` record for ``config.json``. When the plan starts a fresh run from
    ``--init-from``, the weights are verified and checked against the recipe's model, built
    here on the CPU (before anything is written; the random state is left as it was); else
    the run keeps its saved record."""
    if not plan.init_from:
        return (plan.saved or {}).get("init_from")
    init = read_init_weights(plan.init_from)
    python_state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        cpu = Context(torch.device("cpu"), 0, 1, plan.run_dir)
        model = recipe.build(config, data, cpu).model
    random.setstate(python_state)
    check_fits(init, model.state_dict())
    return init.record
