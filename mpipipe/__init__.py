"""mpipipe: resilient pipeline-parallel (ResPipe) CNN training on MPI, and the core both systems share."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"  # the one version number (pyproject.toml reads it)
__all__ = ["Pipeline", "Route", "__version__", "package_version"]


def package_version() -> str:
    """The version ``--version`` prints: the installed distribution's (importlib.metadata),
    or ``__version__`` when the code runs from a source tree that was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mpipipe")
    except PackageNotFoundError:
        return __version__


def __getattr__(name: str) -> Any:
    # Lazy: `import mpipipe` (e.g. for `python -m mpipipe report`) must not start MPI or
    # import torch; `mpipipe.Pipeline` does both on first use.
    if name in ("Pipeline", "Route"):
        from mpipipe.pipeline import engine as pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'mpipipe' has no attribute {name!r}")
