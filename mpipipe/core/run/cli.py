"""The command-line front shared by `python -m mpipipe` and `python -m stannis`.

Both systems take the same options (``--config``, ``--set``, ``--log``,
``--inject``, ``--resume``) and start a run the same way: check the MPI world
against the launcher, load and check the configuration, check the launch plan,
check the injected faults, and open the HDF5 log on the plan's log rank (the lowest
stage, or the host). Any error stops every rank with one line, and no log is created
or replaced before those checks pass; an existing log is refused unless the user
says ``--overwrite`` (or ``--resume``, which continues it), or it is the log of a run
that failed before its first step (:func:`failed_before_first_step`).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpipipe.core.logs.progress import Progress, startup_line
from mpipipe.core.logs.runlog import LogError, RunLog
from mpipipe.core.mpi.faults import FaultError, check_nodes, check_reachable, parse_all
from mpipipe.core.mpi.roles import LaunchPlan, PlanError, check_world_size, fail_fast
from mpipipe.core.run import recipe
from mpipipe.core.run.configfile import ConfigError, load_config

__all__ = ["Request", "Run", "add_train_arguments", "add_dry_run_arguments", "start_run", "gather_figures",
           "gather_model_state"]


def add_dry_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the commands that build a configuration's model without MPI
    (``cost``, ``plan``): the configuration, overrides, and the input shape when the
    data set is not there to read it from."""
    parser.add_argument("--config", metavar="FILE", help="TOML configuration (jobs/configs/)")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                        help="override one configuration key (repeatable)")
    parser.add_argument("--in-shape", metavar="C,H,W",
                        help="input shape, if the data set is not there to read it from")


def add_train_arguments(parser: argparse.ArgumentParser, *, resume: bool = True) -> None:
    """Add the options every training command shares (``resume``: whether the command
    can continue from checkpoints; without it ``--resume`` is an unknown option, not
    one accepted and ignored)."""
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
        help="HDF5 run log, written by the lowest stage rank (Stannis: the host; under "
             "ResPipe by a survivor if that rank leaves) (default: runs/<system>-<time>.h5). "
             "An existing file is refused unless --overwrite (or --resume, which appends)",
    )
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --log file (default: refuse it)")
    parser.add_argument(
        "--inject", metavar="SPEC", action="append", default=[],
        help="inject a fault (repeatable): kill:stage=K:step=S[:micro=M], "
             "stall:stage=K:step=S[:micro=M][:seconds=T], delay:stage=K:p=P:seconds=T, "
             "slow:rank=R:step=S:factor=F (micro=M: inside step S, after the forward of "
             "micro-batch M); on a testbed: node-kill:node=N:step=S (every process of node N), "
             "partition:node=N:step=S[:seconds=T] (node N's link down for T s, default 10); "
             "failures as a process: poisson:rate=R:seed=S[:rejoin=T][:what=rank|node] (kills "
             "of random ranks or nodes at seeded exponential intervals, R events per time such "
             "as 1/30min; with rejoin=T each a stall of T, or a partition of a node)",
    )
    if not resume:
        parser.set_defaults(resume=None)
    else:
        parser.add_argument("--resume", metavar="DIR",
                            help="continue from the checkpoints in DIR; an existing --log is the "
                                 "run's own log, continued (its rows after the checkpoint's step "
                                 "are dropped: those steps run again)")
    parser.add_argument("--quiet", action="store_true", help="no progress display (the summary line stays)")


@dataclass
class Request:
    """What a training run is asked to do: the one input of both ways in, the command line
    (:meth:`from_args`) and the Python API (``mpipipe.train``, ``stannis.train``).

    ``config`` is a TOML path, a dict of the same sections, or None (the defaults);
    ``settings`` are ``KEY=VALUE`` overrides as ``--set`` takes them; ``objects`` the
    script's model, optimizer, scheduler and loss (:class:`mpipipe.core.run.recipe.Recipe`);
    ``api``: a script goes on after the run, so a rank must not leave the process.
    """

    config: str | Path | Mapping[str, Any] | None = None
    settings: Sequence[str] = ()
    inject: Sequence[str] = ()
    log: str | Path | None = None
    resume: str | Path | None = None
    quiet: bool = False
    overwrite: bool = False
    objects: Mapping[str, Any] = field(default_factory=dict)
    api: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Request:
        """The request the command line makes (:func:`add_train_arguments`)."""
        return cls(config=args.config, settings=list(args.set), inject=list(args.inject),
                   log=args.log, resume=getattr(args, "resume", None), quiet=args.quiet,
                   overwrite=args.overwrite)


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
    request: Request
    prog: str
    recipe: recipe.Recipe
    result: dict[str, Any] = field(default_factory=dict)  # the summary, where the log is written
    final_state: dict[str, Any] | None = None  # the whole model's, where one rank holds it
    status: int = 0  # the exit status the run ended with

    def fail(self, error: BaseException | str) -> None:
        """Stop every rank with one error line (all ranks must reach the same verdict)."""
        self.log.close(f"failed: {error}")
        fail_fast(self.comm, error, self.prog, self.rank)


def default_log_path(system: str) -> Path:
    return Path("runs") / f"{system}-{time.strftime('%Y%m%d-%H%M%S')}.h5"


def planned_steps(cfg: Mapping[str, Any]) -> int:
    """The optimizer steps a pipeline run will take (:func:`mpipipe.core.run.batches.run_steps`), or 0
    if the data set cannot be read yet (its own check reports that). No torch: this runs
    before it."""
    from mpipipe.core.run.batches import DataError, run_steps

    if int(cfg["run"]["steps"]) > 0 or int(cfg["run"].get("epochs", 0)) < 1:
        return int(cfg["run"]["steps"])
    try:
        return run_steps(cfg)
    except DataError:
        return 0


def check_faults(cfg: Mapping[str, Any], plan: LaunchPlan, specs: list[str], steps: int) -> None:
    """Refuse a malformed fault, or one that can never fire in this run (see
    :func:`mpipipe.core.mpi.faults.check_reachable`), before torch is imported or a log is opened.

    Raises:
        FaultError: the first bad fault, named, with the reason.
    """
    faults = parse_all(specs)
    pipeline = cfg.get("pipeline")
    check_reachable(faults, plan, steps=steps or None,
                    chunks=pipeline["chunks"] if pipeline else None,
                    mode=cfg["resilience"]["mode"] if "resilience" in cfg else None)


def own_log(resume: str | None) -> Path | None:
    """The log of the run whose checkpoints ``--resume`` names, if it is beside them:
    a run checkpoints into ``<log>-ckpt`` unless run.checkpoint_dir says otherwise."""
    if not resume:
        return None
    directory = Path(resume)
    if not directory.name.endswith("-ckpt"):
        return None
    log = directory.with_name(directory.name[:-len("-ckpt")] + ".h5")
    return log if log.is_file() else None


def _log_mode(path: Path, request: Request) -> tuple[str, str | None]:
    """How the writer opens ``path``: ``x`` (a new file), ``w`` (--overwrite) or ``a``
    (--resume continues it); or an error line when the file must not be touched."""
    if not path.exists():
        return "x", None
    if path.is_dir():
        return "x", f"--log {path} is a directory; give a file name, e.g. {path / 'run.h5'}"
    if request.overwrite:
        return "w", None
    if request.resume:
        return "a", None
    if failed_before_first_step(path) is not None:
        return "w", None
    return "x", (f"the run log {path} exists; pass --overwrite to replace it, or pick "
                 "another --log")


def failed_before_first_step(path: Path) -> str | None:
    """The status of the run log at ``path`` if its run failed before its first step, else None.

    Such a log is marked by what :meth:`Run.fail` leaves: status ``failed: <error>``, and
    not one row of steps, evaluations or per-rank figures, nor any event after step 0
    (``cost_model`` and ``benchmark`` are written at step 0, before training). It records
    no training, only the configuration and the error the terminal showed; a rerun after
    the fix (a data path, a typo) may replace it without ``--overwrite``. Why keep it
    rather than leave no log: ``mpipipe report`` can still say why that run stopped, and
    a failing run deletes nothing (a delete on an error path is where a bug would cost a
    user a real log); the file is judged only when a rerun wants its name. Anything else
    (a log with a row, a run still ``running`` or killed, a file that is not a run log or
    cannot be read) gives None: a real run's log is never replaced without ``--overwrite``.
    """
    from mpipipe.core.logs.runlog import FORMAT, open_for_reading

    try:
        with open_for_reading(path) as f:
            status = f.attrs.get("status", "")
            status = status.decode() if isinstance(status, bytes) else str(status)
            if f.attrs.get("format") != FORMAT or not status.startswith("failed"):
                return None
            tables = [f["steps"], f["eval"], *f["ranks"].values()]
            if any(len(ds) for group in tables for ds in group.values()):
                return None
            events = f["events"]
            if "step" in events and (events["step"][()] > 0).any():
                return None
    except (OSError, KeyError, TypeError, ValueError):
        return None
    return status


def start_run(
    request: Request,
    *,
    prog: str,
    system: str,
    defaults: Mapping[str, Mapping[str, Any]],
    choices: Mapping[str, tuple[str, ...]] | None,
    build_plan: Callable[[dict, int], LaunchPlan],
    inject_key: tuple[str, str] = ("resilience", "inject"),
    emulation: Callable[[dict, LaunchPlan], Mapping[str, Any]] | None = None,
    total_steps: Callable[[dict], int] = lambda cfg: cfg["run"]["steps"],
    check_hosts: Callable[[LaunchPlan, Sequence[str], dict], None] | None = None,
) -> Run:
    """Check the world, the configuration, the plan and the faults; then open the log.

    ``check_hosts(plan, hosts, cfg)`` is the system's own check of where its ranks run
    (ResPipe: a backup off its stage's node, :mod:`mpipipe.respipe.placement`); it raises
    :class:`PlanError`.

    Exits 2 on any error, on every rank, with one line; nothing is written before
    every check has passed, and an existing log is left as it was unless the user
    asked to overwrite (``--overwrite``) or continue (``--resume``) it.
    """
    from mpi4py import MPI

    # A job that seems stuck can be asked where: mpirun forwards SIGUSR2 to every rank,
    # and each prints its Python stack to stderr and goes on (run_mpi does this on a time-out).
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    _check_world(comm, size, prog, rank)
    cfg, made, plan, total = _checked_config(request, comm, size, prog, defaults, choices,
                                             build_plan, inject_key, total_steps)
    section, key = inject_key
    hosts = _checked_hosts(comm, cfg, plan, cfg[section][key], check_hosts, prog)
    writer = plan.log_rank
    path, mode = _log_choice(comm, request, writer, prog, system)

    import torch

    torch.set_num_threads(max(1, int(cfg["run"].get("threads", 1))))
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg["run"].get("threads", 1)))
    # The configuration as it is used: keys a script's object replaced are left
    # out (Recipe.stored_config); the setup records what runs as `recipe`.
    log, where = _open_log(comm, writer, prog, system, path, mode, lambda: dict(
        config=made.stored_config(), emulation=emulation(cfg, plan) if emulation else None,
        attrs={"plan": plan.describe(), "hosts": hosts}))
    _install_guards(comm, rank, cfg, hosts, log, where, prog)
    if total > 0:
        log.expect_steps(1, total)
    progress = Progress(total, enabled=(rank == writer), quiet=request.quiet,
                        every=cfg["run"].get("log_every", 10), prog=prog)
    if rank == writer:
        progress.startup(startup_line(size, plan.roles, hosts, where))
    return Run(comm, rank, size, cfg, plan, log, progress, request, prog, made)


def _check_world(comm: Any, size: int, prog: str, rank: int) -> None:
    """The MPI world against the launcher's plan, agreed by every rank.

    The one check whose verdict can differ between ranks (it reads each rank's launcher
    environment): every rank learns every verdict, so a rank that alone finds a mismatch
    cannot leave, silently, while the others wait for it in their first collective.
    """
    try:
        check_world_size(size)
        mismatch = None
    except PlanError as e:
        mismatch = str(e)
    mismatch = next((m for m in comm.allgather(mismatch) if m), None)
    if mismatch:
        fail_fast(comm, mismatch, prog, rank)


def _checked_config(request: Request, comm: Any, size: int, prog: str,
                    defaults: Mapping[str, Mapping[str, Any]],
                    choices: Mapping[str, tuple[str, ...]] | None,
                    build_plan: Callable[[dict, int], LaunchPlan], inject_key: tuple[str, str],
                    total_steps: Callable[[dict], int]
                    ) -> tuple[dict, recipe.Recipe, LaunchPlan, int]:
    """(configuration, recipe, launch plan, steps of the run), every one checked, with
    the injected faults; any error stops every rank with its line."""
    try:
        cfg = load_config(request.config, list(request.settings), defaults, choices)
        section, key = inject_key
        if request.inject:
            cfg[section][key] = list(cfg[section][key]) + list(request.inject)
        if float(cfg["run"].get("watchdog_s", 0.0)) < 0:
            raise ConfigError(f"run.watchdog_s = {cfg['run']['watchdog_s']}: give 0 (at least "
                              "60 s or 20 median steps) or the seconds without progress that "
                              "end a stuck job")
        made = recipe.Recipe(cfg, **request.objects)
        plan = build_plan(cfg, size)
        total = total_steps(cfg)
        check_faults(cfg, plan, list(cfg[section][key]), total)
    except (ConfigError, PlanError, FaultError) as e:
        fail_fast(comm, e, prog, comm.Get_rank())
    return cfg, made, plan, total


def _checked_hosts(comm: Any, cfg: dict, plan: LaunchPlan, specs: Sequence[str],
                   check_hosts: Callable[[LaunchPlan, Sequence[str], dict], None] | None,
                   prog: str) -> list[str]:
    """Every rank's node (host name), by rank, once checked.

    Each rank's node: the system checks where its ranks run (check_hosts), and a node
    fault must name a testbed node some rank runs on (faults.check_nodes).
    """
    hosts = comm.allgather(socket.gethostname())
    try:
        if check_hosts is not None:
            check_hosts(plan, hosts, cfg)
        check_nodes(parse_all(specs), hosts, plan)
    except (PlanError, FaultError) as e:
        fail_fast(comm, e, prog, comm.Get_rank())
    return hosts


def _log_choice(comm: Any, request: Request, writer: int, prog: str, system: str
                ) -> tuple[Path | None, str | None]:
    """The log's path and how it is opened (on the writer; None elsewhere).

    The writer decides about the file (it may be the only rank that sees it), and
    every rank learns the verdict, so that a refusal stops all of them at once.
    """
    rank = comm.Get_rank()
    path = mode = error = None
    if rank == writer:
        path = Path(request.log) if request.log else own_log(request.resume) or default_log_path(system)
        mode, error = _log_mode(path, request)
        if mode == "w" and not request.overwrite:
            print(f"{prog}: note: replacing {path}, the log of a run that failed before its "
                  f"first step", file=sys.stderr, flush=True)
    error = comm.bcast(error, root=writer)
    if error:
        fail_fast(comm, error, prog, rank)
    return path, mode


def _open_log(comm: Any, writer: int, prog: str, system: str, path: Path | None, mode: str | None,
              header: Callable[[], dict[str, Any]]) -> tuple[RunLog, str | None]:
    """The run log (the writer's file; a null log that knows where it is elsewhere) and
    its resolved path. ``header()``: the log's config, emulation and attrs, made on
    the writer only.

    The writer opens the log; everyone learns whether that worked, so a bad path
    stops all ranks instead of leaving the others waiting for the writer.
    The others learn the file and its start time too, so that a survivor can take
    the log over if the writer dies (ResPipe).
    """
    rank = comm.Get_rank()
    log: RunLog = RunLog.null()
    error = None
    if rank == writer:
        assert path is not None and mode is not None
        try:
            log = RunLog(path, system=system, comm_size=comm.Get_size(), mode=mode, **header())
        except (OSError, LogError) as e:
            error = f"cannot write the run log {path}: {e}"
    error, where, start = comm.bcast((error, str(log.path.resolve()) if log.active else None,
                                      log.start), root=writer)
    if error:
        fail_fast(comm, error, prog, rank)
    if rank != writer:
        log = RunLog.null(where, start, system=system)
    return log, where


def _install_guards(comm: Any, rank: int, cfg: dict, hosts: Sequence[str], log: RunLog,
                    where: str | None, prog: str) -> None:
    """The watchdog and the stop signals' handlers.

    A rank that makes no progress for run.watchdog_s ends the job, saying where
    (mpipipe.core.mpi.watchdog); its stack goes beside the log.
    """
    from mpipipe.core.mpi import stop, watchdog

    watchdog.install(watchdog.Watchdog(
        rank=rank, seconds=float(cfg["run"].get("watchdog_s", 0.0)),
        stacks=Path(f"{where}.stacks") if where else Path(f"stacks-{os.getpid()}"),
        prog=prog, holds_log=lambda: log.active, close_log=lambda status: log.close(status),
        abort=comm.Abort))
    stop.install(hosts)  # SIGINT, SIGTERM, SIGUSR1: stop at the next step boundary (mpipipe.core.mpi.stop)


def gather_figures(comm: Any, figures: Mapping[str, float], root: int = 0) -> dict[int, dict[str, float]] | None:
    """Gather each rank's per-step figures on ``root`` (small pickled dicts, off the data path)."""
    gathered = comm.gather(dict(figures), root=root)
    if gathered is None:
        return None
    return {r: f for r, f in enumerate(gathered) if f is not None}


def gather_model_state(comm: Any, state: Any, root: int) -> dict[str, Any] | None:
    """The whole model's ``state_dict`` on ``root`` (the log's writer), from each rank's
    stage ``state`` (a :class:`~mpipipe.core.state.stagestate.StageState`; None on a rank
    without one); None on every other rank. Collective over ``comm``.

    Why over MPI: a script that called ``mpipipe.train`` gets its model back at the end
    without a checkpoint directory, and without reading files other ranks may still be
    writing. A stage keeps the chain's names (:func:`mpipipe.pipeline.partition.split`),
    so the parts add up to the chain's ``state_dict``; neighbour-merged stages and a
    rank's interleaved chunks alike.
    """
    mine = state.model_state() if state is not None else {}
    parts = comm.gather(mine, root=root)
    if parts is None:
        return None
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    return merged
