"""CIFAR-10 image classification (airbench-style net or ResNet-18), data in memory.

The images are uint8 tensors on the device, augmented there once per epoch (random
translate, alternating flips); the net is airbench94's, trained with SGD-Nesterov,
label smoothing and Lookahead averaging, evaluated with test-time augmentation.
Validation uses the official test split unless ``val_fraction`` holds out part of the
training set. The run itself (folder, resume, handlers, processes) is the run layer's
(``recipes.runner``).
"""

from dataclasses import replace
from pathlib import Path

import torch
from ignite.metrics import Accuracy, Loss

from handlers.cost import training_flops
from handlers.lookahead import Lookahead
from recipes.cifar.batches import EvalBatches, TrainBatches
from recipes.cifar.config import Config
from recipes.cifar.data import CifarArrays, holdout_validation, load_cifar10, make_synthetic, subset
from recipes.cifar.model import TTA_FORWARDS, TTAPredict, build_model, stages
from recipes.common.optimizers import build_optimizer
from recipes.common.paths import default_data_dir
from recipes.runner.api import Context, Parts, Recipe, RunPlan
from recipes.runner.config.command_line import ConfigError
from recipes.runner.training.fingerprint import fingerprint_arrays

SYNTHETIC_SIZES = (10_000, 2_000)  # train, test samples when no subset is given
# Lookahead as airbench94 tuned it, in samples rather than steps so that it means the same
# at any batch size: an update every 5120 samples keeping 0.95**5 (times the ramp), from
# 30% of the run on.
LOOKAHEAD_EVERY_SAMPLES, LOOKAHEAD_DECAY, LOOKAHEAD_START = 5 * 1024, 0.95**5, 0.3


def data_folder(config: Config) -> Path:
    return default_data_dir("cifar10") if config.data_dir == "auto" else Path(config.data_dir)


def data_source(config: Config) -> str:
    """Where the images come from, and which split validates: by default CIFAR-10's test
    split (as airbench94 and most CIFAR results report), which then also picks best.pt and
    stops early: the header says so rather than call test data validation silently."""
    source = "synthetic images" if config.dataset == "synthetic" else str(data_folder(config))
    if config.val_fraction:
        return (f"{source} (validation: the last {config.val_fraction:.0%} of train held out; "
                "the test split stays unseen until evaluate --split test)")
    return (f"{source} (validation: the test split, which also picks best.pt; --val-fraction "
            "0.1 holds out training images instead)")


def load_data(config: Config) -> CifarArrays:
    if config.strategy == "fsdp" and config.lookahead:  # its average would be sharded
        raise ConfigError("--lookahead: not with --strategy fsdp (its average of the weights "
                          "is not gathered into checkpoints); add --lookahead false")
    if config.dataset == "synthetic":
        sizes = config.train_subset or SYNTHETIC_SIZES[0], config.val_subset or SYNTHETIC_SIZES[1]
        arrays = make_synthetic(*sizes, seed=config.seed)
    else:
        # Only the auto fallback downloads: a --data-dir that holds nothing is most likely
        # a typo, and a failed download would leave its (empty) folder behind.
        arrays = load_cifar10(data_folder(config), download=config.data_dir == "auto")
    if config.val_fraction:
        try:
            arrays = holdout_validation(arrays, config.val_fraction)
        except ValueError as error:  # too few training samples to hold any out
            raise ConfigError(f"--val-fraction: {error}") from None
    return subset(arrays, config.train_subset, config.val_subset)


def build(config: Config, arrays: CifarArrays, ctx: Context) -> Parts:
    train_batches = TrainBatches(arrays.train_images, arrays.train_labels, config.batch_size,
                                 seed=config.seed, device=ctx.device, rank=ctx.rank,
                                 world_size=ctx.world_size, channels_last=config.channels_last,
                                 crop_padding=config.crop_padding, flip=config.flip)
    val_batches = EvalBatches(arrays.test_images, arrays.test_labels, 1024 // ctx.world_size,
                              device=ctx.device, rank=ctx.rank, world_size=ctx.world_size,
                              channels_last=config.channels_last)
    net = build_model(config.model, num_classes=len(arrays.classes)).to(ctx.device)
    if hasattr(net, "init_whitening"):  # fitted to the first 5000 (normalised) train images
        net.init_whitening(train_batches.normalise(train_batches.images[:5000]))
    if config.channels_last:
        net = net.to(memory_format=torch.channels_last)
    model = ctx.distribute(net)  # checkpoints hold `net` (FSDP shards it in place)
    optimizer = build_optimizer(config, model, own="sgd", lr=config.lr,
                                momentum=config.momentum, nesterov=config.nesterov)
    predict = TTAPredict(config.tta)

    def before_evaluation(final: bool) -> None:
        predict.name = config.final_tta if final else config.tta

    def attach_lookahead(trainer, evaluator, plan: RunPlan) -> dict[str, Lookahead]:
        if not config.lookahead:
            return {}
        # At least 10 updates in a run, however short (a smoke run averages too).
        every = min(round(LOOKAHEAD_EVERY_SAMPLES / (config.batch_size * config.accum_steps)),
                    plan.total_steps // 10)
        lookahead = Lookahead(net, plan.total_steps, decay_base=LOOKAHEAD_DECAY,
                              every=max(1, every),
                              start_step=round(LOOKAHEAD_START * plan.total_steps))
        lookahead.attach(trainer)
        return {"lookahead": lookahead}

    # Metrics accumulate on the device (no host copy per batch) and are summed over all
    # processes when computed: the result is that of one process seeing every sample.
    metrics = {"accuracy": Accuracy(device=ctx.device),
               "loss": Loss(torch.nn.functional.cross_entropy, device=ctx.device)}
    return Parts(model=net, train_model=model, optimizer=optimizer, metrics=metrics,
                 train_batches=train_batches, val_batches=val_batches,
                 loss_fn=torch.nn.CrossEntropyLoss(label_smoothing=config.label_smoothing),
                 predict=predict, attach_extra=attach_lookahead,
                 before_evaluation=before_evaluation,
                 evaluation_forwards=lambda final: TTA_FORWARDS[
                     config.final_tta if final else config.tta],
                 num_classes=len(arrays.classes),
                 model_flops=training_flops(net, train_batches.normalise(
                     train_batches.images[:1])))


def fingerprint(arrays: CifarArrays) -> dict[str, dict]:
    return {"training": fingerprint_arrays(arrays.train_labels, arrays.train_images,
                                           arrays.classes),
            "validation": fingerprint_arrays(arrays.test_labels, arrays.test_images,
                                             arrays.classes)}


RECIPE = Recipe(
    name="cifar", summary=__doc__.splitlines()[0], config=Config, load_data=load_data,
    build=build, metrics={"accuracy": "max", "loss": "min"}, best="accuracy",
    sample_counts=lambda arrays: (len(arrays.train_labels), len(arrays.test_labels)),
    commands="recipes.cifar.commands", blocks=stages,
    fingerprint=fingerprint, data_source=data_source,
    stand_in_data=lambda config: load_data(replace(config, dataset="synthetic")))
