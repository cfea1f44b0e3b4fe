"""The pipeline engine: one stage per rank, micro-batches forward and back, gradients accumulated."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from mpipipe.core.transport import ACT, EVAL, GRAD, LABEL, SHADOW, Transport
from mpipipe.pipeline.partition import split
from mpipipe.pipeline.schedule import actions

__all__ = ["Pipeline", "Route", "StepState", "Have", "stage_consumers", "EVAL_LABEL_MICRO",
           "SHADOW_GRAD_MICRO"]

# Evaluation labels travel with kind EVAL and this micro index, which no micro-batch uses.
EVAL_LABEL_MICRO = 1023
# Hot backups (resilience): with `relay_grads`, a stage also relays the gradient of its
# output for micro-batch i to its shadows as SHADOW micro SHADOW_GRAD_MICRO + i.
SHADOW_GRAD_MICRO = 512

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepState:
    """What one stage (or its hot mirror) has done of one step, micro-batch by micro-batch.

    Why: a resumable pipeline keeps it when a step is interrupted, so that after a
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


@dataclass(frozen=True)
class Route:
    """Which communicator rank serves each stage, and the generation of that assignment.

    Resilience replaces a route with one where a failed or late stage is served by its
    backup and the generation is one higher; messages carry the generation in their tag,
    so nothing sent under an older route is ever received under the new one.

    `shadows` lists (stage, rank) pairs: rank also receives a copy of the input
    activations of stage (kind SHADOW), for hot backups that run the stage's forward.
    """

    ranks: tuple[int, ...]
    generation: int = 0
    shadows: tuple[tuple[int, int], ...] = field(default=())

    @classmethod
    def default(cls, stages: int) -> Route:
        """Stage k on rank k, generation 0."""
        return cls(tuple(range(stages)))

    @classmethod
    def from_plan(cls, plan: object, stages: int, generation: int = 0) -> Route:
        """Stage k on the rank the launch plan gives role `stage k`."""
        ranks = []
        for k in range(stages):
            found = plan.ranks_of("stage", k)  # type: ignore[attr-defined]
            if len(found) != 1:
                raise ValueError(f"the launch plan has {len(found)} ranks for stage {k}")
            ranks.append(found[0])
        return cls(tuple(ranks), generation)

    def stage_of(self, rank: int) -> int | None:
        """The stage `rank` serves, or None (a backup, or a rank left out)."""
        try:
            return self.ranks.index(rank)
        except ValueError:
            return None

    def shadows_of(self, stage: int) -> list[int]:
        return [r for s, r in self.shadows if s == stage]

    def moved(self, stage: int, rank: int) -> Route:
        """This route with `stage` served by `rank`, one generation later."""
        ranks = list(self.ranks)
        ranks[stage] = rank
        return Route(tuple(ranks), self.generation + 1, self.shadows)

    def renumbered(self, mapping: Mapping[int, int], generation: int | None = None) -> Route:
        """The same assignment in another communicator's numbering (after a Shrink)."""
        gen = self.generation + 1 if generation is None else generation
        return Route(tuple(mapping[r] for r in self.ranks), gen,
                     tuple((s, mapping[r]) for s, r in self.shadows if r in mapping))


class Pipeline:
    """A synchronous micro-batch pipeline over MPI ranks, in the spirit of torchgpipe's GPipe.

    Every rank builds the same `module` (same seed) and the same Pipeline; each keeps all
    partitions (small CNNs) so that any rank can serve any stage after a takeover, and
    runs the one its route gives it.

    Labels travel: the first stage passes `y` with `x` and sends the whole mini-batch's
    labels straight to the last stage (one LABEL message per step, payload 8 bytes per
    sample). With `labels="local"` the last stage uses the `y` it is given instead (it
    reads the labels itself) and nothing is sent.
    """

    def __init__(self, module: nn.Sequential, balance: Sequence[int], chunks: int,
                 schedule: str = "gpipe", comm: object | None = None,
                 route: Route | None = None, *, in_shape: Sequence[int] | None = None,
                 labels: str = "travel", deadline: float | None = None,
                 label_dtype: torch.dtype = torch.int64) -> None:
        if comm is None:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        if labels not in ("travel", "local"):
            raise ValueError(f"labels must be 'travel' or 'local', got {labels!r}")
        actions(schedule, 0, 1, 1)  # validates the name
        self.module = module
        self.partitions = split(module, balance)
        self.balance = list(balance)
        self.k = len(self.partitions)
        self.chunks = chunks
        self.schedule = schedule
        self.labels = labels
        self.label_dtype = label_dtype
        self.deadline = deadline
        self.in_shape = tuple(in_shape) if in_shape is not None else None
        self._shapes: list[tuple[tuple[int, ...], torch.dtype]] | None = None
        self.step_count = 0
        self.eval_count = 0
        self.last_compute_s = 0.0
        self.last_wait_s = 0.0
        self.relay_grads = False  # set by resilience in hot mode
        # Resilience in hot mode: keep an interrupted step (and the last one) to finish it.
        self.resumable = False
        self.inflight: StepState | None = None
        self.last_state: StepState | None = None
        self.peer_have: dict[int, Have] = {}
        self._resent: set[tuple[int, int, int, int]] = set()  # (dest, kind, step, micro)
        self._resuming = False
        # Called with (step, micro) after each forward of a stage (fault injection).
        self.after_forward: Callable[[int, int], object] | None = None
        self.comm = comm
        self.route = route or Route.default(self.k)
        self.transport = Transport(comm, self.route.generation)
        self.rebind(self.route, comm)

    # -- where this rank sits ----------------------------------------------------------
    def rebind(self, route: Route, comm: object | None = None) -> None:
        """Serve `route` (on `comm`, if given) from now on: after a takeover or shrink.

        Pending sends of the old route are dropped; the byte counters carry over.

        Raises:
            ValueError: the route does not name one distinct rank of `comm` per stage.
        """
        comm = comm if comm is not None else self.comm
        size = comm.Get_size()  # type: ignore[attr-defined]
        if len(route.ranks) != self.k:
            raise ValueError(f"route {route.ranks} has {len(route.ranks)} ranks for {self.k} stages")
        if len(set(route.ranks)) != self.k or not all(0 <= r < size for r in route.ranks):
            raise ValueError(f"route {route.ranks}: need {self.k} distinct ranks in 0..{size - 1}")
        old = self.transport
        old.discard()
        self.transport = Transport(comm, route.generation)
        # requests given up on keep their buffers alive for as long as this pipeline lives
        self.transport._abandoned = old._abandoned
        if comm is self.comm:
            self.transport.bytes_sent.update(old.bytes_sent)
            self.transport.bytes_recv.update(old.bytes_recv)
        self.transport.wait_s = old.wait_s
        self.comm, self.route = comm, route
        self.peer_have, self._resent = {}, set()
        self.rank = comm.Get_rank()  # type: ignore[attr-defined]
        self.stage = route.stage_of(self.rank)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.k - 1

    @property
    def stage_module(self) -> nn.Sequential | None:
        """This rank's partition, or None on a rank without a stage."""
        return None if self.stage is None else self.partitions[self.stage]

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (nothing on a rank without a stage), for its optimizer."""
        if self.stage is None:
            return iter(())
        return self.partitions[self.stage].parameters()

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    # -- shapes ------------------------------------------------------------------------
    def boundary_shapes(self, in_shape: Sequence[int] | None = None
                        ) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Per-sample shape and dtype entering each stage (and leaving the last).

        Computed once, locally, by a no-grad forward of two zero samples through all
        partitions, so that receivers can size buffers without a header message.
        """
        if self._shapes is None:
            shape = self.in_shape or (tuple(in_shape) if in_shape is not None else None)
            if shape is None:
                raise ValueError("this stage does not get x and cannot infer activation "
                                 "shapes: pass in_shape=(C, H, W) to Pipeline")
            self.in_shape = tuple(shape)
            modes = [m.training for m in self.module.modules()]
            self.module.eval()
            try:
                with torch.no_grad():
                    x = torch.zeros(2, *shape)
                    shapes = [(tuple(x.shape[1:]), x.dtype)]
                    for part in self.partitions:
                        x = part(x)
                        shapes.append((tuple(x.shape[1:]), x.dtype))
            finally:
                for m, mode in zip(self.module.modules(), modes, strict=True):
                    m.training = mode
            self._shapes = shapes
        return self._shapes

    # -- one training step -------------------------------------------------------------
    def step(self, x: torch.Tensor | None, y: torch.Tensor | None, loss_fn: LossFn, *,
             step: int | None = None, mirror: tuple[int, int] | None = None) -> float | None:
        """Forward and backward all micro-batches of one mini-batch; return the loss.

        `x` is read on the first stage and `y` on the first stage (labels travel) or the
        last (labels="local"). Gradients are zeroed first and then accumulated into this
        stage's parameters; the optimizer is never stepped here, so a step interrupted
        by a failure can be replayed as a whole. `loss_fn` must return the mean over a
        micro-batch; micro-batch i is weighted by its share n_i / B so that gradients
        and loss equal those of the whole mini-batch. Returns the mini-batch loss on the
        last stage and None elsewhere.

        With `mirror=(stage, source)` a rank without a stage runs that stage's actions on
        the copies `source` relays (kind SHADOW) and sends nothing: a hot backup. On a
        `resumable` pipeline an interrupted step is kept (:class:`StepState`) and the next
        call for the same step and stage continues it where it stopped, even on another
        route and as the stage itself after a mirror's takeover (see :meth:`resume`).

        Raises:
            Late: a message missed `self.deadline`.
            PeerFailed: a peer died (ULFM).
            ValueError: a mini-batch with fewer samples than micro-batches.
        """
        stage = self.stage if mirror is None else mirror[0]
        if stage is None:
            return None
        step_no = self.step_count if step is None else step
        t0 = time.perf_counter()
        wait0 = self.transport.wait_s
        st = self.inflight
        if st is None or st.step != step_no or st.stage != stage:
            st = self._begin(stage, step_no)
        try:
            self._run(st, x, y, loss_fn, None if mirror is None else mirror[1])
        except BaseException:
            self.transport.discard()
            if not self.resumable:
                self.inflight = None
            raise
        finally:
            elapsed = time.perf_counter() - t0
            self.last_wait_s = self.transport.wait_s - wait0
            self.last_compute_s = elapsed - self.last_wait_s
        self.inflight = None
        st.saved.clear()
        self.last_state = st if self.resumable else None
        self.step_count = step_no + 1
        return st.loss_sum if stage == self.k - 1 else None

    def _begin(self, stage: int, step_no: int) -> StepState:
        for p in self.partitions[stage].parameters():
            p.grad = None
        self.inflight = StepState(stage, step_no)
        return self.inflight

    def _run(self, st: StepState, x: torch.Tensor | None, y: torch.Tensor | None,
             loss_fn: LossFn, source: int | None) -> None:
        """The actions of `st.stage` from `st.pos` on; `source` is a mirror's stage rank."""
        stage, t, m, deadline = st.stage, self.transport, self.chunks, self.deadline
        first, last = stage == 0, stage == self.k - 1
        part = self.partitions[stage]
        ranks = self.route.ranks
        shadows = self.route.shadows_of(stage) if source is None else []
        if first and source is None and st.xs is None:
            if x is None:
                raise ValueError("the first stage needs x")
            if len(x) < m:
                raise ValueError(f"a mini-batch of {len(x)} samples cannot make {m} "
                                 f"micro-batches; use a batch size >= chunks")
            st.xs = x.tensor_split(m)
            self.boundary_shapes(x.shape[1:])
        shapes = self.boundary_shapes()
        if (first or last) and st.ys is None and st.y is None:
            if source is not None:  # a mirror reads its labels itself
                if last:
                    if y is None:
                        raise ValueError("a mirror of the last stage needs y")
                    st.ys = list(y.tensor_split(m))
            else:
                st.ys, st.y = self._labels(y, st.step, 0, LABEL)
        if last and st.ys is not None and not st.total:
            st.total = sum(len(v) for v in st.ys)
        todo = actions(self.schedule, stage, self.k, m)
        keep = self.resumable  # what was sent stays, to be sent again after a takeover
        while st.pos < len(todo):
            op, i = todo[st.pos]
            if op == "F":
                inp = st.inputs.get(i)
                if inp is None:
                    if first and source is None:
                        assert st.xs is not None
                        inp = st.xs[i]
                    else:
                        shape, dtype = shapes[stage]
                        inp = t.recv_rows(shape, dtype, ranks[stage - 1] if source is None
                                          else source, kind=ACT if source is None else SHADOW,
                                          step=st.step, micro=i, deadline=deadline)
                        inp.requires_grad_(inp.is_floating_point())
                    st.inputs[i] = inp
                for r in shadows:
                    self._emit(inp, r, SHADOW, st.step, i)
                out = part(inp)
                if last:
                    assert st.ys is not None
                    out = loss_fn(out, st.ys[i]) * (len(st.ys[i]) / st.total)
                    st.loss_sum += float(out.detach())
                elif keep:
                    st.outs[i] = out.detach()
                st.saved[i] = (inp, out)
                st.pos += 1
                if source is None and not last:
                    self._emit(out, ranks[stage + 1], ACT, st.step, i)
                if self.after_forward is not None:  # a mirror's too: a fault aimed at it
                    self.after_forward(st.step, i)
            else:
                inp, out = st.saved[i]
                grad = None
                if not last:
                    grad = st.grads.get(i)
                    if grad is None:
                        grad = t.recv(torch.empty_like(out),
                                      ranks[stage + 1] if source is None else source,
                                      kind=GRAD if source is None else SHADOW, step=st.step,
                                      micro=i if source is None else SHADOW_GRAD_MICRO + i,
                                      deadline=deadline)
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
        t.flush(deadline)

    # -- finishing a step after a takeover (hot backups) -------------------------------
    def _emit(self, tensor: torch.Tensor, dest: int, kind: int, step: int, micro: int) -> None:
        """Send unless `dest` has this message: it said so, or :meth:`resume` sent it."""
        if self.peer_have:
            key = (dest, kind, step, micro)
            if _has(self.peer_have.get(dest), kind, step, micro) or key in self._resent:
                return
            if self._resuming:
                self._resent.add(key)
        self.transport.send(tensor, dest, kind=kind, step=step, micro=micro)

    def have(self, step: int) -> Have:
        """What this rank holds of `step`'s messages, for the ranks that send it them."""
        st = self.inflight
        if st is None or st.step != step:
            return Have(step, 0, 0, False)
        bits = lambda d: sum(1 << i for i in d)  # noqa: E731
        return Have(step, bits(st.inputs), bits(st.grads), st.ys is not None)

    def suppliers(self, mirror_source: int | None = None) -> list[int]:
        """The ranks whose messages this rank consumes in a step (on the current route)."""
        if self.stage is None:
            return [] if mirror_source is None else [mirror_source]
        j, ranks = self.stage, self.route.ranks
        out = {ranks[j - 1]} if j > 0 else set()
        if j < self.k - 1:
            out.add(ranks[j + 1])
        if j == self.k - 1 and j > 0 and self.labels == "travel":
            out.add(ranks[0])
        return sorted(out)

    def consumers(self) -> list[int]:
        """The ranks that consume this rank's messages in a step (stages and mirrors)."""
        if self.stage is None:
            return []
        return sorted(stage_consumers(self.stage, self.route.ranks,
                                      self.route.shadows_of(self.stage), self.labels))

    def resume(self, peer_have: Mapping[int, Have]) -> int:
        """After a takeover: send each consumer what it lacks of the steps this rank holds.

        `peer_have` maps each consumer (rank on the current route) to what it holds.
        Messages a consumer has are never sent again, now or when this rank produces
        them later (a promoted mirror is behind the stage it replaces); every message it
        lacks goes to it once. Returns the number of messages sent.

        Raises:
            PeerFailed: a consumer is dead (a new round follows).
        """
        self.peer_have = dict(peer_have)
        # A relay is sent before its action counts as done: redoing the action must not
        # send again what this resend delivers.
        self._resent, self._resuming = set(), True
        sent = self.transport.pending()
        j, ranks = self.stage, self.route.ranks
        try:
            for st in (self.last_state, self.inflight):
                if st is None or j is None or st.stage != j:
                    continue
                if j < self.k - 1:
                    for i, o in st.outs.items():
                        self._emit(o, ranks[j + 1], ACT, st.step, i)
                if j > 0:
                    for i, g in st.gins.items():
                        self._emit(g, ranks[j - 1], GRAD, st.step, i)
                if j == 0 and st.y is not None and self.k > 1 and self.labels == "travel":
                    self._emit(st.y, ranks[-1], LABEL, st.step, 0)
                for r in self.route.shadows_of(j):
                    for i, inp in st.inputs.items():
                        self._emit(inp, r, SHADOW, st.step, i)
                    for i, g in st.grads.items() if self.relay_grads else ():
                        self._emit(g, r, SHADOW, st.step, SHADOW_GRAD_MICRO + i)
        finally:
            self._resuming = False
        return self.transport.pending() - sent

    def abandon(self) -> None:
        """Forget an interrupted step (it will be replayed from its start)."""
        self.inflight = None
        self.last_state = None
        self.peer_have, self._resent = {}, set()

    def _labels(self, y: torch.Tensor | None, step_no: int, micro: int, kind: int
                ) -> tuple[list[torch.Tensor] | None, torch.Tensor | None]:
        """(labels of each micro-batch on the last stage, labels the first stage sent)."""
        m = self.chunks
        if self.labels == "local" or (self.first and self.last):
            if not self.last:
                return None, None
            if y is None:
                raise ValueError("the last stage needs y (labels='local')")
            return list(y.tensor_split(m)), None
        if self.first:
            if y is None:
                raise ValueError("the first stage needs y: labels travel from it to the "
                                 "last stage")
            sent = y.to(self.label_dtype)
            self._emit(sent, self.route.ranks[-1], kind, step_no, micro)
            return None, sent
        whole = self.transport.recv_rows((), self.label_dtype, self.route.ranks[0], kind=kind,
                                         step=step_no, micro=micro, deadline=self.deadline)
        return list(whole.tensor_split(m)), None

    # -- evaluation --------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, x: torch.Tensor | None, y: torch.Tensor | None
                 ) -> tuple[int, int] | None:
        """Forward-only pass of one batch; (correct, count) on the last stage, else None.

        Every stage must call it the same number of times; messages use kind EVAL and
        their own counter, so evaluation never mixes with training traffic.
        """
        if self.stage is None:
            return None
        seq = self.eval_count
        stage, t, m = self.stage, self.transport, self.chunks
        part = self.partitions[stage]
        prev_rank = self.route.ranks[stage - 1] if stage > 0 else -1
        next_rank = self.route.ranks[stage + 1] if stage < self.k - 1 else -1
        was_training = part.training
        part.eval()
        try:
            xs: Sequence[torch.Tensor] = ()
            if self.first:
                if x is None:
                    raise ValueError("the first stage needs x")
                xs = x.tensor_split(m)
                self.boundary_shapes(x.shape[1:])
            shapes = self.boundary_shapes()
            ys = self._labels(y, seq, EVAL_LABEL_MICRO, EVAL)[0] if (self.first or self.last) \
                else None
            correct = count = 0
            for i in range(m):
                if self.first:
                    inp = xs[i]
                else:
                    shape, dtype = shapes[stage]
                    inp = t.recv_rows(shape, dtype, prev_rank, kind=EVAL, step=seq, micro=i,
                                      deadline=self.deadline)
                out = part(inp)
                if self.last:
                    assert ys is not None
                    correct += int((out.argmax(1) == ys[i]).sum())
                    count += len(ys[i])
                else:
                    t.send(out, next_rank, kind=EVAL, step=seq, micro=i)
            t.flush(self.deadline)
        except BaseException:
            t.discard()
            raise
        finally:
            part.train(was_training)
        self.eval_count = seq + 1
        return (correct, count) if self.last else None
