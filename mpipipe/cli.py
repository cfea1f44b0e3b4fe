"""The command-line front shared by `python -m mpipipe` and `python -m stannis`.

Both systems take the same options (``--config``, ``--set``, ``--log``,
``--inject``, ``--resume``) and start a run the same way: check the MPI world
against the launcher, load and check the configuration, check the launch plan,
and open the HDF5 log on rank 0. Any error stops every rank with one line.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ConfigError, load_config
from .progress import Progress, startup_line
from .roles import LaunchPlan, PlanError, check_world_size, fail_fast
from .runlog import RunLog

__all__ = ["Run", "add_train_arguments", "start_run", "gather_figures"]


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options every training command shares."""
    parser.add_argument(
        "--config", metavar="FILE",
        help="TOML configuration (examples in jobs/configs/; every key and its default is listed "
             "in docs/configuration.md); omitted keys take their defaults",
    )
    parser.add_argument(
        "--set", metavar="KEY=VALUE", action="append", default=[],
        help="override one configuration key, e.g. --set pipeline.chunks=8 (repeatable; the "
             "value is read as TOML, so strings may be given bare)",
    )
    parser.add_argument(
        "--log", metavar="RUN.h5",
        help="HDF5 run log, written by rank 0 (under ResPipe by a survivor if rank 0 "
             "leaves) (default: runs/<system>-<time>.h5)",
    )
    parser.add_argument(
        "--inject", metavar="SPEC", action="append", default=[],
        help="inject a fault (repeatable): kill:stage=K:step=S[:micro=M], "
             "stall:stage=K:step=S[:micro=M][:seconds=T], delay:stage=K:p=P:seconds=T, "
             "slow:rank=R:step=S:factor=F (micro=M: inside step S, after the forward of "
             "micro-batch M)",
    )
    parser.add_argument("--resume", metavar="DIR", help="continue from the checkpoints in DIR")
    parser.add_argument("--quiet", action="store_true", help="no progress display (the summary line stays)")


@dataclass
class Run:
    """Everything a training loop needs that is not model-specific."""

    comm: Any
    rank: int
    size: int
    cfg: dict[str, dict[str, Any]]
    plan: LaunchPlan
    log: RunLog
    progress: Progress
    args: argparse.Namespace
    prog: str

    def fail(self, error: BaseException | str) -> None:
        """Stop every rank with one error line (all ranks must reach the same verdict)."""
        self.log.close(f"failed: {error}")
        fail_fast(self.comm, error, self.prog, self.rank)


def default_log_path(system: str) -> Path:
    return Path("runs") / f"{system}-{time.strftime('%Y%m%d-%H%M%S')}.h5"


def start_run(
    args: argparse.Namespace,
    *,
    prog: str,
    system: str,
    defaults: Mapping[str, Mapping[str, Any]],
    choices: Mapping[str, tuple[str, ...]] | None,
    build_plan: Callable[[dict, int], LaunchPlan],
    inject_key: tuple[str, str] = ("resilience", "inject"),
    emulation: Callable[[dict, LaunchPlan], Mapping[str, Any]] | None = None,
    total_steps: Callable[[dict], int] = lambda cfg: cfg["run"]["steps"],
) -> Run:
    """Check the world, the configuration and the plan; open the log. Exits 2 on any error."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        check_world_size(size)
        cfg = load_config(args.config, args.set, defaults, choices)
        if args.inject:
            section, key = inject_key
            cfg[section][key] = list(cfg[section][key]) + list(args.inject)
        plan = build_plan(cfg, size)
    except (ConfigError, PlanError) as e:
        fail_fast(comm, e, prog, rank)

    import torch

    torch.set_num_threads(max(1, int(cfg["run"].get("threads", 1))))
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg["run"].get("threads", 1)))

    # Rank 0 opens the log; everyone learns whether that worked, so a bad path
    # stops all ranks instead of leaving the others waiting for rank 0.
    # The others learn the file and its start time too, so that a survivor can take
    # the log over if rank 0 dies (ResPipe).
    log: RunLog = RunLog.null()
    error = None
    if rank == 0:
        path = Path(args.log) if args.log else default_log_path(system)
        try:
            log = RunLog(path, system=system, config=cfg, comm_size=size,
                         emulation=emulation(cfg, plan) if emulation else None,
                         attrs={"plan": plan.describe()})
        except OSError as e:
            error = f"cannot write the run log {path}: {e}"
    error, where, start = comm.bcast((error, str(log.path.resolve()) if log.active else None,
                                      log.start), root=0)
    if error:
        fail_fast(comm, error, prog, rank)
    if rank != 0:
        log = RunLog.null(where, start, system=system)
    progress = Progress(total_steps(cfg), enabled=(rank == 0), quiet=args.quiet,
                        every=cfg["run"].get("log_every", 10), prog=prog)
    hosts = comm.gather(MPI.Get_processor_name(), root=0)
    if rank == 0:
        progress.startup(startup_line(size, plan.roles, hosts, where))
    return Run(comm, rank, size, cfg, plan, log, progress, args, prog)


def gather_figures(comm: Any, figures: Mapping[str, float], root: int = 0) -> dict[int, dict[str, float]] | None:
    """Gather each rank's per-step figures on ``root`` (small pickled dicts, off the data path)."""
    gathered = comm.gather(dict(figures), root=root)
    if gathered is None:
        return None
    return {r: f for r, f in enumerate(gathered) if f is not None}
