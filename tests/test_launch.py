"""mpipipe.tools.launch: every job gets a temporary directory of its own for Open MPI's
session files, gone once the job is over (a killed job's stale rendezvous files made a
later mpirun with the same pid fail to start)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from mpipipe.tools.launch import kill_job, run_mpi, start_mpi

WHERE = "import os; from mpi4py import MPI; print('tmpdir', os.environ['TMPDIR'], os.listdir(os.environ['TMPDIR']))"


def _tmpdir(out: str) -> Path:
    return Path(next(line for line in out.splitlines() if line.startswith("tmpdir")).split()[1])


@pytest.mark.timeout(120)
def test_each_job_keeps_its_session_files_in_a_directory_of_its_own() -> None:
    first = run_mpi(1, ["-c", WHERE], timeout=90)
    second = run_mpi(1, ["-c", WHERE], timeout=90)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    a, b = _tmpdir(first.stdout), _tmpdir(second.stdout)
    assert a != b and a.parent == b.parent
    assert "ompi." in first.stdout  # Open MPI's session directory was in it
    assert not a.exists() and not b.exists()  # removed once each job was over


@pytest.mark.timeout(120)
def test_a_killed_jobs_directory_goes_with_it() -> None:
    job = start_mpi(1, ["-c", WHERE + "; import time; time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        where = _tmpdir(job.stdout.readline())
        assert where.is_dir()
    finally:  # also when the test fails or times out: no 600 s sleeper is left behind
        kill_job(job)
    assert not where.exists()
    assert os.environ.get("TMPDIR") != str(where)  # the caller's own environment is untouched
