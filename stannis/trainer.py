"""`python -m stannis train`: one host and N CSD ranks, weighted allreduce, HyperTune."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from mpipipe.core.logs.logschema import EventKind
from mpipipe.core.logs.runlog import LogError
from mpipipe.core.mpi import ft, stop, watchdog
from mpipipe.core.mpi.faults import FaultPlan, parse_all
from mpipipe.core.run import recipe
from mpipipe.core.run.batches import DataFault, label_range_ok, test_batches, transforms
from mpipipe.core.run.cli import Request, Run, start_run
from mpipipe.core.run.lr import decay

from .allreduce import BufferAverage, WeightedAllreduce, broadcast_state
from .audit import AuditedComm
from .background_log import BackgroundLog
from .config import STANNIS_CHOICES, STANNIS_DEFAULTS, csd_dir, csd_profile, emulation, stannis_plan
from .csd import CoreTurns, Stretch, cpu_binding
from .data import BatchStream, DataError, open_split
from .energy import EnergyError, PowerModel, make_meter
from .hypertune import (
    Plan,
    RankProfile,
    Retuner,
    RetuneRule,
    TuneError,
    evaluate,
    fit_step_model,
    scaled_lr,
    share_caps,
    tune,
    with_floors,
)

PROG = "stannis train"

# One row of figures every rank sends to the host per step (float64, buffer API), in
# the same wait as the gradients: this step's, and the previous step's that are known
# only after its exchange (so every step's log row is written one step late).
STEP_FIGURES = ("compute_s", "batch_size", "loss_sum", "busy_s")
LATE_FIGURES = ("wait_s", "joules", "bytes_sent", "bytes_recv", "mpi_bytes", "unaudited_bytes")
FIGURES = STEP_FIGURES + LATE_FIGURES
FIG_BYTES = 8 * len(FIGURES)
STOP_BYTES = 8  # the step's stop code (mpipipe.core.mpi.stop), reduced with the gradients
# Start-up phases (benchmark, first plan) a job tries before it gives up: each failed
# one dropped a dead CSD or hit an MPI error that a shrink did not explain.
START_ATTEMPTS = 4


def _count(x: float) -> int:
    """A byte count carried as float64; -1 where it was lost."""
    return int(x) if math.isfinite(x) else -1


class HostLost(RuntimeError):
    """The host rank died: there is no one left to hold the public data and the log.

    ``survivors``: the world ranks left; the lowest says so and closes the log."""

    def __init__(self, message: str, survivors: list[int]) -> None:
        super().__init__(message)
        self.survivors = survivors


def equal_split(global_batch: int, n: int) -> list[int]:
    """Horovod's default: the same batch on every rank (the remainder to the first ranks)."""
    return [global_batch // n + (1 if i < global_batch % n else 0) for i in range(n)]


class Trainer:
    """One rank of a Stannis job: the host (rank 0) or a CSD."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.cfg = cfg = run.cfg
        self.world_rank = run.rank
        self.role = run.plan.role_of(run.rank)
        self.is_host = self.role.kind == "host"
        self.comm = AuditedComm(run.comm)
        self.log = BackgroundLog(run.log)
        # The watchdog closes the log through the writer thread, rows queued before first.
        watchdog.use_log(lambda: run.log.active, self._close_stuck)
        self.members = list(range(run.size))  # world ranks of the current communicator
        self.world_group = run.comm.Get_group()
        seed = cfg["run"]["seed"]
        torch.manual_seed(seed)

        if self.is_host:
            self.profile = None
            threads = cfg["run"]["threads"]
            power = PowerModel(cfg["host"]["idle_w"], cfg["host"]["active_w"])
            self.stretch = Stretch(1.0)
            self.max_batch = cfg["host"]["max_batch"]
            energy_source, emulated = cfg["host"]["energy"], False
        else:
            self.profile = csd_profile(cfg, self.role.index)
            threads = self.profile.threads
            power = self.profile.power
            self.stretch = Stretch(self.profile.slowdown)
            self.max_batch = cfg["csd"]["max_batch"]
            energy_source, emulated = "auto", self.profile.emulated
            if emulated and cfg["csd"]["nice"] > 0:
                # A real CSD computes on the drive's own cores. Here its compute shares
                # the machine with the host, so it runs at low priority: it uses the
                # cores the host leaves idle instead of taking the host's.
                os.nice(cfg["csd"]["nice"])
        torch.set_num_threads(threads)

        # Each rank opens only its own data; the verdicts are shared so that every
        # rank stops together on any rank's error.
        error = None
        try:
            self.meter = make_meter(power, energy_source, emulated=emulated)
            self.stream, self.test = self._open_data(seed)
        except (DataError, EnergyError) as e:
            error = f"rank {self.world_rank} ({self.role}): {e}"
        verdicts = self.comm.allgather((error, len(self.stream) if error is None else 0,
                                        self.meter.source if error is None else "",
                                        MPI.Get_processor_name(), os.getpid()))
        errors = [v[0] for v in verdicts if v[0]]
        if errors:
            run.fail(errors[0])
        self.records = {r: v[1] for r, v in enumerate(verdicts)}
        self.sources = {r: v[2] for r, v in enumerate(verdicts)}
        self.bindings = dict(enumerate(self.comm.allgather(
            self._bind_cpus(one_machine=len({v[3] for v in verdicts}) == 1))))
        self.turns = self._core_turns(job=f"{verdicts[0][4]}")  # the host's pid names the job
        self.comm.take()  # start-up traffic is not a training step's

        in_shape = self._in_shape()
        try:  # every rank seeded alike above: the same weights (checked in _sync_from_host)
            self.model = run.recipe.build_model(in_shape)
            self.model.float()
            self.optimizer = run.recipe.make_optimizer(self.model)
            self.loss_fn = run.recipe.make_loss()
            self.schedule = run.recipe.schedule(int(cfg["run"]["steps"]))
        except recipe.RecipeError as e:
            run.fail(e)
        if run.log.active:  # what runs, read from the objects (docs/hdf5-log.md), as built
            o = cfg["optim"]
            self.log.set_attr("recipe", run.recipe.describe(  # through the writer thread
                self.model, self.schedule, self.loss_fn, optimizer=self.optimizer,
                rate={"base_batch": o["base_batch"], "warmup_steps": o["warmup_steps"]}))
        averaged = None if cfg["stannis"]["local_buffers"] else BufferAverage(self.comm, self.model)
        self.buffers = averaged if averaged is not None and averaged.nbytes else None
        self.reducer = WeightedAllreduce(self.comm, self.model.parameters(),
                                         cfg["stannis"]["bucket_bytes"], exchange=cfg["stannis"]["exchange"],
                                         root=0)  # the host: rank 0, before and after a shrink
        self.step = 0  # optimizer steps applied (the host's state is shared in _start)

        self.faults = FaultPlan(parse_all(cfg["stannis"]["inject"]), seed=seed, stage=None,
                                rank=self.world_rank)
        # The host logs every rank's faults from the same plans, run dry.
        self.fault_shadows = {}
        if self.is_host:
            for r in range(run.size):
                self.fault_shadows[r] = FaultPlan(
                    self.faults.all, seed=seed, stage=None, rank=r, sleep=lambda s: None,
                    kill=lambda: None, on_fire=self._fault_logger(r), dry=True)
        self.batches: list[int] = []
        self.profiles: dict[int, RankProfile] = {}
        s = cfg["stannis"]
        # host: each rank's busy times at the plan in force, and when to re-tune on them
        self.retuner = Retuner(RetuneRule(every=s["retune_every"],
                                          noise_retunes_per_100=s["noise_retunes_per_100"],
                                          min_gain=s["min_gain"],
                                          imbalance_threshold=s["imbalance_threshold"]))
        self.floors_fit = True  # host: the last plan gave every rank its batch floor
        self.dropped_pending: list[int] = []
        self._cycle: float | None = None  # end of the last gradient exchange
        self._post = (math.nan,) * len(LATE_FIGURES)  # last step's late figures, sent next
        self._pending: dict[str, Any] | None = None  # host: the step row held back
        self.history: list[tuple[int, int, float]] = []  # host: (step, samples, end time)
        self.totals = {r: {"samples": 0, "joules": 0.0, "busy_s": 0.0} for r in self.members}

    # -- set-up -------------------------------------------------------------------------
    def _bind_cpus(self, one_machine: bool) -> list[int] | None:
        """Bind this rank's compute to its own cores when emulated CSDs share the host's machine.

        Only the calling (main) thread and the threads it starts later are bound:
        the host's log writer, already running, keeps every core. Returns the CPUs,
        or None if nothing was bound.
        """
        c = self.cfg["csd"]
        if not (c["bind_cpus"] and c["emulated"] and one_machine
                and hasattr(os, "sched_setaffinity")):
            return None
        profiles = [csd_profile(self.cfg, k) for k in range(1, self.run.size)]
        available = sorted(os.sched_getaffinity(0))
        cpus = cpu_binding(0 if self.is_host else self.role.index,
                           [p.threads / p.slowdown for p in profiles], available)
        if cpus == available:
            return None
        os.sched_setaffinity(0, cpus)
        return cpus

    def _core_turns(self, job: str) -> CoreTurns:
        """Open the compute lock of this rank's core when other CSDs are bound to it too.

        Collective (every rank knows the bindings): all members open their lock
        file (named by ``job``, unique among running jobs), and after a barrier the
        first member of each shared core unlinks it (see CoreTurns).
        """
        groups: dict[tuple[int, ...], list[int]] = {}
        for r, cpus in self.bindings.items():
            if cpus:
                groups.setdefault(tuple(cpus), []).append(r)
        shared = {cpus: ranks for cpus, ranks in groups.items() if len(ranks) > 1}
        if not shared:
            return CoreTurns(None)
        mine = tuple(self.bindings[self.world_rank] or ())
        turns = CoreTurns(CoreTurns.name(job, mine) if mine in shared else None)
        self.comm.Barrier()
        if mine in shared and self.world_rank == shared[mine][0]:
            turns.release_name()
        return turns

    def _open_data(self, seed: int) -> tuple[BatchStream, Any]:
        cfg = self.cfg
        root = cfg["data"]["path"]
        share = cfg["data"]["public_to_csds"]
        n = cfg["stannis"]["csds"]
        public = None
        if self.is_host or share > 0:
            public = open_split(f"{root}/public/train")
        parts = []
        test = None
        if self.is_host:
            test = open_split(f"{root}/public/test")  # checked now; read by test_batches
            keep = len(public) - int(round(share * len(public))) if n else len(public)
            parts.append((public, np.arange(keep)))
        else:
            private = open_split(csd_dir(cfg, self.role.index))
            parts.append((private, np.arange(len(private))))
            if share > 0:
                given = np.arange(len(public) - int(round(share * len(public))), len(public))
                parts.append((public, np.array_split(given, n)[self.role.index - 1]))
        classes = cfg["model"]["num_classes"]
        for reader in {id(r): r for r, _ in parts}.values():
            label_range_ok(reader, classes)  # DataError: labels outside the model's classes
        # Each sample's draws: (run.seed, this rank's epoch, its record in its data set);
        # a TransformError is a DataError, agreed on with the others' verdicts.
        augment = transforms(cfg["data"], seed=seed)
        return BatchStream(parts, seed=seed * 1000 + self.world_rank, num_classes=classes,
                           augment=augment), test

    def _in_shape(self) -> tuple[int, ...]:
        reader = self.stream.parts[0][0]
        fields = {f.name: f for f in reader.schema}
        if "image" not in fields or "label" not in fields:
            self.run.fail(f"{reader}: records need fields 'image' and 'label'")
        return tuple(fields["image"].shape)

    def _sync_from_host(self) -> None:
        """Every rank starts (and restarts after a failure) from the host's parameters
        and optimizer state."""
        broadcast_state(self.comm, self.model, self.optimizer, self.step)

    def _fault_logger(self, rank: int):
        def log(fault: Any, step: int, detail: dict) -> None:
            self.log.event(EventKind.FAULT_INJECTED, step=step + 1, rank=rank, fault=str(fault),
                               **detail)
        return log

    # -- one step's pieces --------------------------------------------------------------
    def _compute(self, b: int) -> tuple[float, float]:
        """Forward and backward on ``b`` local samples; returns (device seconds, loss sum).

        Device seconds: wall time, and at least CPU time times the emulated slow-down
        (see csd.py).
        """
        t0 = time.perf_counter()
        c0 = time.thread_time()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        if b > 0:
            with self.turns:  # CSDs that share a core take turns (see csd.CoreTurns)
                x, y = self.stream.next(b)
                loss = self.loss_fn(self.model(x), y)
                loss.backward()
            loss_sum = float(loss.item()) * b
        return self.stretch.apply(time.thread_time() - c0, time.perf_counter() - t0, b), loss_sum

    def benchmark(self) -> None:
        """Time a few batch sizes on every rank; the host fits step models and tunes."""
        s = self.cfg["stannis"]
        sizes = [min(b, self.max_batch) for b in s["benchmark_batches"]]
        self.run.progress.message(
            f"benchmark: batch sizes {', '.join(map(str, sizes))}, {s['benchmark_repeats']} "
            f"timed steps each, on {len(self.members)} ranks")
        row = np.zeros(len(sizes) * 2)
        error = None
        try:
            self._compute(max(sizes))  # warm-up: first calls allocate and are not typical
            for i, b in enumerate(sizes):
                # The fastest repeat: noise (a busy core, a cache miss) only ever adds time.
                times = []
                for _ in range(s["benchmark_repeats"]):
                    times.append(self._compute(b)[0])
                    watchdog.beat()
                row[2 * i], row[2 * i + 1] = b, float(np.min(times))
        except DataFault as e:  # the benchmark reads records too: every rank stops, as in a step
            error = str(e)
        self.optimizer.zero_grad(set_to_none=True)
        table = np.zeros((self.comm.Get_size(), len(row))) if self.is_host else None
        code, worst = np.array([stop.agree_code(self.comm, error)], dtype=np.float64), np.zeros(1)
        agreed = self.comm.Iallreduce(code, worst, op=MPI.MAX)
        self.comm.Gather(row, table, root=0)
        agreed.Wait()
        halt = stop.stop_from(self.comm, int(worst[0]), error, 0)
        if halt is not None:
            raise halt  # before any step: nothing trained, nothing to resume
        if self.is_host:
            for pos, r in enumerate(self.members):
                bs, ts = table[pos, 0::2], table[pos, 1::2]
                self.profiles[r] = self._rank_profile(r, fit_step_model(list(bs), list(ts)))
            self.log.event(EventKind.BENCHMARK, step=0, models={
                r: {"overhead_s": p.model.overhead_s, "per_sample_s": p.model.per_sample_s}
                for r, p in self.profiles.items()})

    def _rank_profile(self, r: int, model: Any) -> RankProfile:
        cfg = self.cfg
        if r == 0:
            return RankProfile(model, cfg["host"]["max_batch"], 1, cfg["host"]["idle_w"],
                               cfg["host"]["active_w"])
        p = csd_profile(cfg, self.run.plan.role_of(r).index)
        return RankProfile(model, cfg["csd"]["max_batch"], 1, p.idle_w, p.active_w)

    def _capped(self) -> list[RankProfile]:
        """The members' profiles as the plan obeys them (see :meth:`_constrain`)."""
        return self._constrain([self.profiles[r] for r in self.members])

    def _constrain(self, profiles: list[RankProfile]) -> list[RankProfile]:
        """The members' profiles with each batch capped by its share of the records,
        and floored where its fixed per-step overhead would dominate.

        Recomputed at every plan, so the caps follow the data that is left after a
        CSD is dropped (see hypertune.share_caps); the floors come from each
        rank's benchmark fit (hypertune.batch_floor, stannis.overhead_share).
        """
        s = self.cfg["stannis"]
        caps = share_caps([self.records[r] for r in self.members], s["global_batch"],
                          s["max_oversample"])
        out = []
        for p, cap in zip(profiles, caps, strict=True):
            top = min(p.max_batch, cap)
            out.append(replace(p, max_batch=top, min_batch=min(p.min_batch, top)))
        out, self.floors_fit = with_floors(out, s["global_batch"], s["overhead_share"])
        return out

    def _plan_batches(self, reason: str, plan: Plan | None = None) -> None:
        """Host: choose batches for the current members (HyperTune or equal split)."""
        s = self.cfg["stannis"]
        old = list(self.batches)
        floors: list[int] = []
        if s["tune"]:
            capped = self._capped()
            floors = [p.min_batch for p in capped]
            plan = plan or tune(capped, s["global_batch"], s["objective"], s["mix_weight"])
            new = list(plan.batches)
            predicted = plan.samples_per_s
            if not self.floors_fit:
                reason += (f"; floors {floors} scaled down to fit the global batch "
                           f"{s['global_batch']}: raise stannis.global_batch for every rank "
                           f"to work at <= {s['overhead_share']:.0%} overhead")
        else:
            new = equal_split(s["global_batch"], len(self.members))
            predicted = math.nan
        self.batches = new
        self.retuner.restart(self.members)
        if old != new:
            self.log.event(EventKind.RETUNE, step=self.step, reason=reason, ranks=self.members,
                               old=old, new=new, predicted_sps=predicted, floors=floors)
            self.run.progress.message(f"step {self.step}: batches {old} -> {new} ({reason})")

    def _share_plan(self) -> None:
        """Host decides, everyone applies at the same step boundary."""
        buf = np.array(self.batches if self.is_host else [0] * self.comm.Get_size(),
                       dtype=np.int64)
        self.comm.Bcast(buf, root=0)
        self.batches = [int(b) for b in buf]

    def _maybe_retune(self) -> None:
        """Host: every ``retune_every`` steps, re-tune if the gain beats the noise.

        The rule is hypertune.Retuner's (pure, unit-tested without MPI): smoothed
        per-rank times, a bar derived from the measured spread of step times.
        """
        s = self.cfg["stannis"]
        if not s["tune"]:
            return
        decision = self.retuner.check(
            self.step, self.members, self.batches, [self.profiles[r] for r in self.members],
            self._constrain, s["global_batch"], s["objective"], s["mix_weight"])
        if decision is None:
            return
        for r, p in zip(self.members, decision.profiles, strict=True):
            self.profiles[r] = p
        if decision.target is not None:
            self._plan_batches(decision.reason, evaluate(self._capped(), decision.target))

    # -- failures -----------------------------------------------------------------------
    def _recover_until_stable(self, error: BaseException, attempts: int = 4, *,
                              replan: bool = True, agreed: bool = False) -> None:
        """Recover, and recover again if another rank fails during the recovery.

        ``agreed``: the caller has just taken part in an agreement on this communicator
        (the end of a phase, :func:`mpipipe.core.mpi.ft.agreed_phase`), which stands for the recovery's own.
        """
        for attempt in range(attempts):
            try:
                self._recover(error, replan=replan, agreed=agreed and attempt == 0)
                return
            except MPI.Exception as e:
                if attempt == attempts - 1:
                    raise
                error = e

    def _recover(self, error: BaseException, *, replan: bool = True, agreed: bool = False) -> None:
        """Drop the dead CSDs (ULFM shrink), resync from the host and re-balance.

        Every way into a recovery takes part in exactly one agreement before the shrink:
        here (after the revoke, which makes every other survivor fail out of whatever it
        waits in) or, with ``agreed``, at the end of a phase (:func:`~mpipipe.core.mpi.ft.agreed_phase`). So a
        rank that recovers from an error inside the last step and a rank that finished
        that step and agreed on the end of training meet in the same agreement, then in
        the same shrink, instead of waiting in different collectives for ever.

        ``replan=False`` during the benchmark phase: there are no step models to
        balance with yet; the survivors benchmark again and plan from that.
        """
        t0 = time.perf_counter()
        ft.revoke(self.comm.comm)
        if not agreed:
            ft.agree(self.comm.comm, 0)
        new = ft.shrink(self.comm.comm)
        survivors = list(new.Get_group().Translate_ranks(list(range(new.Get_size())),
                                                         self.world_group))
        dead = [r for r in self.members if r not in survivors]
        self.dropped_pending += dead  # logged once the survivors are in step again
        if 0 in dead:
            raise HostLost(f"the host (rank 0) died at step {self.step + 1}; a Stannis job "
                           "cannot continue without it (the public data and the model's "
                           "reference copy live there)", survivors)
        old_comm = self.comm
        self.comm = AuditedComm(new)
        self.comm.sent, self.comm.recv = old_comm.sent, old_comm.recv
        self.members = survivors
        self.reducer.comm = self.comm
        if self.buffers is not None:
            self.buffers.comm = self.comm
        # The host's state wins: a survivor that already applied this step and one
        # that had not end up identical, momentum included.
        step = np.array([self.step], dtype=np.int64)
        self.comm.Bcast(step, root=0)
        self.step = int(step[0])
        self._sync_from_host()
        dead, self.dropped_pending = self.dropped_pending, []
        # The interrupted exchange carried the last step's late figures: that row is
        # written without them.
        self._post = (math.nan,) * len(LATE_FIGURES)
        if self.is_host:
            self._write_pending(None)
        if self.is_host and dead:
            for r in dead:
                self.log.event(EventKind.CSD_DROPPED, step=self.step, rank=r, error=str(error),
                                   samples_lost=self.records.get(r, 0),
                                   recovery_s=time.perf_counter() - t0)
                self.run.progress.message(
                    f"step {self.step}: rank {r} died; dropped, its {self.records.get(r, 0)} "
                    "private samples are no longer trained on")
                self.profiles.pop(r, None)
            self.retuner.forget_moves()
            if replan:
                self._plan_batches(f"ranks {dead} dropped")
        elif self.is_host:
            self.log.event(EventKind.MPI_ERROR_RECOVERED, step=self.step, error=str(error))
        if replan:
            self._share_plan()

    def _start_once(self) -> None:
        """Share the host's state, benchmark (when tuning), plan and share the first batches."""
        self._sync_from_host()
        if self.cfg["stannis"]["tune"]:
            self.benchmark()
        if self.is_host:
            self._plan_batches("start" if self.cfg["stannis"]["tune"] else "equal batches")
        self._share_plan()

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
            self._recover_until_stable(error, replan=False, agreed=True)

    # -- the loop -----------------------------------------------------------------------
    def train(self) -> None:
        cfg = self.cfg
        s, o = cfg["stannis"], cfg["optim"]
        steps = cfg["run"]["steps"]
        if self.is_host:
            for r in self.members:
                self.log.event(EventKind.ENERGY_SOURCE, step=0, rank=r, source=self.sources[r])
            if any(self.bindings.values()):
                self.log.event(EventKind.CPU_BINDING, step=0, cpus={r: c for r, c in self.bindings.items()},
                               why="emulated CSDs bound to their own cores, as real drives compute "
                                   "on theirs (csd.bind_cpus); CSDs sharing a core take turns to "
                                   "compute")
        self._start()
        self.comm.take()
        self.t_train = time.perf_counter()  # samples/s in the summary counts training only
        eval_every = cfg["run"]["eval_every"]
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
                self._recover_until_stable(error, agreed=True)
                self._cycle = None
                continue
            try:
                self._one_step(steps, s, o)
            except MPI.Exception as e:
                # Under ULFM a peer's death can also surface as another error class (a
                # non-blocking collective reports MPI_ERR_OTHER when its schedule aborts),
                # so any MPI error leads to revoke + shrink; without a dead rank the
                # shrink keeps everyone and the step is simply redone.
                if not ft.ulfm_enabled():
                    raise
                self._recover_until_stable(e)
                self._cycle = None
                continue
            if self.is_host and eval_every and self.step % eval_every == 0 and \
                    self.step < steps:
                self.evaluate()
        if self.is_host:
            accuracy = self.evaluate()
            self._summary(accuracy)
        self.log.drain()

    def _one_step(self, steps: int, s: dict, o: dict) -> None:
        index = self.step  # 0-based, as fault specs count
        pos = self.members.index(self.world_rank)
        if self.is_host:
            for shadow in self.fault_shadows.values():
                if shadow.rank in self.members:
                    shadow.at_step(index)
            for f in self.faults.all:
                if f.kind == "slow" and f.step == index and f.rank in self.members:
                    self.log.event(EventKind.FAULT_INJECTED, step=index + 1, rank=f.rank,
                                       fault=str(f), factor=f.factor)
        t_start = time.perf_counter()
        self.meter.start()
        self.faults.at_step(index)
        self.stretch.extra = self.faults.slowdown(index)
        b = self.batches[pos]
        error = None
        if b > 0 and self.stretch.factor == 1.0:
            # Gradients go up while backward still runs (WeightedAllreduce's Overlap). Not
            # on an emulated CSD: its backward runs at the host's pace and then sleeps off
            # the slow-down, so its gradients would be ready far earlier than a real slow
            # device's and the overlap would hide more than it could.
            self.reducer.arm(b)
        try:
            compute_s, loss_sum = self._compute(b)
        except DataFault as e:  # every rank learns it in this step's exchange, and stops
            error, compute_s, loss_sum, b = str(e), 0.0, 0.0, 0
        # Busy time: from the end of the last gradient exchange to the start of this
        # one. It counts what compute_s does not (the optimizer, the host's logging and
        # evaluation), which the step time of the job pays all the same.
        busy_s = compute_s if self._cycle is None else time.perf_counter() - self._cycle
        # This step's figures, and the previous step's that only its end knew, travel
        # to the host in the same wait as the gradients (see FIGURES).
        row = np.array([compute_s, b, loss_sum, busy_s, *self._post], dtype=np.float64)
        table = self._figure_table()
        self.reducer.reset_counters()
        # A data error or a stop signal on any rank travels with the gradients (one float64).
        code = np.array([stop.agree_code(self.comm, error)], dtype=np.float64)
        worst = np.zeros(1)
        buffers = self.buffers.requests(b) if self.buffers is not None else []
        total = self.reducer.reduce(b, alongside=[self.comm.Igather(row, table, root=0),
                                                  self.comm.Iallreduce(code, worst, op=MPI.MAX),
                                                  *buffers])
        if self.buffers is not None:
            self.buffers.apply()
        halt = stop.stop_from(self.comm, int(worst[0]), error, index)
        if halt is not None:
            raise halt  # before this step's update: the run ends with `index` steps done
        self._cycle = time.perf_counter()
        if self.schedule.scheduled:  # the user's scheduler (config or script) owns the rate
            self.schedule.apply(self.optimizer, index)
        else:
            # optim.lr, or a given optimizer's own rate, scaled (Schedule.base_rate)
            self.schedule.set_rates(self.optimizer, lambda base: scaled_lr(
                base, o["base_batch"], int(total), index, o["warmup_steps"]) * decay(index, steps, o["schedule"]))
        self.optimizer.step()
        joules = self.meter.stop(compute_s)
        sent, recv = self.comm.take()  # this step's gradients and figures, and any plan
        self._post = (self.reducer.wait_s, joules, sent, recv, *self.comm.last_mpi)
        self.step = index + 1
        watchdog.beat(index)
        if self.is_host:
            self._record(table, time.perf_counter() - t_start)
            self._maybe_retune()
        if s["tune"] and self.step % s["retune_every"] == 0:
            self._share_plan()

    def _close_stuck(self, status: str) -> None:
        """The watchdog's end of a stuck run: the queued rows, then the status."""
        try:
            self.log.drain()
        finally:
            self.run.log.close(status)

    def _record(self, table: np.ndarray, wall: float) -> None:
        """Host: account one step from the exchanged table, and log the step before it.

        The table holds this step's figures (what the tuner needs now) and the
        previous step's late ones (wait, joules, bytes), which complete the log row
        held back one step.
        """
        self._write_pending(table[:, len(STEP_FIGURES):])
        total_b = 0
        loss_sum = 0.0
        now = {}
        for pos, r in enumerate(self.members):
            fig = dict(zip(STEP_FIGURES, table[pos, :len(STEP_FIGURES)], strict=True))
            b = int(fig["batch_size"])
            total_b += b
            loss_sum += fig["loss_sum"]
            now[r] = {"compute_s": fig["compute_s"], "batch_size": b, "busy_s": fig["busy_s"]}
            self.retuner.record(r, b, fig["busy_s"])
            t = self.totals.setdefault(r, {"samples": 0, "joules": 0.0, "busy_s": 0.0})
            t["samples"] += b
            t["busy_s"] += fig["compute_s"]
        loss = loss_sum / total_b if total_b else math.nan
        sps = total_b / wall if wall > 0 else math.nan
        self._pending = {"step": self.step, "time": self.log.elapsed(), "loss": loss,
                         "samples": total_b, "samples_per_s": sps, "ranks": now}
        self.run.progress.update(self.step, loss=loss, samples=total_b, time=self._pending["time"])
        self.last_loss = loss
        self.history.append((self.step, total_b, time.perf_counter()))

    def _figure_table(self) -> np.ndarray | None:
        """Host: the receive buffer of one gather of every member's FIGURES row."""
        return np.zeros((self.comm.Get_size(), len(FIGURES))) if self.is_host else None

    def _write_pending(self, late: np.ndarray | None) -> None:
        """Host: write the held-back step row with its late figures (NaN if lost)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        ranks = pending.pop("ranks")
        for pos, (r, fig) in enumerate(ranks.items()):
            values = late[pos] if late is not None else [math.nan] * len(LATE_FIGURES)
            wait_s, joules, sent, recv, mpi, unaudited = (float(v) for v in values)
            fig.update(wait_s=wait_s, joules=joules, bytes_sent=_count(sent),
                       bytes_recv=_count(recv), mpi_bytes=_count(mpi),
                       unaudited_bytes=_count(unaudited))
            if _count(unaudited) > 0:  # MPI counted traffic the audited door did not see
                self.log.event(EventKind.UNAUDITED_TRAFFIC, step=pending["step"], rank=r,
                               bytes=_count(unaudited), mpi_bytes=_count(mpi))
            if math.isfinite(joules):
                self.totals[r]["joules"] += joules
        self.log.step(pending.pop("step"), ranks=ranks, **pending)

    def flush_figures(self) -> None:
        """Every rank: send the last step's late figures so its log row can be written.

        Collective; call once training stops (the bytes are not a step's).
        """
        row = np.array([math.nan] * len(STEP_FIGURES) + list(self._post), dtype=np.float64)
        table = self._figure_table()
        self.comm.Gather(row, table, root=0)
        self.comm.take()
        self._post = (math.nan,) * len(LATE_FIGURES)
        if self.is_host:
            self._write_pending(table[:, len(STEP_FIGURES):])

    def evaluate(self) -> float:
        """Host: accuracy on the public test split."""
        self.model.eval()
        correct = count = 0
        loss = 0.0
        with torch.no_grad():
            d = self.cfg["data"]
            for x, y in test_batches(f"{d['path']}/public", 1024, mean=d["mean"], std=d["std"]):
                watchdog.beat()
                out = self.model(x)
                loss += float(self.loss_fn(out, y).item()) * len(y)
                correct += int((out.argmax(1) == y).sum())
                count += len(y)
        self.model.train()
        accuracy = correct / max(count, 1)
        self.log.eval(self.step, accuracy=accuracy, loss=loss / max(count, 1))
        self.run.progress.evaluation(self.step, accuracy)
        return accuracy

    def _summary(self, accuracy: float) -> None:
        elapsed = time.perf_counter() - self.t_train
        per_rank = {}
        for r, t in self.totals.items():
            per_rank[r] = {
                "samples": t["samples"], "joules": t["joules"],
                "samples_per_joule": t["samples"] / t["joules"] if t["joules"] else 0.0,
                "energy_source": self.sources.get(r, "?"),
            }
        samples = sum(t["samples"] for t in self.totals.values())
        # Measured (RAPL: the host's whole package, emulated CSDs' CPU work included)
        # and modelled joules are never added up: with both, there is no total.
        sources = sorted({self.sources.get(r, "?") for r in self.totals})
        joules = sum(t["joules"] for t in self.totals.values()) if len(sources) == 1 else math.nan
        summary = {
            "steps": self.step, "samples": samples, "seconds": elapsed,
            "samples_per_s": self.run.progress.samples_per_s, "energy_sources": sources,  # mpipipe.core.logs.progress
            "joules": joules, "samples_per_joule": samples / joules if joules else 0.0,
            "accuracy": accuracy, "loss": getattr(self, "last_loss", math.nan),
            "final_batches": dict(zip(self.members, self.batches, strict=True)),
            "ranks": per_rank, "grad_bytes": self.reducer.payload_bytes,
            "control_bytes": FIG_BYTES + STOP_BYTES,
            "buffer_bytes": self.buffers.nbytes if self.buffers is not None else 0,
        }
        self.log.set_attr("summary", summary)
        self.run.result.update(summary)
        self.run.progress.summary(steps=self.step, samples_per_s=summary["samples_per_s"],
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
        run.final_state = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    if len(trainer.members) < run.size:
        # A CSD was dropped: under ULFM, MPI_Finalize runs an agreement over the whole
        # world, which was seen to wait for the dead rank now and then (as in ResPipe).
        # Everything is written and closed by now: leave without it.
        if run.request.api:  # a script goes on: leave when it ends
            stop.exit_at_end(0)
            return 0
        stop.flush_and_exit(0)
    return 0
