"""`python -m stannis train`: one host and N CSD ranks, weighted allreduce, HyperTune.

A rank's :class:`Trainer` composes the parts, one idea each: the rank's device
(:mod:`stannis.device`), the data-parallel step (:mod:`stannis.step`), the step
figures (:mod:`stannis.figures`), HyperTune's batches (:mod:`stannis.tuning`), the
recovery from a lost CSD (:mod:`stannis.recovery`), the injected faults
(:mod:`stannis.injection`) and the evaluation (:mod:`stannis.evaluation`). They share
the current communicator and members (:mod:`stannis.members`); the trainer runs the
phases: the start, the steps, the end.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from mpi4py import MPI

from mpipipe.core.logs.logschema import EventKind
from mpipipe.core.logs.runlog import LogError
from mpipipe.core.mpi import ft, stop, watchdog
from mpipipe.core.run import recipe
from mpipipe.core.run.cli import Request, Run, start_run
from mpipipe.core.state.stagestate import StageState

from .audit import AuditedComm
from .background_log import BackgroundLog
from .config import STANNIS_CHOICES, STANNIS_DEFAULTS, emulation, stannis_plan
from .data import DataError
from .device import open_device
from .evaluation import Evaluation
from .figures import FIG_BYTES, FIGURES, LATE_FIGURES, STEP_FIGURES, STOP_BYTES, StepFigures, run_summary
from .hypertune import TuneError
from .injection import Injection
from .members import Members
from .recovery import HostLost, Recovery
from .step import DataParallelStep
from .tuning import Tuning, equal_split

__all__ = ["FIGURES", "FIG_BYTES", "LATE_FIGURES", "PROG", "START_ATTEMPTS", "STEP_FIGURES",
           "STOP_BYTES", "HostLost", "Trainer", "equal_split", "main", "run_training"]

PROG = "stannis train"

# Start-up phases (benchmark, first plan) a job tries before it gives up: each failed
# one dropped a dead CSD or hit an MPI error that a shrink did not explain.
START_ATTEMPTS = 4


class Trainer:
    """One rank of a Stannis job: the host (rank 0) or a CSD."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.cfg = cfg = run.cfg
        self.world_rank = run.rank
        self.role = run.plan.role_of(run.rank)
        self.is_host = self.role.kind == "host"
        self.group = Members(run.comm)
        self.log = BackgroundLog(run.log)
        # The watchdog closes the log through the writer thread, rows queued before first.
        watchdog.use_log(lambda: run.log.active, self._close_stuck)
        seed = cfg["run"]["seed"]
        torch.manual_seed(seed)
        self.device = device = open_device(run, self.group.comm, self.role)
        state, loss_fn, schedule = self._build_model(device.in_shape(run.fail))
        self.stepper = DataParallelStep(self.group, state, loss_fn, schedule, device, cfg)
        self.injection = Injection(cfg["stannis"]["inject"], seed, self.world_rank, run.size,
                                   self.is_host, self.log, run.plan)
        self.tuning = Tuning(cfg, self.group, device.records, run.plan.role_of, device.max_batch,
                             self.is_host, self.log, run.progress)
        self.figures = StepFigures(self.group, device.meter, self.log, run.progress, self.is_host)
        self.evaluation = Evaluation(state.module, loss_fn, cfg["data"], cfg["run"]["eval_every"],
                                     self.log, run.progress)
        self.recovery = Recovery(self.group, self.stepper, self.figures, self.tuning,
                                 device.records, self.is_host, self.log, run.progress)

    def _build_model(self, in_shape: tuple[int, ...]) -> tuple:
        """The recipe's model and optimizer (one StageState), loss and rate schedule
        (recorded in the log as built)."""
        run, cfg = self.run, self.cfg
        try:  # every rank seeded alike: the same weights (checked in DataParallelStep.sync_from_host)
            model = run.recipe.build_model(in_shape)
            model.float()
            state = StageState(model, run.recipe.make_optimizer)
            loss_fn = run.recipe.make_loss()
            schedule = run.recipe.schedule(int(cfg["run"]["steps"]))
        except recipe.RecipeError as e:
            run.fail(e)
        if run.log.active:  # what runs, read from the objects (docs/hdf5-log.md), as built
            o = cfg["optim"]
            self.log.set_attr("recipe", run.recipe.describe(  # through the writer thread
                model, schedule, loss_fn, optimizer=state.optimizer,
                rate={"base_batch": o["base_batch"], "warmup_steps": o["warmup_steps"]}))
        return state, loss_fn, schedule

    # -- what the commands and benches read -------------------------------------------------
    @property
    def comm(self) -> AuditedComm:
        """The communicator of the current members."""
        return self.group.comm

    @property
    def members(self) -> list[int]:
        """The world ranks training now (fewer than the world's after a CSD was dropped)."""
        return self.group.ranks

    @property
    def step(self) -> int:
        """Optimizer steps applied."""
        return self.stepper.done

    @property
    def model(self) -> torch.nn.Module:
        """The model this rank trains (on the host, the run's final state once it ends)."""
        return self.stepper.model

    # -- the phases -----------------------------------------------------------------------
    def _start_once(self) -> None:
        """Share the host's state, benchmark (when tuning), plan and share the first batches."""
        self.stepper.sync_from_host()
        if self.cfg["stannis"]["tune"]:
            self.tuning.benchmark(self.stepper)
        if self.is_host:
            self.tuning.plan("start" if self.cfg["stannis"]["tune"] else "equal batches", self.step)
        self.tuning.share()

    def _start(self) -> None:
        """Start every survivor alike (:meth:`_start_once`, then an agreement).

        A CSD that dies in this phase (ULFM) is dropped and the survivors start it
        over; the agreement ends the phase so that no rank starts training while
        another benchmarks again.
        """
        for attempt in range(START_ATTEMPTS):
            error = ft.agreed_phase(self.comm.comm, self._start_once)
            if error is None:
                return
            if attempt == START_ATTEMPTS - 1:
                raise error
            self.recovery.until_stable(error, replan=False, agreed=True)

    def _log_start(self) -> None:
        """Host: every rank's energy source, and the CPUs the emulated CSDs are bound to."""
        for r in self.members:
            self.log.event(EventKind.ENERGY_SOURCE, step=0, rank=r, source=self.device.sources[r])
        if any(self.device.bindings.values()):
            self.log.event(EventKind.CPU_BINDING, step=0, cpus=dict(self.device.bindings),
                           why="emulated CSDs bound to their own cores, as real drives compute "
                               "on theirs (csd.bind_cpus); CSDs sharing a core take turns to "
                               "compute")

    def train(self) -> None:
        steps = self.cfg["run"]["steps"]
        if self.is_host:
            self._log_start()
        self._start()
        self.comm.take()
        self.injection.start()
        self.t_train = time.perf_counter()  # samples/s in the summary counts training only
        ends = 0
        while True:
            if self.step >= steps:
                # The end is a phase of its own: the last step's plan broadcast may fail
                # on the host after the others left it (seen on the testbed after a
                # node-kill), so every survivor agrees that training is over. It stays
                # inside the loop (unlike _start's phase): a recovery takes the host's step,
                # which may be one behind if the host failed before its last update, and
                # then every survivor trains that step again before it ends.
                error = ft.agreed_phase(self.comm.comm, self.flush_figures)
                if error is None:
                    break
                ends += 1
                if ends == START_ATTEMPTS:
                    raise error
                self.recovery.until_stable(error, agreed=True)
                self.figures.restart_clock()
                continue
            try:
                self._one_step(steps)
            except MPI.Exception as e:
                # Under ULFM a peer's death can also surface as another error class (a
                # non-blocking collective reports MPI_ERR_OTHER when its schedule aborts),
                # so any MPI error leads to revoke + shrink; without a dead rank the
                # shrink keeps everyone and the step is simply redone.
                if not ft.ulfm_enabled():
                    raise
                self.recovery.until_stable(e)
                self.figures.restart_clock()
                continue
            if self.is_host and self.evaluation.due(self.step, steps):
                self.evaluate()
        if self.is_host:
            accuracy = self.evaluate()
            self._summary(accuracy)
        self.log.drain()

    def _one_step(self, steps: int) -> None:
        """One training step of every member: local compute, then gradients, figures and
        stop code in one exchange, then the update; rates decay over ``steps``."""
        index = self.step  # 0-based, as fault specs count
        self.injection.announce(index, self.members)
        t_start = time.perf_counter()
        self.figures.start()
        slowdown = self.injection.fire(index)
        b, compute_s, loss_sum, error = self.stepper.local(self.tuning.batch_of(self.world_rank),
                                                           slowdown)
        # This step's figures, and the previous step's that only its end knew, travel
        # to the host in the same wait as the gradients (see FIGURES).
        row = self.figures.row(compute_s, b, loss_sum)
        table = self.figures.table()
        total = self.stepper.exchange(b, error, index, row, table)
        self.figures.exchanged()
        self.stepper.update(index, total, steps)
        self.figures.close(compute_s, self.stepper.wait_s)
        watchdog.beat(index)
        if self.is_host:
            self.tuning.observe(self.figures.record(table, time.perf_counter() - t_start, self.step))
            self.tuning.maybe_retune(self.step)
        s = self.cfg["stannis"]
        if s["tune"] and self.step % s["retune_every"] == 0:
            self.tuning.share()

    def _close_stuck(self, status: str) -> None:
        """The watchdog's end of a stuck run: the queued rows, then the status."""
        try:
            self.log.drain()
        finally:
            self.run.log.close(status)

    def flush_figures(self) -> None:
        """Every rank: send the last step's late figures so its log row can be written.

        Collective; call once training stops (the bytes are not a step's).
        """
        self.figures.flush()

    def evaluate(self) -> float:
        """Host: accuracy on the public test split."""
        return self.evaluation.evaluate(self.step)

    def _summary(self, accuracy: float) -> None:
        progress = self.run.progress
        summary = run_summary(
            self.figures.totals, self.device.sources, elapsed=time.perf_counter() - self.t_train,
            steps=self.step, samples_per_s=progress.samples_per_s, accuracy=accuracy,
            loss=self.figures.last_loss,
            final_batches=dict(zip(self.members, self.tuning.batches, strict=True)),
            grad_bytes=self.stepper.grad_bytes, buffer_bytes=self.stepper.buffer_bytes)
        self.log.set_attr("summary", summary)
        self.run.result.update(summary)
        progress.summary(steps=self.step, samples_per_s=summary["samples_per_s"],
                         samples_per_joule=summary["samples_per_joule"],
                         accuracy=accuracy, log=str(self.run.log.path))


def main(args: argparse.Namespace) -> int:
    """Run ``stannis train`` on this rank; returns the exit status."""
    return run_training(Request.from_args(args)).status


def run_training(request: Request) -> Run:
    """Set up the run a request asks for on this rank and train; the library both ways in
    call (the command line and :func:`stannis.train`). Returns the Run: its ``status``, and
    on the host its ``result`` and ``final_state``.

    Raises:
        mpipipe.core.mpi.roles.TrainingFailed: a bad configuration, plan, fault or log path
            (the same line, on every rank).
    """
    run = start_run(request, prog=PROG, system="stannis", defaults=STANNIS_DEFAULTS,
                    choices=STANNIS_CHOICES, build_plan=stannis_plan,
                    inject_key=("stannis", "inject"), emulation=emulation)
    run.status = _train(run)
    return run


def _train(run: Run) -> int:
    """Train on this rank; the exit status (a lost host or an MPI failure leaves at once)."""
    run.comm.Set_errhandler(MPI.ERRORS_RETURN)
    trainer = None
    try:
        trainer = Trainer(run)
        trainer.train()
    except (TuneError, DataError) as e:
        if trainer is not None:
            trainer.log.drain()
        run.fail(e)
    except stop.StopRun as e:  # every rank agreed in the step's exchange
        try:
            trainer.flush_figures()
        except MPI.Exception:  # a peer died meanwhile: the last row keeps NaN figures
            pass
        trainer.log.drain()
        if trainer.is_host:
            stop.announce(PROG, e, checkpoint_dir=None,
                          unresumable="Stannis keeps no checkpoints; a new run starts over")
        run.log.close(e.status)
        if len(trainer.members) < run.size:  # as below: no MPI_Finalize with a dead rank
            stop.flush_and_exit(e.exit_code)
        return e.exit_code
    except HostLost as e:
        if run.rank == min(e.survivors):
            # One line, and the log the host left open is closed with the reason: the
            # lowest survivor opens it once the dead host's lock is gone (a dead process
            # holds none) and writes the status only; its rows stay the host's.
            print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
            try:
                run.log.take_over(None)
                run.log.close(f"failed: {e}")
            except LogError as why:
                print(f"{PROG}: error: the run log could not be closed: {why}",
                      file=sys.stderr, flush=True)
        stop.flush_and_exit(1)  # the host is dead: MPI_Finalize would wait for it
    except (MPI.Exception, ft.PhaseFailed) as e:
        # A failure the recovery could not get past (without ULFM, any): say so and leave
        # at once, without MPI_Finalize. A rank that exits with an error makes mpirun end
        # the job, where a rank that waits for the others at its end would hang it.
        if trainer is not None:
            trainer.log.drain()
        run.log.close(f"failed: mpi: {e}")
        print(f"{PROG}: error: rank {run.rank}: an MPI failure stopped the run: {e}",
              file=sys.stderr, flush=True)
        stop.flush_and_exit(1)
    run.log.close()
    if trainer.is_host:
        run.final_state = trainer.stepper.state.model_state()
    if len(trainer.members) < run.size:
        # A CSD was dropped: under ULFM, MPI_Finalize runs an agreement over the whole
        # world, which was seen to wait for the dead rank now and then (as in ResPipe).
        # Everything is written and closed by now: leave without it.
        if run.request.api:  # a script goes on: leave when it ends
            stop.exit_at_end(0)
            return 0
        stop.flush_and_exit(0)
    return 0
