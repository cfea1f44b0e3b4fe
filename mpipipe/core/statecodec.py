"""A stage's replica: its parameters and optimizer state as one flat float32 tensor.

Why one flat tensor: a replica travels as a single buffer message (no pickling,
and its size is what the cost model predicts), and a snapshot for rollback is
one copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where used: the cost command and the report never need it
    import torch

__all__ = ["state_bytes", "replica_numel", "pack_state", "unpack_state"]


def state_bytes(param_bytes: int, n_tensors: int, optim: str, momentum: float = 0.0) -> int:
    """Bytes of optimizer state a replica carries (the layout :func:`pack_state` writes).

    SGD with momentum keeps one buffer per parameter, SGD without none; Adam
    keeps two moments per parameter and one float32 step count per tensor.

    Raises:
        ValueError: an optimizer the replicas do not know how to carry.
    """
    if optim == "sgd":
        return param_bytes if momentum else 0
    if optim == "adam":
        return 2 * param_bytes + 4 * n_tensors
    raise ValueError(f"optimizer {optim!r}: replicas know sgd and adam")


def _state_keys(optim: str) -> tuple[str, ...]:
    return {"sgd": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq")}[optim]


def replica_numel(params: Sequence[torch.Tensor], optim: str, momentum: float = 0.0) -> int:
    """Number of float32 values in a replica of ``params`` and their optimizer state."""
    n = sum(p.numel() for p in params)
    return n + state_bytes(4 * n, len(params), optim, momentum) // 4


def pack_state(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer, optim: str,
               momentum: float = 0.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """Parameters then optimizer state, as one flat float32 tensor (one message, no pickling)."""
    import torch

    numel = replica_numel(params, optim, momentum)
    flat = out if out is not None else torch.empty(numel, dtype=torch.float32)
    pos = 0
    with torch.no_grad():
        for p in params:
            flat[pos:pos + p.numel()].copy_(p.reshape(-1))
            pos += p.numel()
        has_state = optim == "adam" or momentum
        if has_state:
            for p in params:
                st = optimizer.state.get(p, {})
                for key in _state_keys(optim):
                    buf = st.get(key)
                    seg = flat[pos:pos + p.numel()]
                    seg.copy_(buf.reshape(-1)) if buf is not None else seg.zero_()
                    pos += p.numel()
            if optim == "adam":
                for p in params:
                    step = optimizer.state.get(p, {}).get("step")
                    flat[pos] = float(step) if step is not None else 0.0
                    pos += 1
    assert pos == numel
    return flat


def unpack_state(flat: torch.Tensor, params: Sequence[torch.Tensor],
                 optimizer: torch.optim.Optimizer, optim: str, momentum: float, count: int) -> None:
    """Load a replica into ``params`` and ``optimizer`` (state only once a step was taken)."""
    import torch

    pos = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[pos:pos + p.numel()].view_as(p))
            pos += p.numel()
        if optim == "adam" or momentum:
            for p in params:
                st = optimizer.state[p] if count > 0 else {}
                for key in _state_keys(optim):
                    if count > 0:
                        st[key] = flat[pos:pos + p.numel()].view_as(p).clone()
                    pos += p.numel()
                if count == 0:
                    optimizer.state.pop(p, None)
            if optim == "adam":
                for p in params:
                    if count > 0:
                        optimizer.state[p]["step"] = torch.tensor(float(flat[pos]))
                    pos += 1
