"""The only door to MPI in a Stannis run: counts every byte a rank hands to MPI.

Privacy in Stannis means that no private sample or label leaves its CSD; only
gradients and small control records do. Rather than trusting each call site,
the trainer wraps its communicator in :class:`AuditedComm`, which forwards the
few operations Stannis uses, adds up the bytes each sends and receives, and
refuses every other communicating method, so a new code path cannot send
anything unseen. The per-step counts go to the HDF5 log (``bytes_sent``), and
a test checks that a CSD's count equals its gradient plus control bytes.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
from mpi4py import MPI

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

    def __getattr__(self, name: str) -> Any:
        if name in _PASS_THROUGH:
            return getattr(self.comm, name)
        raise AttributeError(f"AuditedComm does not allow {name}: every operation that moves "
                             "data must be counted; add it to stannis/audit.py")

    def take(self) -> tuple[int, int]:
        """Bytes sent and received since the last call (one step's figures)."""
        out = (self.sent, self.recv)
        self.sent = self.recv = 0
        return out

    # -- buffer API ---------------------------------------------------------------------
    def Iallreduce(self, sendbuf: Any, recvbuf: Any, op: MPI.Op = MPI.SUM) -> MPI.Request:
        n = _nbytes(recvbuf if sendbuf is MPI.IN_PLACE else sendbuf)
        self.sent += n
        self.recv += n
        return self.comm.Iallreduce(sendbuf, recvbuf, op=op)

    def _count_gather(self, sendbuf: Any, recvbuf: Any, root: int) -> None:
        n = _nbytes(sendbuf)
        self.sent += n
        if self.comm.Get_rank() == root:
            self.recv += _nbytes(recvbuf) - n

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
        self.comm.Bcast(buf, root=root)

    # -- pickled objects (start-up only: error strings, sizes) ----------------------------
    def allgather(self, obj: Any) -> list[Any]:
        n = len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        out = self.comm.allgather(obj)
        self.sent += n
        self.recv += sum(len(pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)) for o in out) - n
        return out
