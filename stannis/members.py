"""The ranks a Stannis job trains with now, and the communicator that joins them.

Every part of a rank's trainer (the step, the tuner, the step figures, the recovery)
talks over the same communicator and indexes the same member list. A recovery
replaces both at once (:meth:`Members.adopt`); the parts read them here at each use,
so that none of them keeps a communicator the shrink left behind.
"""

from __future__ import annotations

from mpi4py import MPI

from .audit import AuditedComm


class Members:
    """The current communicator (audited) and the world ranks in it, in its rank order."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = AuditedComm(comm)
        self.ranks = list(range(comm.Get_size()))  # world ranks of the current communicator
        self.world_group = comm.Get_group()

    def position(self, world_rank: int) -> int:
        """Where ``world_rank`` stands in the current communicator."""
        return self.ranks.index(world_rank)

    def world_ranks(self, new: MPI.Comm) -> list[int]:
        """The world ranks of the processes in ``new`` (a shrink of the current communicator)."""
        return list(new.Get_group().Translate_ranks(list(range(new.Get_size())),
                                                    self.world_group))

    def adopt(self, new: MPI.Comm, survivors: list[int]) -> None:
        """Train on ``new`` from now on; its audited byte counts go on from the old one's."""
        old = self.comm
        self.comm = AuditedComm(new)
        self.comm.sent, self.comm.recv = old.sent, old.recv
        self.ranks = survivors
