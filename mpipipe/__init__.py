"""mpipipe: resilient pipeline-parallel (ResPipe) CNN training on MPI, and the core both systems share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mpipipe.core.version import __version__, package_version

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["Pipeline", "Route", "__version__", "package_version", "sequential", "train", "Result",
           "TrainingFailed"]


def __getattr__(name: str) -> Any:
    # Lazy: `import mpipipe` (e.g. for `python -m mpipipe report`) must not start MPI or
    # import torch; `mpipipe.Pipeline` does both on first use.
    if name in ("Pipeline", "Route"):
        from mpipipe.pipeline import engine as pipeline

        return getattr(pipeline, name)
    if name in ("train", "Result", "TrainingFailed"):  # the Python API (mpipipe.api)
        from mpipipe import api

        return getattr(api, name)
    raise AttributeError(f"module 'mpipipe' has no attribute {name!r}")


def sequential(model: nn.Module, example_input: torch.Tensor | None = None) -> nn.Sequential:
    """`model` as a flat nn.Sequential a pipeline can cut (see mpipipe.core.run.chain.sequential).

    A function here, importing torch on the call, so that `import mpipipe` stays light."""
    from mpipipe.core.run.chain import sequential as chain_sequential

    return chain_sequential(model, example_input)
