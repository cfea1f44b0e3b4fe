"""Batch-size-weighted gradient allreduce over flattened, bucketed buffers, and the
broadcast that puts every rank on the host's parameters and optimizer state."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from mpipipe.core.statecodec import pack_state, unpack_state
from mpipipe.core.transport import pause

from .config import EXCHANGES


def broadcast_state(comm: Any, params: Sequence[torch.nn.Parameter],
                    optimizer: torch.optim.Optimizer, optim: str, momentum: float,
                    steps_taken: int, root: int = 0) -> None:
    """Give every rank ``root``'s parameters and optimizer state, in one buffer ``Bcast``.

    Why the optimizer state too: after a CSD is dropped the survivors restart from
    the host's state; with its momentum (or Adam moments) they continue the same
    trajectory instead of restarting the average from zero. ``steps_taken`` = 0
    means no optimizer step yet: the state is then empty everywhere.
    """
    flat = pack_state(params, optimizer, optim, momentum).contiguous()
    comm.Bcast([flat.numpy(), MPI.FLOAT], root=root)
    unpack_state(flat, params, optimizer, optim, momentum, steps_taken)


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
                 bucket_bytes: int = 4 << 20, exchange: str = "host", root: int = 0) -> None:
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {', '.join(EXCHANGES)}, got {exchange!r}")
        self.comm = comm
        self.exchange, self.root = exchange, root
        self.params = [p for p in params if p.requires_grad]
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
        self.bytes_sent = 0
        self.calls = 0
        self.wait_s = 0.0
        self._down: Any = None  # the star's buffers, made on first use (see _through_root)
        self._parts: Any = None

    @property
    def payload_bytes(self) -> int:
        """Bytes one rank contributes per ``reduce``: every gradient plus the weight slot."""
        return int(self._buf.nbytes)

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
        flat = self.flat
        for p, off in zip(self.params, self.offsets, strict=True):
            n = p.numel()
            if p.grad is None or weight == 0:
                flat[off:off + n].zero_()
            else:
                torch.mul(p.grad.reshape(-1), float(weight), out=flat[off:off + n])
        flat[-1] = float(weight)
        if self.exchange == "host" and self.comm.Get_size() > 1:
            self._through_root(alongside)
        else:
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
            down = self._down_buffer()
            requests = [*alongside]
            for start, stop in self.buckets:
                requests.append(comm.Isend([self._buf[start:stop], MPI.FLOAT], dest=root, tag=UP_TAG))
                requests.append(comm.Irecv([down[start:stop], MPI.FLOAT], source=root, tag=DOWN_TAG))
                self.bytes_sent += (stop - start) * 4
                self.calls += 1
            self._wait(requests)
            self._buf[:] = down
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

