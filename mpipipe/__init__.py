"""mpipipe: resilient pipeline-parallel (ResPipe) CNN training on MPI, and the core both systems share."""

__version__ = "0.1.0"

from .pipeline import Pipeline, Route  # noqa: E402

__all__ = ["Pipeline", "Route", "__version__"]
