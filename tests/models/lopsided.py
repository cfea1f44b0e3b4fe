"""A model whose layers' times differ by orders of magnitude, and whose parameters lie
elsewhere: the cut by time is then one and the same in every timing, however noisy the
machine, and differs from the cut by parameters (tests/test_plan_matches_run.py).

Layer 4 runs one 3x3 convolution ``repeats`` times (50 forward and backward passes on a
micro-batch of digits: 20 ms on a busy 2-core machine) and holds 10 parameters; the six
others are each one cheap call (0.1 ms there), and layer 1 holds most of the parameters. In 3
stages the slowest stage is smallest only with layer 4 alone, so the cut by time is
[4, 1, 2], whatever the noise as long as layer 4 outlasts layers 0-3 together; the cut
by parameters puts layer 1 alone at the front."""

from __future__ import annotations

import torch
from torch import nn


class Repeat(nn.Module):
    """One small convolution applied ``repeats`` times: much time, few parameters."""

    def __init__(self, repeats: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, padding=1)
        self.repeats = repeats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.repeats):
            x = torch.tanh(self.conv(x))
        return x


def lopsided(num_classes: int = 10, repeats: int = 50) -> nn.Sequential:
    """The factory a config names: model.factory = "tests/models/lopsided.py:lopsided"
    (input 1x8x8, the digits)."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(64, 64), nn.Unflatten(1, (1, 8, 8)), nn.ReLU(),
        Repeat(repeats),
        nn.Flatten(), nn.Linear(64, num_classes))
