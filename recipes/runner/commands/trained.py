"""A trained model back from its run: what ``evaluate``, ``predict`` and ``generate`` start from.

``load_trained(recipe, source, checkpoint, device)`` finds the checkpoint (a run folder's
``checkpoints/<best|last>.pt`` or a file), verifies it as a resume does
(``handlers.checkpoint.formats.read_checkpoint``: sidecar checksum, ``weights_only=True``),
rebuilds the run's config from the one stored in the checkpoint, refuses a checkpoint of
another recipe, loads the run's data and builds the recipe's parts with that config, then
loads the weights the run evaluated: the averaged ones when the run used ``--averaging``.
Nothing is written anywhere.
"""

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from handlers.checkpoint.files import CheckpointError, checkpoint_in, is_checkpoint
from handlers.checkpoint.formats import read_checkpoint
from recipes.runner.api import Context, Parts, Recipe
from recipes.runner.config.command_line import ConfigError, validate
from recipes.runner.console import warn
from recipes.runner.training.fingerprint import describe_change
from recipes.runner.training.launch import process_device

CHECKPOINTS = ("best", "last")


@dataclass
class Trained:
    """A recipe's parts built with a run's config, its model holding the checkpoint's weights
    (in eval mode) and its evaluation hooks set as for the evaluation that scored it."""

    recipe: Recipe
    config: Any
    data: Any
    parts: Parts
    device: torch.device
    checkpoint: Path
    meta: dict[str, Any]
    # Where the run's outputs go: the run folder, or the checkpoint's folder for a lone file.
    run_dir: Path
    final_evaluation: bool  # scored by the evaluation after the last epoch (final TTA)
    recorded: dict[str, float]  # the run's metrics of the evaluation at this checkpoint's step


def find_checkpoint(source: str, checkpoint: str) -> tuple[Path, Path]:
    """(checkpoint, run folder) for ``source``, a run folder or a checkpoint (a file, or a
    sharded checkpoint's folder)."""
    path = Path(source).expanduser()
    if is_checkpoint(path):
        run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
        return path, run_dir
    if not path.is_dir():
        raise ConfigError(f"{source}: no such run folder or checkpoint file")
    folder = path / "checkpoints"
    if not folder.is_dir():
        raise ConfigError(f"{source}: not a run folder (it has no checkpoints/ folder); give "
                          "a run folder (runs/<recipe>/<name>) or a .pt checkpoint file")
    file = checkpoint_in(folder, checkpoint)
    if file is None:
        file = folder / f"{checkpoint}.pt"
        hint = (" (the run stopped before its first evaluation?); try --checkpoint last"
                if checkpoint == "best" else "")
        raise ConfigError(f"{file}: no such checkpoint{hint}")
    return file, path


def saved_config(recipe: Recipe, path: Path, meta: dict[str, Any]) -> tuple[Any, dict]:
    """(the run's config, its data fingerprint) from a checkpoint's ``meta``; a checkpoint of
    another recipe, whose config has keys this recipe lacks, is refused."""
    stored = meta.get("config")
    if not isinstance(stored, dict):
        raise CheckpointError(path, "no run config in its meta: not a checkpoint of a recipe run")
    stored = dict(stored)
    fingerprint = stored.pop("data", None) or {}
    # Keys the recipe lacks mean another recipe's run; keys the run lacks are newer than
    # it and take their defaults.
    extra = sorted(stored.keys() - {spec.name for spec in dataclasses.fields(recipe.config)})
    if extra:
        raise CheckpointError(path, f"not a checkpoint of the {recipe.name} recipe (its "
                                    f"config has keys {recipe.name} lacks: {', '.join(extra[:5])})")
    config = recipe.config(**stored)
    validate(config)
    return config, fingerprint


def load_trained(recipe: Recipe, source: str, checkpoint: str = "best",
                 device: str | None = None, split: str = "validation") -> Trained:
    """Verify and load the checkpoint of ``source`` and rebuild the recipe's model with it,
    on ``device`` (default: the run's own ``--device``); the parts' validation batches are
    those of ``split`` (validation, or one of ``recipe.eval_splits()``)."""
    if checkpoint not in CHECKPOINTS:
        raise ConfigError(f"--checkpoint: {checkpoint!r} is not allowed; choose one of: "
                          f"{', '.join(CHECKPOINTS)}")
    path, run_dir = find_checkpoint(source, checkpoint)
    payload = read_checkpoint(path, required_keys=("model",))
    meta = payload["meta"]
    config, fingerprint = saved_config(recipe, path, meta)
    if device is not None:
        config = dataclasses.replace(config, device=device)
        validate(config)
    try:
        resolved = process_device(config.device)
    except ValueError as error:
        raise ConfigError(f"--device: {error}") from None
    data = recipe.load_data(config)
    _note_data_change(fingerprint, recipe.fingerprint(data))
    if split != "validation":
        data = recipe.eval_splits()[split](data)
    torch.manual_seed(config.seed)  # as the run built its parts
    random.seed(config.seed)
    parts = recipe.build(config, data, Context(resolved, 0, 1, run_dir))
    try:
        parts.model.load_state_dict(_evaluated_weights(payload))
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as error:
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise CheckpointError(path, f"its weights do not fit {recipe.name}'s model "
                                    f"({first_line})") from None
    parts.model.eval()
    final = meta.get("epoch") == config.epochs
    if parts.before_evaluation is not None:
        parts.before_evaluation(final)
    return Trained(recipe, config, data, parts, resolved, path, meta, run_dir, final,
                   _recorded_metrics(payload))


def _evaluated_weights(payload: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The weights the run's evaluations saw: with ``--averaging`` the checkpoint's ``model``
    holds the trained weights and ``averaging`` the average, which every evaluation swapped
    in (``handlers.weight_averaging``); before its first update there is no average yet."""
    averaging = payload.get("averaging")
    if isinstance(averaging, dict) and averaging.get("num_updates", 0) > 0:
        return averaging["averaged_model"]
    return payload["model"]


def _recorded_metrics(payload: dict[str, Any]) -> dict[str, float]:
    """The validation metrics the run recorded at the checkpoint's optimizer step (its
    ``history``), or {} when no evaluation happened at that step (a mid-epoch save)."""
    curves = (payload.get("history") or {}).get("val") or {}
    steps = list(curves.get("step", []))
    step = payload["meta"].get("optimizer_step")
    if step not in steps:
        return {}
    at = len(steps) - 1 - steps[::-1].index(step)
    return {name: values[at] for name, values in curves.items()
            if name != "step" and len(values) == len(steps)}


def _note_data_change(saved: dict[str, Any], now: dict[str, Any]) -> None:
    changes = [describe_change(saved[split], facts, split) for split, facts in now.items()
               if split in saved]
    change = "; ".join(line for line in changes if line)
    if change:
        warn(f"note: the data changed since the run ({change}): its recorded metrics may "
             "not reproduce")
