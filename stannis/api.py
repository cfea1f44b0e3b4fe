"""``stannis.train(...)``: Stannis from a Python script, on every rank under mpirun (the
same program as ``python -m stannis train``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from mpipipe.core.run.python_api import Result, run_command, shared_log_path

__all__ = ["train"]


def train(config: str | Path | Mapping[str, Any] | None = None, *, model: Any = None,
          optimizer: Callable[[list[Any]], Any] | None = None,
          scheduler: Callable[[Any], Any] | None = None,
          loss: Callable[[Any, Any], Any] | None = None, log: str | Path | None = None,
          settings: Iterable[str] = (), quiet: bool = False, overwrite: bool = False) -> Result:
    """Train on this rank (the host, rank 0, or a CSD); call it on every rank of the job.

    The arguments are :func:`mpipipe.train`'s (Stannis keeps no checkpoints: no resume).
    The host's :class:`~mpipipe.core.run.python_api.Result` holds the metrics and the final
    ``state_dict`` in your model's names.

    Raises:
        mpipipe.core.run.python_api.TrainingFailed: the run did not complete.
    """
    from stannis.trainer import main

    path = shared_log_path(log, "stannis")
    return run_command(main, config, prog="stannis.train", log=path, settings=settings,
                       quiet=quiet, overwrite=overwrite, can_resume=False,
                       state=lambda run: run.final_state,
                       objects={"model": model, "optimizer": optimizer,
                                "scheduler": scheduler, "loss": loss})
