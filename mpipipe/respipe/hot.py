"""Hot mode's side of ResPipe: a backup mirrors every step of its stage, and a round
that can finish the step in flight promotes the mirror where it stands.

The :class:`HotMirror` part of :class:`mpipipe.respipe.trainer.ResPipe`; the step's
hot-mode machinery (StepState, Have, relays, resume) is :class:`mpipipe.respipe.mirror.HotSteps`,
composed around the engine and held by the membership (``m.steps``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from mpipipe.core.mpi.transport import CTRL, SHADOW
from mpipipe.respipe.logbook import Logbook
from mpipipe.respipe.membership import _DEBUG, Membership
from mpipipe.respipe.mirror import Have
from mpipipe.respipe.replicas import Replicas, _Slot


class HotMirror:
    """Mirroring a stage's steps, and finishing a step in flight after a takeover.

    Built with the membership, the replicas (whose ``own`` state mirrors the stage), the
    logbook (a mirror keeps the stage's figures in case it takes over) and what a step
    needs: ``batch_of`` (the last stage's mirror reads y itself), the loss and the
    schedule.
    """

    def __init__(self, m: Membership, replicas: Replicas, book: Logbook, *,
                 batch_of: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 schedule: Any, in_shape: tuple[int, ...]) -> None:
        self.m, self.replicas, self.book = m, replicas, book
        self.batch_of, self.loss_fn, self.schedule = batch_of, loss_fn, schedule
        self.in_shape = in_shape
        self._snap: _Slot | None = None  # the mirror's state before its step

    def mirror_step(self, k: int, stage_w: int) -> None:
        """Hot mode: run stage k's actions on the tensors it relays, then step.

        The stage relays its inputs and its output gradients (stages < K-1); the last
        stage's mirror reads y itself, so the mirror applies exactly the stage's update,
        in the same order. The pipeline keeps the step's progress, so that a takeover
        in the middle of it finishes the step where the mirror stands (no replay).
        """
        m, r = self.m, self.replicas
        pipe, t = m.pipe, m.pipe.transport
        s = m.done
        own = r.mirror(k)
        st = m.steps.inflight
        if st is None or st.step != s or st.stage != k:
            # Wait (briefly, so END and announcements are seen) for the step's first
            # relayed tensor (every schedule starts with the forward of micro-batch 0).
            if not r.probe(stage_w, t.tag(SHADOW, s, 0)):
                time.sleep(0.0005)
                return
            self._snap = _Slot(own.pack(), s)
        pipe.deadline = m.deadline()
        pipe.boundary_shapes(self.in_shape)
        t.reset_counters()
        y = self.batch_of(s)[1] if k == pipe.k - 1 else None
        loss = m.steps.step(None, y, self.loss_fn, step=s, mirror=(k, m.drank(stage_w)))
        own.apply_step(self.schedule, s)
        m.done = s + 1
        assert self._snap is not None
        r.mirrored(self._snap)
        # Kept in case this mirror takes over before the stage's figures reach the log.
        self.book.keep_figs(self.book.step_figs(s, loss))
        if m.done % m.settings.replicate_every == 0:
            # The periodic replica guards the mirror against drift; it replaces the state.
            m.after_step = True
            r.take(stage_w, k, m.done, t)
            r.load_newest()
            m.after_step = False

    def promote(self, k: int) -> None:
        """This hot mirror now serves stage k from where it stands, its step in flight too."""
        self.replicas.mirror(k)  # a backup that has not mirrored a step yet starts now
        self.replicas.became_stage(k)
        self.m.say(f"took over stage {k} in step {self.m.done + 1} (hot, no replay)")

    def go_on(self) -> None:
        """After a round that keeps the step in flight: each rank tells the ranks it takes
        messages from what it holds, then sends its own consumers what they lack."""
        m = self.m
        steps, t = m.steps, m.pipe.transport
        deadline = max(m.settings.deadline_s, 1.0)
        source = None if m.shadowing is None or m.stage is not None \
            else m.drank(m.route_w[m.shadowing])
        mine = steps.have(m.done).encode()
        for r in steps.suppliers(source):
            t.send(mine, r, kind=CTRL, step=0)
        theirs = {r: Have.decode(t.recv(torch.empty(4, dtype=torch.int64), r, kind=CTRL,
                                        step=0, deadline=deadline))
                  for r in steps.consumers()}
        sent = steps.resume(theirs)
        if _DEBUG:
            m.say(f"go on at step {m.done}: holds {steps.have(m.done)}, resent {sent} messages")
