"""Deferred BatchNorm (``[pipeline] deferred_batch_norm = true``): running statistics
committed once per mini-batch, from the whole mini-batch, as torchgpipe's
DeferredBatchNorm does.

Why: a pipeline splits each mini-batch into micro-batches, and a plain BatchNorm updates
its running statistics once per micro-batch (the default here, whose reference is
gradient accumulation over the same micro-batches). With this option each micro-batch is
still normalized with its own statistics, but the running mean and variance move once
per step, from the statistics of the mini-batch as a whole: the running statistics of
single-process training on the full batch. The per-step sums are transient (not in the
state_dict, so not in a replica): a replayed step starts them again, and a hot mirror
that takes over mid-step keeps its own, which are the stage's.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["DeferredBatchNorm", "defer_batch_norm", "begin_step", "commit_step"]


class DeferredBatchNorm(_BatchNorm):
    """Mixed into a BatchNorm's own class by :func:`defer_batch_norm` (its dimension
    check and state_dict stay the original's)."""

    def _start(self) -> None:
        c = self.num_features
        self.register_buffer("_sum", torch.zeros(c, dtype=torch.float64), persistent=False)
        self.register_buffer("_sum_sq", torch.zeros(c, dtype=torch.float64), persistent=False)
        self._count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or not self.track_running_stats:
            return super().forward(x)
        self._check_input_dim(x)
        dims = [0, *range(2, x.dim())]
        with torch.no_grad():
            d = x.detach().double()
            self._sum += d.sum(dims)
            self._sum_sq += (d * d).sum(dims)
            self._count += x.numel() // x.size(1)
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def reset(self) -> None:
        """Forget the sums of a step (a new step, or one started again)."""
        self._sum.zero_()
        self._sum_sq.zero_()
        self._count = 0

    def commit(self) -> None:
        """Move the running statistics once, by the step's whole mini-batch."""
        n = self._count
        if n == 0 or not self.track_running_stats:
            return
        with torch.no_grad():
            mean = self._sum / n
            var = (self._sum_sq / n - mean * mean).clamp_min(0.0)
            unbiased = var * (n / (n - 1)) if n > 1 else var
            self.num_batches_tracked.add_(1)
            m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
            self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
            self.running_var.mul_(1 - m).add_(unbiased.to(self.running_var.dtype), alpha=m)
        self.reset()


_CLASSES: dict[type, type] = {}


def defer_batch_norm(module: nn.Module) -> int:
    """Make every BatchNorm in ``module`` (at any depth, in traced pieces too) a deferred
    one, in place: the same parameters, buffers and state_dict names. Returns how many."""
    count = 0
    for m in module.modules():
        if isinstance(m, _BatchNorm) and not isinstance(m, DeferredBatchNorm):
            cls = type(m)
            if cls not in _CLASSES:
                _CLASSES[cls] = type(f"Deferred{cls.__name__}", (DeferredBatchNorm, cls), {})
            m.__class__ = _CLASSES[cls]
            m._start()
            count += 1
    _FOUND.clear()  # what was found before this conversion is stale
    return count


_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _deferred(module: nn.Module) -> list[DeferredBatchNorm]:
    """The deferred BatchNorms in ``module``, found once per module (twice a step, on the
    step's path: a walk over every submodule each time is not needed)."""
    found = _FOUND.get(module)
    if found is None:
        found = _FOUND[module] = [m for m in module.modules() if isinstance(m, DeferredBatchNorm)]
    return found


def begin_step(module: nn.Module) -> None:
    """A new step of ``module`` starts: no sums from an interrupted one count."""
    for m in _deferred(module):
        m.reset()


def commit_step(module: nn.Module) -> None:
    """The step's micro-batches all went forward: commit each deferred BatchNorm."""
    for m in _deferred(module):
        m.commit()
