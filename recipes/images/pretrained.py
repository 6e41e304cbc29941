"""``--weights``: start the images recipe's model from torchvision's pretrained weights.

``DEFAULT`` is torchvision's recommended weights for ``--model``, read from torch's cache
(``torch.hub.get_dir()/checkpoints/<file>``) and downloaded there by torchvision when
missing; offline, put the file there. A file is any ``state_dict`` of that torchvision
model saved with ``torch.save`` (e.g. a download from torchvision's model page). The
weights load into the model with its original classifier head (torchvision's stem too: the
weights were trained with it, so no CIFAR-style stem), then the head is replaced by a new,
seeded layer with one output per class of the image folder.
"""

import urllib.error
from pathlib import Path

import torch
import torchvision
from torch import nn

from recipes.runner.config.command_line import ConfigError
from recipes.runner.training.init_from import first_mismatch

NO_WEIGHTS = "none"
DEFAULT = "DEFAULT"


def weights_file(value: str, model_name: str) -> Path | None:
    """The file ``--weights value`` names for ``model_name`` (None for ``none``); for
    ``DEFAULT``, torch's cached copy, downloaded by torchvision when missing."""
    if value == NO_WEIGHTS:
        return None
    if value != DEFAULT:
        return Path(value)
    weights = torchvision.models.get_model_weights(model_name).DEFAULT
    cached = Path(torch.hub.get_dir()) / "checkpoints" / weights.url.rsplit("/", 1)[-1]
    if not cached.is_file():
        try:
            weights.get_state_dict(progress=False, check_hash=True)  # into torch's cache
        except (urllib.error.URLError, OSError, RuntimeError) as error:
            reason = getattr(error, "reason", None) or error
            raise ConfigError(f"--weights DEFAULT: cannot download {weights.url} ({reason}); "
                              f"offline, put that file at {cached}") from None
    return cached


def classifier_head(model: nn.Module) -> str:
    """The name of the layer that gives the class scores: torchvision's classifiers end in a
    Linear (resnet's ``fc``, vit's ``heads.head``, convnext's ``classifier.2``, ...), or in
    a 1x1 convolution (squeezenet's ``classifier.1``)."""
    last_linear = last_conv = None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last_linear = name
        elif isinstance(module, nn.Conv2d):
            last_conv = name
    return last_linear or last_conv


def read_pretrained(path: Path, model_name: str) -> dict[str, torch.Tensor]:
    """The weights in ``path``, checked against torchvision's ``model_name`` (its head may
    have any number of classes): ``ConfigError`` naming the first key that does not fit."""
    where = f"--weights {path}"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # zip errors, weights_only refusals: not a weights file
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ConfigError(f"{where}: not a state_dict file: {first_line}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"{where}: not a state_dict of tensors (a run's checkpoint? use "
                          "--init-from for those)")
    with torch.random.fork_rng(devices=[]):  # the check leaves the random state alone
        mismatch = first_mismatch(state, _original(model_name, state).state_dict(),
                                  "the weights file")
    if mismatch:
        raise ConfigError(f"{where}: not weights of torchvision's {model_name}: {mismatch}")
    return state


def _original(model_name: str, state: dict[str, torch.Tensor]) -> nn.Module:
    """Torchvision's untrained ``model_name`` with as many classes as the head in ``state``."""
    model = torchvision.models.get_model(model_name, weights=None)
    head = state.get(f"{classifier_head(model)}.weight")
    if head is not None:  # without it, the key check names what is missing
        replace_head(model, head.shape[0])
    return model


def replace_head(model: nn.Module, num_classes: int) -> None:
    """A new, untrained classifier head of ``num_classes`` outputs, in the old one's place."""
    parent_name, _, attribute = classifier_head(model).rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, attribute)
    if isinstance(old, nn.Linear):
        new = nn.Linear(old.in_features, num_classes, bias=old.bias is not None)
    else:
        new = nn.Conv2d(old.in_channels, num_classes, old.kernel_size, old.stride,
                        old.padding, bias=old.bias is not None)
    setattr(parent, attribute, new)


def pretrained_classifier(model_name: str, state: dict[str, torch.Tensor],
                          num_classes: int) -> nn.Module:
    """Torchvision's ``model_name`` with the weights ``state`` (checked by
    ``read_pretrained``) and a new head of ``num_classes`` outputs."""
    model = _original(model_name, state)
    model.load_state_dict(state)
    replace_head(model, num_classes)
    return model
