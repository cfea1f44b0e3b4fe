"""Hot mode's side of ResPipe: a backup mirrors every step of its stage, and a round
that can finish the step in flight promotes the mirror where it stands.

Kept together (the :class:`HotMirror` mixin of :class:`mpipipe.respipe.trainer.ResPipe`)
so that the engine's hot-mode parts (StepState, Have, relays, resume) can move next to
it in one piece; the calls into the engine are unchanged.
"""

from __future__ import annotations

import time

import torch

from mpipipe.core.mpi.transport import CTRL, SHADOW
from mpipipe.core.state.stagestate import StageState
from mpipipe.respipe.membership import _DEBUG
from mpipipe.respipe.mirror import Have
from mpipipe.respipe.replicas import _Slot


class HotMirror:
    """Mirroring a stage's steps, and finishing a step in flight after a takeover."""

    def _mirror_step(self, k: int, stage_w: int) -> None:
        """Hot mode: run stage k's actions on the tensors it relays, then step.

        The stage relays its inputs and its output gradients (stages < K-1); the last
        stage's mirror reads y itself, so the mirror applies exactly the stage's update,
        in the same order. The pipeline keeps the step's progress, so that a takeover
        in the middle of it finishes the step where the mirror stands (no replay).
        """
        pipe, t = self.pipe, self.pipe.transport
        s = self.done
        self._start_mirror(k)
        own = self.own
        assert own is not None
        st = pipe.inflight
        if st is None or st.step != s or st.stage != k:
            # Wait (briefly, so END and announcements are seen) for the step's first
            # relayed tensor (every schedule starts with the forward of micro-batch 0).
            if not self._probe(stage_w, t.tag(SHADOW, s, 0)):
                time.sleep(0.0005)
                return
            self._mirror_snap = _Slot(own.pack(), s)
        pipe.deadline = self._deadline()
        pipe.boundary_shapes(self.in_shape)
        t.reset_counters()
        y = self.batch_of(s)[1] if k == pipe.k - 1 else None
        loss = pipe.step(None, y, self.loss_fn, step=s, mirror=(k, self._drank(stage_w)))
        own.apply_step(self.schedule, s)
        snap = self._mirror_snap
        self.snapshot = snap
        self.done = s + 1
        self.slots = [snap, _Slot(own.pack(), self.done)]
        # Kept in case this mirror takes over before the stage's figures reach the log.
        self._keep_figs(self._step_figs(s, loss))
        if self.done % self.settings.replicate_every == 0:
            # The periodic replica guards the mirror against drift; it replaces the state.
            self._after_step = True
            self._take_replica(stage_w, k, self.done, t)
            own.unpack(self.slots[-1].flat, self.done)
            self._after_step = False

    def _start_mirror(self, k: int) -> None:
        """A new mirror of stage k starts from the replica it holds (of step 0, or of a
        resumed run's checkpoint), optimizer state included."""
        if self.own is not None and self._mirror_of == k:
            return
        self.own = StageState(self._module(k), self.make_optimizer, step=self.done)
        self._mirror_of = k
        self.pipe.abandon()
        if self.slots:
            self.own.unpack(self.slots[-1].flat, self.slots[-1].count, step=self.done)

    def _promote_mirror(self, k: int) -> None:
        """This hot mirror now serves stage k from where it stands, its step in flight too."""
        self._start_mirror(k)  # a backup that has not mirrored a step yet starts now
        self.stage, self.shadowing = k, None
        self.slots = []
        self.snapshot = self.prev_snapshot = None
        self._say(f"took over stage {k} in step {self.done + 1} (hot, no replay)")

    def _go_on(self) -> None:
        """After a round that keeps the step in flight: each rank tells the ranks it takes
        messages from what it holds, then sends its own consumers what they lack."""
        pipe, t = self.pipe, self.pipe.transport
        deadline = max(self.settings.deadline_s, 1.0)
        source = None if self.shadowing is None or self.stage is not None \
            else self._drank(self.route_w[self.shadowing])
        mine = pipe.have(self.done).encode()
        for r in pipe.suppliers(source):
            t.send(mine, r, kind=CTRL, step=0)
        theirs = {r: Have.decode(t.recv(torch.empty(4, dtype=torch.int64), r, kind=CTRL,
                                        step=0, deadline=deadline))
                  for r in pipe.consumers()}
        sent = pipe.resume(theirs)
        if _DEBUG:
            self._say(f"go on at step {self.done}: holds {pipe.have(self.done)}, "
                      f"resent {sent} messages")
