"""The cifar recipe's keys: its ``Config``, read by ``python -m recipes cifar`` before torch
loads (no torch here).

The names of the models and of the test-time augmentations are those of
``recipes.cifar.model``'s ``MODELS`` and ``TTA_PREDICTS`` (a test checks that they agree).
"""

from dataclasses import dataclass

from recipes.common.optimizer_choice import OptimizerChoice
from recipes.runner.config.command_line import field
from recipes.runner.config.run_keys import RunConfig

MODEL_NAMES = ("airbench", "resnet18")
TTA_NAMES = ("none", "mirror", "mirror_translate")
FLIPS = ("random", "alternating")


@dataclass
class Config(OptimizerChoice, RunConfig):
    # Muon for the conv filters reaches in 8 epochs what SGD alone reaches in 10 (docs/results.md).
    epochs: int = field(8, "epochs to train", min=1)
    optimizer: str = field(
        "muon", "muon: Muon (momentum orthogonalised by Newton-Schulz) for the conv filters, "
        "SGD-Nesterov for the rest (norm shifts, whitening bias, head); sgd: SGD for every "
        "weight", choices=("sgd", "muon"), fixed_on_resume=True)
    # Optimizer steps of airbench94's batch, 1024 samples: 49 an epoch, 392 in the run
    # (batch 256 took 1,568; on a GPU a step's cost is the host's dispatches, nearly whatever
    # the batch). Two micro-batches of 512 make each step: on a CPU a forward and backward
    # of 1024 images at once costs 1.18x per image what 256 or 512 do (measured, 2 cores).
    batch_size: int = field(512, "global batch size (samples per micro-batch, all "
                            "processes); --accum-steps of them make an optimizer step",
                            min=1, fixed_on_resume=True)
    accum_steps: int = field(2, "micro-batches per optimizer step (on a GPU, where a step "
                             "costs the host's op dispatches rather than the images, "
                             "--batch-size 1024 --accum-steps 1 dispatches half the forward "
                             "and backward ops for the same steps)", min=1,
                             fixed_on_resume=True)
    # The SGD groups keep airbench94's own LR at this batch; Muon's per-step LR is raised and
    # its momentum lowered for four times fewer steps, between the batch-256 tuning
    # (0.04 / 0.85) and airbench94_muon's batch 2000 (0.24 / 0.6) (docs/results.md).
    lr: float = field(1.5, "peak learning rate of the SGD groups (airbench94's 1.5 per 1024 "
                      "samples)", min=0, min_exclusive=True)
    muon_lr: float = field(0.12, "peak LR of the Muon weights (their step size relative to "
                           "the weight's size; --optimizer muon)", min=0, min_exclusive=True,
                           fixed_on_resume=True)
    muon_momentum: float = field(0.7, "momentum of the Muon weights (Nesterov)", min=0,
                                 max=0.999, fixed_on_resume=True)
    data_dir: str = field("auto", "CIFAR-10 folder (image folders or python batches); auto: "
                          "../shared/data/cifar10, else data/cifar10 (downloaded if missing)")
    dataset: str = field("cifar10", "data set", choices=("cifar10", "synthetic"),
                         fixed_on_resume=True)
    model: str = field("airbench", "network", choices=MODEL_NAMES, fixed_on_resume=True)
    momentum: float = field(0.85, "SGD momentum", min=0, max=0.999, fixed_on_resume=True)
    nesterov: bool = field(True, "Nesterov momentum", fixed_on_resume=True)
    weight_decay: float = field(1.33e-3, "weight decay (not on biases and norm weights)", min=0,
                                fixed_on_resume=True)
    label_smoothing: float = field(0.2, "label smoothing of the training loss", min=0, max=0.99)
    crop_padding: int = field(2, "random-translate augmentation, in pixels (0: off)", min=0,
                              max=16)
    flip: str = field("alternating", "horizontal flips: random in each epoch, or alternating "
                      "(each image mirrored in every other epoch)", choices=FLIPS)
    lookahead: bool = field(True, "lookahead weight averaging (from 30% of the run on)",
                            fixed_on_resume=True)
    train_subset: int | None = field(None, "use only the first N training samples", min=1,
                                     fixed_on_resume=True)
    val_subset: int | None = field(None, "use only the first N validation samples", min=1,
                                   fixed_on_resume=True)
    val_fraction: float | None = field(None, "hold out this fraction of train for validation "
                                       "instead of the test split", min=0, max=0.5,
                                       min_exclusive=True, fixed_on_resume=True)
    channels_last: bool = field(True, "channels_last memory format (faster on CPU, measured)")
    tta: str = field("mirror", "test-time augmentation of the evaluations during the run",
                     choices=TTA_NAMES)
    final_tta: str = field("mirror_translate", "test-time augmentation of the evaluation after "
                           "the last epoch (mirror_translate: 6 forwards per image)",
                           choices=TTA_NAMES)
