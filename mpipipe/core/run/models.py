"""The model zoo: CNNs written as flat nn.Sequential so that a pipeline can cut them anywhere."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["MODELS", "build_model", "lenet", "vgg", "resnet", "ResidualBlock"]


def _flat_features(layers: nn.Sequential, in_shape: Sequence[int]) -> int:
    with torch.no_grad():
        return int(layers(torch.zeros(1, *in_shape)).numel())


def lenet(num_classes: int, in_shape: Sequence[int]) -> nn.Sequential:
    """LeNet-5 style: two conv/pool blocks and three fully connected layers.

    MNIST-sized images get LeNet-5's 5x5 convolutions with 6 and 16 channels. Images
    smaller than 16 pixels (the 8x8 digits) get 3x3 convolutions with padding, so that the
    two poolings still leave a 2x2 map, and 16 and 32 channels: with 6 and 16 the net
    plateaus near 95% on digits, with 16 and 32 it reaches about 97% in 600 steps.
    """
    c, h, w = in_shape
    k, pad, c1, c2 = (5, 2, 6, 16) if min(h, w) >= 16 else (3, 1, 16, 32)
    features = nn.Sequential(
        nn.Conv2d(c, c1, k, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, k, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
    )
    n = _flat_features(features, in_shape)
    return nn.Sequential(
        *features,
        nn.Linear(n, 120), nn.ReLU(),
        nn.Linear(120, 84), nn.ReLU(),
        nn.Linear(84, num_classes),
    )


def vgg(num_classes: int, in_shape: Sequence[int], widths: Sequence[int] = (32, 64, 128),
        hidden: int = 256) -> nn.Sequential:
    """VGG style for 32x32 images: per width two 3x3 conv+ReLU then a 2x2 max-pool.

    No batch norm and no dropout, so that pipelined training is exactly single-process
    training (the equality tests rely on it).
    """
    c = in_shape[0]
    layers: list[nn.Module] = []
    for width in widths:
        layers += [nn.Conv2d(c, width, 3, padding=1), nn.ReLU(),
                   nn.Conv2d(width, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        c = width
    layers.append(nn.Flatten())
    n = _flat_features(nn.Sequential(*layers), in_shape)
    layers += [nn.Linear(n, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)]
    return nn.Sequential(*layers)


class ResidualBlock(nn.Module):
    """conv-norm-ReLU-conv-norm plus a (projected) shortcut, then ReLU: one pipeline unit.

    A block is a single module so that the network stays an nn.Sequential and a stage
    boundary never cuts a skip connection. GroupNorm, not BatchNorm: it normalises each
    sample on its own, so splitting a mini-batch into micro-batches changes nothing.
    """

    def __init__(self, cin: int, cout: int, stride: int = 1, groups: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(min(groups, cout), cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(min(groups, cout), cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                          nn.GroupNorm(min(groups, cout), cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        return torch.relu(y + self.shortcut(x))


def resnet(num_classes: int, in_shape: Sequence[int],
           widths: Sequence[int] = (16, 32, 64), blocks_per_width: int = 2) -> nn.Sequential:
    """A small ResNet (CIFAR style): stem, residual blocks, global average pool, linear."""
    c = in_shape[0]
    layers: list[nn.Module] = [nn.Conv2d(c, widths[0], 3, padding=1, bias=False),
                               nn.GroupNorm(min(8, widths[0]), widths[0]), nn.ReLU()]
    cin = widths[0]
    for i, width in enumerate(widths):
        for b in range(blocks_per_width):
            stride = 2 if (i > 0 and b == 0) else 1
            layers.append(ResidualBlock(cin, width, stride))
            cin = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


MODELS = {"lenet": lenet, "vgg": vgg, "resnet": resnet}


def build_model(name: str, num_classes: int, in_shape: Sequence[int]) -> nn.Sequential:
    """Build a zoo model for images of shape (C, H, W) and `num_classes` classes.

    Raises:
        ValueError: unknown name, or an input shape that is not (C, H, W).
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if len(in_shape) != 3 or min(in_shape) < 1:
        raise ValueError(f"in_shape must be (C, H, W) with positive sizes, got {tuple(in_shape)}")
    return MODELS[name](num_classes, tuple(int(s) for s in in_shape))
