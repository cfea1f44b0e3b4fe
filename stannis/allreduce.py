"""Batch-size-weighted gradient allreduce over flattened, bucketed buffers, and the
broadcast that puts every rank on the host's parameters and optimizer state."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from mpipipe.core.mpi.transport import pause
from mpipipe.core.state.stagestate import StageState

from .config import BUCKET_BYTES, EXCHANGES


def broadcast_state(comm: Any, state: StageState, root: int = 0) -> None:
    """Give every rank ``root``'s whole model state (parameters and buffers) and optimizer
    state, in one buffer ``Bcast`` (:meth:`mpipipe.core.state.stagestate.StageState.pack`;
    every rank's ``state.step`` is already the root's).

    Why the optimizer state too: after a CSD is dropped the survivors restart from
    the host's state; with its momentum (or Adam moments) they continue the same
    trajectory instead of restarting the average from zero. A step of 0 means no
    optimizer step yet: the optimizer's state is then empty everywhere.
    """
    flat = state.pack()
    comm.Bcast([flat.numpy(), MPI.BYTE], root=root)
    state.unpack(flat, state.step)


class BufferAverage:
    """Average a model's floating buffers (BatchNorm's running statistics) over the ranks
    with the same batch weights as the gradients, in one non-blocking allreduce that
    waits with the gradients' (``requests``, then :meth:`apply` after the exchange).

    Why weighted: a running mean updated with momentum m from each rank's batch mean and
    then averaged with weights b_i / sum(b) is exactly the running mean updated from the
    union batch's mean. A running variance averaged so is the weighted mean of the
    ranks' batch variances: the union batch's minus the spread between the ranks'
    means (docs/stannis.md). Integer buffers (BatchNorm's batch counter) take the
    largest count: every rank that trained counted the step. A rank with an empty batch
    weighs nothing. ``[stannis] local_buffers = true`` keeps them per rank instead
    (as FedBN does); then this is not used.
    """

    def __init__(self, comm: Any, module: torch.nn.Module) -> None:
        self.comm = comm
        params = {id(p) for p in module.parameters()}
        state = [t for t in module.state_dict(keep_vars=True).values() if id(t) not in params]
        self.floats = [t for t in state if t.is_floating_point()]
        self.ints = [t for t in state if not t.is_floating_point()]
        nf = sum(t.numel() for t in self.floats)
        ni = sum(t.numel() for t in self.ints)
        self._fsend, self._frecv = np.zeros(nf + 1), np.zeros(nf + 1)
        self._isend, self._irecv = np.zeros(ni, np.int64), np.zeros(ni, np.int64)

    @property
    def nbytes(self) -> int:
        """Bytes each rank sends per step (0 for a model without buffers)."""
        return (self._fsend.nbytes if self.floats else 0) + self._isend.nbytes

    def requests(self, weight: float) -> list[MPI.Request]:
        """Start the step's reductions of this rank's buffers, weighted by ``weight``."""
        reqs = []
        if self.floats:
            pos = 0
            for t in self.floats:
                n = t.numel()
                self._fsend[pos:pos + n] = t.detach().reshape(-1).double().numpy() * weight
                pos += n
            self._fsend[-1] = weight
            reqs.append(self.comm.Iallreduce(self._fsend, self._frecv, op=MPI.SUM))
        if self.ints:
            self._isend[:] = np.concatenate([t.detach().reshape(-1).numpy() for t in self.ints])
            reqs.append(self.comm.Iallreduce(self._isend, self._irecv, op=MPI.MAX))
        return reqs

    def apply(self) -> None:
        """Put the averages in place (after the requests completed); nothing if no rank
        trained this step."""
        with torch.no_grad():
            total = self._frecv[-1] if self.floats else 0.0
            if total > 0:
                pos = 0
                for t in self.floats:
                    n = t.numel()
                    t.copy_(torch.from_numpy(self._frecv[pos:pos + n] / total).view_as(t))
                    pos += n
            pos = 0
            for t in self.ints:
                n = t.numel()
                t.copy_(torch.from_numpy(self._irecv[pos:pos + n]).view_as(t))
                pos += n


# Tags of the star exchange, one per direction: messages between two ranks with one tag
# arrive in the order they were sent, so bucket k is the k-th of each. Small, as MPI
# promises tags up to 32767 only; Stannis sends no other point-to-point message.
UP_TAG = 11
DOWN_TAG = 12


class WeightedAllreduce:
    """Replace every gradient by the mean of all ranks' gradients weighted by batch size.

    Each rank's gradient is the mean over its own batch; weighting by the batch
    size b_i and dividing by sum(b_i) gives the gradient of the mean loss over
    the union of all batches, whatever the split (Horovod and DDP average
    equally, which is wrong once batches differ). The gradients are copied into
    one flat buffer whose slices (buckets) are summed over the ranks on the buffer
    API, so nothing is pickled. The weight itself rides in the last slot of the last
    bucket, so the total costs no extra message. Every bucket's messages are
    non-blocking and waited for with the transport's back-off, because a blocking
    call busy-polls and would steal the core of the rank still computing on an
    oversubscribed machine.

    A rank whose batch is empty passes ``weight=0`` (its gradients may be
    ``None``) and still takes part in every collective.

    Overlap (:meth:`arm`, then backward, then :meth:`reduce`): the flat buffer holds the
    parameters last layer first, the order in which backward produces their gradients,
    and a hook on each parameter copies its gradient in as soon as it is accumulated.
    On the star's leaves each bucket whose gradients are all in goes up at once, while
    backward still computes the earlier layers (as DDP and Horovod overlap theirs), in
    bucket order, so that bucket k is still the k-th message of its tag. Why: on a slow
    link the gradients' way up took as long as the sums' way down (about 50 ms each for
    LeNet's 248 KB at 100 Mbit/s on the testbed), and the biggest layers are the last.

    ``exchange`` picks the route of the sums:

    - ``"allreduce"``: MPI's own ``Iallreduce`` (ring or recursive doubling), best when
      every rank's link is as fast as every other's;
    - ``"host"``: through rank ``root`` (Stannis's host), a star: every other rank sends
      its buckets to the root, which adds them and sends the sums back. Each CSD's link
      carries its gradients once each way and nothing else, in two hops. Measured on
      the testbed (a 1000 Mbit/s host, four 100 Mbit/s CSDs at an eighth of a core;
      LeNet's 248 KB): 24 ms against 68 ms for ``Iallreduce``, whose rounds cross the
      slow links several times and wait each time for a CSD's next CPU slice. The root
      holds ``size - 1`` receive buffers of one bucket.
    """

    def __init__(self, comm: MPI.Comm, params: Iterable[torch.nn.Parameter],
                 bucket_bytes: int = BUCKET_BYTES, exchange: str = "host", root: int = 0) -> None:
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {', '.join(EXCHANGES)}, got {exchange!r}")
        self.comm = comm
        self.exchange, self.root = exchange, root
        # Last layer first: the order backward produces gradients in (see Overlap).
        self.params = [p for p in params if p.requires_grad][::-1]
        if not self.params:
            raise ValueError("WeightedAllreduce needs at least one parameter that requires grad")
        dtypes = {p.dtype for p in self.params}
        if dtypes != {torch.float32}:
            got = sorted(map(str, dtypes))
            raise ValueError(f"WeightedAllreduce expects float32 parameters, got {got}; "
                             "convert the model with .float()")
        if bucket_bytes < 4:
            raise ValueError(f"bucket_bytes must be at least 4, got {bucket_bytes}")
        self.offsets: list[int] = []
        total = 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        # One extra float32 slot carries the weight (exact for integers < 2**24).
        self.flat = torch.zeros(total + 1, dtype=torch.float32)
        self._buf = self.flat.numpy()
        per_bucket = max(1, bucket_bytes // 4)
        self.buckets = [(s, min(s + per_bucket, total + 1))
                        for s in range(0, total + 1, per_bucket)]
        # Which buckets each parameter's slice touches (the weight slot is the last bucket's).
        self._touches = [range(off // per_bucket, (off + max(p.numel(), 1) - 1) // per_bucket + 1)
                         for p, off in zip(self.params, self.offsets, strict=True)]
        # How many parameters each bucket waits for before it can go up.
        self._needs = [sum(k in touched for touched in self._touches) for k in range(len(self.buckets))]
        # A leaf of the star: the rank that sends its buckets up during backward (Overlap).
        self._leaf = exchange == "host" and comm.Get_size() > 1 and comm.Get_rank() != root
        self._armed: float | None = None  # the weight of the backward in flight, if armed
        self._copied: list[bool] = []
        self._missing: list[int] = []
        self._next = 0  # the first bucket not yet sent up
        self._early: list[MPI.Request] = []
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self._on_grad(i))
        self.bytes_sent = 0
        self.calls = 0
        self.wait_s = 0.0
        self._down: Any = None  # the star's buffers, made on first use (see _through_root)
        self._parts: Any = None

    @property
    def payload_bytes(self) -> int:
        """Bytes one rank contributes per ``reduce``: every gradient plus the weight slot."""
        return int(self._buf.nbytes)

    def arm(self, weight: float) -> None:
        """Start the overlap for the next backward, of a batch of ``weight`` samples.

        Until :meth:`reduce` (which must follow, with the same weight), each gradient is
        copied into the buffer as backward accumulates it, and on a leaf of the star
        each complete bucket is sent up at once. Without ``arm`` the hooks do nothing,
        so a backward that is not a step's (a benchmark, a test) sends nothing.
        """
        if weight <= 0:
            raise ValueError(f"arm a backward of a non-empty batch, got weight {weight}")
        self._disarm()
        self._armed = float(weight)
        self._copied = [False] * len(self.params)
        self._missing = list(self._needs)
        self.flat[-1] = float(weight)

    def _on_grad(self, i: int) -> None:
        if self._armed is None or self._copied[i]:
            return
        p, off = self.params[i], self.offsets[i]
        if p.grad is None:
            return
        torch.mul(p.grad.reshape(-1), self._armed, out=self.flat[off:off + p.numel()])
        self._copied[i] = True
        for k in self._touches[i]:
            self._missing[k] -= 1
        if self._leaf:
            while self._next < len(self.buckets) and self._missing[self._next] == 0:
                self._early += self._send_up(self._next)
                self._next += 1

    def _send_up(self, k: int) -> list[MPI.Request]:
        """A leaf's bucket ``k``: its gradients up to the root, and the receive of its sums."""
        start, stop = self.buckets[k]
        self.bytes_sent += (stop - start) * 4
        self.calls += 1
        return [self.comm.Isend([self._buf[start:stop], MPI.FLOAT], dest=self.root, tag=UP_TAG),
                self.comm.Irecv([self._down_buffer()[start:stop], MPI.FLOAT], source=self.root, tag=DOWN_TAG)]

    def _disarm(self) -> None:
        self._armed = None
        self._next = 0
        self._early = []

    def reduce(self, weight: float, alongside: Sequence[MPI.Request] = ()) -> float:
        """Average gradients across ranks weighted by ``weight`` and return the total weight.

        If every rank passed 0 the gradients become zero, so an optimizer step
        changes nothing (apart from momentum and weight decay). ``alongside``
        are other non-blocking requests (the trainer's step figures) completed
        in the same wait: one synchronisation per step instead of two, which on
        an oversubscribed machine saves a round of waking every rank.

        Raises:
            mpi4py.MPI.Exception: a peer failed (under ULFM); the local gradients
                are untouched, so the caller may shrink and call again.
        """
        if weight < 0:
            raise ValueError(f"weight must be >= 0 (a batch size), got {weight}")
        if self._armed is not None and self._armed != weight:
            if self._next:
                raise RuntimeError(f"reduce({weight}) after a backward armed with weight {self._armed} "
                                   f"that has sent buckets already")
            self._disarm()  # armed, but no backward ran (the batch could not be read)
        flat = self.flat
        copied = self._copied if self._armed is not None else [False] * len(self.params)
        for i, (p, off) in enumerate(zip(self.params, self.offsets, strict=True)):
            n = p.numel()
            if copied[i]:
                continue
            if p.grad is None or weight == 0:
                flat[off:off + n].zero_()
            else:
                torch.mul(p.grad.reshape(-1), float(weight), out=flat[off:off + n])
        flat[-1] = float(weight)
        if self.exchange == "host" and self.comm.Get_size() > 1:
            try:
                self._through_root(alongside)
            finally:
                self._disarm()
        else:
            self._disarm()
            requests = []
            for start, stop in self.buckets:
                view = self._buf[start:stop]
                requests.append(self.comm.Iallreduce(MPI.IN_PLACE, [view, MPI.FLOAT], op=MPI.SUM))
                self.bytes_sent += view.nbytes
                self.calls += 1
            self._wait([*alongside, *requests])
        total = float(self._buf[-1])
        if total > 0:
            flat[:-1].div_(total)
        for p, off in zip(self.params, self.offsets, strict=True):
            n = p.numel()
            src = flat[off:off + n].view_as(p)
            if p.grad is None:
                p.grad = src.clone()
            else:
                p.grad.copy_(src)
        return total

    def _through_root(self, alongside: Sequence[MPI.Request]) -> None:
        """The star: buckets up to the root, summed there, and the sums back down.

        The root takes the buckets one at a time (its receive buffers hold one bucket
        per other rank), the others post everything at once. Sums go back in the send
        buffer's own bucket on the root, and into a buffer of their own elsewhere (a
        send's buffer may not be written while the send is pending).
        """
        comm, root = self.comm, self.root
        others = [r for r in range(comm.Get_size()) if r != root]
        if comm.Get_rank() != root:
            requests = [*alongside, *self._early]  # the buckets sent during backward, if armed
            for k in range(self._next, len(self.buckets)):  # (0 unless armed)
                requests += self._send_up(k)
            self._wait(requests)
            self._buf[:] = self._down_buffer()
            return
        width = max(stop - start for start, stop in self.buckets)
        parts = self._root_buffer(len(others), width)
        sends: list[MPI.Request] = []
        for start, stop in self.buckets:
            n = stop - start
            self._wait([comm.Irecv([parts[i, :n], MPI.FLOAT], source=r, tag=UP_TAG)
                        for i, r in enumerate(others)])
            view = self._buf[start:stop]
            view += parts[:, :n].sum(axis=0)
            sends += [comm.Isend([view, MPI.FLOAT], dest=r, tag=DOWN_TAG) for r in others]
            self.bytes_sent += n * 4 * len(others)
            self.calls += 1
        self._wait([*alongside, *sends])

    def _down_buffer(self) -> Any:
        if self._down is None:
            self._down = np.empty_like(self._buf)
        return self._down

    def _root_buffer(self, rows: int, width: int) -> Any:
        parts = self._parts
        if parts is None or parts.shape != (rows, width):  # (fewer rows once a CSD is dropped)
            self._parts = parts = np.empty((rows, width), dtype=np.float32)
        return parts

    def _wait(self, requests: list[MPI.Request]) -> None:
        start = time.perf_counter()
        try:
            for request in requests:
                while not request.Test():
                    pause(time.perf_counter() - start)
        finally:
            self.wait_s += time.perf_counter() - start

    def reset_counters(self) -> None:
        """Zero the byte, call and wait counters (the log reports them per step)."""
        self.bytes_sent = 0
        self.calls = 0
        self.wait_s = 0.0

