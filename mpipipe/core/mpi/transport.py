"""Tensor point-to-point messages on mpi4py buffers, with tags, deadlines and byte counters."""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np
import torch
from mpi4py import MPI

from mpipipe.core.mpi import watchdog

# Message kinds (3 bits of the tag). EVAL carries forward-only evaluation traffic so that
# it can never be matched by a training receive of the same step number.
ACT, GRAD, LABEL, REPLICA, SHADOW, CTRL, EVAL = range(7)
KIND_NAMES = {ACT: "ACT", GRAD: "GRAD", LABEL: "LABEL", REPLICA: "REPLICA",
              SHADOW: "SHADOW", CTRL: "CTRL", EVAL: "EVAL"}

# Tag layout, high to low bits: generation (5) | kind (3) | step (12) | micro (10) = 30 bits,
# below the 2**31 - 1 tag bound of Open MPI (the MPI standard only promises 32767, which
# is checked at construction).
GEN_BITS, KIND_BITS, STEP_BITS, MICRO_BITS = 5, 3, 12, 10
TAG_BITS = GEN_BITS + KIND_BITS + STEP_BITS + MICRO_BITS

# Back-off of a waiting rank, in three phases: poll Test for SPIN_S (a message already on
# its way costs nothing), then poll and sched_yield() until YIELD_S (another runnable
# process on this core gets it, yet the wake-up is immediate), then sleep a tenth of the
# time waited so far, at most MAX_SLEEP_S, so that a long wait costs almost no CPU on an
# oversubscribed machine.
SPIN_S = 50e-6
YIELD_S = 2e-3
FIRST_SLEEP_S = 50e-6
MAX_SLEEP_S = 250e-6


HOOK_EVERY_S = 0.01  # how often a long wait calls the wait hook
_wait_hook: Callable[[], None] | None = None


def set_wait_hook(hook: Callable[[], None] | None) -> None:
    """Call ``hook()`` every HOOK_EVERY_S while any receive or flush waits; an exception it
    raises ends the wait (the receive is cancelled). Why: ResPipe's clean stop reaches a
    rank blocked on a peer that stopped (mpipipe.core.mpi.stop) long before that peer's deadline."""
    global _wait_hook
    _wait_hook = hook


def _hook(waited: float, due: float) -> float:
    """Run the wait hook if ``waited`` passed ``due``; returns the next due time."""
    if _wait_hook is None or waited < due:
        return due
    _wait_hook()
    return waited + HOOK_EVERY_S


def pause(waited: float) -> None:
    """One back-off step of a rank that has waited ``waited`` seconds (see SPIN_S)."""
    if waited <= SPIN_S:
        return
    if waited <= YIELD_S:
        os.sched_yield()
        return
    time.sleep(min(MAX_SLEEP_S, max(FIRST_SLEEP_S, waited / 10)))

_FAILED_CLASSES = {MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED}

_MPI_TYPES = {
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
    torch.int64: MPI.INT64_T,
    torch.int32: MPI.INT32_T,
    torch.uint8: MPI.UINT8_T,
    torch.float16: MPI.UINT16_T,   # moved as raw 16-bit words
    torch.bfloat16: MPI.UINT16_T,
}


class Late(TimeoutError):
    """A receive passed its deadline: the sender is delayed (or gone without ULFM)."""

    def __init__(self, source: int, waited_s: float, kind: int = -1, step: int = -1,
                 micro: int = -1) -> None:
        self.source, self.waited_s = source, waited_s
        self.kind, self.step, self.micro = kind, step, micro
        what = KIND_NAMES.get(kind, "message")
        super().__init__(f"{what} from rank {source} (step {step}, micro {micro}) "
                         f"is late: waited {waited_s:.3f} s")


class PeerFailed(RuntimeError):
    """A peer died (ULFM MPIX_ERR_PROC_FAILED) or the communicator was revoked."""

    def __init__(self, peer: int, error_class: int | None = None) -> None:
        self.peer, self.error_class = peer, error_class
        how = "revoked the communicator" if error_class == MPI.ERR_REVOKED else "failed"
        super().__init__(f"rank {peer} {how} (MPI error class {error_class})")


def make_tag(generation: int, kind: int, step: int, micro: int) -> int:
    """Pack (generation, kind, step, micro) into one MPI tag; fields wrap modulo their width.

    Why a tag and not a header: MPI matches on tags before any byte is copied, so a
    message of another generation or step is simply never received (a demoted rank that
    wakes up cannot inject stale data) and no header costs a copy.
    """
    if not 0 <= kind < (1 << KIND_BITS):
        raise ValueError(f"message kind {kind} is out of range 0..{(1 << KIND_BITS) - 1}")
    tag = generation % (1 << GEN_BITS)
    tag = (tag << KIND_BITS) | kind
    tag = (tag << STEP_BITS) | (step % (1 << STEP_BITS))
    return (tag << MICRO_BITS) | (micro % (1 << MICRO_BITS))


def split_tag(tag: int) -> tuple[int, int, int, int]:
    """Inverse of make_tag: (generation mod 32, kind, step mod 4096, micro mod 1024)."""
    micro = tag & ((1 << MICRO_BITS) - 1)
    tag >>= MICRO_BITS
    step = tag & ((1 << STEP_BITS) - 1)
    tag >>= STEP_BITS
    kind = tag & ((1 << KIND_BITS) - 1)
    return tag >> KIND_BITS, kind, step, micro


def _buffer(tensor: torch.Tensor) -> list:
    """The tensor's own memory as an mpi4py buffer spec (no copy)."""
    try:
        mpi_type = _MPI_TYPES[tensor.dtype]
    except KeyError:
        raise TypeError(f"cannot send tensors of dtype {tensor.dtype}; "
                        f"supported: {sorted(str(d) for d in _MPI_TYPES)}") from None
    if tensor.device.type != "cpu":
        raise TypeError(f"transport moves CPU tensors only, got one on {tensor.device}")
    if tensor.dtype in (torch.float16, torch.bfloat16):
        array = tensor.detach().view(torch.int16).numpy()
    else:
        array = tensor.detach().numpy()
    return [array, mpi_type]


def _error_class(exc: MPI.Exception) -> int:
    return exc.Get_error_class()


class Transport:
    """Non-blocking tensor sends and deadline-bounded receives on one communicator.

    One Transport per (communicator, generation). Sends are Isend on the tensor memory
    and are completed by flush() (or opportunistically while waiting); receives are
    Irecv into a preallocated tensor, waited on with back-off and an optional deadline.
    """

    def __init__(self, comm: MPI.Comm, generation: int = 0) -> None:
        tag_ub = comm.Get_attr(MPI.TAG_UB)
        if tag_ub is not None and tag_ub < (1 << TAG_BITS) - 1:
            raise RuntimeError(f"this MPI allows tags up to {tag_ub}; the transport needs "
                               f"{(1 << TAG_BITS) - 1} (use Open MPI or MPICH)")
        self.comm = comm
        self.rank = comm.Get_rank()
        self.generation = generation
        self.bytes_sent: defaultdict[int, int] = defaultdict(int)
        self.bytes_recv: defaultdict[int, int] = defaultdict(int)
        self.wait_s = 0.0
        self._pending: list[tuple[MPI.Request, torch.Tensor, int]] = []
        # Requests given up on (peer late or dead): their tensors stay referenced so that
        # MPI never reads or writes freed memory.
        self._abandoned: list[tuple[MPI.Request, torch.Tensor, int]] = []

    # -- counters ----------------------------------------------------------------------
    def reset_counters(self) -> None:
        """Zero the byte counters and wait time (called once per step by the trainer)."""
        self.bytes_sent.clear()
        self.bytes_recv.clear()
        self.wait_s = 0.0

    @property
    def total_sent(self) -> int:
        return sum(self.bytes_sent.values())

    @property
    def total_recv(self) -> int:
        return sum(self.bytes_recv.values())

    def tag(self, kind: int, step: int, micro: int = 0) -> int:
        return make_tag(self.generation, kind, step, micro)

    # -- sending -----------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dest: int, *, kind: int, step: int,
             micro: int = 0) -> None:
        """Start sending `tensor` to `dest`; the tensor is kept alive until flush().

        Raises:
            PeerFailed: `dest` is known dead (ULFM) or the communicator was revoked.
        """
        payload = tensor.detach()
        if not payload.is_contiguous():
            payload = payload.contiguous()
        try:
            request = self.comm.Isend(_buffer(payload), dest, self.tag(kind, step, micro))
        except MPI.Exception as exc:
            raise self._failure(exc, dest) from exc
        self.bytes_sent[dest] += payload.numel() * payload.element_size()
        self._pending.append((request, payload, dest))

    def flush(self, deadline: float | None = None) -> None:
        """Wait until every started send has completed (its buffer may then be reused).

        Raises:
            Late: a receiver did not take its message within `deadline` seconds.
            PeerFailed: a receiver died.
        """
        start = time.perf_counter()
        due = HOOK_EVERY_S
        if self._pending:
            watchdog.waiting((self._pending[0][2], "", 0, 0))
        try:
            while self._pending:
                self._complete_sends()
                if not self._pending:
                    break
                waited = time.perf_counter() - start
                if deadline is not None and waited > deadline:
                    dest = self._pending[0][2]
                    raise Late(dest, waited)
                due = _hook(waited, due)
                pause(waited)
        finally:
            watchdog.waiting("")
            self.wait_s += time.perf_counter() - start

    def pending(self) -> int:
        """Number of sends started and not yet known complete."""
        return len(self._pending)

    def _complete_sends(self) -> None:
        still = []
        for request, payload, dest in self._pending:
            try:
                done = request.Test()
            except MPI.Exception as exc:
                self._abandoned.append((request, payload, dest))
                self._abandoned.extend(p for p in self._pending if p[0] is not request)
                self._pending = []
                raise self._failure(exc, dest) from exc
            if not done:
                still.append((request, payload, dest))
        self._pending = still

    def discard(self) -> None:
        """Give up on every pending send (after a failure, before rebuilding the route).

        The requests are not waited for, because their peer may be dead; their buffers
        stay referenced so that MPI never touches freed memory.
        """
        self._abandoned.extend(self._pending)
        self._pending = []

    # -- receiving ---------------------------------------------------------------------
    def recv(self, out: torch.Tensor, source: int, *, kind: int, step: int, micro: int = 0,
             deadline: float | None = None) -> torch.Tensor:
        """Receive into the preallocated contiguous `out` and return it.

        Raises:
            Late: nothing matching arrived within `deadline` seconds (the receive is
                cancelled, so `out` is not written afterwards).
            PeerFailed: `source` died (ULFM) or the communicator was revoked.
            ValueError: the message is larger than `out`.
        """
        if not out.is_contiguous():
            raise ValueError("recv needs a contiguous output tensor")
        tag = self.tag(kind, step, micro)
        status = MPI.Status()
        try:
            request = self.comm.Irecv(_buffer(out), source, tag)
        except MPI.Exception as exc:
            raise self._failure(exc, source) from exc
        self._wait(request, status, out, source, kind, step, micro, deadline)
        nbytes = status.Get_count(MPI.BYTE)
        self.bytes_recv[source] += nbytes
        return out

    def recv_rows(self, row_shape: Sequence[int], dtype: torch.dtype, source: int, *,
                  kind: int, step: int, micro: int = 0,
                  deadline: float | None = None) -> torch.Tensor:
        """Receive a tensor of shape (n, *row_shape) whose row count n the sender chose.

        Why: micro-batches of one mini-batch differ in size by one row when the batch
        does not divide evenly, and middle stages never see the batch; a matched probe
        reads the size from the message envelope, so no size header is sent.
        """
        tag = self.tag(kind, step, micro)
        status = MPI.Status()
        start = time.perf_counter()
        message = None
        due = HOOK_EVERY_S
        watchdog.waiting((source, KIND_NAMES.get(kind, str(kind)), step, micro))
        try:
            while True:
                message = self.comm.Improbe(source, tag, status)
                if message is not None:
                    break
                waited = time.perf_counter() - start
                if deadline is not None and waited > deadline:
                    raise Late(source, waited, kind, step, micro)
                self._complete_sends()
                due = _hook(waited, due)
                pause(waited)
        except MPI.Exception as exc:
            raise self._failure(exc, source) from exc
        finally:
            watchdog.waiting("")
            self.wait_s += time.perf_counter() - start
        row_elems = math.prod(row_shape)
        item = torch.empty((), dtype=dtype).element_size()
        nbytes = status.Get_count(MPI.BYTE)
        if row_elems == 0 or nbytes % (row_elems * item):
            raise ValueError(f"message of {nbytes} bytes from rank {source} is not a whole "
                             f"number of rows of shape {tuple(row_shape)} and {dtype}")
        out = torch.empty((nbytes // (row_elems * item), *row_shape), dtype=dtype)
        try:
            request = message.Irecv(_buffer(out))
        except MPI.Exception as exc:
            raise self._failure(exc, source) from exc
        self._wait(request, MPI.Status(), out, source, kind, step, micro, None)
        self.bytes_recv[source] += nbytes
        return out

    def _wait(self, request: MPI.Request, status: MPI.Status, out: torch.Tensor, source: int,
              kind: int, step: int, micro: int, deadline: float | None) -> None:
        start = time.perf_counter()
        due = HOOK_EVERY_S
        watchdog.waiting((source, KIND_NAMES.get(kind, str(kind)), step, micro))
        try:
            while True:
                if request.Test(status):
                    watchdog.beat()
                    return
                waited = time.perf_counter() - start
                if deadline is not None and waited > deadline:
                    self._cancel(request, out, source)
                    raise Late(source, waited, kind, step, micro)
                self._complete_sends()
                try:
                    due = _hook(waited, due)
                except BaseException:
                    self._cancel(request, out, source)
                    raise
                pause(waited)
        except MPI.Exception as exc:
            raise self._failure(exc, source) from exc
        finally:
            watchdog.waiting("")
            self.wait_s += time.perf_counter() - start

    def _cancel(self, request: MPI.Request, out: torch.Tensor, source: int) -> None:
        try:
            request.Cancel()
            if request.Test():
                return
        except MPI.Exception:
            pass
        self._abandoned.append((request, out, source))

    # -- helpers -----------------------------------------------------------------------
    @staticmethod
    def _failure(exc: MPI.Exception, peer: int) -> Exception:
        error_class = _error_class(exc)
        if error_class in _FAILED_CLASSES:
            return PeerFailed(peer, error_class)
        return exc


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a numpy array (no copy); used by tests and benchmarks."""
    return _buffer(tensor)[0]
