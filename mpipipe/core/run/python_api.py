"""The Python API's shared part: run a training command from a script, on every rank under
mpirun, with the user's own Python objects, and give back what it did.

Why the command itself: ``python -m mpipipe train`` and ``mpipipe.train(...)`` must be one
program, so that a script and the command line cannot drift apart. The script's objects
(model, optimizer, scheduler, loss) take the place of the configuration's names through
:func:`mpipipe.core.run.recipe.give`; errors end the job exactly as on the command line (one
line, exit status 2), because under MPI one rank cannot raise while the others wait.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpipipe.core.run import recipe
from mpipipe.core.run.cli import Run, add_train_arguments, default_log_path

__all__ = ["Result", "TrainingFailed", "run_command", "shared_log_path", "stage_states"]


class TrainingFailed(RuntimeError):
    """The run ended without completing (its log says why); raised on every rank that
    returns to the script."""


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


def run_command(main: Callable[[argparse.Namespace], int], config: str | Path | Mapping[str, Any] | None, *,
                prog: str, log: Path, settings: Iterable[str] = (), resume: str | Path | None = None,
                quiet: bool = False, overwrite: bool = False, can_resume: bool = True,
                objects: Mapping[str, Any] | None = None,
                state: Callable[[Run], dict[str, Any] | None] = lambda run: None) -> Result:
    """Run a training command's ``main`` with these arguments and the script's objects;
    returns the :class:`Result` (``state(run)`` gives the final state_dict on the writer).

    Raises:
        TrainingFailed: the run ended with a non-zero status (the log says why).
    """
    parser = argparse.ArgumentParser(prog=prog)
    add_train_arguments(parser, resume=can_resume)
    argv = ["--log", str(log)]
    for s in settings:
        argv += ["--set", s]
    if resume is not None:
        argv += ["--resume", str(resume)]
    argv += ["--quiet"] if quiet else []
    argv += ["--overwrite"] if overwrite else []
    args = parser.parse_args(argv)
    args.config = config if isinstance(config, Mapping) or config is None else str(config)
    args.api = True
    recipe.give(**(objects or {}))
    try:
        code = main(args)
        run: Run | None = getattr(args, "started", None)
        result = Result(rank=run.rank if run is not None else 0, log=log)
        if run is not None and run.result:
            result.metrics = dict(run.result)
            found = state(run)
            if found is not None:
                names = recipe.source_names()
                if names and set(found) <= set(names):
                    found = {names[k]: v for k, v in found.items()}
                result.state_dict = found
    finally:
        recipe.give()
    if code != 0:
        raise TrainingFailed(f"{prog}: the run ended with status {code}; see {log}")
    return result


def stage_states(directory: Path, step: int, wait_s: float = 60.0) -> dict[str, Any]:
    """The whole model's state_dict from the stages' checkpoints of ``step`` in
    ``directory``: each stage writes its own at the run's end, and this waits until they
    hold every entry of the model (:func:`mpipipe.core.run.recipe.chain_keys`), however many
    stages there were at the end (a neighbour takeover merges two).

    Raises:
        TrainingFailed: the checkpoints of that step did not cover the model in ``wait_s``.
    """
    from mpipipe.core.state import checkpoint

    want = recipe.chain_keys()
    give_up = time.monotonic() + wait_s
    while True:
        merged: dict[str, Any] = {}
        for path in sorted(Path(directory).glob("stage-*.pt")):
            try:
                state = checkpoint.load_stage(directory, int(path.stem.split("-")[1]))
            except (checkpoint.CheckpointError, ValueError):
                continue
            if state.step == step:
                merged.update(state.params)
        if merged and want <= set(merged):
            return merged
        if time.monotonic() > give_up:
            raise TrainingFailed(f"the stages' checkpoints of step {step} in {directory} did "
                                 f"not cover the model within {wait_s:.0f} s")
        time.sleep(0.1)
