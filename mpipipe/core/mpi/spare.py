"""Spare ranks: in the MPI world, not in the job, idle until it ends.

Why: ResPipe's overhead is judged against the plain pipeline, and a resilient
job has more ranks (its backups). Run with fewer ranks, the plain job would
also differ in the number of processes sharing the machine's cores and in the
size of the world the MPI runtime (ULFM's failure detector) watches, and that
difference would be counted as the cost of resilience. Spares (``"spare K"``
in ``[plan]``, after every working rank) give the plain job the same world
size: they take part in no route, no replica and no collective of the job,
and sleep until the working ranks finish.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

__all__ = ["set_aside", "POLL_S"]

#: How often a spare looks whether the job has ended (it sleeps in between).
POLL_S = 0.05


@contextmanager
def set_aside(run: Any) -> Iterator[Any]:
    """Yield the working ranks' Run (over a communicator without the spares), or None on a spare.

    Collective over the world. A spare waits inside, taking no core, until
    every working rank has left the block (or, under ULFM, one of them died:
    the job is over then as well), and gets None. A working rank gets ``run``
    with the spares left out of its communicator, size and plan; ranks keep
    their numbers because spares are the last ranks (`mpipipe.pipeline.plan.pipeline_plan` checks).
    Without spares in the plan this yields ``run`` itself and costs nothing.
    """
    spares = run.plan.ranks_of("spare")
    if not spares:
        yield run
        return
    from mpi4py import MPI

    end = run.comm.Dup()
    end.Set_errhandler(MPI.ERRORS_RETURN)
    spare = run.rank in spares
    workers = run.comm.Split(MPI.UNDEFINED if spare else 0, run.rank)
    if spare:
        _idle_until_end(end, MPI)
        yield None
        return
    try:
        yield replace(run, comm=workers, size=workers.Get_size(), plan=run.plan.without_spares())
    finally:
        try:
            end.Ibarrier().Wait()  # releases the spares
        except MPI.Exception:
            pass  # a rank died (ULFM): the spares saw it and left


def _idle_until_end(end: Any, MPI: Any) -> None:
    from mpipipe.core.mpi import watchdog

    request = end.Ibarrier()
    try:
        while not request.Test():
            watchdog.beat()  # idle by design, not stuck
            time.sleep(POLL_S)
    except MPI.Exception:
        # A working rank died (ULFM). Leave without MPI_Finalize, whose world-wide
        # agreement could wait for the dead rank (as ResPipe's ranks do).
        from mpipipe.core.mpi.stop import flush_and_exit

        flush_and_exit(0)
