"""Cut an nn.Sequential into contiguous stages: by an explicit balance, measured time or parameters."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["split", "stage_modules", "StageChunks", "check_balance", "balance_interleaved",
           "balance_by_time", "balance_by_params", "balance_costs", "layer_times", "cut_costs",
           "param_costs", "timing_sample", "automatic_balance"]


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


# At most this many cuts are compared by their simulated step (interleaved balancing).
MAX_CUTS_SIMULATED = 20_000


def balance_interleaved(costs: Sequence[float], k: int, v: int, m: int,
                        schedule: str = "interleaved-1f1b") -> list[int]:
    """Cut per-layer costs into v x K chunks for a schedule of v chunks per rank.

    Why not :func:`balance_costs`: rank r runs chunks r, r + K, ..., so what sets the
    pace is what each rank does in all, and when. Every cut is compared by the step it
    makes (:func:`mpipipe.pipeline.schedule.makespan`, a forward taking a third of a
    layer's cost and a backward two thirds, messages free) when there are at most
    MAX_CUTS_SIMULATED cuts; otherwise the smallest largest chunk is taken.
    """
    from itertools import accumulate, combinations
    from math import comb

    from mpipipe.pipeline.schedule import makespan

    n, parts = len(costs), v * k
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} layers into {parts} non-empty chunks")
    if comb(n - 1, parts - 1) > MAX_CUTS_SIMULATED:
        return balance_costs(costs, parts)
    prefix = list(accumulate((max(float(c), 0.0) for c in costs), initial=0.0))
    best: tuple[float, float] | None = None
    chosen: list[int] = []
    for cuts in combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        chunk = [prefix[bounds[i + 1]] - prefix[bounds[i]] for i in range(parts)]
        key = (makespan(schedule, k, v, m, [c / 3 for c in chunk], [2 * c / 3 for c in chunk]),
               max(chunk))
        if best is None or key < best:
            best, chosen = key, [bounds[i + 1] - bounds[i] for i in range(parts)]
    return chosen


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


def cut_costs(costs: Sequence[float], k: int, v: int = 1, m: int = 1) -> list[int]:
    """The cut of per-layer ``costs`` into K stages (:func:`balance_costs`), or into
    v x K chunks for m micro-batches when each rank runs v > 1 (:func:`balance_interleaved`)."""
    return balance_costs(costs, k) if v == 1 else balance_interleaved(costs, k, v, m)


def param_costs(module: nn.Sequential) -> list[float]:
    """Each layer's parameter count plus one (so parameter-free layers count a little)."""
    return [float(1 + sum(p.numel() for p in layer.parameters())) for layer in module]


def balance_by_params(module: nn.Sequential, k: int, v: int = 1, m: int = 1) -> list[int]:
    """Balance by parameter count (plus one per layer so parameter-free layers count a little).

    With v > 1 chunks per rank (interleaved), v x K chunks for m micro-batches."""
    return cut_costs(param_costs(module), k, v, m)


def layer_times(module: nn.Sequential, sample: torch.Tensor, repeat: int = 5) -> list[float]:
    """Fastest forward+backward seconds of each layer on `sample` (a mini- or micro-batch).

    Each layer is timed alone on the output of the previous one, backward with a
    gradient of ones, as torchgpipe's balance-by-time does. The minimum over `repeat`
    rounds, not the mean: on a shared machine other processes only ever add time.
    """
    was_training = module.training
    module.train()
    times: list[list[float]] = [[] for _ in module]
    # Timing runs the layers in training mode: BatchNorm's running statistics move. They
    # are put back, or this rank's weights would differ from every other rank's.
    buffers = {name: b.clone() for name, b in module.named_buffers()}
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
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(buffers[name])
    return [min(t[1:]) for t in times]


def balance_by_time(module: nn.Sequential, sample: torch.Tensor, k: int,
                    repeat: int = 5, v: int = 1, m: int = 1) -> list[int]:
    """Balance by measured per-layer forward+backward time on `sample`.

    With v > 1 chunks per rank (interleaved), v x K chunks for m micro-batches."""
    return cut_costs(layer_times(module, sample, repeat), k, v, m)


def timing_sample(in_shape: Sequence[int], batch_size: int, m: int) -> torch.Tensor:
    """The input a run times its layers on: one micro-batch (``batch_size // m`` samples
    of ``in_shape``) of seeded normal noise, the same in every process that asks."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(max(1, batch_size // m), *in_shape, generator=gen)


def automatic_balance(cfg: Mapping[str, Any], model: nn.Sequential, in_shape: Sequence[int],
                      costs: Sequence[float] | None = None) -> tuple[list[int], list[float]]:
    """The cut a run makes when ``pipeline.balance`` is empty, and the per-layer costs it
    cut: seconds of forward+backward on one micro-batch (``balance_by = "time"``,
    :func:`layer_times` with the run's ``run.threads`` compute threads) or parameter
    counts plus one (``"params"``). ``costs`` given: cut those instead of measuring
    (a run's logged ``balance_costs``, to see the cut it made).

    Why one function: the run (``mpipipe.pipeline.train.setup``, on rank 0, which
    broadcasts the cut) and the dry run (``python -m mpipipe plan``, in one process)
    both call it, so that they time the same sample with the same threads and cut with
    the same rule; only the timings' noise can make them differ.
    """
    from mpipipe.pipeline.config import chunks_per_stage

    p = cfg["pipeline"]
    k, m, v = int(p["stages"]), int(p["chunks"]), chunks_per_stage(cfg)
    if costs is None:
        if p["balance_by"] == "params":
            costs = param_costs(model)
        else:
            sample = timing_sample(in_shape, int(cfg["data"]["batch_size"]), m)
            threads = torch.get_num_threads()
            torch.set_num_threads(max(1, int(cfg["run"].get("threads", 1))))
            try:
                costs = layer_times(model, sample)
            finally:
                torch.set_num_threads(threads)
    costs = [float(c) for c in costs]
    if len(costs) != len(model):
        raise ValueError(f"{len(costs)} layer costs for a model of {len(model)} layers")
    return cut_costs(costs, k, v, m), costs
