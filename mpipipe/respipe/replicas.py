"""Replicas: the state this rank serves, and the copies of stages it holds.

A stage sends its state to its holders every R steps; holders keep the two newest; a
round promotes a backup, merges a neighbour's ward into it, rolls a stage back to its
snapshot, or re-syncs every holder. Every state moves through
:class:`~mpipipe.core.state.stagestate.StageState`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from mpipipe.core.mpi import ft
from mpipipe.core.mpi.transport import REPLICA, PeerFailed
from mpipipe.core.state.stagestate import MakeOptimizer, StageState
from mpipipe.pipeline.engine import Pipeline, Route
from mpipipe.respipe.membership import Membership
from mpipipe.respipe.messages import Decision


@dataclass
class _Slot:
    """One held copy of a stage's state: the flat replica and its step count."""

    flat: torch.Tensor
    count: int


class Replicas:
    """The served state (``own``), held replicas (``slots``, a neighbour's ``ward_slots``)
    and rollback snapshots of one rank.

    Built with the :class:`Membership` (route, holders, communicators, pipeline) and the
    run's optimizer recipe. ``own`` is the :class:`StageState` of the stage this rank
    serves, or, in hot mode, mirrors (``mirror_of``).
    """

    def __init__(self, m: Membership, make_optimizer: MakeOptimizer,
                 in_shape: tuple[int, ...]) -> None:
        self.m = m
        self.make_optimizer = make_optimizer
        self.in_shape = in_shape
        self.own: StageState | None = None
        self.mirror_of: int | None = None  # hot: the stage ``own`` mirrors
        self.slots: list[_Slot] = []  # held replicas (backup or neighbour), newest last
        self.ward_slots: dict[int, list[_Slot]] = {}  # neighbour mode: per ward
        self.snapshot: _Slot | None = None
        self.prev_snapshot: _Slot | None = None  # the snapshot before ``snapshot``
        self._sizes: dict[int, tuple[Any, int]] = {}  # id(stage module) -> bytes
        if m.stage is not None:
            self.own = StageState(m.module(m.stage), make_optimizer)
        # Every rank built the model from the same seed: before the first replica
        # arrives, a holder's copy of the initial state is the replica of step 0.
        for k in ([m.shadowing] if m.shadowing is not None else m.wards):
            self.hold(_Slot(self.state_of(k).pack(), 0), k)

    def state_of(self, stage: int) -> StageState:
        """The state of ``stage``: this rank's own, or a new one over the stage's module
        (for a held stage: its replica's layout, a checkpoint to load)."""
        if stage == self.m.stage and self.own is not None:
            return self.own
        return StageState(self.m.module(stage), self.make_optimizer)

    def newest(self) -> list[_Slot]:
        """The held replicas a round reports (a backup's, or a neighbour's first ward's)."""
        held = self.slots if self.m.stage is None else next(iter(self.ward_slots.values()), [])
        return sorted(held, key=lambda s: s.count)

    def warm_up(self, stage: int) -> None:
        """Run the stage's layers and its optimizer once on throwaway copies.

        Why: the first optimizer step of a process imports parts of torch that take
        seconds; a backup that paid this only at takeover would miss its deadline.
        """
        pipe = self.m.pipe
        shapes = pipe.boundary_shapes(self.in_shape)
        for c in range(stage, len(pipe.chunk_modules), pipe.k):  # the stage's chunks
            part = copy.deepcopy(pipe.chunk_modules[c])
            shape, dtype = shapes[c]
            x = torch.zeros((2, *shape), dtype=dtype, requires_grad=dtype.is_floating_point)
            out = part(x)
            out.float().sum().backward()
            opt = StageState(part, self.make_optimizer).optimizer
            if opt is not None:
                opt.step()

    # -- a stage's side ------------------------------------------------------------------
    def keep_snapshot(self) -> None:
        """Before a step: a copy of the served state to roll back to. Two kept: after a
        round that went on, a later one may roll back to the step before (a mirror that
        was a step behind sets P)."""
        assert self.own is not None
        if self.snapshot is not None and self.snapshot.count != self.m.done:
            self.prev_snapshot = self.snapshot
        self.snapshot = _Slot(self.own.pack(), self.m.done)

    def replicate(self) -> None:
        """Send this stage's replica to its holders every R steps (and take the ward's)."""
        m = self.m
        assert m.stage is not None and self.own is not None
        if m.done % m.settings.replicate_every:
            return
        t = m.pipe.transport
        holders = m.holders_of(m.stage)
        if holders:
            flat = self.own.pack()
            for h in holders:
                t.send(flat, m.drank(h), kind=REPLICA, step=m.done)
        for ward in m.wards:
            self.take(m.route_w[ward], ward, m.done, t)
        t.flush(m.deadline())

    def rollback(self, P: int) -> None:
        """A round replays step P: a stage that completed a step beyond P goes back to its
        snapshot of P; one cut inside step P reloads it too (its forwards moved BatchNorm's
        running statistics, which the replay must not count twice)."""
        m = self.m
        if m.stage is None or self.own is None:
            return
        if m.done > P:
            snap = next((x for x in (self.snapshot, self.prev_snapshot)
                         if x is not None and x.count == P), None)
            if snap is None:
                raise RuntimeError(f"cannot roll back from step {m.done} to {P}")
            self.own.unpack(snap.flat, P)
            m.done = P
        elif self.snapshot is not None and self.snapshot.count == P == m.done:
            self.own.unpack(self.snapshot.flat, P)

    # -- a holder's side -----------------------------------------------------------------
    def _buffer(self, stage: int) -> torch.Tensor:
        """A buffer for a replica of ``stage``: its exact size, from the stage's layout
        (computed once per stage module: a neighbour's merge makes new modules)."""
        module = self.m.module(stage)
        if id(module) not in self._sizes:  # the module kept: ids stay unique
            self._sizes[id(module)] = (module, self.state_of(stage).nbytes)
        return torch.empty(self._sizes[id(module)][1], dtype=torch.uint8)

    def take(self, source_w: int, stage: int, count: int, t: Any,
             deadline: float | None = None) -> None:
        """Receive the replica of ``stage`` at step ``count`` from ``source_w`` and hold it."""
        buf = self._buffer(stage)
        t.recv(buf, self.m.drank(source_w), kind=REPLICA, step=count,
               deadline=self.m.deadline() if deadline is None else deadline)
        self.hold(_Slot(buf, count), stage)

    def hold(self, slot: _Slot, stage: int) -> None:
        """Keep the two newest replicas of ``stage``."""
        if self.m.stage is not None:  # a neighbour holding its ward's replica
            held = self.ward_slots.get(stage, [])
            self.ward_slots[stage] = [s for s in held if s.count != slot.count][-1:] + [slot]
        else:
            self.slots = [s for s in self.slots if s.count != slot.count][-1:] + [slot]

    def probe(self, source_w: int, tag: int) -> bool:
        """Is a data message from ``source_w`` waiting? A dead source raises PeerFailed."""
        src = self.m.drank(source_w)
        try:
            return bool(self.m.pipe.transport.comm.Iprobe(src, tag))
        except self.m.MPI.Exception as e:
            raise PeerFailed(src, ft.error_class(e)) from e

    def load_held(self, stage: int, step: int, checkpoint_state: dict[str, Any]) -> None:
        """A resumed run: a checkpoint becomes the held replica of ``step`` (a takeover
        before the first new replica continues from it, not from the initial weights),
        or this rank's own state."""
        state = self.state_of(stage)
        state.load_state_dict(checkpoint_state)
        if stage != self.m.stage:
            slot = _Slot(state.pack(), step)
            if self.m.stage is not None:
                self.ward_slots[stage] = [slot]
            else:
                self.slots = [slot]

    # -- rounds --------------------------------------------------------------------------
    def mirror(self, k: int) -> StageState:
        """Hot mode: the state mirroring stage k. A new mirror starts from the replica it
        holds (of step 0, or of a resumed run's checkpoint), optimizer state included."""
        if self.own is not None and self.mirror_of == k:
            return self.own
        self.own = StageState(self.m.module(k), self.make_optimizer, step=self.m.done)
        self.mirror_of = k
        self.m.steps.abandon()
        if self.slots:
            self.own.unpack(self.slots[-1].flat, self.slots[-1].count, step=self.m.done)
        return self.own

    def mirrored(self, before: _Slot) -> None:
        """Hot mode: the mirror applied a step; it keeps its state from before the step
        (the round's P may be either) and after it."""
        assert self.own is not None
        self.snapshot = before
        self.slots = [before, _Slot(self.own.pack(), self.m.done)]

    def load_newest(self) -> None:
        """Hot mode: the periodic replica replaces the mirror's state (it guards against drift)."""
        assert self.own is not None
        self.own.unpack(self.slots[-1].flat, self.m.done)

    def promote(self, k: int, count: int, P: int) -> None:
        """This backup now serves stage k from its replica of step ``count``."""
        slot = next((s for s in self.slots if s.count == count), None)
        if self.own is None or self.mirror_of != k:
            self.own = StageState(self.m.module(k), self.make_optimizer)
        if slot is None:
            raise RuntimeError(f"backup of stage {k} lacks the replica of step {count}")
        self.own.unpack(slot.flat, count, step=P)
        self.became_stage(k)
        self.m.done = P
        self.m.say(f"took over stage {k} at step {P + 1} (replica of step {count})")

    def became_stage(self, k: int) -> None:
        """This backup serves stage k now: it holds no replica and no snapshot."""
        self.m.stage, self.m.shadowing = k, None
        self.slots = []
        self.snapshot = self.prev_snapshot = None

    def merge(self, d: Decision, P: int) -> Pipeline:
        """Neighbour takeover: the pipeline loses stage k, whose layers join its holder's.
        Returns the new pipeline (every survivor builds it with one stage fewer).

        The module's layers are shared, so optimizers keep their parameters; the holder
        loads its replica of stage k into those layers and one optimizer covers both
        slices (:meth:`StageState.absorb`).
        """
        m = self.m
        k = d.merge
        old = m.pipe
        into = k - 1 if k > 0 else 0  # index of the merged stage in the new pipeline
        balance = list(old.balance)
        if k > 0:
            balance[k - 1:k + 1] = [balance[k - 1] + balance[k]]
        else:
            balance[0:2] = [balance[0] + balance[1]]
        route = Route(tuple(m.members.index(w) for w in d.route), d.gen)
        new = Pipeline(old.module, balance, old.chunks, old.schedule, m.data, route,
                       in_shape=self.in_shape, labels=old.labels, deadline=old.deadline,
                       label_dtype=old.label_dtype, seed=old.seed)
        new.after_forward = old.after_forward
        holder = m.route_w[k - 1] if k > 0 else m.route_w[1]
        if m.wrank == holder:
            count = d.choices[k]
            slot = next((s for s in self.ward_slots.get(k, []) if s.count == count), None)
            if slot is None:
                raise RuntimeError(f"neighbour of stage {k} lacks its replica of step {count}")
            assert self.own is not None
            self.own.absorb(new.partitions[into], old.partitions[k], slot.flat, count)
            m.say(f"took over stage {k} into its own (replica of step {count})")
        self.snapshot = self.prev_snapshot = None
        self.ward_slots = {}
        return new

    def restart_backup(self, P: int) -> None:
        """A backup whose stage replays from P waits for the re-synced replica of P."""
        self.slots = []
        self.m.done = P

    def forget(self) -> None:
        """A replaced rank that rejoins as a backup starts with nothing."""
        self.own, self.snapshot, self.slots = None, None, []
        self.prev_snapshot = None

    def resync(self, P: int) -> None:
        """After a takeover every stage refreshes its backups, so all replicas are of step P."""
        m = self.m
        t = m.pipe.transport
        deadline = max(m.settings.deadline_s, 1.0)
        if m.stage is not None:
            assert self.own is not None
            holders = m.holders_of(m.stage)
            if holders:
                flat = self.own.pack()
                for h in holders:
                    t.send(flat, m.drank(h), kind=REPLICA, step=P, micro=1)
            for ward in m.wards:
                self._take_resync(m.route_w[ward], ward, P, t, deadline)
            t.flush(deadline)
        elif m.shadowing is not None:
            self._take_resync(m.route_w[m.shadowing], m.shadowing, P, t, deadline)
            if m.settings.mode == "hot":
                if self.own is None or self.mirror_of != m.shadowing:
                    self.own = StageState(m.module(m.shadowing), self.make_optimizer)
                    self.mirror_of = m.shadowing
                self.own.unpack(self.slots[-1].flat, P)
            m.done = P

    def _take_resync(self, source_w: int, stage: int, P: int, t: Any, deadline: float) -> None:
        buf = self._buffer(stage)
        t.recv(buf, self.m.drank(source_w), kind=REPLICA, step=P, micro=1, deadline=deadline)
        if self.m.stage is not None:
            self.ward_slots[stage] = [_Slot(buf, P)]
        else:
            self.slots = [_Slot(buf, P)]
