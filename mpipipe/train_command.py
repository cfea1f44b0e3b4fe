"""`python -m mpipipe train`: the training command; it picks plain pipeline training or ResPipe."""

from __future__ import annotations

import argparse
from typing import Any

from mpipipe.core.run.cli import Request, Run, add_train_arguments, planned_steps, start_run
from mpipipe.pipeline.config import PIPELINE_CHOICES, PIPELINE_DEFAULTS
from mpipipe.pipeline.plan import pipeline_plan
from mpipipe.pipeline.schedule import SCHEDULES
from mpipipe.respipe.auto import requested
from mpipipe.respipe.placement import check_hosts

__all__ = ["add_parser", "main", "run_training"]

PROG = "mpipipe train"

EPILOG = """\
configuration sections (see docs/configuration.md and jobs/configs/):
  [run]       seed, steps (or epochs), eval_every, log_every, checkpoint_every, checkpoint_dir
  [data]      path (a directory with train/ and test/ made by python -m native.convert),
              batch_size
  [model]     factory ("file.py:function" or "package.module:function", your nn.Module),
              kwargs, or name (lenet | vgg | resnet); num_classes, loss, loss_kwargs
  [optim]     name (sgd | adam | any torch.optim class), lr, kwargs, scheduler (any
              torch.optim.lr_scheduler class) and scheduler_kwargs, or schedule
              (constant | cosine); momentum, weight_decay (sgd, adam)
  [pipeline]  stages (K, one rank each), deferred_batch_norm, balance (layers per stage, v x K entries for
              interleaved-1f1b; [] = automatic),
              balance_by (time | params), chunks (micro-batches),
              schedule ({schedules}; see docs/pipeline.md)
  [plan]      explicit launch plan, e.g. "stage 0" = 0
  [resilience] backups, deadline_s, ... (ResPipe; see docs/respipe.md)

example:
  mpirun -n 3 python -m mpipipe train --config jobs/configs/pipeline-digits.toml \\
      --set pipeline.chunks=8 --log runs/digits.h5
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `train` subcommand on the `python -m mpipipe` dispatcher."""
    parser = subparsers.add_parser(
        "train", help="train a CNN cut into pipeline stages (one MPI rank per stage)",
        description="Train a CNN cut into K pipeline stages, one MPI rank per stage, with "
                    "micro-batch pipelining (GPipe or 1F1B). Launch with mpirun -n K.",
        epilog=EPILOG.format(schedules=" | ".join(SCHEDULES)), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_arguments(parser)
    parser.set_defaults(func=main)
    return parser


def _ulfm() -> bool:
    from mpipipe.core.mpi.ft import ulfm_enabled

    return ulfm_enabled()


def main(args: argparse.Namespace) -> int:
    """Body of `python -m mpipipe train`: the command line's request, run; its exit status."""
    run = run_training(Request.from_args(args))
    return run.status if run is not None else 0


def run_training(request: Request) -> Run | None:
    """Set up the run a request asks for on this rank, then train (plain or ResPipe); the
    library both ways in call (the command line and :func:`mpipipe.train`).

    Returns the :class:`~mpipipe.core.run.cli.Run` (its ``status``, and on the log's writer
    its ``result`` and ``final_state``), or None on a spare rank, which idled until the job
    ended.

    Raises:
        mpipipe.core.mpi.roles.TrainingFailed: a bad configuration, plan, fault or log path
            (the same line, on every rank).
    """
    from mpipipe.core.mpi.spare import set_aside

    run = start_run(request, prog=PROG, system="mpipipe", defaults=PIPELINE_DEFAULTS,
                    choices=PIPELINE_CHOICES, build_plan=pipeline_plan,
                    total_steps=planned_steps, check_hosts=check_hosts)
    with set_aside(run) as run:
        if run is None:
            return None  # a spare rank: it idled until the job ended
        if run.plan.ranks_of("backup") or run.cfg["resilience"]["inject"] or _ulfm() \
                or requested(run.cfg):
            # ResPipe: backup ranks exist, faults are injected, ULFM can report a dead
            # stage, or "auto" is to choose its mode and R: the resilient loop drives the
            # job (without backups it stops cleanly, naming the lost stage).
            from mpipipe.respipe.command import train as respipe_train

            run.status = int(respipe_train(run))
        else:
            from mpipipe.pipeline.train import train

            run.status = int(train(run))
        return run
