"""Replicas: a stage sends its state to its holders every R steps; holders keep the two
newest; a backup waits for them, and a round promotes, merges (neighbour) or re-syncs.

The :class:`Replicas` mixin of :class:`mpipipe.respipe.trainer.ResPipe`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from mpipipe.core.mpi import ft, stop, watchdog
from mpipipe.core.mpi.transport import REPLICA, PeerFailed
from mpipipe.core.state.stagestate import StageState
from mpipipe.pipeline.engine import Route
from mpipipe.respipe.control import _END
from mpipipe.respipe.messages import Decision
from mpipipe.respipe.mirror import MirrorPipeline as Pipeline  # ResPipe's: the engine + hot mode

_BACKUP_POLL_S = 0.02
# A cold backup looks for its next replica this often. Not less often: a replica larger
# than MPI's eager limit leaves its stage only once the backup receives it, and the stage
# waits for that within its deadline, which deadline_factor can make a few milliseconds.
PAUSE_S = 0.001


@dataclass
class _Slot:
    """One held copy of a stage's state: the flat replica and its step count."""

    flat: torch.Tensor
    count: int


class Replicas:
    """Sending, holding and loading stage replicas."""

    def _warm_up(self, stage: int) -> None:
        """Run the stage's layers and its optimizer once on throwaway copies.

        Why: the first optimizer step of a process imports parts of torch that take
        seconds; a backup that paid this only at takeover would miss its deadline.
        """
        import copy

        shapes, pipe = self.pipe.boundary_shapes(self.in_shape), self.pipe
        for c in range(stage, len(pipe.chunk_modules), pipe.k):  # the stage's chunks
            part = copy.deepcopy(pipe.chunk_modules[c])
            shape, dtype = shapes[c]
            x = torch.zeros((2, *shape), dtype=dtype, requires_grad=dtype.is_floating_point)
            out = part(x)
            out.float().sum().backward()
            opt = StageState(part, self.make_optimizer).optimizer
            if opt is not None:
                opt.step()

    def _replicate(self) -> None:
        """Send this stage's replica to its holders every R steps (and take the ward's)."""
        assert self.stage is not None and self.own is not None
        R = self.settings.replicate_every
        if self.done % R:
            return
        t = self.pipe.transport
        holders = self._holders_of(self.stage)
        if holders:
            flat = self.own.pack()
            for h in holders:
                t.send(flat, self._drank(h), kind=REPLICA, step=self.done)
        for ward in self.wards:
            self._take_replica(self.route_w[ward], ward, self.done, t)
        t.flush(self._deadline())

    def _replica_buffer(self, stage: int) -> torch.Tensor:
        """A buffer for a replica of ``stage``: its exact size, from the stage's layout
        (computed once per stage module: a neighbour's merge makes new modules)."""
        module = self._module(stage)
        sizes = self._replica_sizes
        if id(module) not in sizes:
            state = self.own if stage == self.stage and self.own is not None \
                else StageState(module, self.make_optimizer)
            sizes[id(module)] = (module, state.nbytes)  # the module kept: ids stay unique
        return torch.empty(sizes[id(module)][1], dtype=torch.uint8)

    def _take_replica(self, source_w: int, stage: int, count: int, t: Any,
                      deadline: float | None = None) -> None:
        buf = self._replica_buffer(stage)
        t.recv(buf, self._drank(source_w), kind=REPLICA, step=count,
               deadline=self._deadline() if deadline is None else deadline)
        self._hold(_Slot(buf, count), stage)

    def _hold(self, slot: _Slot, stage: int) -> None:
        """Keep the two newest replicas of ``stage``."""
        if self.stage is not None:  # a neighbour holding its ward's replica
            held = self.ward_slots.get(stage, [])
            self.ward_slots[stage] = [s for s in held if s.count != slot.count][-1:] + [slot]
        else:
            self.slots = [s for s in self.slots if s.count != slot.count][-1:] + [slot]

    def _backup_wait(self, total: int) -> bool:
        """One poll of a backup: take replicas (cold) or mirror a step (hot). True when done."""
        k = self.shadowing
        assert k is not None
        watchdog.beat()  # a backup that polls is not stuck (its stage's watchdog covers it)
        stage_w = self.route_w[k]
        # The control plane is looked at message by message only when something waits
        # there (or a stop signal came): the dozen probes of a full look cost a backup
        # more CPU than its stage's replicas do, on the cores its stages run on.
        if not self.control.quiet() or stop.requested() is not None:
            if self.control.poll(_END, self._drank(stage_w), seq=0) is not None:
                return True
            self.stopper.check(boundary=True)
            self._check_announcements()
        self._poll_rejoin()
        # A fault aimed at this backup (rank=R) fires once it knows the stage has begun
        # the step: at each replica (cold), or as it mirrors the step (hot; micro= fires
        # after the mirrored forward).
        while self._faults_at < min(self.done, total - 1):
            self._faults_at += 1
            self.faults.at_step(self._faults_at, by_rank=True)
        R = self.settings.replicate_every
        nxt = (self.done // R + 1) * R
        if self.done >= total or (self.settings.mode != "hot" and nxt > total):
            # Nothing comes after the last step but END. A stage that finished leaves at
            # once: a probe for a next step would find it dead and start a round over a
            # completed run (seed 3 #60); a stage dead after its last step ends this wait.
            if self.ulfm and stage_w in ft.failed_ranks(self.world):
                return True
            time.sleep(_BACKUP_POLL_S)
            return False
        if self.settings.mode == "hot":
            self._mirror_step(k, stage_w)
            return False
        t = self.pipe.transport
        # Probe before receiving: a cancelled receive could lose a replica already matched.
        if self._probe(stage_w, t.tag(REPLICA, nxt)):
            self._take_replica(stage_w, k, nxt, t)
            self.done = nxt
        else:
            time.sleep(PAUSE_S)
        return False

    def _probe(self, source_w: int, tag: int) -> bool:
        """Is a data message from ``source_w`` waiting? A dead source raises PeerFailed."""
        src = self._drank(source_w)
        try:
            return bool(self.pipe.transport.comm.Iprobe(src, tag))
        except self.MPI.Exception as e:
            raise PeerFailed(src, ft.error_class(e)) from e

    def _promote(self, k: int, count: int, P: int) -> None:
        """This backup now serves stage k from its replica of step ``count``."""
        slot = next((s for s in self.slots if s.count == count), None)
        if self.own is None or self._mirror_of != k:
            self.own = StageState(self._module(k), self.make_optimizer)
        if slot is None:
            raise RuntimeError(f"backup of stage {k} lacks the replica of step {count}")
        self.own.unpack(slot.flat, count, step=P)
        self.stage, self.shadowing = k, None
        self.done = P
        self.slots = []
        self.snapshot = self.prev_snapshot = None
        self._say(f"took over stage {k} at step {P + 1} (replica of step {count})")

    def _merge(self, d: Decision, P: int) -> None:
        """Neighbour takeover: the pipeline loses stage k, whose layers join its holder's.

        Every survivor rebuilds the pipeline with one stage fewer (the module's layers
        are shared, so optimizers keep their parameters); the holder loads its replica
        of stage k into those layers and gets one optimizer over both slices.
        """
        k = d.merge
        old = self.pipe
        into = k - 1 if k > 0 else 0  # index of the merged stage in the new pipeline
        balance = list(old.balance)
        if k > 0:
            balance[k - 1:k + 1] = [balance[k - 1] + balance[k]]
        else:
            balance[0:2] = [balance[0] + balance[1]]
        route = Route(tuple(self.members.index(w) for w in d.route), d.gen)
        new = Pipeline(old.module, balance, old.chunks, old.schedule, self.data, route,
                       in_shape=self.in_shape, labels=old.labels, deadline=old.deadline,
                       label_dtype=old.label_dtype, seed=old.seed)
        new.after_forward = old.after_forward
        holder = self.route_w[k - 1] if k > 0 else self.route_w[1]
        if self.wrank == holder:
            count = d.choices[k]
            slot = next((s for s in self.ward_slots.get(k, []) if s.count == count), None)
            if slot is None:
                raise RuntimeError(f"neighbour of stage {k} lacks its replica of step {count}")
            assert self.own is not None
            self.own.absorb(new.partitions[into], old.partitions[k], slot.flat, count)
            self._say(f"took over stage {k} into its own (replica of step {count})")
        self.pipe = new
        self.stage = d.route.index(self.wrank) if self.wrank in d.route else None
        self.snapshot = self.prev_snapshot = None
        self.ward_slots = {}

    def _resync(self, P: int) -> None:
        """After a takeover every stage refreshes its backups, so all replicas are of step P."""
        t = self.pipe.transport
        deadline = max(self.settings.deadline_s, 1.0)
        if self.stage is not None:
            assert self.own is not None
            holders = self._holders_of(self.stage)
            if holders:
                flat = self.own.pack()
                for h in holders:
                    t.send(flat, self._drank(h), kind=REPLICA, step=P, micro=1)
            for ward in self.wards:
                self._take_resync(self.route_w[ward], ward, P, t, deadline)
            t.flush(deadline)
        elif self.shadowing is not None:
            self._take_resync(self.route_w[self.shadowing], self.shadowing, P, t, deadline)
            if self.settings.mode == "hot":
                if self.own is None or self._mirror_of != self.shadowing:
                    self.own = StageState(self._module(self.shadowing), self.make_optimizer)
                    self._mirror_of = self.shadowing
                self.own.unpack(self.slots[-1].flat, P)
            self.done = P

    def _take_resync(self, source_w: int, stage: int, P: int, t: Any, deadline: float) -> None:
        buf = self._replica_buffer(stage)
        t.recv(buf, self._drank(source_w), kind=REPLICA, step=P, micro=1, deadline=deadline)
        if self.stage is not None:
            self.ward_slots[stage] = [_Slot(buf, P)]
        else:
            self.slots = [_Slot(buf, P)]
