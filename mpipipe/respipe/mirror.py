"""ResPipe's hot steps: a part composed around the pipeline engine that finishes a step
after a takeover.

Why apart from the engine: a plain pipeline never resumes a step, relays to shadows or
answers what it holds, and should not pay for it (mpipipe.pipeline.engine). ResPipe
wraps its engine in a :class:`HotSteps`, which holds the :class:`Pipeline` (``engine``)
and reads its fields (route, transport, partitions, deadline, ...) but keeps what hot
mode adds as its own; when no hot feature is on (cold and neighbour modes) its step is
the engine's plain step, so those modes run every schedule the engine runs.

What hot mode adds, all of one chunk per rank (interleaved schedules are refused):

- :class:`StepState`: what a stage (or its mirror) has done of a step, so that after a
  takeover every survivor finishes the step from where it stopped;
- relays: a stage sends a copy of each input (and, with `relay_grads`, of each output
  gradient) to its shadows (kind SHADOW), and a mirror runs the stage's actions on them;
- :class:`Have` and :meth:`HotSteps.resume`: after a takeover each rank tells its
  suppliers what it holds and gets only what it lacks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from mpipipe.core.mpi.transport import ACT, GRAD, LABEL, SHADOW
from mpipipe.pipeline.deferred_bn import begin_step, commit_step
from mpipipe.pipeline.engine import MAX_TAGGED_MICRO, LossFn, Pipeline, Route, micro_seed
from mpipipe.pipeline.schedule import Op

__all__ = ["HotSteps", "StepState", "Have", "stage_consumers", "SHADOW_GRAD_MICRO"]

# Hot backups: with `relay_grads`, a stage also relays the gradient of its output for
# micro-batch i to its shadows as SHADOW micro SHADOW_GRAD_MICRO + i.
SHADOW_GRAD_MICRO = MAX_TAGGED_MICRO


@dataclass
class StepState:
    """What one stage (or its hot mirror) has done of one step, micro-batch by micro-batch.

    Why: resumable hot steps keep it when a step is interrupted, so that after a
    takeover every survivor finishes the step from where it stopped instead of
    replaying it, and can send again what a new neighbour lacks. `pos` counts the
    schedule's actions done; the dicts map a micro-batch to the tensors it received
    (`inputs`, `grads`: the gradient of its output) and sent (`outs`, `gins`: the
    gradient of its input); `saved` holds the graphs still to run backward.
    """

    stage: int
    step: int
    pos: int = 0
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    outs: dict[int, torch.Tensor] = field(default_factory=dict)
    gins: dict[int, torch.Tensor] = field(default_factory=dict)
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    xs: Sequence[torch.Tensor] | None = None  # first stage: its micro-batches of x
    ys: list[torch.Tensor] | None = None  # last stage: labels per micro-batch
    y: torch.Tensor | None = None  # first stage: the labels it sent
    loss_sum: float = 0.0
    total: int = 0


@dataclass(frozen=True)
class Have:
    """What a rank holds of step `step`: bit i of `inputs` (`grads`) = micro-batch i's
    input (output gradient); `labels` = the step's labels. It holds all of earlier steps."""

    step: int
    inputs: int
    grads: int
    labels: bool

    def encode(self) -> torch.Tensor:
        return torch.tensor([self.step, self.inputs, self.grads, int(self.labels)],
                            dtype=torch.int64)

    @classmethod
    def decode(cls, v: torch.Tensor) -> Have:
        s, i, g, lab = (int(x) for x in v.tolist())
        return cls(s, i, g, bool(lab))


def _has(h: Have | None, kind: int, step: int, micro: int) -> bool:
    """Does the rank that sent `h` hold this message already?"""
    if h is None or kind not in (ACT, GRAD, LABEL, SHADOW) or step > h.step:
        return False
    if step < h.step:
        return True
    if kind == LABEL:
        return h.labels
    if kind == GRAD or (kind == SHADOW and micro >= SHADOW_GRAD_MICRO):
        return bool(h.grads >> (micro % SHADOW_GRAD_MICRO) & 1)
    return bool(h.inputs >> micro & 1)  # ACT, or SHADOW of an input


def stage_consumers(stage: int, ranks: Sequence[int], shadows: Sequence[int],
                    labels: str) -> set[int]:
    """The ranks that take stage `stage`'s messages in a step, on a route of `ranks`:
    its neighbours, its `shadows` (hot mirrors), and the last stage when labels travel."""
    out = set(shadows)
    if stage > 0:
        out.add(ranks[stage - 1])
    if stage < len(ranks) - 1:
        out.add(ranks[stage + 1])
        if stage == 0 and labels == "travel":
            out.add(ranks[-1])
    return out


class HotSteps:
    """ResPipe's training steps: the engine's, and in hot mode resumable ones with relays
    and mirrors.

    Composed around the engine (``engine``, a :class:`~mpipipe.pipeline.engine.Pipeline`):
    it reads the engine's route, transport, partitions and schedule, and writes only the
    figures a step leaves on it (``step_count``, ``last_compute_s``, ``last_wait_s``).
    What hot mode keeps is its own: ``relay_grads`` and ``resumable`` (set by the
    membership in hot mode), the step in flight and the last one (:class:`StepState`),
    and what the consumers hold after a takeover (:class:`Have`). With no hot feature on
    (no shadows, no mirror, neither flag) :meth:`step` is the engine's plain step.
    """

    def __init__(self, engine: Pipeline) -> None:
        self.engine = engine
        self.relay_grads = False  # set by ResPipe in hot mode
        # Hot mode: keep an interrupted step (and the last one) to finish it.
        self.resumable = False
        self.inflight: StepState | None = None
        self.last_state: StepState | None = None
        self.peer_have: dict[int, Have] = {}
        self._resent: set[tuple[int, int, int, int]] = set()  # (dest, kind, step, micro)
        self._resuming = False

    def rebind(self, route: Route, comm: object | None = None) -> None:
        """Bind the engine to `route` (:meth:`Pipeline.rebind`); what the consumers of the
        old route held no longer counts."""
        self.engine.rebind(route, comm)
        self.peer_have, self._resent = {}, set()

    def _hot(self, stage: int, mirror: tuple[int, int] | None) -> bool:
        """Is any hot feature on for this step (else the plain step runs)?"""
        return (mirror is not None or self.resumable or self.relay_grads
                or bool(self.peer_have) or bool(self.engine.route.shadows_of(stage)))

    # -- one training step -------------------------------------------------------------
    def step(self, x: torch.Tensor | None, y: torch.Tensor | None, loss_fn: LossFn, *,
             step: int | None = None, mirror: tuple[int, int] | None = None) -> float | None:
        """The engine's step (:meth:`Pipeline.step`), and in hot mode a resumable one.

        With `mirror=(stage, source)` a rank without a stage runs that stage's actions on
        the copies `source` relays (kind SHADOW) and sends nothing: a hot backup. When
        `resumable`, an interrupted step is kept (:class:`StepState`) and the next call
        for the same step and stage continues it where it stopped, even on another route
        and as the stage itself after a mirror's takeover (see :meth:`resume`).

        Raises:
            Late: a message missed the engine's `deadline`.
            PeerFailed: a peer died (ULFM).
            ValueError: a mini-batch with fewer samples than micro-batches, or hot mode
                with a schedule of several chunks per rank.
        """
        e = self.engine
        stage = e.stage if mirror is None else mirror[0]
        if stage is None:
            return None
        if not self._hot(stage, mirror):
            return e.step(x, y, loss_fn, step=step)
        if e.v > 1:
            raise ValueError(f"ResPipe's hot mode runs one chunk per rank; schedule "
                             f"{e.schedule!r} has {e.v}")
        step_no = e.step_count if step is None else step
        t0 = time.perf_counter()
        wait0 = e.transport.wait_s
        st = self.inflight
        if st is None or st.step != step_no or st.stage != stage:
            st = self._begin(stage, step_no)
        try:
            self._run_hot(st, x, y, loss_fn, None if mirror is None else mirror[1])
        except BaseException:
            e.transport.discard()
            if not self.resumable:
                self.inflight = None
            raise
        finally:
            elapsed = time.perf_counter() - t0
            e.last_wait_s = e.transport.wait_s - wait0
            e.last_compute_s = elapsed - e.last_wait_s
        self.inflight = None
        commit_step(e.partitions[stage])  # deferred BatchNorm: the whole step's sums
        st.saved.clear()
        self.last_state = st if self.resumable else None
        e.step_count = step_no + 1
        return st.loss_sum if stage == e.k - 1 else None

    def _begin(self, stage: int, step_no: int) -> StepState:
        part = self.engine.partitions[stage]
        for p in part.parameters():
            p.grad = None
        begin_step(part)
        self.inflight = StepState(stage, step_no)
        return self.inflight

    def _run_hot(self, st: StepState, x: torch.Tensor | None, y: torch.Tensor | None,
                 loss_fn: LossFn, source: int | None) -> None:
        """The actions of `st.stage` from `st.pos` on; `source` is a mirror's stage rank."""
        e, stage = self.engine, st.stage
        shadows = e.route.shadows_of(stage) if source is None else []
        self._hot_inputs(st, x, y, source)
        todo = e.plan(stage)
        while st.pos < len(todo):
            a = todo[st.pos]
            if a.op == Op.FORWARD:
                self._hot_forward(st, a.micro, loss_fn, source, shadows)
            else:
                self._hot_backward(st, a.micro, source, shadows)
        e.transport.flush(e.deadline)

    def _hot_inputs(self, st: StepState, x: torch.Tensor | None, y: torch.Tensor | None,
                    source: int | None) -> None:
        """The first stage's micro-batches of x, and the labels of the first and last
        stages (a mirror of the last stage reads its labels itself), once per step."""
        e = self.engine
        first, last = st.stage == 0, st.stage == e.k - 1
        if first and source is None and st.xs is None:
            st.xs = e.split_x(x)
        if (first or last) and st.ys is None and st.y is None:
            if source is not None:
                if last:
                    if y is None:
                        raise ValueError("a mirror of the last stage needs y")
                    st.ys = list(y.tensor_split(e.chunks))
            else:
                st.ys, st.y = e.exchange_labels(y, st.step, 0, LABEL, send=self._emit)
        if last and st.ys is not None and not st.total:
            st.total = sum(len(v) for v in st.ys)

    def _hot_forward(self, st: StepState, i: int, loss_fn: LossFn, source: int | None,
                     shadows: Sequence[int]) -> None:
        """Micro-batch i's forward: its input (kept, received, or relayed to a mirror),
        relayed to the shadows, and its output sent on (or its loss, on the last stage)."""
        e = self.engine
        stage, ranks = st.stage, e.route.ranks
        first, last = stage == 0, stage == e.k - 1
        inp = st.inputs.get(i)
        if inp is None:
            if first and source is None:
                assert st.xs is not None
                inp = st.xs[i]
            else:
                shape, dtype = e.boundary_shapes()[stage]
                inp = e.transport.recv_rows(
                    shape, dtype, ranks[stage - 1] if source is None else source,
                    kind=ACT if source is None else SHADOW, step=st.step, micro=i,
                    deadline=e.deadline)
                inp.requires_grad_(inp.is_floating_point())
            st.inputs[i] = inp
        for r in shadows:
            self._emit(inp, r, SHADOW, st.step, i)
        torch.default_generator.manual_seed(micro_seed(e.seed, stage, st.step, i))
        out = e.partitions[stage](inp)
        if last:
            assert st.ys is not None
            out = loss_fn(out, st.ys[i]) * (len(st.ys[i]) / st.total)
            st.loss_sum += float(out.detach())
        elif self.resumable:  # what was sent stays, to be sent again after a takeover
            st.outs[i] = out.detach()
        st.saved[i] = (inp, out)
        st.pos += 1
        if source is None and not last:
            self._emit(out, ranks[stage + 1], ACT, st.step, i)
        if e.after_forward is not None:  # a mirror's too: a fault aimed at it
            e.after_forward(st.step, i)

    def _hot_backward(self, st: StepState, i: int, source: int | None,
                      shadows: Sequence[int]) -> None:
        """Micro-batch i's backward: the output's gradient (kept, received, or relayed to
        a mirror), relayed to the shadows, and the input's gradient sent back."""
        e = self.engine
        stage, ranks, keep = st.stage, e.route.ranks, self.resumable
        first, last = stage == 0, stage == e.k - 1
        inp, out = st.saved[i]
        grad = None
        if not last:
            grad = st.grads.get(i)
            if grad is None:
                grad = e.transport.recv(
                    torch.empty_like(out), ranks[stage + 1] if source is None else source,
                    kind=GRAD if source is None else SHADOW, step=st.step,
                    micro=i if source is None else SHADOW_GRAD_MICRO + i,
                    deadline=e.deadline)
                st.grads[i] = grad
            for r in shadows if self.relay_grads else ():
                self._emit(grad, r, SHADOW, st.step, SHADOW_GRAD_MICRO + i)
        if out.requires_grad:
            out.backward(grad)
        del st.saved[i]
        st.pos += 1
        if not keep:  # 1F1B's point: hold the tensors of in-flight micro-batches only
            st.inputs.pop(i, None)
            st.grads.pop(i, None)
        if not first:
            g = inp.grad if inp.grad is not None else torch.zeros_like(inp)
            if keep:
                st.gins[i] = g
            if source is None:
                self._emit(g, ranks[stage - 1], GRAD, st.step, i)

    # -- finishing a step after a takeover ---------------------------------------------
    def _emit(self, tensor: torch.Tensor, dest: int, kind: int, step: int, micro: int) -> None:
        """Send unless `dest` has this message: it said so, or :meth:`resume` sent it.

        Every message of a hot step leaves through here (the labels too: the engine's
        :meth:`~Pipeline.exchange_labels` is given it); the plain step never runs while
        `peer_have` is set (:meth:`_hot`), so it sends with the transport directly."""
        if self.peer_have:
            key = (dest, kind, step, micro)
            if _has(self.peer_have.get(dest), kind, step, micro) or key in self._resent:
                return
            if self._resuming:
                self._resent.add(key)
        self.engine.transport.send(tensor, dest, kind=kind, step=step, micro=micro)

    def have(self, step: int) -> Have:
        """What this rank holds of `step`'s messages, for the ranks that send it them."""
        st = self.inflight
        if st is None or st.step != step:
            return Have(step, 0, 0, False)
        bits = lambda d: sum(1 << i for i in d)  # noqa: E731
        return Have(step, bits(st.inputs), bits(st.grads), st.ys is not None)

    def suppliers(self, mirror_source: int | None = None) -> list[int]:
        """The ranks whose messages this rank consumes in a step (on the current route)."""
        e = self.engine
        if e.stage is None:
            return [] if mirror_source is None else [mirror_source]
        j, ranks = e.stage, e.route.ranks
        out = {ranks[j - 1]} if j > 0 else set()
        if j < e.k - 1:
            out.add(ranks[j + 1])
        if j == e.k - 1 and j > 0 and e.labels == "travel":
            out.add(ranks[0])
        return sorted(out)

    def consumers(self) -> list[int]:
        """The ranks that consume this rank's messages in a step (stages and mirrors)."""
        e = self.engine
        if e.stage is None:
            return []
        return sorted(stage_consumers(e.stage, e.route.ranks,
                                      e.route.shadows_of(e.stage), e.labels))

    def resume(self, peer_have: Mapping[int, Have]) -> int:
        """After a takeover: send each consumer what it lacks of the steps this rank holds.

        `peer_have` maps each consumer (rank on the current route) to what it holds.
        Messages a consumer has are never sent again, now or when this rank produces
        them later (a promoted mirror is behind the stage it replaces); every message it
        lacks goes to it once. Returns the number of messages sent.

        Raises:
            PeerFailed: a consumer is dead (a new round follows).
        """
        e = self.engine
        self.peer_have = dict(peer_have)
        # A relay is sent before its action counts as done: redoing the action must not
        # send again what this resend delivers.
        self._resent, self._resuming = set(), True
        sent = e.transport.pending()
        j, ranks = e.stage, e.route.ranks
        try:
            for st in (self.last_state, self.inflight):
                if st is None or j is None or st.stage != j:
                    continue
                if j < e.k - 1:
                    for i, o in st.outs.items():
                        self._emit(o, ranks[j + 1], ACT, st.step, i)
                if j > 0:
                    for i, g in st.gins.items():
                        self._emit(g, ranks[j - 1], GRAD, st.step, i)
                if j == 0 and st.y is not None and e.k > 1 and e.labels == "travel":
                    self._emit(st.y, ranks[-1], LABEL, st.step, 0)
                for r in e.route.shadows_of(j):
                    for i, inp in st.inputs.items():
                        self._emit(inp, r, SHADOW, st.step, i)
                    for i, g in st.grads.items() if self.relay_grads else ():
                        self._emit(g, r, SHADOW, st.step, SHADOW_GRAD_MICRO + i)
        finally:
            self._resuming = False
        return e.transport.pending() - sent

    def abandon(self) -> None:
        """Forget an interrupted step (it will be replayed from its start)."""
        self.inflight = None
        self.last_state = None
        self.peer_have, self._resent = {}, set()
