"""The pipeline engine: each rank runs its stage's chunks, micro-batches forward and back.

The plain step executor lives here and does only what a plain pipeline needs: ResPipe's
hot mode (keeping a step's progress to finish it after a takeover, relaying to shadow
ranks) is :class:`mpipipe.respipe.mirror.HotSteps`, a part that holds a Pipeline and
reads its fields, so the plain step pays nothing for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from mpipipe.core.mpi.transport import ACT, EVAL, GRAD, LABEL, Transport
from mpipipe.pipeline.deferred_bn import begin_step, commit_step
from mpipipe.pipeline.partition import split, stage_modules
from mpipipe.pipeline.schedule import Action, Op, actions, virtual_stages
from mpipipe.pipeline.schedule import get as get_schedule

__all__ = ["Pipeline", "Route", "EVAL_LABEL_MICRO", "MAX_TAGGED_MICRO", "micro_seed"]


def micro_seed(seed: int, chunk: int, step: int, micro: int) -> int:
    """The seed of torch's CPU generator for the forward of micro-batch ``micro`` of
    0-based ``step`` through model chunk ``chunk`` (the stage, without interleaving).

    Why a pure function: the random numbers a stage draws (Dropout's masks) must be the
    same in a replay after a takeover, on a hot mirror and in a resumed run, and a
    single-process reference can draw them too, by seeding before each chunk's forward.
    A 64-bit mix (splitmix64's finaliser), so that neighbouring steps get unrelated
    streams."""
    z = (seed * 0x9E3779B97F4A7C15 + chunk * 0xBF58476D1CE4E5B9 + step * 0x94D049BB133111EB
         + micro * 0xD6E8FEB86659FD93) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF

# Evaluation labels travel with kind EVAL and this micro index, which no micro-batch uses.
EVAL_LABEL_MICRO = 1023
# The tag's micro field carries (virtual stage round, micro-batch): a message into chunk
# c for micro-batch i has micro (c // K) * m + i, so the v chunks of one rank never share
# a tag on the same link; with one chunk per rank it is i, as it always was. Below 512,
# which ResPipe's hot mirror uses for relayed gradients (mpipipe.respipe.mirror).
MAX_TAGGED_MICRO = 512

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# send(tensor, dest, kind, step, micro): how a message leaves (see Pipeline.exchange_labels)
Send = Callable[[torch.Tensor, int, int, int, int], None]


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

    `balance` gives the layers of each model chunk. With the schedules that run one chunk
    per rank ("gpipe", "1f1b") it has one entry per stage; with "interleaved-1f1b" it has
    v x K entries for K ranks (K = the route's length, or the communicator's size) and
    rank k runs chunks k, k + K, ... (v virtual stages per rank). `partitions[k]` is
    always stage k's whole module (all its chunks; their layers keep the model's names,
    so its state_dict is the stage's part of the model's), `chunk_modules` the v x K
    chunks in model order.

    Labels travel: the first stage passes `y` with `x` and sends the whole mini-batch's
    labels straight to the last stage (one LABEL message per step, payload 8 bytes per
    sample). With `labels="local"` the last stage uses the `y` it is given instead (it
    reads the labels itself) and nothing is sent.
    """

    def __init__(self, module: nn.Sequential, balance: Sequence[int], chunks: int,
                 schedule: str = "gpipe", comm: object | None = None,
                 route: Route | None = None, *, in_shape: Sequence[int] | None = None,
                 labels: str = "travel", deadline: float | None = None,
                 label_dtype: torch.dtype = torch.int64, seed: int = 0) -> None:
        if comm is None:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        if labels not in ("travel", "local"):
            raise ValueError(f"labels must be 'travel' or 'local', got {labels!r}")
        plan = get_schedule(schedule)  # validates the name
        self.module = module
        self.chunk_modules = split(module, balance)
        self.balance = list(balance)
        if plan.virtual:
            k = len(route.ranks) if route is not None else comm.Get_size()  # type: ignore[attr-defined]
        else:
            k = len(self.chunk_modules)
        self.v = virtual_stages(schedule, len(self.chunk_modules), k)
        self.k = k
        if self.v > 1:
            actions(schedule, 0, k, chunks, self.v)  # e.g. chunks not a multiple of K
            if self.v * chunks > MAX_TAGGED_MICRO:
                raise ValueError(f"{self.v} chunks per rank x {chunks} micro-batches = "
                                 f"{self.v * chunks} tagged messages per link and step; at "
                                 f"most {MAX_TAGGED_MICRO} fit the message tag")
        self.partitions = stage_modules(self.chunk_modules, k)
        self.chunks = chunks
        self.schedule = schedule
        self.labels = labels
        self.label_dtype = label_dtype
        self.deadline = deadline
        self.in_shape = tuple(in_shape) if in_shape is not None else None
        self._shapes: list[tuple[tuple[int, ...], torch.dtype]] | None = None
        self._plans: dict[int, list[Action]] = {}
        self.step_count = 0
        self.eval_count = 0
        self.seed = seed  # of every micro-batch's random numbers (micro_seed)
        self.last_compute_s = 0.0
        self.last_wait_s = 0.0
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
        """This rank's partition (all its chunks), or None on a rank without a stage."""
        return None if self.stage is None else self.partitions[self.stage]

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (nothing on a rank without a stage), for its optimizer."""
        if self.stage is None:
            return iter(())
        return self.partitions[self.stage].parameters()

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def plan(self, stage: int) -> list[Action]:
        """Stage `stage`'s actions in a step (computed once: the schedule is data)."""
        todo = self._plans.get(stage)
        if todo is None:
            todo = self._plans[stage] = actions(self.schedule, stage, self.k, self.chunks, self.v)
        return todo

    def tag_micro(self, chunk: int, micro: int) -> int:
        """The tag's micro field of a message into (ACT) or out of (GRAD) chunk `chunk`."""
        return (chunk // self.k) * self.chunks + micro

    # -- shapes ------------------------------------------------------------------------
    def boundary_shapes(self, in_shape: Sequence[int] | None = None
                        ) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Per-sample shape and dtype entering each chunk (and leaving the last).

        Computed once, locally, by a no-grad forward of two zero samples through all
        chunks, so that receivers can size buffers without a header message.
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
                    for part in self.chunk_modules:
                        x = part(x)
                        shapes.append((tuple(x.shape[1:]), x.dtype))
            finally:
                for m, mode in zip(self.module.modules(), modes, strict=True):
                    m.training = mode
            self._shapes = shapes
        return self._shapes

    # -- one training step -------------------------------------------------------------
    def step(self, x: torch.Tensor | None, y: torch.Tensor | None, loss_fn: LossFn, *,
             step: int | None = None) -> float | None:
        """Forward and backward all micro-batches of one mini-batch; return the loss.

        `x` is read on the first stage and `y` on the first stage (labels travel) or the
        last (labels="local"). Gradients are zeroed first and then accumulated into this
        stage's parameters; the optimizer is never stepped here, so a step interrupted
        by a failure can be replayed as a whole. `loss_fn` must return the mean over a
        micro-batch; micro-batch i is weighted by its share n_i / B so that gradients
        and loss equal those of the whole mini-batch. Returns the mini-batch loss on the
        last stage and None elsewhere.

        Raises:
            Late: a message missed `self.deadline`.
            PeerFailed: a peer died (ULFM).
            ValueError: a mini-batch with fewer samples than micro-batches.
        """
        stage = self.stage
        if stage is None:
            return None
        step_no = self.step_count if step is None else step
        t0 = time.perf_counter()
        wait0 = self.transport.wait_s
        for p in self.partitions[stage].parameters():
            p.grad = None
        begin_step(self.partitions[stage])  # deferred BatchNorm: this step's sums only
        try:
            loss = self._run(stage, step_no, x, y, loss_fn)
        except BaseException:
            self.transport.discard()
            raise
        finally:
            elapsed = time.perf_counter() - t0
            self.last_wait_s = self.transport.wait_s - wait0
            self.last_compute_s = elapsed - self.last_wait_s
        commit_step(self.partitions[stage])
        self.step_count = step_no + 1
        return loss

    def split_x(self, x: torch.Tensor | None) -> Sequence[torch.Tensor]:
        """The first stage's micro-batches of `x` (and the shapes, now that x is known).

        Raises:
            ValueError: no `x`, or fewer samples than micro-batches.
        """
        m = self.chunks
        if x is None:
            raise ValueError("the first stage needs x")
        if len(x) < m:
            raise ValueError(f"a mini-batch of {len(x)} samples cannot make {m} "
                             f"micro-batches; use a batch size >= chunks")
        self.boundary_shapes(x.shape[1:])
        return x.tensor_split(m)

    def _run(self, stage: int, step_no: int, x: torch.Tensor | None, y: torch.Tensor | None,
             loss_fn: LossFn) -> float | None:
        """Run stage `stage`'s actions of one step; the loss on the last stage."""
        t, k, deadline, chunks = self.transport, self.k, self.deadline, self.chunk_modules
        last_chunk = len(chunks) - 1
        ranks = self.route.ranks
        xs = self.split_x(x) if stage == 0 else ()
        shapes = self.boundary_shapes()
        ys = self.exchange_labels(y, step_no, 0, LABEL)[0] if stage in (0, k - 1) else None
        total = sum(len(v) for v in ys) if ys is not None else 0
        after = self.after_forward
        saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        loss_sum = 0.0
        for a in self.plan(stage):
            c, i = a.stage, a.micro
            if a.op == Op.FORWARD:
                if c == 0:
                    inp = xs[i]
                else:
                    shape, dtype = shapes[c]
                    inp = t.recv_rows(shape, dtype, ranks[(c - 1) % k], kind=ACT, step=step_no,
                                      micro=self.tag_micro(c, i), deadline=deadline)
                    inp.requires_grad_(inp.is_floating_point())
                torch.default_generator.manual_seed(micro_seed(self.seed, c, step_no, i))
                out = chunks[c](inp)
                if c == last_chunk:
                    assert ys is not None
                    out = loss_fn(out, ys[i]) * (len(ys[i]) / total)
                    loss_sum += float(out.detach())
                else:
                    t.send(out, ranks[(c + 1) % k], kind=ACT, step=step_no,
                           micro=self.tag_micro(c + 1, i))
                saved[c, i] = (inp, out)
                if after is not None:
                    after(step_no, i)
            else:
                inp, out = saved.pop((c, i))
                grad = None
                if c < last_chunk:
                    grad = t.recv(torch.empty_like(out), ranks[(c + 1) % k], kind=GRAD,
                                  step=step_no, micro=self.tag_micro(c + 1, i),
                                  deadline=deadline)
                if out.requires_grad:
                    out.backward(grad)
                if c > 0:
                    g = inp.grad if inp.grad is not None else torch.zeros_like(inp)
                    t.send(g, ranks[(c - 1) % k], kind=GRAD, step=step_no,
                           micro=self.tag_micro(c, i))
        t.flush(deadline)
        return loss_sum if stage == k - 1 else None

    def exchange_labels(self, y: torch.Tensor | None, step_no: int, micro: int, kind: int,
                        send: Send | None = None
                        ) -> tuple[list[torch.Tensor] | None, torch.Tensor | None]:
        """(labels of each micro-batch on the last stage, labels the first stage sent).

        The first stage sends the labels with `send` (default: the transport's send);
        ResPipe's hot steps pass their own, which skips what the last stage holds
        already after a takeover (mpipipe.respipe.mirror).
        """
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
            dest = self.route.ranks[-1]
            if send is None:
                self.transport.send(sent, dest, kind=kind, step=step_no, micro=micro)
            else:
                send(sent, dest, kind, step_no, micro)
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
        their own counter, so evaluation never mixes with training traffic. A stage of
        several chunks runs them in model order, all micro-batches through each.
        """
        if self.stage is None:
            return None
        seq = self.eval_count
        stage, t, m, k = self.stage, self.transport, self.chunks, self.k
        ranks, chunks = self.route.ranks, self.chunk_modules
        last_chunk = len(chunks) - 1
        part = self.partitions[stage]
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
            ys = self.exchange_labels(y, seq, EVAL_LABEL_MICRO, EVAL)[0] if (self.first or self.last) \
                else None
            correct = count = 0
            for c in range(stage, last_chunk + 1, k):
                for i in range(m):
                    if c == 0:
                        inp = xs[i]
                    else:
                        shape, dtype = shapes[c]
                        inp = t.recv_rows(shape, dtype, ranks[(c - 1) % k], kind=EVAL, step=seq,
                                          micro=self.tag_micro(c, i), deadline=self.deadline)
                    out = chunks[c](inp)
                    if c == last_chunk:
                        assert ys is not None
                        correct += int((out.argmax(1) == ys[i]).sum())
                        count += len(ys[i])
                    else:
                        t.send(out, ranks[(c + 1) % k], kind=EVAL, step=seq,
                               micro=self.tag_micro(c + 1, i))
            t.flush(self.deadline)
        except BaseException:
            t.discard()
            raise
        finally:
            part.train(was_training)
        self.eval_count = seq + 1
        return (correct, count) if self.last else None
