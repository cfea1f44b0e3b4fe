"""Glue for ``python -m mpipipe train`` with ResPipe: the data and evaluation callables
the trainer takes, and :func:`train`, which runs it on every rank and turns its end
(completed, a stage lost, a clean stop, replaced) into an exit status and a closed log.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mpipipe.core.logs.runlog import LogError
from mpipipe.core.mpi import ft
from mpipipe.core.mpi.stop import StopRun
from mpipipe.pipeline.engine import Pipeline
from mpipipe.respipe import auto
from mpipipe.respipe.trainer import Demoted, ResPipe, Settings, StageLost


class BatchCache:
    """``batch_of(step)`` over a sequential reader: keeps the last few batches for replays.

    Why copies: the reader reuses its output buffers, and a replay after a takeover
    re-reads the mini-batch of a step the reader has already moved past.
    """

    def __init__(self, next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                 keep: int = 3, first_step: int = 0,
                 seek: Callable[[int], None] | None = None) -> None:
        self.next_batch = next_batch
        self.keep = keep
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.next_step = first_step
        self.seek = seek

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step in self.cache:
            return self.cache[step]
        if step < self.next_step:
            raise RuntimeError(f"step {step} is older than the {self.keep} batches kept")
        if self.seek is not None and step - self.next_step >= self.keep:
            # Far behind (a backup that just took over): jump instead of reading every
            # batch in between, and read the last `keep` so that replays still find them.
            self.cache.clear()
            self.next_step = step - self.keep + 1
            self.seek(self.next_step)
        while self.next_step <= step:
            x, y = self.next_batch()
            self.cache[self.next_step] = (x.clone(), y.clone())
            self.next_step += 1
        for old in [s for s in self.cache if s < step - self.keep + 1]:
            del self.cache[old]
        return self.cache[step]


class _NoParams:
    """The optimizer of a stage without parameters (only ReLU or pooling layers)."""

    state: dict = {}

    def step(self) -> None:
        return None


def _eval_fn(cfg: Mapping[str, Any], eval_batches: int
             ) -> Callable[[Pipeline], tuple[int, int] | None]:
    """A forward-only pass over the test split; (correct, count) on the last stage."""
    from mpipipe.core.run import batches

    path, bs = cfg["data"]["path"], cfg["data"]["batch_size"]

    def evaluate(pipe: Pipeline) -> tuple[int, int] | None:
        correct = count = 0
        result = None
        if pipe.first:
            test_set: Iterable[tuple[Any, Any]] = batches.test_batches(path, bs, mean=cfg["data"]["mean"],
                                                                       std=cfg["data"]["std"])
        else:
            test_set = ((None, None) for _ in range(eval_batches))
        for x, y in test_set:
            r = pipe.evaluate(x, y if (pipe.first or pipe.last) else None)
            if r is not None:
                correct, count = correct + r[0], count + r[1]
                result = (correct, count)
        return result

    return evaluate


def _close_log(run: Any, status: str) -> bool:
    """Close the log if this rank writes it; False (and one error line) if it could not,
    or if it holds less than it should (the status written is then ``incomplete: ...``)."""
    try:
        return run.log.close(status) == status
    except LogError as e:
        print(f"{run.prog}: error: {e}", file=sys.stderr, flush=True)
        return False


class _LazyReader:
    """The training reader, opened on first use: only the ranks that read data ever open it."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        self.cfg = cfg
        self.reader: Any = None

    def open(self) -> Any:
        from mpipipe.core.run import batches

        if self.reader is None:
            self.reader = batches.TrainBatches.from_config(self.cfg)
        return self.reader

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.open().next()

    def seek(self, step: int) -> None:
        self.open().seek_batch(step)


def train(run: Any) -> int:
    """`python -m mpipipe train` with ResPipe: the resilient loop on every rank; exit status.

    Builds the same model, pipeline and data as the plain loop (mpipipe.pipeline.train.setup),
    then hands the steps to :class:`ResPipe`. A stage lost with no backup stops every
    survivor with one error line naming the stage (exit 2) and a closed, readable log.
    """
    from mpipipe.core.state import checkpoint
    from mpipipe.pipeline import train as plain

    s = plain.setup(run)
    cfg, log, progress = run.cfg, run.log, run.progress
    try:
        wanted = auto.AutoRequest.from_config(cfg, has_backups=bool(run.plan.ranks_of("backup")),
                                              virtual=s.pipe.v > 1)
        if wanted is None:
            Settings.from_config(cfg, s.pipe.k, s.pipe.chunks)
    except ValueError as e:
        run.fail(e)
    retune = None
    if wanted is not None:
        cfg, retune = _choose(run, s, wanted)
    if run.rank == 0:
        print(f"{run.prog}: {ft.startup_note()}", flush=True)  # even under --quiet
    reader = _LazyReader(cfg)

    def make_opt(module: nn.Module) -> Any:
        return run.recipe.make_optimizer(module) or _NoParams()

    resume = None
    if run.request.resume:
        directory = run.request.resume
        resume = (s.start_step, lambda k: checkpoint.load_stage(directory, k))
    error = None
    try:
        rp = ResPipe(cfg=cfg, plan=run.plan, pipe=s.pipe, make_optimizer=make_opt,
                     loss_fn=s.loss_fn, batch_of=BatchCache(reader.next_batch, seek=reader.seek),
                     evaluate=_eval_fn(cfg, s.eval_batches), log=log,
                     progress=progress, comm=run.comm,
                     in_shape=s.in_shape, checkpoint_dir=s.checkpoint_dir, resume=resume,
                     schedule=s.schedule, retune=retune)
    except checkpoint.CheckpointError as e:  # a backup's (a stage's failed in setup)
        error = str(e)
    plain.agree(run, error)
    try:
        result = rp.train(s.total_steps, cfg["run"]["eval_every"])
    except StageLost as e:
        _stage_lost(run, rp, e)
    except StopRun as e:  # a data error or a stop signal: every rank leaves, none takes over
        _stopped(run, rp, e, s.checkpoint_dir)
    except Demoted as e:
        _demoted(run, rp, e)
    return _finish(run, rp, result)


def _choose(run: Any, s: Any, wanted: auto.AutoRequest) -> tuple[dict[str, Any], auto.Retune | None]:
    """``"auto"``: measure, choose the mode and R on rank 0, log it; the resolved config,
    and what chooses R again at rounds (None when R is fixed)."""
    from mpipipe.core.logs.runlog import EventKind
    from mpipipe.pipeline.plan import backup_counts

    if run.rank == 0:
        print(f"{run.prog}: resilience \"auto\": measuring the stages and the link to choose "
              f"{' or '.join(wanted.modes)} mode and R", flush=True)
    backups = backup_counts(run.cfg["resilience"]["backups"], s.pipe.k)
    choice = auto.choose(run, s.pipe, wanted, in_shape=s.in_shape,
                         make_optimizer=run.recipe.make_optimizer, backups=backups,
                         steps=s.total_steps, batch_size=run.cfg["data"]["batch_size"])
    run.log.event(EventKind.RESILIENCE_CHOSEN, step=0, rank=0, **choice.detail())
    if run.rank == 0:
        print(f"{run.prog}: resilience \"auto\" chose {choice.why}", flush=True)
    cfg = auto.resolved(run.cfg, choice)
    try:
        Settings.from_config(cfg, s.pipe.k, s.pipe.chunks)
    except ValueError as e:
        run.fail(e)
    retune = None
    if len(wanted.rs) > 1:
        retune = auto.Retune(wanted, choice, in_shape=s.in_shape,
                             make_optimizer=run.recipe.make_optimizer,
                             batch_size=run.cfg["data"]["batch_size"],
                             labels=8 if s.pipe.labels == "travel" and s.pipe.k > 1 else 0,
                             steps=s.total_steps)
    return cfg, retune


def _stage_lost(run: Any, rp: ResPipe, e: StageLost) -> None:
    """A stage lost with no backup: the log closed, one error line, exit 2 on every survivor."""
    from mpipipe.core.mpi import stop

    _close_log(run, f"failed: {e}")
    if rp.m.members and rp.wrank == rp.m.members[0]:
        print(f"{run.prog}: error: {e}", file=sys.stderr, flush=True)
        rp.close_lobby()  # a replaced rank waiting to rejoin leaves too
    try:
        rp.m.data.Barrier()  # the log is closed before any survivor exits
    except Exception:  # noqa: BLE001 - a further failure: exit anyway
        pass
    # Leave without MPI_Finalize: under ULFM it runs an agreement over the world,
    # which we saw hang now and then with a dead rank in it. The log and the
    # checkpoints are closed files by now; mpirun reports the exit status.
    stop.flush_and_exit(2)


def _stopped(run: Any, rp: ResPipe, e: StopRun, checkpoint_dir: Path | None) -> None:
    """A data error or a stop signal: the writer's line and log, then every rank leaves."""
    from mpipipe.core.mpi import stop

    if rp.is_logger:
        stop.announce(run.prog, e, checkpoint_dir=checkpoint_dir
                      if e.kind == "signal" else None)
        _close_log(run, e.status)
    stop.all_reach(rp.m.data, 30.0)  # the writer's line and log before anyone's exit
    stop.flush_and_exit(e.exit_code)


def _demoted(run: Any, rp: ResPipe, e: Demoted) -> None:
    """This rank was late and replaced: one line, and it leaves (exit 0).

    Under ULFM it first stays, idle, until the run is over: the run log is closed (a
    writer ended it) or the job's last members tell it so. If instead every other rank
    dies first, as when the stages that replaced it die while it stalled, nobody else is
    left to close the log (their records wait in its journals): it writes them, closes
    the log as a lost stage, and leaves with exit 2.
    """
    from mpipipe.core.mpi import stop

    print(f"{run.prog}: rank {run.rank} was late and has been replaced ({e}); it leaves "
          f"the job without sending anything", file=sys.stderr, flush=True)
    lost = _outlive(run, rp) if rp.m.ulfm and run.log.path is not None else None
    if lost is not None and run.log.close_abandoned(f"failed: {lost}"):
        print(f"{run.prog}: error: {lost}", file=sys.stderr, flush=True)
        stop.flush_and_exit(2)
    # (a replaced log writer let go of the log: a survivor writes it now)
    # Leave without MPI_Finalize, whose world-wide agreement would wait for ranks
    # that have moved on (or, after a lost stage, exited with an error).
    stop.flush_and_exit(0)


OUTLIVE_S = 600.0  # how long a replaced rank stays to close a log nobody is left to close


def _outlive(run: Any, rp: ResPipe) -> StageLost | None:
    """Wait (at most OUTLIVE_S, idle) until the run is over: None once its log is closed
    or the last generation said so on the lobby; the lost stage to report once ULFM knows
    every other rank of the job to be dead while the log still says ``running``."""
    import time

    from mpipipe.core.mpi import watchdog

    world = rp.m.world
    others = set(range(world.Get_size())) - {rp.wrank}
    give_up = time.monotonic() + OUTLIVE_S
    while time.monotonic() < give_up and others:
        if rp.rejoin.closed():
            return None
        status = run.log.status_on_disk()
        if status is not None and status != "running":
            return None
        if others <= set(ft.failed_ranks(world)):
            stage, rank = next(((k, w) for k, w in enumerate(rp.m.route_w) if w != rp.wrank),
                               (0, min(others)))
            return StageLost(stage, rank, "failed, as did every other rank of the job after "
                                          "this rank was replaced,")
        watchdog.beat()  # idle on purpose, bounded by OUTLIVE_S
        time.sleep(0.2)
    return None


def _finish(run: Any, rp: ResPipe, result: Mapping[str, Any]) -> int:
    """A completed run: the model for a script, the summary and the closed log on the
    writer, the exit status every rank agrees on; returns it (or leaves with it)."""
    from mpipipe.core.mpi import stop

    log, progress = run.log, run.progress
    if run.request.api:  # a script gets the model back on the writer (mpipipe.train)
        run.final_state = _final_state(rp)
    code = 0
    if log.active:
        summary = {
            "steps": result["steps"],
            # the file's rows: a writer that took over has not seen the first ones itself
            # (its own rows only if the file is not open yet: the old writer holds it)
            "samples_per_s": log.throughput() if len(log.written("time")) else progress.samples_per_s,
            "final_loss": result["loss"],
            "test_accuracy": result["accuracy"],
            "takeovers": result["takeovers"],
            "log": str(log.path),
        }
        log.set_attr("summary", summary)
        run.result.update(summary)
        progress.summary(**summary)  # printed under --quiet too
        code = 0 if _close_log(run, "completed") else 1
    if run.request.api:  # a script's ranks learn the writer's verdict alike
        try:
            code = rp.m.data.bcast(code, root=rp.m.drank(rp.m.log_w))
        except Exception:  # noqa: BLE001 - MPI's error under ULFM: a member died at the end
            pass
    if result["takeovers"] or result["generation"]:
        # A replaced rank leaves without MPI_Finalize (see Demoted above), and a killed
        # one never reaches it; the world-wide agreement inside Finalize was seen to wait
        # for such a rank now and then. Everything is written and closed: leave as well.
        if run.request.api:  # a script goes on: leave when it ends
            stop.exit_at_end(code)
            return code
        stop.flush_and_exit(code)
    return code


def _final_state(rp: ResPipe) -> dict[str, Any] | None:
    """The whole model's state on the log's writer, gathered from the stages of the last
    generation over its communicator (None elsewhere). A member that fails during the
    gather leaves the writer without it: said in one line, and the run still completes
    (its checkpoints, where configured, hold the state)."""
    from mpipipe.core.run.cli import gather_model_state

    own = rp.replicas.own if rp.m.stage is not None else None
    try:
        return gather_model_state(rp.m.data, own, rp.m.drank(rp.m.log_w))
    except Exception as e:  # noqa: BLE001 - MPI's error under ULFM: a member died at the end
        if rp.is_logger:
            print(f"mpipipe train: note: the final model could not be gathered ({e}); "
                  "Result.state_dict is None", file=sys.stderr, flush=True)
        return None
