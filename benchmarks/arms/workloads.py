"""The two training workloads every engine arm runs: a tiny MLP and the CIFAR default recipe.

A workload fixes everything the arms must share: the initial weights (each run trains a
deep copy of ``template``), the optimizer, the loss, the batches (made once, held in
memory), the clipping threshold and the probe batch whose loss after training checks
that every arm computed the same thing.
"""

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from recipes.cifar.batches import TrainBatches
from recipes.cifar.data import CifarArrays, make_synthetic, subset
from recipes.cifar.model import build_model
from recipes.cifar.recipe import Config
from recipes.common.optimizers import param_groups

Batch = tuple[torch.Tensor, torch.Tensor]

# Above every gradient norm these workloads reach, so the clip costs what a real clip costs
# (a global norm and a multiply of every gradient) but multiplies by exactly 1.0: the
# trajectory does not depend on it, and Ignite's stock trainer, which cannot clip, trains
# the same weights as the arms that do. The parity check fails if this stops being true.
NEVER_REACHED_GRAD_NORM = 1e4

TINY_FEATURES, TINY_HIDDEN, TINY_CLASSES = 32, 32, 10


@dataclass
class Workload:
    name: str
    template: nn.Module
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    loss_fn: nn.Module
    batches: list[Batch]  # warmup + timed, in order
    probe: Batch
    warmup: int
    batch_size: int
    max_grad_norm: float = NEVER_REACHED_GRAD_NORM
    block: int | None = None  # timed iterations per block (see WindowTimer); None: all

    @property
    def timed(self) -> int:
        return len(self.batches) - self.warmup

    def fresh(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        """A deep copy of the initial model and a new optimizer over it."""
        model = copy.deepcopy(self.template)
        return model, self.make_optimizer(model)

    @torch.no_grad()
    def probe_loss(self, model: nn.Module) -> float:
        """Loss of ``model`` on the probe batch in eval mode: compares weights (and
        BatchNorm statistics) across arms without depending on how an arm reports loss."""
        was_training = model.training
        model.eval()
        x, y = self.probe
        loss = float(self.loss_fn(model(x), y))
        model.train(was_training)
        return loss


def tiny_workload(warmup: int, timed: int, batch_size: int = 32, seed: int = 0) -> Workload:
    """Linear(32, 32) - ReLU - Linear(32, 10), batch 32: the step costs tens of
    microseconds, so what an engine adds per iteration dominates."""
    torch.manual_seed(seed)
    template = nn.Sequential(
        nn.Linear(TINY_FEATURES, TINY_HIDDEN), nn.ReLU(), nn.Linear(TINY_HIDDEN, TINY_CLASSES)
    )
    generator = torch.Generator().manual_seed(seed + 1)

    def batch() -> Batch:
        x = torch.randn(batch_size, TINY_FEATURES, generator=generator)
        return x, torch.randint(0, TINY_CLASSES, (batch_size,), generator=generator)

    batches = [batch() for _ in range(warmup + timed)]

    def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)

    return Workload("tiny", template, make_optimizer, nn.CrossEntropyLoss(), batches, batch(),
                    warmup, batch_size)


def cifar_workload(
    warmup: int, timed: int, batch_size: int | None = None, channels_last: bool = True,
    seed: int = 0, arrays: CifarArrays | None = None,
) -> Workload:
    """The CIFAR recipe's defaults (``recipes.cifar.recipe.Config``): airbench net with its
    whitening layer fitted, SGD with Nesterov momentum and weight-decay groups,
    label-smoothed cross-entropy, fp32; batches made by the recipe's own ``TrainBatches``
    (crop + flip, normalised) before timing, from the first images of ``arrays`` (real
    CIFAR-10, say), else from synthetic CIFAR-shaped images."""
    config = Config()
    batch_size = batch_size or config.batch_size
    n_train = batch_size * (warmup + timed)
    if arrays is None:
        arrays = make_synthetic(n_train, batch_size, seed=seed)
    elif len(arrays.train_labels) < n_train:
        raise ValueError(f"{warmup + timed} batches of {batch_size} need {n_train} training "
                         f"images; the arrays hold {len(arrays.train_labels)}")
    arrays = subset(arrays, n_train, batch_size)
    source = TrainBatches(arrays.train_images, arrays.train_labels, batch_size, seed=seed,
                          channels_last=channels_last, crop_padding=config.crop_padding)
    batches = list(source.epoch_batches(1))
    probe = (source.normalise(arrays.test_images), arrays.test_labels)
    torch.manual_seed(seed)
    template = build_model(config.model)
    template.init_whitening(source.normalise(arrays.train_images[:5000]))
    if channels_last:
        template = template.to(memory_format=torch.channels_last)

    def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(param_groups(model, config.weight_decay), lr=config.lr,
                               momentum=config.momentum, nesterov=config.nesterov)

    loss_fn = nn.CrossEntropyLoss(label_smoothing=config.label_smoothing)
    return Workload("cifar", template, make_optimizer, loss_fn, batches, probe, warmup,
                    batch_size)
