"""A link's rate as the training code gets it: the project's transport on tensors.

Why in the core: the link probe command (``python -m mpipipe linkprobe``) reports it, and
ResPipe's ``"auto"`` measures the link between its first two stages at start-up with the
same function, so the two agree.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["measure"]


def measure(comm: MPI.Comm, source: int, dest: int, total_bytes: int,
            message_bytes: int = 4 << 20) -> tuple[int, float]:
    """Bytes sent and seconds ``dest`` took to receive them from ``source`` (every rank calls
    this; ``total_bytes`` is rounded down to whole messages, at least one).

    The sender starts every message at once (as a pipeline stage does with its outgoing
    activations); the clock runs on the receiver from a barrier to the last byte. One
    message first, untimed, opens the TCP connection between the two.
    """
    import torch

    from mpipipe.core.mpi.transport import ACT, Transport

    transport = Transport(comm)
    count = max(1, total_bytes // message_bytes)
    buf = torch.zeros(message_bytes // 4, dtype=torch.float32)

    def exchange(steps: range) -> None:
        if comm.rank == source:
            for step in steps:
                transport.send(buf, dest, kind=ACT, step=step)
            transport.flush()
        elif comm.rank == dest:
            for step in steps:
                transport.recv(buf, source, kind=ACT, step=step)

    exchange(range(1))
    comm.Barrier()
    t0 = time.perf_counter()
    exchange(range(1, count + 1))
    seconds = time.perf_counter() - t0
    seconds = comm.bcast(seconds, root=dest)
    comm.Barrier()
    return count * (message_bytes // 4) * 4, seconds
