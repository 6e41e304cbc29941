"""The optimizer that ``--optimizer <the recipe's own>|muon`` chooses
(``recipes.common.optimizer_choice``) and the param groups each optimizer gets."""

import math
from typing import Any

import torch
from torch import nn

from engine.muon import Muon

OWN_OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two optimizer groups, nanoGPT's rule: every trainable parameter of 2 or more
    dimensions (weight matrices, conv filters, embeddings) with ``weight_decay``, biases and
    normalisation parameters (ndim <= 1) without it. Frozen parameters are left out; a
    parameter shared by two modules (tied weights) is listed once."""
    if not (isinstance(weight_decay, int | float) and math.isfinite(weight_decay)
            and weight_decay >= 0):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in trainable if p.ndim > 1], "weight_decay": weight_decay},
        {"params": [p for p in trainable if p.ndim <= 1], "weight_decay": 0.0},
    ]


def hidden_weights(model: nn.Module) -> list[nn.Parameter]:
    """The trainable weights Muon is for: every parameter of 2 or more dimensions except
    embeddings and the output layer (the last ``nn.Linear`` the model registers), whose
    rows are not directions of a hidden space."""
    linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
    left_out = {id(module.weight) for module in model.modules()
                if isinstance(module, nn.Embedding)}
    left_out |= {id(linears[-1].weight)} if linears else set()
    return [p for p in model.parameters()
            if p.requires_grad and p.ndim >= 2 and id(p) not in left_out]


def build_optimizer(config: Any, model: nn.Module, *, own: str, normalize: bool = True,
                    **options: Any) -> torch.optim.Optimizer:
    """The recipe's own optimizer (``own``: ``sgd`` or ``adamw``, with ``options``) over
    ``param_groups`` (``decayed``: the weights and embeddings; ``not_decayed``: biases and
    norms), or with ``--optimizer muon`` the same with the hidden weights moved to a third
    group, ``muon``.
    ``normalize`` (see ``Muon``) suits weights that a norm layer follows (conv nets);
    without it the Muon group takes the recipe's weight decay, decoupled."""
    groups = [{**group, "name": name} for group, name in
              zip(param_groups(model, config.weight_decay), ("decayed", "not_decayed"),
                  strict=True)]
    if config.optimizer == own:
        return OWN_OPTIMIZERS[own](groups, **options)
    muon = hidden_weights(model)
    moved = {id(p) for p in muon}
    groups = [{**group, "params": [p for p in group["params"] if id(p) not in moved]}
              for group in groups]
    groups.append({"params": muon, "name": "muon", "use_muon": True, "lr": config.muon_lr,
                   "momentum": config.muon_momentum, "nesterov": config.muon_momentum > 0,
                   "normalize": normalize,
                   "weight_decay": 0.0 if normalize else config.weight_decay})
    return Muon([group for group in groups if group["params"]], other=own, **options)
