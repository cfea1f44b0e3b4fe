"""Throughput between ranks, measured with the project's own transport.

Why: a testbed link is shaped to a configured rate, and the figures ResPipe and Stannis
report in time are only as good as that rate. This measures what the training code
itself gets (``Transport.send``/``recv`` on tensors, Open MPI's TCP), not what a raw
socket gets, so ``measured / configured`` is the ``link_rate_ratio`` of the cluster bench.

    mpirun ... -n 2 python -m mpipipe linkprobe [--mbytes 24] [--pairs 0:1,1:0]

prints one JSON line per pair: source and destination ranks and hosts, bytes, seconds
and Mbit/s (payload bytes, 10^6 bits per Mbit).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

from mpipipe.core.mpi.linkrate import measure

__all__ = ["measure", "add_parser", "main"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """The ``linkprobe`` command of ``python -m mpipipe`` (run it under mpirun, on two ranks or more)."""
    doc = __doc__ or ""
    parser = subparsers.add_parser("linkprobe", help="throughput between ranks, by the project's transport "
                                                     "(under mpirun)",
                                   description=doc.splitlines()[0])
    parser.add_argument("--mbytes", type=float, default=24.0, help="MB sent per pair (default 24)")
    parser.add_argument("--pairs", default="0:1,1:0", help="SRC:DST rank pairs, comma-separated (default 0:1,1:0)")
    parser.set_defaults(func=main)
    return parser


def main(args: argparse.Namespace) -> int:
    """Measure each pair in turn; rank 0 prints the JSON lines."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    try:
        pairs = [tuple(int(r) for r in p.split(":")) for p in args.pairs.split(",")]
        if any(len(p) != 2 or p[0] == p[1] or not all(0 <= r < comm.size for r in p) for p in pairs):
            raise ValueError
    except ValueError:
        if comm.rank == 0:
            print(f"python -m mpipipe linkprobe: error: --pairs {args.pairs!r} must be SRC:DST pairs of "
                  f"two different ranks below {comm.size}, e.g. 0:1,1:0", file=sys.stderr)
        return 2
    hosts = comm.allgather(socket.gethostname())
    total = int(args.mbytes * 1e6)
    for source, dest in pairs:
        sent, seconds = measure(comm, source, dest, total)
        if comm.rank == 0:
            print(json.dumps({"source": source, "dest": dest, "source_host": hosts[source],
                              "dest_host": hosts[dest], "bytes": sent, "seconds": round(seconds, 4),
                              "mbit_s": round(sent * 8 / seconds / 1e6, 2)}), flush=True)
    return 0
