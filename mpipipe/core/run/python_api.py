"""The Python API's shared part: a training run from a script, on every rank under mpirun,
with the user's own Python objects, and what it gives back.

Why a library under the command, not the command under the library: ``python -m mpipipe
train`` parses its arguments into the same :class:`~mpipipe.core.run.cli.Request` that
``mpipipe.train(...)`` builds, and both call the same ``run_training``; so a script and
the command line cannot drift apart. An error is :class:`TrainingFailed` on every rank
(the command prints its one line and exits 2; a script may catch it and go on), the
script's objects travel in the request (no module state: two runs in one script share
nothing), and the final model comes back over MPI to the log's writer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpipipe.core.mpi.roles import TrainingFailed
from mpipipe.core.run.cli import Request, Run, default_log_path

__all__ = ["Result", "TrainingFailed", "train_with", "shared_log_path"]


@dataclass
class Result:
    """What a run gives back to the script, on every rank.

    ``metrics`` and ``state_dict`` are filled on the rank that wrote the log at the end
    (``is_writer``): the run's summary (steps, samples per second, final loss, test
    accuracy, takeovers, ...), and the whole model's final ``state_dict()`` (parameters
    and buffers) under the names of your model, ready for ``model.load_state_dict``.
    """

    rank: int
    log: Path | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    state_dict: dict[str, Any] | None = None

    @property
    def is_writer(self) -> bool:
        """Whether this rank holds the metrics and the state (it wrote the log)."""
        return bool(self.metrics)


def shared_log_path(log: str | Path | None, system: str) -> Path:
    """The run's log path, the same on every rank (a default one is rank 0's name)."""
    if log is not None:
        return Path(log)
    from mpi4py import MPI

    return Path(MPI.COMM_WORLD.bcast(str(default_log_path(system)), root=0))


def train_with(run_training: Callable[[Request], Run | None], request: Request, *,
               prog: str) -> Result:
    """Run ``run_training(request)`` (a system's library entry) and give back its
    :class:`Result`, the state in the user's model's names.

    Raises:
        TrainingFailed: the run did not start (its one line) or did not complete.
    """
    from mpipipe.core.mpi import stop, watchdog

    try:
        run = run_training(request)
    finally:  # the script goes on: no watchdog, and its own Ctrl-C
        watchdog.uninstall()
        stop.uninstall()
    log = Path(request.log) if request.log is not None else None
    if run is None:  # a spare rank: it idled while the stages trained
        from mpi4py import MPI

        return Result(rank=MPI.COMM_WORLD.Get_rank(), log=log)
    if run.status != 0:
        raise TrainingFailed(f"the run ended with status {run.status}; see {log}", prog,
                             run.rank, run.status)
    result = Result(rank=run.rank, log=log, metrics=dict(run.result))
    if run.final_state is not None:
        names = run.recipe.names
        result.state_dict = {names.get(k, k): v for k, v in run.final_state.items()}
    return result


def objects(model: Any, optimizer: Any, scheduler: Any, loss: Any) -> Mapping[str, Any]:
    """The script's objects as a request carries them (None: the configuration's)."""
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loss": loss}
