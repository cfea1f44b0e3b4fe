"""``ft.agreed_phase``: every survivor gets the same verdict on a phase, under real ULFM.

A phase whose collective failed on one rank only (the root, after the others left it),
or in which a rank was killed, must end in an error on every survivor, so that all of
them recover together; a phase that completed everywhere ends in None everywhere.
"""

from __future__ import annotations

import pytest

from mpipipe.core.launch import run_mpi

SCRIPT = """
import os, signal
import numpy as np
from mpi4py import MPI
from mpipipe.core import ft
comm = MPI.COMM_WORLD.Dup()
comm.Set_errhandler(MPI.ERRORS_RETURN)
me = comm.rank

def bcast():
    comm.Bcast(np.zeros(4), root=0)

def root_fails_after_the_others_left():
    bcast()
    if me == 0:
        raise MPI.Exception(MPI.ERR_OTHER)

def a_rank_dies():
    if me == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    bcast()

for name, work in (("clean", bcast), ("root", root_fails_after_the_others_left),
                   ("killed", a_rank_dies)):
    verdict = ft.agreed_phase(comm, work)
    print(name, me, "ok" if verdict is None else "error", flush=True)
    if verdict is not None:
        comm = ft.shrink(comm)
        comm.Barrier()
        print(name, me, "shrunk to", comm.size, flush=True)
"""


@pytest.mark.timeout(150)
def test_every_survivor_gets_the_same_verdict(tmp_path):
    script = tmp_path / "phase.py"
    script.write_text(SCRIPT)
    result = run_mpi(3, [str(script)], ulfm=True, timeout=120)
    lines = set(result.stdout.splitlines())
    why = result.stdout + result.stderr[-3000:]
    for r in range(3):
        assert f"clean {r} ok" in lines, why
        assert f"root {r} error" in lines and f"root {r} shrunk to 3" in lines, why
    for r in range(2):
        assert f"killed {r} error" in lines and f"killed {r} shrunk to 2" in lines, why
