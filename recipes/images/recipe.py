"""Image classification on any image-folder tree, with any torchvision model and DataLoader workers.

``--data-dir`` holds ``train/<class>/<image>`` and ``val/<class>/<image>`` (or ``test/``),
or only ``train/`` with ``--val-fraction``. Each sample is decoded and augmented in a
DataLoader worker (pad-and-crop for images of 64 px or less, a random resized crop
above, then a horizontal flip) and normalised on the device. The network is any
torchvision classification model by name, untrained with a CIFAR-style stem for small
images or from torchvision's pretrained weights with a new head (``--weights``), trained
with SGD-Nesterov and label smoothing. A run killed mid-epoch resumes exactly, with any
number of workers (``recipes.images.data``). The run itself (folder, resume, handlers,
processes) is the run layer's (``recipes.runner``).
"""

from pathlib import Path

import ignite.distributed as idist
import torch
import torchvision
from ignite.metrics import Accuracy, Loss
from torch import nn

from handlers.cost import training_flops
from recipes.common.optimizers import build_optimizer
from recipes.common.paths import data_dir_candidates, default_data_dir, places_looked_in
from recipes.images.config import LAYOUT, MAX_AUTO_SIZE, SMALL_IMAGE_MAX, Config
from recipes.images.data import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    EpochBatchSampler,
    ImageData,
    ImageFiles,
    ImageFolders,
    NormaliseOnDevice,
    TrainLoader,
    channel_stats,
    eval_loader,
    eval_transform,
    list_image_folders,
    report_skipped,
    shorter_side,
    train_transform,
)
from recipes.images.pretrained import pretrained_classifier, read_pretrained, weights_file
from recipes.runner.api import Context, Parts, Recipe
from recipes.runner.config.command_line import DataError
from recipes.runner.training.fingerprint import fingerprint_files


def data_folder(config: Config) -> Path:
    return default_data_dir("cifar10") if config.data_dir == "auto" else Path(config.data_dir)


def load_data(config: Config) -> ImageData:
    """List and check the tree (``DataError`` before anything is written), pick the image
    size and measure the normalisation statistics."""
    auto, root = config.data_dir == "auto", data_folder(config)
    if auto and not root.is_dir():
        places = places_looked_in(data_dir_candidates("cifar10"))
        raise DataError(f"--data-dir auto: no CIFAR-10 folders in {places}: expected {LAYOUT}; "
                        "name such a folder with --data-dir")
    if not root.is_dir():
        raise DataError(f"--data-dir {root} is not a folder: expected one with {LAYOUT}")
    folders = list_image_folders(root, config.val_fraction)
    if idist.get_rank() == 0:
        report_skipped(folders.skipped, root)
    size = config.image_size or min(shorter_side(folders.train[0][0]), MAX_AUTO_SIZE)
    weights = weights_file(config.weights, config.model)
    pretrained = None if weights is None else read_pretrained(weights, config.model)
    if config.normalize == "imagenet":
        return ImageData(folders, size, IMAGENET_MEAN, IMAGENET_STD, pretrained)
    return ImageData(folders, size, *channel_stats(folders.train, size), pretrained)


def stand_in_data(config: Config) -> ImageData:
    """Two classes of files that are never read, for ``--describe``: the wiring needs the
    class count and the batch counts, not the images, so it is shown without the tree."""
    samples = [(Path(f"stand-in-{index}.png"), index % 2) for index in range(2 * config.batch_size)]
    folders = ImageFolders(Path("stand-in"), ["a", "b"], samples, samples[:2], "stand-in", [])
    return ImageData(folders, config.image_size or 32, IMAGENET_MEAN, IMAGENET_STD)


def build_classifier(name: str, num_classes: int, small_images: bool) -> nn.Module:
    """An untrained torchvision model. For small images, a CIFAR-style stem: the first
    conv becomes 3x3 with stride 1 and a max-pool right after it (before the next conv)
    goes, so a 32 px image enters the first stage at full size instead of 8 px."""
    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    if small_images:
        convs = 0
        for path, module in list(model.named_modules()):
            parent_path, _, attribute = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            if isinstance(module, nn.Conv2d):
                convs += 1
                if convs > 1:
                    break
                setattr(parent, attribute, nn.Conv2d(module.in_channels, module.out_channels, 3,
                                                     padding=1, bias=module.bias is not None))
            elif isinstance(module, nn.MaxPool2d) and convs == 1:
                setattr(parent, attribute, nn.Identity())
                break
    return model


def stages(model: nn.Module) -> list[nn.Module]:
    """The blocks ``--strategy fsdp`` shards one by one, for any torchvision classifier: the
    stages at the model's top level when it has more than two (ResNet's ``layer1`` to
    ``layer4``), else the parts of its largest sequence of modules (the stages in
    ``features`` of ConvNeXt, EfficientNet or VGG, a ViT's encoder layers), else its
    top-level parts; only parts that hold parameters."""
    def size(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    top = [child for child in model.children() if size(child)]
    stacked = [child for child in top if isinstance(child, nn.Sequential)]
    if len(stacked) > 2:
        return stacked
    sequences = [module for module in model.modules()
                 if isinstance(module, nn.Sequential | nn.ModuleList)]
    largest = [child for child in max(sequences, key=size, default=[]) if size(child)]
    return largest if len(largest) > 1 else top


def build(config: Config, data: ImageData, ctx: Context) -> Parts:
    folders, pin_memory = data.folders, ctx.device.type == "cuda"
    sampler = EpochBatchSampler(len(folders.train), config.batch_size, seed=config.seed,
                                rank=ctx.rank, world_size=ctx.world_size)
    train_batches = TrainLoader(
        ImageFiles(folders.train, train_transform(data.image_size), seed=config.seed), sampler,
        num_workers=config.num_workers, pin_memory=pin_memory)
    val_batches = eval_loader(ImageFiles(folders.val, eval_transform(data.image_size)),
                              config.batch_size // ctx.world_size, num_workers=config.num_workers,
                              rank=ctx.rank, world_size=ctx.world_size, pin_memory=pin_memory)
    if data.pretrained is None:
        net = build_classifier(config.model, len(folders.classes),
                               small_images=data.image_size <= SMALL_IMAGE_MAX)
    else:
        net = pretrained_classifier(config.model, data.pretrained, len(folders.classes))
    net = net.to(ctx.device)
    model = ctx.distribute(net)  # checkpoints hold `net` (FSDP shards it in place)
    optimizer = build_optimizer(config, model, own="sgd", lr=config.lr,
                                momentum=config.momentum, nesterov=config.nesterov)
    metrics = {"accuracy": Accuracy(device=ctx.device),
               "loss": Loss(nn.functional.cross_entropy, device=ctx.device)}
    return Parts(model=net, train_model=model, optimizer=optimizer, metrics=metrics,
                 train_batches=train_batches, val_batches=val_batches,
                 loss_fn=nn.CrossEntropyLoss(label_smoothing=config.label_smoothing),
                 prepare_batch=NormaliseOnDevice(data.mean, data.std),
                 num_classes=len(data.folders.classes),
                 model_flops=training_flops(net, torch.zeros(1, 3, data.image_size,
                                                             data.image_size, device=ctx.device)))


def fingerprint(data: ImageData) -> dict[str, dict]:
    """Per split: file names, sizes and labels (the class names are in the counts)."""
    folders = data.folders
    return {"training": fingerprint_files(folders.train, folders.root, folders.classes),
            "validation": {**fingerprint_files(folders.val, folders.root, folders.classes),
                           "source": folders.val_source}}


RECIPE = Recipe(
    name="images", summary=__doc__.splitlines()[0], config=Config, load_data=load_data,
    build=build, metrics={"accuracy": "max", "loss": "min"}, best="accuracy",
    sample_counts=lambda data: (len(data.folders.train), len(data.folders.val)),
    commands="recipes.images.commands", blocks=stages,
    fingerprint=fingerprint, data_source=lambda config: str(data_folder(config)),
    stand_in_data=stand_in_data)
