"""The image-folder recipe's commands besides training and ``evaluate``: ``predict``, and the
training split for ``evaluate --split training``."""

import dataclasses
from typing import TYPE_CHECKING

import torch

from recipes.common.predict import predict_command
from recipes.images.data import eval_transform
from recipes.runner.trained import Trained

if TYPE_CHECKING:  # the recipe imports this module
    from recipes.images.recipe import ImageData


def image_batch(trained: Trained, images: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [3,H,W] images -> the uint8 batch an evaluation loader yields (resized and
    centre-cropped to the run's side); the run's ``prepare_batch`` normalises it."""
    view = eval_transform(trained.data.image_size)
    return (torch.stack([view(image) for image in images]),
            torch.zeros(len(images), dtype=torch.int64))


def training_split(data: "ImageData") -> "ImageData":
    """The data with the training files, seen through the evaluation transform, as its
    validation split."""
    return dataclasses.replace(data, folders=dataclasses.replace(data.folders,
                                                                 val=data.folders.train))


COMMANDS = {"predict": predict_command(image_batch, lambda data: data.folders.classes)}
EVAL_SPLITS = {"training": training_split}
