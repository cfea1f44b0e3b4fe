"""mpipipe: resilient pipeline-parallel (ResPipe) CNN training on MPI, and the core both systems share."""

from __future__ import annotations

from typing import Any

from mpipipe.core.version import __version__, package_version

__all__ = ["Pipeline", "Route", "__version__", "package_version"]


def __getattr__(name: str) -> Any:
    # Lazy: `import mpipipe` (e.g. for `python -m mpipipe report`) must not start MPI or
    # import torch; `mpipipe.Pipeline` does both on first use.
    if name in ("Pipeline", "Route"):
        from mpipipe.pipeline import engine as pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'mpipipe' has no attribute {name!r}")
