"""A user's own model, as a test brings it: Conv-BatchNorm-ReLU blocks with residual adds
and Dropout before the classifier, written as a plain nn.Module (not an nn.Sequential),
so that the pipeline must trace it into a chain (mpipipe.core.run.chain)."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class OwnNet(nn.Module):
    def __init__(self, num_classes: int = 10, width: int = 8, p: float = 0.25) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.block1 = Block(width)
        self.pool = nn.MaxPool2d(2)
        self.block2 = Block(width)
        self.drop = nn.Dropout(p)
        self.fc = nn.Linear(width * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.stem(x)))
        x = self.pool(self.block1(x))
        x = self.block2(x)
        return self.fc(self.drop(torch.flatten(x, 1)))


def own_net(num_classes: int = 10, width: int = 8, p: float = 0.25) -> nn.Module:
    """The factory a config names: model.factory = "tests/models/own.py:own_net"."""
    return OwnNet(num_classes, width, p)
