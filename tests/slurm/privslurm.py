"""A private Slurm cluster for the tests: munged, slurmctld and slurmd(s), every file in one
state directory, every daemon stopped by its process id.

Why one module: ``tests/slurm/run.sh`` (``make test-slurm``: one slurmd for this machine)
and ``tests/cluster/test_slurm_testbed.py`` (one slurmd inside each testbed node) start and
stop the same daemons; only the node lines of ``slurm.conf`` and where each slurmd runs
differ. Nothing here touches the machine's own ``/etc/slurm`` or munged.

On a testbed, slurmctld runs on the host and listens on the bridge address; each node's
slurmd is started through ``jobs/testbed/rsh-agent`` (the node's cgroup, then ``nsenter
--net``, ``unshare --uts``, hostname ``mpt-NODE``), so every job step it starts inherits
the node's network, hostname and CPU budget. The Slurm node names are the nodes'
hostnames (``mpt-NODE``).

Command line (for run.sh)::

    python tests/slurm/privslurm.py start STATE [--testbed] [--runs DIR]
    python tests/slurm/privslurm.py stop STATE

``start`` prints ``SLURM_CONF=STATE/slurm.conf`` when every node is idle; ``stop`` cancels
the cluster's jobs, then stops slurmd(s), slurmctld and munged (pids in ``STATE/pids``).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = Path(__file__).with_name("slurm.conf.in")
sys.path.insert(0, str(ROOT))  # run as a script from run.sh: mpipipe from this tree

from mpipipe.tools import emulator as _emulator  # noqa: E402

__all__ = ["Cluster", "SlurmError", "first_job_id", "start", "stop", "main"]


class SlurmError(RuntimeError):
    """The private cluster did not come up (the message quotes the daemons' last log lines)."""


@dataclass
class Cluster:
    """A started private cluster: its state directory, config and node names."""

    state: Path
    nodes: tuple[str, ...]

    @property
    def conf(self) -> Path:
        return self.state / "slurm.conf"

    def env(self) -> dict[str, str]:
        """This process's environment with SLURM_CONF naming the private cluster."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def logs(self, lines: int = 40) -> str:
        """The last lines of every daemon log (for a failure message)."""
        out = []
        for f in sorted((self.state / "log").glob("*")):
            tail = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"----- {f} (last {lines} lines)\n" + "\n".join(tail))
        return "\n".join(out)


def first_job_id(runs: Path) -> int:
    """One past every job id already used under ``runs/`` (``runs/ID/`` or ``runs/NAME-ID.out``).

    Why: the job scripts name run directories by job id, and a fresh cluster counts from 1
    again; without this a new job would write into an old run's directory.
    """
    top = 0
    for f in runs.glob("*") if runs.is_dir() else ():
        m = re.fullmatch(r"(\d+)", f.name) or re.fullmatch(r".*-(\d+)\.out", f.name)
        if m:
            top = max(top, int(m.group(1)))
    return top + 1


def _free_port(avoid: int = 0) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != avoid:
            return port


def _render(state: Path, *, ctld_addr: str, nodes: Sequence[tuple[str, str, int]], first_id: int) -> None:
    ctld_port = _free_port()
    lines = [f"NodeName={name} NodeAddr={addr} CPUs={cpus} State=UNKNOWN" for name, addr, cpus in nodes]
    lines.append(f"PartitionName=test Nodes={','.join(n for n, _, _ in nodes)} Default=YES MaxTime=60 State=UP")
    text = TEMPLATE.read_text()
    for key, value in {"CTLD_HOST": socket.gethostname().split(".")[0], "CTLD_ADDR": ctld_addr,
                       "CTLD_PORT": ctld_port, "SLURMD_PORT": _free_port(ctld_port),
                       "FIRST_JOB_ID": first_id, "STATE": state, "NODES": "\n".join(lines)}.items():
        text = text.replace(f"@{key}@", str(value))
    (state / "slurm.conf").write_text(text)


def _spawn(state: Path, name: str, argv: Sequence[str]) -> int:
    """Start one daemon in the foreground mode of its own (so its pid is the daemon's),
    detached from this process group, output to ``log/NAME.out``; record its pid."""
    with open(state / "log" / f"{name}.out", "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    with open(state / "pids", "a") as f:
        f.write(f"{proc.pid} {name}\n")
    return proc.pid


def start(state: Path, *, on_testbed: bool = False, first_id: int = 1, timeout: float = 60) -> Cluster:
    """Start munged, slurmctld and the slurmd(s) with everything in ``state`` (made if missing).

    ``on_testbed``: one slurmd per node of the testbed that is up, started inside its node;
    else one slurmd for this machine, reached at 127.0.0.1. Returns once every node is
    idle. On any failure the daemons started so far are stopped before the error.

    Raises:
        SlurmError: a tool is missing, no testbed is up, or the nodes are not idle in time.
    """
    for tool in ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode != 0:
            raise SlurmError(f"{tool} is not installed: run tests/slurm/run.sh once (it installs slurm-wlm "
                             f"and munge with apt-get) or apt-get install slurm-wlm munge")
    if on_testbed:
        tb = _emulator.current()
        if tb is None:
            raise SlurmError("no testbed is up: run 'python -m mpipipe testbed up FILE' first")
        nodes = [(n.host, str(tb.address(n)), n.slots) for n in tb.nodes]
        ctld_addr = str(tb.bridge_address)
    else:
        # nproc obeys OMP_NUM_THREADS (the Makefile sets it to 1): ask the kernel instead.
        nodes = [(socket.gethostname().split(".")[0], "127.0.0.1", len(os.sched_getaffinity(0)))]
        ctld_addr = "127.0.0.1"
    for sub in ("munge", "ctld", "log", *(f"spool-{n}" for n, _, _ in nodes)):
        (state / sub).mkdir(parents=True, exist_ok=True)
    # munged wants its socket directory searchable by all; the key itself is 0400.
    state.chmod(0o755)
    (state / "munge").chmod(0o755)
    _render(state, ctld_addr=ctld_addr, nodes=nodes, first_id=first_id)
    cluster = Cluster(state, tuple(n for n, _, _ in nodes))
    conf = str(cluster.conf)
    try:
        key, sock = state / "munge" / "munge.key", state / "munge" / "munge.socket"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}", "--force"], check=True,
                       capture_output=True, timeout=30)
        key.chmod(0o400)
        _spawn(state, "munged", ["munged", "-F", "--force", f"--key-file={key}", f"--socket={sock}",
                                 f"--pid-file={state}/munge/munged.pid", f"--log-file={state}/log/munged.log",
                                 f"--seed-file={state}/munge/munged.seed"])
        _wait(lambda: sock.is_socket(), 10, "munged did not make its socket", cluster)
        _spawn(state, "slurmctld", ["slurmctld", "-D", "-i", "-f", conf])
        for name in cluster.nodes:
            cmd = ["slurmd", "-D", "-N", name, "-f", conf]
            if on_testbed:  # exec: the agent's shell becomes slurmd, so the pid recorded is slurmd's
                cmd = _emulator.node_command(tb, name, ["exec", *cmd])
            _spawn(state, f"slurmd-{name}", cmd)

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True,
                                 env=cluster.env(), timeout=10).stdout.split("\n")
            states = dict(line.split() for line in out if line.strip())
            return all(states.get(n, "").startswith("idle") for n in cluster.nodes)

        _wait(idle, timeout, f"nodes {', '.join(cluster.nodes)} not idle after {timeout:g} s", cluster)
    except BaseException:
        stop(state)
        raise
    return cluster


def _wait(ready, timeout: float, what: str, cluster: Cluster) -> None:
    give_up = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > give_up:
            raise SlurmError(f"{what}; daemon logs:\n{cluster.logs()}")
        time.sleep(0.5)


def _alive(pid: int, state: Path) -> bool:
    """Whether ``pid`` is still one of this cluster's daemons (not a zombie, not a reused pid:
    every daemon's command line names the state directory)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z" and str(state) in cmdline


def stop(state: Path, *, grace: float = 10) -> list[int]:
    """Cancel the cluster's jobs (while slurmd is alive to signal them), then stop its
    daemons in reverse start order: SIGTERM, and SIGKILL after ``grace`` seconds.
    Returns the pids stopped. Idempotent: a daemon already gone is skipped."""
    pids_file = state / "pids"
    if not pids_file.exists():
        return []
    pids = [int(line.split()[0]) for line in pids_file.read_text().splitlines() if line.strip()]
    env = dict(os.environ, SLURM_CONF=str(state / "slurm.conf"))
    if any(_alive(p, state) for p in pids):
        try:
            jobs = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=env,
                                  timeout=10).stdout.split()
            if jobs:
                subprocess.run(["scancel", *jobs], capture_output=True, env=env, timeout=10)
                give_up = time.monotonic() + 15
                while time.monotonic() < give_up and subprocess.run(
                        ["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=env,
                        timeout=10).stdout.strip():
                    time.sleep(0.5)
        except (OSError, subprocess.TimeoutExpired):
            pass  # slurmctld gone or hung: the daemons are stopped below all the same
    stopped = []
    for pid in reversed(pids):
        if not _alive(pid, state):
            continue
        os.kill(pid, signal.SIGTERM)
        give_up = time.monotonic() + grace
        while _alive(pid, state) and time.monotonic() < give_up:
            _reap(pid)
            time.sleep(0.1)
        if _alive(pid, state):
            print(f"privslurm: daemon {pid} ignored SIGTERM for {grace:g} s; sending SIGKILL", file=sys.stderr)
            os.kill(pid, signal.SIGKILL)
        _reap(pid)
        stopped.append(pid)
    return stopped


def _reap(pid: int) -> None:
    """Collect a daemon this process started (else it stays a zombie until we exit)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="privslurm.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("start", help="start the private cluster in STATE and wait for idle nodes")
    p.add_argument("state", type=Path)
    p.add_argument("--testbed", action="store_true", help="one slurmd inside each node of the testbed that is up")
    p.add_argument("--runs", type=Path, metavar="DIR",
                   help="number jobs past every job id used under DIR (the job scripts' runs/)")
    p.add_argument("--timeout", type=float, default=60)
    p = sub.add_parser("stop", help="cancel the jobs and stop the daemons recorded in STATE/pids")
    p.add_argument("state", type=Path)
    args = parser.parse_args(argv)
    state = args.state.resolve()
    if args.command == "stop":
        pids = stop(state)
        if pids:
            print(f"privslurm: stopped daemons {' '.join(map(str, pids))}")
        return 0
    try:
        cluster = start(state, on_testbed=args.testbed, timeout=args.timeout,
                        first_id=first_job_id(args.runs) if args.runs else 1)
    except (SlurmError, subprocess.CalledProcessError) as e:
        print(f"privslurm: error: {e}", file=sys.stderr)
        return 1
    print(f"SLURM_CONF={cluster.conf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
