"""The pipeline engine: partition, schedules as data, the step executor, and plain training.

``mpipipe.pipeline.Pipeline`` and ``Route`` are the engine's (imported on first use, so that
importing the package does not import torch).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Pipeline", "Route"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mpipipe.pipeline import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'mpipipe.pipeline' has no attribute {name!r}")
