"""The only door to MPI in a Stannis run: counts every byte a rank hands to MPI.

Privacy in Stannis means that no private sample or label leaves its CSD; only
gradients and small control records do. Rather than trusting each call site,
the trainer wraps its communicator in :class:`AuditedComm`, which forwards the
few operations Stannis uses, adds up the bytes each sends and receives, and
refuses every other communicating method, so a new code path cannot send
anything unseen. The per-step counts go to the HDF5 log (``bytes_sent``), and
a test checks that a CSD's count equals its gradient plus control bytes.

A door only counts what goes through it. So the audit also reads MPI's own
counters (:mod:`stannis.mpicount`, under every communicator of the process) and
predicts them from the operations it forwarded: ``mpi_bytes`` is what MPI
counted in a step, ``unaudited_bytes`` what it counted beyond the prediction,
which a raw ``MPI.COMM_WORLD.Send`` of a private sample makes positive.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
from mpi4py import MPI

from . import mpicount

# Methods that do not move application data: queries, fault-tolerance plumbing.
_PASS_THROUGH = frozenset({
    "Get_rank", "Get_size", "Get_group", "Get_attr", "Set_errhandler", "Revoke", "Shrink",
    "Agree", "Is_revoked", "Free", "Get_failed", "Ack_failed", "Failure_ack",
    "Failure_get_acked", "rank", "size", "group", "Barrier",
})


def _nbytes(buf: Any) -> int:
    """Bytes of an mpi4py buffer spec: an array, or [array, datatype]."""
    if isinstance(buf, list | tuple):
        buf = buf[0]
    return int(np.asarray(buf).nbytes) if not isinstance(buf, memoryview) else buf.nbytes


class AuditedComm:
    """A communicator that counts payload bytes per rank and allows only known operations."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.sent = 0
        self.recv = 0
        # MPI's own count at the last take(), and what the forwarded operations add
        # to it (None: the window holds an operation whose MPI count is not known).
        self.mpi = mpicount.counters()
        self._mpi_mark = self.mpi.read() if self.mpi else 0
        self._expected: int | None = 0
        self.last_mpi = (-1, -1)  # (mpi_bytes, unaudited_bytes) of the last window

    def __getattr__(self, name: str) -> Any:
        if name in _PASS_THROUGH:
            return getattr(self.comm, name)
        raise AttributeError(f"AuditedComm does not allow {name}: every operation that moves "
                             "data must be counted; add it to stannis/audit.py")

    def take(self) -> tuple[int, int]:
        """Bytes sent and received since the last call (one step's figures).

        Also closes the window of MPI's own count: ``last_mpi`` becomes (bytes MPI
        counted, bytes it counted that no forwarded operation explains), -1 where
        MPI gives no counters or the window held a pickled operation.
        """
        out = (self.sent, self.recv)
        self.sent = self.recv = 0
        if self.mpi is not None:
            now = self.mpi.read()
            counted, self._mpi_mark = now - self._mpi_mark, now
            unaudited = counted - self._expected if self._expected is not None else -1
            self.last_mpi = (counted, unaudited)
        self._expected = 0
        return out

    def _expect(self, nbytes: int, *, root: int | None = None) -> None:
        """What MPI's monitoring adds for one forwarded collective (see mpicount)."""
        if self._expected is not None and (root is None or self.comm.Get_rank() == root):
            self._expected += nbytes * (self.comm.Get_size() - 1)

    # -- buffer API ---------------------------------------------------------------------
    def Iallreduce(self, sendbuf: Any, recvbuf: Any, op: MPI.Op = MPI.SUM) -> MPI.Request:
        n = _nbytes(recvbuf if sendbuf is MPI.IN_PLACE else sendbuf)
        self.sent += n
        self.recv += n
        self._expect(n)
        return self.comm.Iallreduce(sendbuf, recvbuf, op=op)

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> MPI.Request:
        n = _nbytes(buf)
        self.sent += n
        if self._expected is not None:
            self._expected += n  # the PML counts an application's message once, at its sender
        return self.comm.Isend(buf, dest=dest, tag=tag)

    def Irecv(self, buf: Any, source: int, tag: int = 0) -> MPI.Request:
        self.recv += _nbytes(buf)
        return self.comm.Irecv(buf, source=source, tag=tag)

    def _count_gather(self, sendbuf: Any, recvbuf: Any, root: int) -> None:
        n = _nbytes(sendbuf)
        self.sent += n
        if self.comm.Get_rank() == root:
            self.recv += _nbytes(recvbuf) - n
        self._expect(n, root=root)

    def Gather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        self._count_gather(sendbuf, recvbuf, root)
        self.comm.Gather(sendbuf, recvbuf, root=root)

    def Igather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> MPI.Request:
        self._count_gather(sendbuf, recvbuf, root)
        return self.comm.Igather(sendbuf, recvbuf, root=root)

    def Bcast(self, buf: Any, root: int = 0) -> None:
        n = _nbytes(buf)
        if self.comm.Get_rank() == root:
            self.sent += n
        else:
            self.recv += n
        self._expect(n, root=root)
        self.comm.Bcast(buf, root=root)

    # -- pickled objects (start-up only: error strings, sizes) ----------------------------
    def allgather(self, obj: Any) -> list[Any]:
        n = len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        out = self.comm.allgather(obj)
        self._expected = None  # mpi4py's own framing: MPI's count is not predicted
        self.sent += n
        self.recv += sum(len(pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)) for o in out) - n
        return out
