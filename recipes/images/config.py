"""The images recipe's keys: its ``Config``, read by ``python -m recipes images`` before
torch loads (no torch here; ``--model`` is checked against torchvision's list, which loads
torch, only once every other key is known to be well-formed)."""

import os
from dataclasses import dataclass
from pathlib import Path

from recipes.common.optimizer_choice import OptimizerChoice
from recipes.runner.config.command_line import field
from recipes.runner.config.run_keys import RunConfig

MAX_AUTO_SIZE = 224  # --image-size by default: the first image's shorter side, at most this
SMALL_IMAGE_MAX = 64  # up to this side: pad-and-crop augmentation and a CIFAR-style stem
LAYOUT = ("train/<class>/<image> and val/<class>/<image> (or test/), or only train/ with "
          "--val-fraction")


def _check_model(name: str) -> str | None:
    import torchvision  # only here: this module imports no torch

    if name in torchvision.models.list_models(module=torchvision.models):
        return None
    return f"must be a torchvision classification model (e.g. resnet18), got {name!r}"


def _check_weights(value: str) -> str | None:
    if value in ("none", "DEFAULT") or Path(value).is_file():
        return None
    return f"must be DEFAULT, none or a weights file; {value!r} is not a file"


@dataclass
class Config(OptimizerChoice, RunConfig):
    lr: float = field(0.1, "peak learning rate (SGD; 0.1 per 256 samples is the usual start)",
                      min=0, min_exclusive=True)
    data_dir: str = field("auto", f"image-folder tree: {LAYOUT}; auto: the CIFAR-10 folders "
                          "../shared/data/cifar10, else data/cifar10")
    val_fraction: float | None = field(None, "hold out this fraction of each training class "
                                       "(the same files every time) instead of val/ or test/",
                                       min=0, max=0.5, min_exclusive=True, fixed_on_resume=True)
    image_size: int | None = field(None, "side of the square images the model sees (none: the "
                                   f"first training image's shorter side, at most "
                                   f"{MAX_AUTO_SIZE}); at most {SMALL_IMAGE_MAX}: pad-and-crop "
                                   "and a CIFAR-style stem, else random resized crops", min=8,
                                   fixed_on_resume=True)
    normalize: str = field("train", "per-channel mean and std: train = measured on up to 256 "
                           "training images at each start, imagenet = ImageNet's",
                           choices=("train", "imagenet"), fixed_on_resume=True)
    model: str = field("resnet18", "any torchvision classification model by name (untrained "
                       "unless --weights)", check=_check_model, fixed_on_resume=True)
    weights: str = field("none", "start --model from pretrained weights, its classifier head "
                         "replaced for the folder's classes: DEFAULT (torchvision's, downloaded "
                         "into torch's cache), a state_dict file (.pth), or none",
                         check=_check_weights)
    num_workers: int = field(len(os.sched_getaffinity(0)), "DataLoader worker processes "
                             "(default: this machine's cores; 0: load in the training "
                             "process); kept on resume", min=0, fixed_on_resume=True)
    momentum: float = field(0.9, "SGD momentum", min=0, max=0.999, fixed_on_resume=True)
    nesterov: bool = field(True, "Nesterov momentum", fixed_on_resume=True)
    weight_decay: float = field(5e-4, "weight decay (not on biases and norm weights)", min=0,
                                fixed_on_resume=True)
    label_smoothing: float = field(0.1, "label smoothing of the training loss", min=0, max=0.99)
