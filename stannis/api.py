"""``stannis.train(...)``: Stannis from a Python script, on every rank under mpirun (the
same program as ``python -m stannis train``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from mpipipe.core.run.cli import Request
from mpipipe.core.run.python_api import Result, objects, shared_log_path, train_with

__all__ = ["train"]


def train(config: str | Path | Mapping[str, Any] | None = None, *, model: Any = None,
          optimizer: Callable[[Any], Any] | None = None,
          scheduler: Callable[[Any], Any] | None = None,
          loss: Callable[[Any, Any], Any] | None = None, log: str | Path | None = None,
          settings: Iterable[str] = (), inject: Iterable[str] = (), quiet: bool = False,
          overwrite: bool = False) -> Result:
    """Train on this rank (the host, rank 0, or a CSD); call it on every rank of the job.

    The arguments are :func:`mpipipe.train`'s (Stannis keeps no checkpoints: no resume;
    ``optimizer`` gets the whole model, in your names). The host's
    :class:`~mpipipe.core.run.python_api.Result` holds the metrics and the final ``state_dict`` in
    your model's names.

    Raises:
        mpipipe.core.mpi.roles.TrainingFailed: on every rank, with the command's one line, or
            the run did not complete.
    """
    from stannis.trainer import run_training

    request = Request(config=config, settings=list(settings), inject=list(inject),
                      log=shared_log_path(log, "stannis"), quiet=quiet, overwrite=overwrite,
                      objects=objects(model, optimizer, scheduler, loss), api=True)
    return train_with(run_training, request, prog="stannis.train")
