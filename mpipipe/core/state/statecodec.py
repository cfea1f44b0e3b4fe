"""A stage's whole state as one flat byte buffer: its module's ``state_dict()`` (parameters
and persistent buffers, such as BatchNorm's running statistics) and its optimizer's
per-parameter state (any optimizer: momentum, Adam's moments, step counters).

Why one flat buffer: a replica travels as a single MPI message (no pickling on the hot
path, and its size is what the cost model predicts), and a snapshot for rollback is one
copy. Why a layout computed once per module: the optimizer's state exists only after its
first step, yet a backup that never stepped must know the size of the replica it receives;
the layout comes from one step of a throwaway copy of the optimizer. Segments are ordered
by element size (8-byte dtypes first), so every segment is aligned for its dtype without
padding and the byte count is the sum of the tensors' bytes, whatever their grouping.

The learning-rate schedule is not part of this state: it is a pure function of the step
(:mod:`mpipipe.core.run.recipe`), and so is a stage's random stream (Dropout), seeded per
micro-batch by the pipeline engine.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where used: the cost command and the report never need it
    import torch
    from torch import nn

__all__ = ["StateError", "StateLayout", "layout_of", "pack_state", "unpack_state", "state_nbytes"]


class StateError(ValueError):
    """A stage's state cannot be carried (an optimizer state of an unknown kind)."""


@dataclass(frozen=True)
class _Segment:
    offset: int
    nbytes: int
    dtype: Any  # torch.dtype
    shape: tuple[int, ...]


@dataclass
class StateLayout:
    """Where each tensor of a module's state and of its optimizer's state lies in the buffer.

    ``module`` maps a ``state_dict`` entry to its segment (the live tensors are kept in
    ``tensors``, in the same order); ``optim[i]`` maps each state key of the module's i-th
    parameter to its segment, or to ``("py", type)`` for a Python number (8 bytes,
    float64) or ``("none", None)`` for a key whose value is None.
    """

    tensors: list[Any]
    module: list[_Segment]
    params: list[Any]
    optim: list[dict[str, tuple[str, Any]]]
    nbytes: int
    # Consecutive tensor segments of one dtype: (offset, bytes, dtype, sources, segments),
    # a source ("m", i) the i-th module tensor or ("o", i, key) the i-th parameter's
    # optimizer state. One concatenation per run packs them (the hot path).
    runs: list[tuple[int, int, Any, list[tuple], list[_Segment]]] = field(default_factory=list)

    @property
    def param_bytes(self) -> int:
        """Bytes of the parameters alone (the rest is buffers and optimizer state)."""
        return sum(p.numel() * p.element_size() for p in self.params)


_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _optimizer_template(module: nn.Module, optimizer: Any) -> list[dict[str, Any]]:
    """The state one step of ``optimizer`` gives each parameter of ``module``, found on a
    deep copy (the optimizer and the module are left as they were)."""
    import torch

    params = list(dict.fromkeys(module.parameters()))
    if optimizer is None:
        return [{} for _ in params]
    memo: dict[int, Any] = {}
    clone = copy.deepcopy(optimizer, memo)
    copies = [memo.get(id(p)) for p in params]
    if any(c is None for c in copies):
        raise StateError(f"{type(optimizer).__name__} does not hold every parameter of the "
                         f"stage; build the optimizer on the stage's own parameters")
    for c in copies:
        c.grad = torch.zeros_like(c)
    try:
        clone.step()
    except TypeError as e:
        raise StateError(f"optimizer {type(optimizer).__name__}: one step without arguments "
                         f"failed ({e}); optimizers that need a closure (LBFGS) are not "
                         f"supported") from None
    return [dict(clone.state.get(c, {})) for c in copies]


def layout_of(module: nn.Module, optimizer: Any = None) -> StateLayout:
    """The layout of ``module``'s state and ``optimizer``'s (cached per module and
    optimizer class: both are fixed once a stage is built).

    Raises:
        StateError: an optimizer state value that is neither a tensor, a number nor None.
    """
    import torch

    key = (type(optimizer).__name__, repr(getattr(optimizer, "defaults", None)))
    cached = _LAYOUTS.get(module, {}).get(key)
    if cached is not None:
        return cached
    state = module.state_dict(keep_vars=True)
    tensors = [t.data if isinstance(t, torch.nn.Parameter) else t for t in state.values()]
    params = list(dict.fromkeys(module.parameters()))
    wanted, optim = _wanted(tensors, _optimizer_template(module, optimizer), optimizer)
    module_segs, runs, offset = _place(wanted, optim, len(tensors))
    layout = StateLayout(tensors, module_segs, params, optim, offset, runs)
    _LAYOUTS.setdefault(module, {})[key] = layout
    return layout


# A tensor the buffer holds: (-element size, order, "m" | "o", index, dtype, shape); "m"
# index i is the module's i-th state tensor, "o" index (i, key) the i-th parameter's
# optimizer state under ``key``.
_Wanted = tuple[int, int, str, Any, Any, tuple[int, ...]]


def _wanted(tensors: list[Any], template: list[dict[str, Any]],
            optimizer: Any) -> tuple[list[_Wanted], list[dict[str, tuple[str, Any]]]]:
    """Every tensor of the state, and each optimizer key's kind (a tensor, a Python number
    carried as float64, a constant bool, or None).

    Raises:
        StateError: an optimizer state value that is neither a tensor, a number nor None.
    """
    import torch

    wanted: list[_Wanted] = []
    optim: list[dict[str, tuple[str, Any]]] = []
    for i, t in enumerate(tensors):
        wanted.append((-t.element_size(), len(wanted), "m", i, t.dtype, tuple(t.shape)))
    for i, st in enumerate(template):
        kinds: dict[str, tuple[str, Any]] = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                wanted.append((-v.element_size(), len(wanted), "o", (i, k), v.dtype, tuple(v.shape)))
                kinds[k] = ("tensor", None)
            elif isinstance(v, bool) or v is None:
                kinds[k] = ("none", v) if v is None else ("const", v)
            elif isinstance(v, int | float):
                wanted.append((-8, len(wanted), "o", (i, k), torch.float64, ()))
                kinds[k] = ("py", type(v))
            else:
                raise StateError(f"{type(optimizer).__name__} keeps {k!r} of type "
                                 f"{type(v).__name__} per parameter; a replica carries "
                                 f"tensors, numbers and None only")
        optim.append(kinds)
    return wanted, optim


def _place(wanted: list[_Wanted], optim: list[dict[str, tuple[str, Any]]],
           n_module: int) -> tuple[list[_Segment], list[tuple], int]:
    """Lay the tensors out, the largest elements first (so no padding is needed): the
    module's segments, the runs of consecutive segments of one dtype (one concatenation
    each when packing), and the total bytes. Fills ``optim``'s segments in place."""
    module_segs: list[_Segment | None] = [None] * n_module
    runs: list[tuple[int, int, Any, list[tuple], list[_Segment]]] = []
    offset = 0
    for neg_size, _, where, idx, dtype, shape in sorted(wanted):
        n = 1
        for d in shape:
            n *= d
        seg = _Segment(offset, n * -neg_size, dtype, shape)
        offset += seg.nbytes
        if where == "m":
            module_segs[idx] = seg
            source: tuple | None = ("m", idx)
        else:
            i, k = idx
            tensor = optim[i][k][0] == "tensor"
            optim[i][k] = (optim[i][k][0], seg) if tensor else ("py", (optim[i][k][1], seg))
            source = ("o", i, k) if tensor else None
        if source is None:
            continue
        if runs and runs[-1][2] == dtype and runs[-1][0] + runs[-1][1] == seg.offset:
            start, size, _, sources, segs = runs[-1]
            runs[-1] = (start, size + seg.nbytes, dtype, [*sources, source], [*segs, seg])
        else:
            runs.append((seg.offset, seg.nbytes, dtype, [source], [seg]))
    return [s for s in module_segs if s is not None], runs, offset


def state_nbytes(module: nn.Module, optimizer: Any = None) -> int:
    """Bytes of a replica of ``module`` under ``optimizer``: the exact size of the message."""
    return layout_of(module, optimizer).nbytes


def _view(flat: torch.Tensor, seg: _Segment) -> torch.Tensor:
    return flat[seg.offset:seg.offset + seg.nbytes].view(seg.dtype).view(seg.shape)


def pack_state(module: nn.Module, optimizer: Any = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The module's ``state_dict`` then its optimizer's state, as one flat uint8 tensor."""
    import torch

    lay = layout_of(module, optimizer)
    flat = out if out is not None else torch.empty(lay.nbytes, dtype=torch.uint8)
    state = optimizer.state if optimizer is not None else {}
    with torch.no_grad():
        for start, size, dtype, sources, segs in lay.runs:
            parts = []
            for src in sources:
                t = lay.tensors[src[1]] if src[0] == "m" else \
                    state.get(lay.params[src[1]], {}).get(src[2])
                if t is None:  # no optimizer state yet (no step taken): zeros
                    parts = None
                    break
                parts.append(t.reshape(-1))
            if parts is not None:
                torch.cat(parts, out=flat[start:start + size].view(dtype))
                continue
            for src, seg in zip(sources, segs, strict=True):
                t = lay.tensors[src[1]] if src[0] == "m" else \
                    state.get(lay.params[src[1]], {}).get(src[2])
                _view(flat, seg).copy_(t) if t is not None else _view(flat, seg).zero_()
        for p, kinds in zip(lay.params, lay.optim, strict=True):
            for k, (kind, seg) in kinds.items():
                if kind == "py":
                    _view(flat, seg[1]).fill_(float(state.get(p, {}).get(k, 0)))
    return flat


def unpack_state(flat: torch.Tensor, module: nn.Module, optimizer: Any = None,
                 count: int = 1) -> None:
    """Load a buffer of :func:`pack_state` into ``module`` and ``optimizer``; the optimizer's
    state only once a step was taken (``count`` > 0: the replica's step count)."""
    import torch

    lay = layout_of(module, optimizer)
    if flat.numel() != lay.nbytes:
        raise StateError(f"a replica of {flat.numel()} bytes does not fit this stage's "
                         f"state of {lay.nbytes} bytes")
    with torch.no_grad():
        for t, seg in zip(lay.tensors, lay.module, strict=True):
            t.copy_(_view(flat, seg))
        if optimizer is None:
            return
        for p, kinds in zip(lay.params, lay.optim, strict=True):
            if count <= 0:
                optimizer.state.pop(p, None)
                continue
            st: dict[str, Any] = {}
            for k, (kind, seg) in kinds.items():
                if kind == "tensor":
                    st[k] = _view(flat, seg).clone()
                elif kind == "py":
                    typ, s = seg
                    st[k] = typ(_view(flat, s).item())
                else:
                    st[k] = seg
            optimizer.state[p] = st
