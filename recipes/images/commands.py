"""The image-folder recipe's commands besides training and ``evaluate``: ``predict`` and
``export``, and the training split for ``evaluate --split training``."""

import dataclasses

import torch

from recipes.common.predict import predict_command
from recipes.images.config import SMALL_IMAGE_MAX
from recipes.images.data import ImageData, eval_transform
from recipes.runner.commands.export import Exportable, export_command
from recipes.runner.commands.trained import Trained


def image_batch(trained: Trained, images: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [3,H,W] images -> the uint8 batch an evaluation loader yields (resized and
    centre-cropped to the run's side); the run's ``prepare_batch`` normalises it."""
    view = eval_transform(trained.data.image_size)
    return (torch.stack([view(image) for image in images]),
            torch.zeros(len(images), dtype=torch.int64))


def training_split(data: ImageData) -> ImageData:
    """The data with the training files, seen through the evaluation transform, as its
    validation split."""
    return dataclasses.replace(data, folders=dataclasses.replace(data.folders,
                                                                 val=data.folders.train))


def rebuild_facts(trained: Trained) -> dict:
    """torchvision's ``model`` with ``num_classes`` outputs (``stem`` cifar: as
    ``recipes.images.recipe.build_classifier`` makes it for small images) and its input:
    images resized and centre-cropped to ``image_size`` px, ``(x / 255 - mean) / std``."""
    data = trained.data
    small = data.pretrained is None and data.image_size <= SMALL_IMAGE_MAX
    return {"model": trained.config.model, "num_classes": len(data.folders.classes),
            "classes": list(data.folders.classes), "stem": "cifar" if small else "torchvision",
            "image_size": data.image_size, "mean": list(data.mean), "std": list(data.std)}


COMMANDS = {"predict": predict_command(image_batch, lambda data: data.folders.classes),
            "export": export_command(Exportable(lambda batch: batch[0], rebuild_facts))}
EVAL_SPLITS = {"training": training_split}
