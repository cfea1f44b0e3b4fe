"""``ft.agreed_phase``: every survivor gets the same verdict on a phase, under real ULFM.

A phase whose collective failed on one rank only (the root, after the others left it),
in which one rank raised something else, or in which a rank was killed, must end in an
error on every survivor, so that all of
them recover together; a phase that completed everywhere ends in None everywhere.
"""

from __future__ import annotations

import pytest

from jobs import ulfm_script_lines

SCRIPT = """
import os, signal
import numpy as np
from mpi4py import MPI
from mpipipe.core.mpi import ft
comm = MPI.COMM_WORLD.Dup()
comm.Set_errhandler(MPI.ERRORS_RETURN)
me = comm.rank

def bcast():
    comm.Bcast(np.zeros(4), root=0)

def root_fails_after_the_others_left():
    bcast()
    if me == 0:
        raise MPI.Exception(MPI.ERR_OTHER)

def another_error_on_one_rank():
    bcast()
    if me == 1:
        raise KeyError("a clean stop, say")

def a_rank_dies():
    if me == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    bcast()

for name, work in (("clean", bcast), ("root", root_fails_after_the_others_left),
                   ("other", another_error_on_one_rank), ("killed", a_rank_dies)):
    try:
        verdict = ft.agreed_phase(comm, work)
        print(name, me, "ok" if verdict is None else type(verdict).__name__, flush=True)
    except KeyError:  # raised on its own rank, after the agreement
        print(name, me, "raised", flush=True)
        verdict = "raised"
    if verdict is not None:
        comm = ft.shrink(comm)
        comm.Barrier()
        print(name, me, "shrunk to", comm.size, flush=True)
"""


@pytest.mark.timeout(150)
def test_every_survivor_gets_the_same_verdict(tmp_path):
    lines, why = ulfm_script_lines(tmp_path, SCRIPT, 3, timeout=120)
    for r in range(3):
        assert f"clean {r} ok" in lines, why
        assert f"root {r} shrunk to 3" in lines and f"other {r} shrunk to 3" in lines, why
    # an error on every survivor: its own MPI error (the root's; another's if the revoke
    # caught it still in the broadcast) or, where its own call completed, PhaseFailed
    assert "root 0 Exception" in lines, why
    for r in (1, 2):
        assert f"root {r} Exception" in lines or f"root {r} PhaseFailed" in lines, why
    # a non-MPI error is raised on its rank after it said "no": no one waits in Agree for it
    assert "other 1 raised" in lines and {"other 0 PhaseFailed", "other 2 PhaseFailed"} <= lines, why
    for r in range(2):
        assert f"killed {r} shrunk to 2" in lines, why
        assert f"killed {r} Exception" in lines or f"killed {r} PhaseFailed" in lines, why
