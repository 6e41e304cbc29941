"""CIFAR's commands besides training and ``evaluate``: ``predict`` and ``export``, and the
splits of ``evaluate --split``: ``training``, and ``test`` for a run that validated on images
held out of train (``--val-fraction``)."""

import dataclasses

import torch
from torchvision.transforms import v2

from recipes.cifar.batches import CIFAR10_MEAN, CIFAR10_STD, EvalBatches
from recipes.cifar.data import IMAGE_SHAPE, CifarArrays
from recipes.common.predict import predict_command
from recipes.runner.commands.export import Exportable, export_command
from recipes.runner.commands.trained import Trained
from recipes.runner.config.command_line import ConfigError


def image_batch(trained: Trained, images: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [3,H,W] images -> one normalised batch, as ``EvalBatches`` makes them; an image
    of another size than CIFAR's 32 px is resized (shorter side) and centre-cropped first."""
    side = IMAGE_SHAPE[-1]
    fit = v2.Compose([v2.Resize(side, antialias=True), v2.CenterCrop(side)])
    stacked = torch.stack([image if tuple(image.shape) == IMAGE_SHAPE else fit(image)
                           for image in images])
    batches = EvalBatches(stacked, torch.zeros(len(images), dtype=torch.int64), len(images),
                          device=trained.device, channels_last=trained.config.channels_last)
    return next(iter(batches))


def training_split(arrays: CifarArrays) -> CifarArrays:
    return dataclasses.replace(arrays, test_images=arrays.train_images,
                               test_labels=arrays.train_labels)


def test_split(arrays: CifarArrays) -> CifarArrays:
    """The official test set, which a ``--val-fraction`` run never looked at."""
    if arrays.held_test is None:
        raise ConfigError("--split test: this run validated on the test split itself (it has "
                          "no --val-fraction); evaluate it without --split")
    images, labels = arrays.held_test
    return dataclasses.replace(arrays, test_images=images, test_labels=labels, held_test=None)


def rebuild_facts(trained: Trained) -> dict:
    """``recipes.cifar.model.build_model(model, num_classes)`` and its input: images of
    ``image_size`` px, ``(x / 255 - mean) / std`` per channel."""
    classes = list(trained.data.classes)
    return {"model": trained.config.model, "num_classes": len(classes), "classes": classes,
            "image_size": IMAGE_SHAPE[-1], "mean": list(CIFAR10_MEAN), "std": list(CIFAR10_STD),
            "channels_last": trained.config.channels_last}


COMMANDS = {"predict": predict_command(image_batch, lambda arrays: arrays.classes),
            "export": export_command(Exportable(lambda batch: batch[0], rebuild_facts))}
EVAL_SPLITS = {"training": training_split, "test": test_split}
