"""Cut an nn.Sequential into contiguous stages: by an explicit balance, measured time or parameters."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["split", "stage_modules", "StageChunks", "check_balance", "balance_by_time", "balance_by_params",
           "balance_costs", "layer_times"]


def check_balance(module: nn.Sequential, balance: Sequence[int]) -> list[int]:
    """Return `balance` as a list after checking that it covers every layer once.

    Raises:
        ValueError: a stage with no layer, or a sum that differs from the layer count.
    """
    balance = [int(b) for b in balance]
    if not balance:
        raise ValueError("balance is empty: give the number of layers of each stage")
    if any(b < 1 for b in balance):
        raise ValueError(f"balance {balance}: every stage needs at least one layer")
    if sum(balance) != len(module):
        raise ValueError(f"balance {balance} covers {sum(balance)} layers but the model has "
                         f"{len(module)}; the entries must add up to {len(module)}")
    return balance


def split(module: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Cut `module` into len(balance) nn.Sequential stages sharing the original layers.

    Layer names are kept, so a stage's state_dict keys are those of the whole model.
    """
    balance = check_balance(module, balance)
    names = list(module._modules.items())
    stages, start = [], 0
    for count in balance:
        stages.append(nn.Sequential(OrderedDict(names[start:start + count])))
        start += count
    return stages


class StageChunks(nn.Sequential):
    """The module of a stage that holds several model chunks (interleaved schedules).

    Why: a stage is what ResPipe replicates, checkpoints and hands over, so it needs one
    module whose parameters and state_dict are those of all its chunks (layer names are
    the model's). Its layers are not consecutive in the model, so it cannot be called:
    `chunks` are the runnable pieces, in model order.
    """

    def __init__(self, chunks: Sequence[nn.Sequential]) -> None:
        super().__init__(OrderedDict(item for c in chunks for item in c._modules.items()))
        self.chunks = list(chunks)  # a plain list: not registered twice as submodules

    def forward(self, *args: object) -> torch.Tensor:
        raise TypeError(f"this stage holds {len(self.chunks)} chunks that are not consecutive "
                        f"in the model: run each of .chunks where the schedule says")


def stage_modules(chunks: Sequence[nn.Sequential], k: int) -> list[nn.Sequential]:
    """Each of `k` stages' module: chunk k itself (one chunk per stage), or a
    :class:`StageChunks` of chunks k, k + K, k + 2K, ... (v = len(chunks) / k per stage)."""
    if len(chunks) % k:
        raise ValueError(f"{len(chunks)} chunks do not divide over {k} stages")
    if len(chunks) == k:
        return list(chunks)
    return [StageChunks(chunks[s::k]) for s in range(k)]


def balance_costs(costs: Sequence[float], k: int) -> list[int]:
    """Cut a sequence of per-layer costs into k contiguous non-empty parts with the
    smallest possible largest part (exact, by dynamic programming; n is small).

    Why the largest part: in a synchronous pipeline the slowest stage sets the pace.
    """
    n = len(costs)
    if not 1 <= k <= n:
        raise ValueError(f"cannot cut {n} layers into {k} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + max(float(c), 0.0))
    inf = float("inf")
    # best[j][i]: smallest largest part when the first i layers form j parts
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for s in range(j - 1, i):
                value = max(best[j - 1][s], prefix[i] - prefix[s])
                # ties go to the later cut, which keeps early stages lighter (they also
                # run the data loader)
                if value <= best[j][i]:
                    best[j][i], cut[j][i] = value, s
    bounds, i = [], n
    for j in range(k, 0, -1):
        s = cut[j][i]
        bounds.append(i - s)
        i = s
    return bounds[::-1]


def balance_by_params(module: nn.Sequential, k: int) -> list[int]:
    """Balance by parameter count (plus one per layer so parameter-free layers count a little)."""
    costs = [1 + sum(p.numel() for p in layer.parameters()) for layer in module]
    return balance_costs(costs, k)


def layer_times(module: nn.Sequential, sample: torch.Tensor, repeat: int = 5) -> list[float]:
    """Fastest forward+backward seconds of each layer on `sample` (a mini- or micro-batch).

    Each layer is timed alone on the output of the previous one, backward with a
    gradient of ones, as torchgpipe's balance-by-time does. The minimum over `repeat`
    rounds, not the mean: on a shared machine other processes only ever add time.
    """
    was_training = module.training
    module.train()
    times: list[list[float]] = [[] for _ in module]
    try:
        for _ in range(repeat + 1):  # the first round warms up allocators
            x = sample.detach()
            for i, layer in enumerate(module):
                x = x.detach().requires_grad_(x.is_floating_point())
                t0 = time.perf_counter()
                y = layer(x)
                if y.requires_grad:
                    y.backward(torch.ones_like(y))
                times[i].append(time.perf_counter() - t0)
                x = y
        module.zero_grad(set_to_none=True)
    finally:
        module.train(was_training)
    return [min(t[1:]) for t in times]


def balance_by_time(module: nn.Sequential, sample: torch.Tensor, k: int,
                    repeat: int = 5) -> list[int]:
    """Balance by measured per-layer forward+backward time on `sample`."""
    return balance_costs(layer_times(module, sample, repeat), k)
