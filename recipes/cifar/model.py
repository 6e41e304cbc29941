"""CIFAR-sized image classifiers: a fast default ('airbench') and a CIFAR ResNet-18.

``build_model(name)`` picks one; ``TTA_PREDICTS`` holds evaluator ``predict`` hooks for
test-time augmentation: none, the mirror image, and mirror plus one-pixel translates.

The default network follows the design ideas of Keller Jordan's airbench94
(a whitening first layer fitted to data patches, three conv groups with max-pool,
BatchNorm without a learned scale, identity-initialised convs, a scaled linear
head); the code here is our own.
"""

from collections.abc import Callable
from typing import Any

import torch
import torchvision
from torch import nn

from engine.batch import Predict, supervised_predict

# Conv group widths (output channels) of the default network, after the 24-filter
# whitening layer. Spatial size: 32 -> 31 (2x2 whitening conv) -> 15 -> 7 -> 3.
AIRBENCH_WIDTHS = (64, 256, 256)
# Eigenvalue floor when fitting the whitening filters (patches are normalised pixels).
WHITENING_EPS = 5e-4
# The head's logits are multiplied by this: small logits early keep the high LR stable.
HEAD_SCALE = 1 / 9
# BatchNorm shifts are stored divided by this factor, so plain SGD moves them
# BIAS_LR_FACTOR**2 = 64 times faster than the other weights (their gradients are tiny
# next to the scale-invariant conv weights') without a separate optimizer group.
BIAS_LR_FACTOR = 8.0


class ShiftOnlyBatchNorm(nn.Module):
    """BatchNorm with a fixed unit scale and a learned shift (fast-learning, see above).

    The conv before it is scale-invariant under normalisation, so a learned
    scale adds nothing but another direction for weight decay to fight.
    """

    def __init__(self, channels: int, momentum: float = 0.4, eps: float = 1e-12) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(channels, eps=eps, momentum=momentum, affine=False)
        self.shift = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) + (BIAS_LR_FACTOR * self.shift).view(1, -1, 1, 1)


class IdentityInitConv(nn.Conv2d):
    """3x3 'same' conv, no bias; its first ``in_channels`` filters start as the identity,
    so the block starts close to passing its input through (trains faster)."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size=3, padding="same", bias=False)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        with torch.no_grad():
            nn.init.dirac_(self.weight[: min(self.in_channels, self.out_channels)])


class ConvGroup(nn.Sequential):
    """conv -> 2x2 max-pool -> BN -> GELU -> conv -> BN -> GELU."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(
            IdentityInitConv(in_channels, out_channels),
            nn.MaxPool2d(2),
            ShiftOnlyBatchNorm(out_channels),
            nn.GELU(),
            IdentityInitConv(out_channels, out_channels),
            ShiftOnlyBatchNorm(out_channels),
            nn.GELU(),
        )


class AirbenchNet(nn.Module):
    """About 2M parameters; ~94% CIFAR-10 test accuracy class in about 10 epochs.

    Call ``init_whitening(images)`` once before training, with a few thousand
    normalised training images: it fits the first layer to decorrelate 2x2
    patches and freezes it. Without it the first layer is an ordinary learned conv.

    >>> model = AirbenchNet()
    >>> model.init_whitening(torch.randn(64, 3, 32, 32))
    >>> model(torch.randn(2, 3, 32, 32)).shape
    torch.Size([2, 10])
    """

    def __init__(self, num_classes: int = 10, widths: tuple[int, int, int] = AIRBENCH_WIDTHS):
        super().__init__()
        whiten_channels = 2 * 3 * 2 * 2  # each 2x2x3 patch direction, with both signs
        self.whiten = nn.Conv2d(3, whiten_channels, kernel_size=2, padding=0)
        nn.init.zeros_(self.whiten.bias)  # whitened patches are centred: start unbiased
        self.body = nn.Sequential(
            nn.GELU(),
            ConvGroup(whiten_channels, widths[0]),
            ConvGroup(widths[0], widths[1]),
            ConvGroup(widths[1], widths[2]),
            nn.MaxPool2d(3),
            nn.Flatten(),
        )
        self.head = nn.Linear(widths[2], num_classes, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return HEAD_SCALE * self.head(self.body(self.whiten(x)))

    @torch.no_grad()
    def init_whitening(self, images: torch.Tensor) -> None:
        """Set the first layer to PCA-whiten 2x2 patches of ``images`` (float, normalised,
        [N,3,32,32]; ~5000 images suffice) and freeze its weight; the bias keeps learning."""
        kernel = self.whiten.kernel_size
        patches = images.float().unfold(2, kernel[0], 1).unfold(3, kernel[1], 1)
        # [N,C,H',W',kh,kw] -> one row per patch, laid out like a conv filter (C,kh,kw).
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, 3 * kernel[0] * kernel[1])
        covariance = patches.T @ patches / patches.shape[0]
        eigenvalues, eigenvectors = torch.linalg.eigh(covariance)
        filters = (eigenvectors / torch.sqrt(eigenvalues + WHITENING_EPS)).T
        filters = filters.reshape(-1, 3, *kernel).to(self.whiten.weight)
        self.whiten.weight.copy_(torch.cat([filters, -filters]))
        self.whiten.weight.requires_grad_(False)


def cifar_resnet18(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 with a 3x3 stride-1 stem and no max-pool (32x32 inputs)."""
    model = torchvision.models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


MODELS: dict[str, Callable[[int], nn.Module]] = {
    "airbench": AirbenchNet,
    "resnet18": cifar_resnet18,
}


def stages(model: nn.Module) -> list[nn.Module]:
    """The blocks ``--strategy fsdp`` shards one by one: airbench's three conv groups,
    ResNet-18's four stages."""
    if isinstance(model, AirbenchNet):
        return [module for module in model.body if isinstance(module, ConvGroup)]
    return [model.layer1, model.layer2, model.layer3, model.layer4]


def build_model(name: str, num_classes: int = 10) -> nn.Module:
    """A freshly initialised model by name: one of ``MODELS``."""
    if name not in MODELS:
        raise ValueError(f"model name must be one of {sorted(MODELS)}, got {name!r}")
    return MODELS[name](num_classes)


def _mirror_mean(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(torch.cat([x, x.flip(-1)]))
    return logits.float().view(2, x.shape[0], -1).mean(0)


def flip_tta_predict(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Evaluator ``predict`` hook: mean of the logits for each image and its horizontal
    mirror (training used random flips, so both are in-distribution), in fp32."""
    x, y = batch
    return _mirror_mean(model, x), y


def mirror_translate_tta_predict(
    model: nn.Module, batch: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Evaluator ``predict`` hook (airbench's level 2): the mirror mean of the image
    weighs 1/2, and those of copies shifted by one pixel up-left and down-right
    (reflect-padded, as in training's translate) 1/4 each. Six forwards per image."""
    x, y = batch
    h, w = x.shape[-2:]
    padded = torch.nn.functional.pad(x, (1, 1, 1, 1), mode="reflect")
    shifted = [padded[..., :h, :w], padded[..., 2:, 2:]]
    logits = 0.5 * _mirror_mean(model, x)
    for view in shifted:
        logits += 0.25 * _mirror_mean(model, view.contiguous(memory_format=_format_of(x)))
    return logits, y


def _format_of(x: torch.Tensor) -> torch.memory_format:
    channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    return torch.channels_last if channels_last else torch.contiguous_format


TTA_PREDICTS: dict[str, Predict] = {
    "none": supervised_predict,  # no augmentation: the engine's own hook
    "mirror": flip_tta_predict,
    "mirror_translate": mirror_translate_tta_predict,
}
TTA_FORWARDS = {"none": 1, "mirror": 2, "mirror_translate": 6}  # per image, of each hook


class TTAPredict:
    """An evaluator ``predict`` hook whose augmentation (a ``TTA_PREDICTS`` name) may change
    between evaluations: the recipe spends six forwards per image only on the last one."""

    def __init__(self, name: str) -> None:
        if name not in TTA_PREDICTS:
            raise ValueError(f"test-time augmentation must be one of {sorted(TTA_PREDICTS)}, "
                             f"got {name!r}")
        self.name = name

    def __call__(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return TTA_PREDICTS[self.name](model, batch)
