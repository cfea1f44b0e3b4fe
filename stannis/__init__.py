"""Stannis: data-parallel training across one host rank and many CSD ranks.

``stannis.train(config, model=..., optimizer=..., scheduler=..., loss=...)`` trains from
a Python script on every rank under mpirun, as ``python -m stannis train`` does."""

from __future__ import annotations

from typing import Any

__all__ = ["train"]


def __getattr__(name: str) -> Any:
    # Lazy: `import stannis` must not start MPI or import torch.
    if name == "train":
        from stannis.api import train

        return train
    raise AttributeError(f"module 'stannis' has no attribute {name!r}")
