"""``mpipipe.train(...)``: train your model from a Python script, as a torchrun script does.

Run the script on every rank under mpirun (``mpirun -n 3 python my_script.py``); the
configuration (a TOML path or a dict of the same shape) decides the plain pipeline or
ResPipe, exactly as ``python -m mpipipe train`` does, which is the same program.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from mpipipe.core.run.cli import Request
from mpipipe.core.run.python_api import Result, TrainingFailed, objects, shared_log_path, train_with

__all__ = ["train", "Result", "TrainingFailed"]


def train(config: str | Path | Mapping[str, Any] | None = None, *, model: Any = None,
          optimizer: Callable[[Any], Any] | None = None,
          scheduler: Callable[[Any], Any] | None = None,
          loss: Callable[[Any, Any], Any] | None = None, log: str | Path | None = None,
          settings: Iterable[str] = (), inject: Iterable[str] = (),
          resume: str | Path | None = None, quiet: bool = False,
          overwrite: bool = False) -> Result:
    """Train on this rank; call it on every rank of the job.

    Args:
        config: a TOML file or a dict of the same sections (``{"pipeline": {"stages": 3}}``).
        model: an ``nn.Module`` (each rank must build the same weights: seed torch first,
            or pass a zero-argument builder, called after ``run.seed`` seeds torch).
        optimizer: ``module -> torch.optim.Optimizer``, called with each stage's module,
            its parameters under your model's names (``m.named_parameters()`` gives
            ``"layer1.0.bn1.weight"``), so param groups by name work on every stage.
        scheduler: ``optimizer -> LRScheduler``, stepped once per optimizer step.
        loss: ``(output, labels) -> scalar``, the mean over a micro-batch.
        log: the HDF5 run log (default ``runs/mpipipe-<time>.h5``).
        settings: ``KEY=VALUE`` overrides, as ``--set`` takes them.
        inject: faults, as ``--inject`` takes them (``"kill:stage=1:step=20"``).

    Returns:
        A :class:`~mpipipe.core.run.python_api.Result`; on the rank that wrote the log its metrics
        and the final whole-model ``state_dict`` in your model's names (gathered over MPI;
        no checkpoint directory is needed).

    Raises:
        TrainingFailed: on every rank, with the one line the command would print (a
            misspelt key, a bad plan or fault), or the run did not complete. A lost
            stage without a backup ends the job as the command line does.
    """
    from mpipipe.train_command import run_training

    request = Request(config=config, settings=list(settings), inject=list(inject),
                      log=shared_log_path(log, "mpipipe"), resume=resume, quiet=quiet,
                      overwrite=overwrite, objects=objects(model, optimizer, scheduler, loss),
                      api=True)
    return train_with(run_training, request, prog="mpipipe.train")
