"""HyperTune in a running job: the batch size of every rank, from its benchmark at the
start and its busy times since, and the re-tunes that follow a rank's change of speed.

The host decides (:meth:`Tuning.plan`, :meth:`Tuning.maybe_retune`); every rank applies
the plan at the same step boundary (:meth:`Tuning.share`). The rules themselves are
:mod:`stannis.hypertune`'s (pure, unit-tested without MPI).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

from mpipipe.core.logs.logschema import EventKind
from mpipipe.core.mpi import stop, watchdog
from mpipipe.core.mpi.roles import Role
from mpipipe.core.run.batches import DataFault

from .config import csd_profile
from .hypertune import (
    Plan,
    RankProfile,
    Retuner,
    RetuneRule,
    StepModel,
    evaluate,
    fit_step_model,
    share_caps,
    tune,
    with_floors,
)
from .members import Members


def equal_split(global_batch: int, n: int) -> list[int]:
    """Horovod's default: the same batch on every rank (the remainder to the first ranks)."""
    return [global_batch // n + (1 if i < global_batch % n else 0) for i in range(n)]


class Computes(Protocol):
    """What the benchmark times: a rank's forward and backward (stannis.step)."""

    def compute(self, b: int) -> tuple[float, float]: ...

    def clear_grads(self) -> None: ...


class Tuning:
    """The batches of the current members, and (host) the step models they are planned on."""

    def __init__(self, cfg: dict, members: Members, records: dict[int, int],
                 role_of: Callable[[int], Role], max_batch: int, is_host: bool,
                 log: Any, progress: Any) -> None:
        self.cfg = cfg
        self.s = s = cfg["stannis"]  # read at each use: a bench switches tuning on and off
        self.members = members
        self.records = records  # world rank -> its records: the batch caps follow the data
        self.role_of = role_of
        self.max_batch = max_batch  # this rank's
        self.is_host = is_host
        self.log = log
        self.progress = progress
        self.batches: list[int] = []
        self.profiles: dict[int, RankProfile] = {}
        # host: each rank's busy times at the plan in force, and when to re-tune on them
        self.retuner = Retuner(RetuneRule(every=s["retune_every"],
                                          noise_retunes_per_100=s["noise_retunes_per_100"],
                                          min_gain=s["min_gain"],
                                          imbalance_threshold=s["imbalance_threshold"]))
        self.floors_fit = True  # host: the last plan gave every rank its batch floor

    def batch_of(self, world_rank: int) -> int:
        """The batch of ``world_rank`` under the plan in force."""
        return self.batches[self.members.position(world_rank)]

    # -- the benchmark ------------------------------------------------------------------
    def benchmark(self, stepper: Computes) -> None:
        """Time a few batch sizes on every rank; the host fits step models and tunes."""
        s = self.s
        sizes = [min(b, self.max_batch) for b in s["benchmark_batches"]]
        self.progress.message(
            f"benchmark: batch sizes {', '.join(map(str, sizes))}, {s['benchmark_repeats']} "
            f"timed steps each, on {len(self.members.ranks)} ranks")
        row = np.zeros(len(sizes) * 2)
        error = None
        try:
            stepper.compute(max(sizes))  # warm-up: first calls allocate and are not typical
            for i, b in enumerate(sizes):
                # The fastest repeat: noise (a busy core, a cache miss) only ever adds time.
                times = []
                for _ in range(s["benchmark_repeats"]):
                    times.append(stepper.compute(b)[0])
                    watchdog.beat()
                row[2 * i], row[2 * i + 1] = b, float(np.min(times))
        except DataFault as e:  # the benchmark reads records too: every rank stops, as in a step
            error = str(e)
        stepper.clear_grads()
        comm = self.members.comm
        table = np.zeros((comm.Get_size(), len(row))) if self.is_host else None
        code, worst = np.array([stop.agree_code(comm, error)], dtype=np.float64), np.zeros(1)
        agreed = comm.Iallreduce(code, worst, op=MPI.MAX)
        comm.Gather(row, table, root=0)
        agreed.Wait()
        halt = stop.stop_from(comm, int(worst[0]), error, 0)
        if halt is not None:
            raise halt  # before any step: nothing trained, nothing to resume
        if self.is_host:
            self._fit(table)

    def _fit(self, table: np.ndarray) -> None:
        """Host: every member's step model from its row of (batch, seconds) pairs."""
        for pos, r in enumerate(self.members.ranks):
            bs, ts = table[pos, 0::2], table[pos, 1::2]
            self.profiles[r] = self._rank_profile(r, fit_step_model(list(bs), list(ts)))
        self.log.event(EventKind.BENCHMARK, step=0, models={
            r: {"overhead_s": p.model.overhead_s, "per_sample_s": p.model.per_sample_s}
            for r, p in self.profiles.items()})

    def _rank_profile(self, r: int, model: StepModel) -> RankProfile:
        cfg = self.cfg
        if r == 0:
            return RankProfile(model, cfg["host"]["max_batch"], 1, cfg["host"]["idle_w"],
                               cfg["host"]["active_w"])
        p = csd_profile(cfg, self.role_of(r).index)
        return RankProfile(model, cfg["csd"]["max_batch"], 1, p.idle_w, p.active_w)

    # -- plans ----------------------------------------------------------------------------
    def capped(self) -> list[RankProfile]:
        """The members' profiles as the plan obeys them (see :meth:`_constrain`)."""
        return self._constrain([self.profiles[r] for r in self.members.ranks])

    def _constrain(self, profiles: list[RankProfile]) -> list[RankProfile]:
        """The members' profiles with each batch capped by its share of the records,
        and floored where its fixed per-step overhead would dominate.

        Recomputed at every plan, so the caps follow the data that is left after a
        CSD is dropped (see hypertune.share_caps); the floors come from each
        rank's benchmark fit (hypertune.batch_floor, stannis.overhead_share).
        """
        s = self.s
        caps = share_caps([self.records[r] for r in self.members.ranks], s["global_batch"],
                          s["max_oversample"])
        out = []
        for p, cap in zip(profiles, caps, strict=True):
            top = min(p.max_batch, cap)
            out.append(replace(p, max_batch=top, min_batch=min(p.min_batch, top)))
        out, self.floors_fit = with_floors(out, s["global_batch"], s["overhead_share"])
        return out

    def plan(self, reason: str, step: int, plan: Plan | None = None) -> None:
        """Host: choose batches for the current members (HyperTune or equal split)."""
        s = self.s
        members = self.members.ranks
        old = list(self.batches)
        floors: list[int] = []
        if s["tune"]:
            capped = self.capped()
            floors = [p.min_batch for p in capped]
            plan = plan or tune(capped, s["global_batch"], s["objective"], s["mix_weight"])
            new = list(plan.batches)
            predicted = plan.samples_per_s
            if not self.floors_fit:
                reason += (f"; floors {floors} scaled down to fit the global batch "
                           f"{s['global_batch']}: raise stannis.global_batch for every rank "
                           f"to work at <= {s['overhead_share']:.0%} overhead")
        else:
            new = equal_split(s["global_batch"], len(members))
            predicted = math.nan
        self.batches = new
        self.retuner.restart(members)
        if old != new:
            self.log.event(EventKind.RETUNE, step=step, reason=reason, ranks=members,
                           old=old, new=new, predicted_sps=predicted, floors=floors)
            self.progress.message(f"step {step}: batches {old} -> {new} ({reason})")

    def share(self) -> None:
        """Host decides, everyone applies at the same step boundary."""
        comm = self.members.comm
        buf = np.array(self.batches if self.is_host else [0] * comm.Get_size(), dtype=np.int64)
        comm.Bcast(buf, root=0)
        self.batches = [int(b) for b in buf]

    # -- re-tunes -------------------------------------------------------------------------
    def observe(self, busy: list[tuple[int, int, float]]) -> None:
        """Host: one step's (rank, batch, busy seconds) of every member."""
        for r, b, seconds in busy:
            self.retuner.record(r, b, seconds)

    def maybe_retune(self, step: int) -> None:
        """Host: every ``retune_every`` steps, re-tune if the gain beats the noise.

        The rule is hypertune.Retuner's (pure, unit-tested without MPI): smoothed
        per-rank times, a bar derived from the measured spread of step times.
        """
        s = self.s
        if not s["tune"]:
            return
        members = self.members.ranks
        decision = self.retuner.check(
            step, members, self.batches, [self.profiles[r] for r in members],
            self._constrain, s["global_batch"], s["objective"], s["mix_weight"])
        if decision is None:
            return
        for r, p in zip(members, decision.profiles, strict=True):
            self.profiles[r] = p
        if decision.target is not None:
            self.plan(decision.reason, step, evaluate(self.capped(), decision.target))

    def drop(self, dead: list[int]) -> None:
        """Host: forget dropped ranks' step models, and the last move (the members changed)."""
        for r in dead:
            self.profiles.pop(r, None)
        self.retuner.forget_moves()
