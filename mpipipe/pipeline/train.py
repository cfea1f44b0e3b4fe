"""Plain pipeline training: set-up, the loop, evaluation, the log and checkpoints.

ResPipe (:mod:`mpipipe.respipe.trainer`) reuses the set-up and wraps the loop; the
`train` command (:mod:`mpipipe.train_command`) picks one of the two."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpipipe.core.logs.logschema import EventKind
from mpipipe.core.mpi import stop, watchdog
from mpipipe.core.mpi.roles import fail_fast
from mpipipe.core.run.cli import Run, gather_figures, gather_model_state

# torch, the engine and the data reader are imported where used, so that a wrong
# configuration is reported before any rank pays for importing torch.
if TYPE_CHECKING:
    import torch
    from torch import nn

    from mpipipe.core.run import batches
    from mpipipe.core.state.checkpoint import Checkpoint
    from mpipipe.core.state.stagestate import StageState
    from mpipipe.pipeline.engine import Pipeline, Route

__all__ = ["Setup", "setup", "agree", "read_batch",
           "train_step", "stopped",
           "evaluate", "save_checkpoint", "train"]


@dataclass
class Setup:
    """Everything built once before the first step, on every rank."""

    run: Run
    model: nn.Sequential
    pipe: Pipeline
    state: StageState | None  # this rank's stage: its module, optimizer and step
    loss_fn: Any
    in_shape: tuple[int, int, int]
    total_steps: int
    schedule: Any  # mpipipe.core.run.recipe.Schedule: the hyperparameters of every step
    start_step: int = 0
    train_data: batches.TrainBatches | None = None
    eval_batches: int = 0
    checkpoint_dir: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def check_same_weights(run: Run, pipe: Pipeline) -> None:
    """Every rank built the whole model from the same seed: a stage and its backups must
    hold the same weights, or a takeover would silently change the model. One CRC per
    stage, compared over all ranks; a mismatch is the user's factory drawing random
    numbers from somewhere torch's seed does not reach."""
    from mpipipe.core.run.recipe import checksum

    mine = [checksum(part) for part in pipe.partitions]
    seen = run.comm.allgather(mine)
    for k in range(len(mine)):
        crcs = {r: sums[k] for r, sums in enumerate(seen)}
        if len(set(crcs.values())) > 1:
            first = next(iter(crcs.values()))
            odd = sorted(r for r, c in crcs.items() if c != first)
            run.fail(f"model.factory is not deterministic: ranks {', '.join(map(str, odd))} "
                     f"built other weights for stage {k} than rank 0, from the same seed "
                     f"(run.seed = {run.cfg['run']['seed']}); draw random numbers with "
                     f"torch only, after the seed is set, or load fixed weights")


def agree(run: Run, error: str | None) -> None:
    """Every rank learns the first error any rank hit, and all stop together."""
    errors = run.comm.allgather(error)
    first = next((e for e in errors if e), None)
    if first:
        run.fail(first)


def _static_checks(cfg: dict) -> str | None:
    """Checks every rank reaches the same verdict on without talking to the others."""
    from mpipipe.pipeline.config import chunks_per_stage
    from mpipipe.pipeline.schedule import check_virtual

    p, d = cfg["pipeline"], cfg["data"]
    if p["chunks"] < 1:
        return f"pipeline.chunks = {p['chunks']}: need at least one micro-batch"
    if p["stages"] < 1:
        return f"pipeline.stages = {p['stages']}: need at least one stage"
    try:
        v = chunks_per_stage(cfg)
        check_virtual(p["schedule"], p["stages"], v, p["chunks"])
    except ValueError as e:
        return f"pipeline.schedule = {p['schedule']!r}: {e}"
    if d["batch_size"] < p["chunks"]:
        return (f"data.batch_size = {d['batch_size']} is smaller than pipeline.chunks = "
                f"{p['chunks']}: every micro-batch needs at least one sample")
    if cfg["run"]["steps"] < 1 and cfg["run"]["epochs"] < 1:
        return "set run.steps or run.epochs to a positive number"
    from mpipipe.core.run.batches import TransformError, transforms

    try:
        transforms(d)  # data.augment, data.mean, data.std; their fit to the images: in setup
    except TransformError as e:
        return str(e)
    return None


def setup(run: Run) -> Setup:
    """Build model, partition, pipeline, optimizer and data on every rank.

    Every configuration error stops all ranks with one line: checks that need no
    message are made on every rank, the others are agreed with one allgather.
    """
    error = _static_checks(run.cfg)  # before torch is imported: a wrong config fails fast
    if error:
        run.fail(error)
    from mpipipe.core.run import batches
    from mpipipe.pipeline.engine import Pipeline, Route

    cfg, comm = run.cfg, run.comm
    in_shape, total, eval_batches = _read_data(run)
    model, loss_fn, schedule, made = _build_model(run, in_shape, total)
    route = Route.from_plan(run.plan, cfg["pipeline"]["stages"])
    my_stage = route.stage_of(run.rank)
    state = _load_resume(run, my_stage)
    balance, costs = _choose_balance(run, model, in_shape, state, route)
    pipe = Pipeline(model, balance, cfg["pipeline"]["chunks"], cfg["pipeline"]["schedule"],
                    comm, route, in_shape=in_shape,
                    deadline=cfg["resilience"]["deadline_s"] or None, seed=cfg["run"]["seed"])
    check_same_weights(run, pipe)
    stage_state = _stage_state(run, pipe, my_stage)
    setup_ = Setup(run, model, pipe, stage_state, loss_fn, in_shape, total, schedule,
                   eval_batches=eval_batches)
    if pipe.first:
        setup_.train_data = batches.TrainBatches.from_config(cfg)
    _resume_from(setup_, state, my_stage, route)
    run.log.expect_steps(setup_.start_step + 1, total)
    setup_.checkpoint_dir = _checkpoint_dir(run)
    run.log.set_attr("balance", balance)
    if made is not None:
        run.log.set_attr("recipe", made)
    if costs is not None:  # what the cut was made from (partition.automatic_balance cuts it again)
        run.log.set_attr("balance_costs", costs)
    return setup_


def _read_data(run: Run) -> tuple[tuple[int, int, int], int, int]:
    """(input shape, steps of the run, test batches), read from the data set; a data
    error stops every rank with its line, a note is printed once."""
    from mpipipe.core.run import batches

    cfg = run.cfg
    path = cfg["data"]["path"]
    try:
        in_shape = batches.image_shape(path)
        batches.transforms(cfg["data"], in_shape)  # TransformError, a DataError: on every rank
        total = batches.run_steps(cfg)
        eval_batches = batches.count_test_batches(path, cfg["data"]["batch_size"])
        note = batches.check_labels(path, cfg["model"]["num_classes"])
        batches.verify_split(path, "test", cfg["model"]["num_classes"])
    except batches.DataError as e:
        run.fail(e)
    if note and run.rank == 0:
        print(f"{run.prog}: note: {note}", file=sys.stderr, flush=True)
    run.progress.total = max(total, 1)
    return in_shape, total, eval_batches


def _build_model(run: Run, in_shape: tuple[int, int, int], total: int
                 ) -> tuple[nn.Sequential, Any, Any, Any]:
    """(model, loss, schedule, the recipe's description or None) from the recipe, after
    the seed is set; a recipe error stops every rank."""
    import torch

    from mpipipe.core.run import recipe

    cfg = run.cfg
    torch.manual_seed(cfg["run"]["seed"])
    try:
        model = run.recipe.build_model(in_shape)
        loss_fn = run.recipe.make_loss()
        schedule = run.recipe.schedule(total)
        run.recipe.make_optimizer(model)  # fails here, not later (the whole model: every name)
    except recipe.RecipeError as e:
        run.fail(e)
    # What runs, read from the objects (docs/hdf5-log.md), as built; written with the cut,
    # once every check passed (a resume with nothing to resume leaves its log untouched).
    made = run.recipe.describe(model, schedule, loss_fn) if run.log.active else None
    if cfg["pipeline"]["deferred_batch_norm"]:
        from mpipipe.pipeline.deferred_bn import defer_batch_norm

        if not defer_batch_norm(model):
            run.fail(f"pipeline.deferred_batch_norm = true, but model {run.recipe.model_name()} "
                     f"has no BatchNorm layer: it would change nothing; leave it false")
    return model, loss_fn, schedule, made


def _load_resume(run: Run, my_stage: int | None) -> Checkpoint | None:
    """The checkpoint of this rank's stage (None without --resume or stage), once every
    rank has read its own and all agree on step and balance."""
    from mpipipe.core.state import checkpoint

    # resume: each stage reads its own file; the balance comes from the checkpoint
    state = None
    error = None
    if run.request.resume and my_stage is not None:
        try:
            state = checkpoint.load_stage(run.request.resume, my_stage)
        except checkpoint.CheckpointError as e:
            error = str(e)
    agree(run, error)
    if run.request.resume:
        seen = run.comm.allgather(None if state is None else (state.step, tuple(state.balance)))
        seen = {s for s in seen if s is not None}
        if len(seen) != 1:
            run.fail(f"the checkpoints in {run.request.resume} disagree on step or balance: "
                     f"{sorted(seen)}; they are not from one run")
    return state


def _choose_balance(run: Run, model: nn.Sequential, in_shape: tuple[int, int, int],
                    state: Checkpoint | None, route: Route) -> tuple[list[int], list[float] | None]:
    """The cut into stages (the checkpoint's, the configured one or an automatic one)
    and the per-layer costs of an automatic cut (None otherwise)."""
    from mpipipe.pipeline.config import chunks_per_stage
    from mpipipe.pipeline.partition import automatic_balance, check_balance

    cfg, comm = run.cfg, run.comm
    k = cfg["pipeline"]["stages"]
    v = chunks_per_stage(cfg)  # checked in _static_checks
    balance = list(cfg["pipeline"]["balance"])
    costs: list[float] | None = None  # the per-layer costs of an automatic cut
    if state is not None or run.request.resume:
        saved = comm.bcast(list(state.balance) if state is not None else None, root=route.ranks[0])
        if balance and balance != saved:
            run.fail(f"pipeline.balance = {balance} differs from the checkpoint's {saved}")
        balance = saved
    elif not balance:
        if v * k > len(model):
            run.fail(f"pipeline.stages = {k}" + (f" with {v} chunks each" if v > 1 else "")
                     + f" but model {run.recipe.model_name()} has only "
                     f"{len(model)} layers")
        # The same function as `python -m mpipipe plan`, so the dry run shows this cut.
        if cfg["pipeline"]["balance_by"] == "params":
            balance, costs = automatic_balance(cfg, model, in_shape)
        else:
            # timings differ from rank to rank: one rank measures, all use its answer
            balance, costs = comm.bcast(automatic_balance(cfg, model, in_shape)
                                        if run.rank == 0 else None, root=0)
    try:
        balance = check_balance(model, balance)
        if len(balance) != v * k:
            raise ValueError(f"pipeline.balance = {balance} has {len(balance)} entries for "
                             f"pipeline.stages = {k}" + (f" x {v} chunks" if v > 1 else ""))
    except ValueError as e:
        run.fail(f"{e}")
    return balance, costs


def _stage_state(run: Run, pipe: Pipeline, my_stage: int | None) -> StageState | None:
    """This rank's stage's state, its optimizer made by the recipe (None without a
    stage); agreed over all ranks."""
    from mpipipe.core.run import recipe
    from mpipipe.core.state.stagestate import StageState

    state, error = None, None
    if pipe.stage_module is not None:
        try:  # a given optimizer may work on the whole model and fail on one stage
            state = StageState(pipe.stage_module, run.recipe.make_optimizer)
        except recipe.RecipeError as e:
            error = f"stage {my_stage}: {e}"
    agree(run, error)  # every rank stops with that line, none waits for this one
    return state


def _resume_from(setup_: Setup, state: Checkpoint | None, my_stage: int | None,
                 route: Route) -> None:
    """Load the checkpoint's weights, optimizer and reader position into ``setup_`` and
    set its first step (with --resume; a mismatch stops every rank)."""
    from mpipipe.core.state.checkpoint import CheckpointError

    run, pipe = setup_.run, setup_.pipe
    comm, total = run.comm, setup_.total_steps
    error = None
    if state is not None:
        assert setup_.state is not None
        try:
            setup_.state.load_state_dict(state.state)
            if setup_.train_data is not None:
                if state.sampler[0] >= 0:
                    setup_.train_data.seek(*state.sampler)
                else:  # ResPipe's checkpoints: its readers are positioned by the step alone
                    setup_.train_data.seek_batch(state.step)
        except (CheckpointError, RuntimeError, ValueError, KeyError) as e:
            why = str(e).removeprefix("does not fit this model and optimizer: ")
            error = (f"the checkpoint of stage {my_stage} in {run.request.resume} does not fit "
                     f"this model and optimizer (was it written with another config?): {why}")
        pipe.eval_count = state.eval_count
    if run.request.resume:
        agree(run, error)  # every rank stops with the same line, none waits for another
        setup_.start_step = comm.bcast(state.step if state is not None else None,
                                       root=route.ranks[0])
        if setup_.start_step >= total:  # before any record: the old log stays as it was
            fail_fast(comm, f"--resume {run.request.resume}: its checkpoints are of step "
                            f"{setup_.start_step}, and this run ends at step {total} (run.steps / "
                            f"run.epochs): nothing to resume; give more steps to train further",
                      run.prog, run.rank)
        pipe.step_count = setup_.start_step
        run.log.cut_after(setup_.start_step)  # a continued log: those steps run again
        run.log.event(EventKind.RESUME, step=setup_.start_step, directory=str(run.request.resume))


def _checkpoint_dir(run: Run) -> Path | None:
    """Where checkpoints go: run.checkpoint_dir, or beside the log (every rank learns the
    writer's log path), or ./checkpoints; None without checkpoints."""
    cfg, comm = run.cfg, run.comm
    ckpt = cfg["run"]["checkpoint_dir"]
    if not ckpt and cfg["run"]["checkpoint_every"] > 0:
        writer = run.plan.log_rank
        log_path = run.log.path if run.rank == writer else None
        log_path = comm.bcast(str(log_path) if log_path else None, root=writer)
        ckpt = str(Path(log_path).with_suffix("")) + "-ckpt" if log_path else "checkpoints"
    return Path(ckpt) if ckpt else None


def read_batch(s: Setup) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, str | None]:
    """The first stage's next mini-batch, or this rank's fatal data error (one line)."""
    from mpipipe.core.run.batches import DataFault

    if s.train_data is None:
        return None, None
    try:
        return s.train_data.next(), None
    except DataFault as e:
        return None, str(e)


def train_step(s: Setup, step: int,
               batch: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, float]:
    """One optimizer step on this rank (``batch``: the first stage's, read already);
    returns its figures for the run log."""
    pipe = s.pipe
    x = y = None
    if batch is not None:
        x, y = batch
    elif s.train_data is not None:
        x, y = s.train_data.next()
    pipe.transport.reset_counters()
    loss = pipe.step(x, y, s.loss_fn, step=step)
    t0 = time.perf_counter()
    if s.state is not None:
        s.state.apply_step(s.schedule, step)
    opt_s = time.perf_counter() - t0
    figures = {
        "compute_s": pipe.last_compute_s + opt_s,
        "wait_s": pipe.last_wait_s,
        "bytes_sent": pipe.transport.total_sent,
        "bytes_recv": pipe.transport.total_recv,
    }
    if loss is not None:
        figures["loss"] = loss
    return figures


def evaluate(s: Setup) -> float:
    """Accuracy on the whole test split, known on every rank (allreduced)."""
    from mpipipe.core.run import batches

    pipe, path, bs = s.pipe, s.run.cfg["data"]["path"], s.run.cfg["data"]["batch_size"]
    correct = count = 0
    if pipe.first:
        test_set = batches.test_batches(path, bs, mean=s.run.cfg["data"]["mean"],
                                        std=s.run.cfg["data"]["std"])
        for x, y in test_set:
            result = pipe.evaluate(x, y)
            if result is not None:
                correct, count = correct + result[0], count + result[1]
    elif pipe.stage is not None:
        for _ in range(s.eval_batches):
            result = pipe.evaluate(None, None)
            if result is not None:
                correct, count = correct + result[0], count + result[1]
    correct, count = s.run.comm.allreduce(correct), s.run.comm.allreduce(count)
    return correct / count if count else math.nan


def save_checkpoint(s: Setup, step: int, position: tuple[int, int] | None = None) -> None:
    """Every stage writes its own file; rank 0 logs one event.

    ``position`` is the reader's position after the last batch trained on; by default
    the reader's position now, which is that one unless a batch was read since (as when
    a stop is agreed on after the next batch was read: it must be read again on resume).
    """
    pipe = s.pipe
    if s.checkpoint_dir is None or s.state is None:
        s.run.comm.Barrier()
        return
    if position is None:
        position = s.train_data.position if s.train_data is not None else (-1, -1)
    s.state.step = step  # the steps this checkpoint holds (a stop's agreed step)
    s.state.save(s.checkpoint_dir, stage=pipe.stage, balance=pipe.balance, sampler=position,
                 eval_count=pipe.eval_count)
    s.run.comm.Barrier()  # the checkpoint exists only once every stage has written
    s.run.log.event(EventKind.CHECKPOINT, step=step, directory=str(s.checkpoint_dir))


def _abort(s: Setup, step: int, error: Exception) -> None:
    """Without resilience a late or dead stage ends the job: say why, then stop every rank."""
    from mpipipe.core.mpi.transport import Late

    run = s.run
    where = f"stage {s.pipe.stage} (rank {run.rank})"
    print(f"{run.prog}: error: {where} at step {step + 1}: {error}; without "
          f"[resilience] backups nothing can take over", file=sys.stderr, flush=True)
    kind = EventKind.LATE if isinstance(error, Late) else EventKind.FAILURE_DETECTED
    run.log.event(kind, step=step + 1, rank=run.rank, error=str(error))
    run.log.close(f"failed: {where}: {error}")
    run.comm.Abort(3)


def stopped(s: Setup, halt: stop.StopRun, position: tuple[int, int] | None) -> int:
    """Every rank, after agreeing to stop: checkpoint (on a signal), one line, the log's
    status; returns the exit status. ``position``: the reader's before the batch read
    for the step that is not run."""
    run = s.run
    if halt.kind == "signal" and s.checkpoint_dir is not None:
        save_checkpoint(s, halt.step, position)
    if run.rank == 0:
        stop.announce(run.prog, halt, checkpoint_dir=s.checkpoint_dir if halt.kind == "signal" else None)
    run.log.close(halt.status)
    return halt.exit_code


def train(run: Run) -> int:
    """The plain pipeline training loop (no backups); returns the exit status."""
    from mpipipe.core.mpi.transport import Late, PeerFailed

    s = setup(run)
    cfg, log, progress, comm = run.cfg, run.log, run.progress, run.comm
    eval_every = cfg["run"]["eval_every"]
    ckpt_every = cfg["run"]["checkpoint_every"]
    batch = cfg["data"]["batch_size"]
    if run.rank == 0:
        progress.message(f"{run.recipe.model_name()} in {s.pipe.k} stages, balance "
                         f"{s.pipe.balance}, {cfg['pipeline']['schedule']}, "
                         f"{s.pipe.chunks} micro-batches of ~{batch // s.pipe.chunks}")
    loss = math.nan
    accuracy = math.nan
    accuracy_step = -1
    t_prev = time.perf_counter()
    step = s.start_step
    for step in range(s.start_step, s.total_steps):
        # A data error or a stop signal on any rank stops every rank here, together.
        position = s.train_data.position if s.train_data is not None else None
        mini, error = read_batch(s)
        halt = stop.agree(comm, error, step)
        if halt is not None:
            return stopped(s, halt, position)
        try:
            figures = train_step(s, step, mini)
        except (Late, PeerFailed) as e:
            _abort(s, step, e)
        gathered = gather_figures(comm, figures)
        watchdog.beat(step)
        now = time.perf_counter()
        dt, t_prev = now - t_prev, now
        if gathered is not None:
            loss = _log_step(run, step, gathered, dt)
        done = step + 1
        if (eval_every and done % eval_every == 0) or done == s.total_steps:
            accuracy, accuracy_step = evaluate(s), done
            log.eval(done, accuracy=accuracy)
            progress.evaluation(done, accuracy)
            t_prev = time.perf_counter()
        if s.checkpoint_dir is not None and (
                (ckpt_every and done % ckpt_every == 0) or done == s.total_steps):
            save_checkpoint(s, done)
            t_prev = time.perf_counter()
    if accuracy_step != s.total_steps:
        accuracy = evaluate(s)
    return _finish(s, loss, accuracy)


def _log_step(run: Run, step: int, gathered: dict[int, dict[str, float]], dt: float) -> float:
    """The writer's row of a step (every rank's figures) and its progress line; returns
    the step's loss, NaN when no rank reported one."""
    log, progress, batch = run.log, run.progress, run.cfg["data"]["batch_size"]
    losses = [f.pop("loss") for f in gathered.values() if "loss" in f]
    loss = losses[0] if losses else math.nan
    sps = batch / dt if dt > 0 else math.nan
    at = log.elapsed()  # the row's time, shown by progress as the log has it
    log.step(step + 1, time=at, loss=loss, samples=batch, samples_per_s=sps, ranks=gathered)
    progress.update(step + 1, loss=loss, samples=batch, time=at)
    return loss


def _finish(s: Setup, loss: float, accuracy: float) -> int:
    """After the last step: the summary (log, result, printed), the model for a script,
    the log closed; returns the exit status."""
    run = s.run
    log, progress, comm = run.log, run.progress, run.comm
    summary = {
        "steps": s.total_steps,
        # mpipipe.core.logs.progress.throughput of the log's rows (of this session's without a log)
        "samples_per_s": log.throughput() if log.active else progress.samples_per_s,
        "final_loss": loss,
        "test_accuracy": accuracy,
        "log": str(log.path) if log.active else "",
    }
    log.set_attr("summary", summary)
    if run.request.api:  # a script gets the model back on the writer (mpipipe.train)
        run.final_state = gather_model_state(comm, s.state, run.plan.log_rank)
    if log.active:  # the writer's: what the Python API gives back
        run.result.update(summary)
    if run.rank == 0:
        progress.summary(**summary)  # printed under --quiet too
    # A log that lacks rows it should hold ends as "incomplete: ...", and so does the run.
    status = 0 if log.close("completed") == "completed" else 1
    if run.request.api:  # a script's ranks learn the writer's verdict alike
        status = comm.bcast(status, root=run.plan.log_rank)
    return status
