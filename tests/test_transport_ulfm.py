"""Under ULFM a dead peer makes the transport raise PeerFailed instead of hanging."""

from __future__ import annotations

import pytest

from mpipipe.tools.launch import run_mpi

# make test-long (.ci/run runs it): the transport under ULFM with a killed peer and a timed-out job.
pytestmark = pytest.mark.long

SCRIPT = """
import os, signal, torch
from mpi4py import MPI
from mpipipe.core.mpi.transport import ACT, PeerFailed, Transport

comm = MPI.COMM_WORLD
t = Transport(comm)
comm.Barrier()
if comm.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
checks = [
    ("recv", lambda: t.recv(torch.empty(4), 1, kind=ACT, step=0, deadline=60)),
    ("recv_rows", lambda: t.recv_rows((4,), torch.float32, 1, kind=ACT, step=1, deadline=60)),
    ("send", lambda: (t.send(torch.ones(1 << 18), 1, kind=ACT, step=2), t.flush(deadline=60))),
]
for name, call in checks:
    try:
        call()
        print(name, "no error", flush=True)
    except PeerFailed as e:
        print(name, "PeerFailed", e.peer, flush=True)
"""


@pytest.mark.timeout(120)
def test_dead_peer_raises_peer_failed(tmp_path):
    script = tmp_path / "kill.py"
    script.write_text(SCRIPT)
    result = run_mpi(2, [str(script)], ulfm=True, timeout=100)
    lines = result.stdout.splitlines()
    for name in ("recv", "recv_rows", "send"):
        assert f"{name} PeerFailed 1" in lines, result.stdout + result.stderr[-2000:]


@pytest.mark.timeout(120)
def test_a_job_past_its_timeout_leaves_no_rank_behind(tmp_path):
    """Ranks are not in mpirun's process group: killing mpirun alone would orphan them."""
    import os
    import subprocess
    import time
    from pathlib import Path

    script = tmp_path / "hang.py"
    script.write_text("from mpi4py import MPI\nimport time\nMPI.COMM_WORLD.Barrier()\n"
                      "print('up', flush=True)\ntime.sleep(600)\n")

    def ranks() -> list[int]:
        found = []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and str(script).encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
        return [p for p in found if p != os.getpid()]

    with pytest.raises(subprocess.TimeoutExpired):
        run_mpi(2, [str(script)], timeout=15)
    deadline = time.monotonic() + 10
    while ranks() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ranks() == []
