"""An emulated cluster on one Linux machine, built from real kernel parts.

Why: on one host every byte between ranks moves through shared memory for free, so the
trade-offs ResPipe and Stannis exist for (resilience against link time, compute in
storage against moving data) cannot be seen in time. A testbed gives each node its own
network link at a fixed rate and its own CPU budget, and the project's launchers run
Open MPI across the nodes as if they were a small cluster.

A node is
  - a network namespace ``mpt-NODE`` whose ``eth0`` is one end of a veth pair; the other
    end (``mpt-NODE`` on the host) is a port of the bridge ``mpt-br``, which holds the
    host's address on the testbed subnet (the first address; nodes get the next ones);
  - a rate on that link, both directions: a ``tc tbf`` on the node's ``eth0`` (what the
    node sends) and one on the host end (what it receives). ``netem`` is not available
    on the machines this was built on, so there is no delay or loss, only rate;
  - a CPU budget: a cgroup ``mpt-NODE`` with a CPU quota (``cpu.cfs_quota_us`` under
    cgroup v1, ``cpu.max`` under v2) of a short period (:func:`period_us`);
  - cores of its own: the same cgroup's ``cpuset.cpus`` (:meth:`Testbed.cores`), so that
    a node runs on the same core(s) in every run, as a real node does on its own, and
    does not take turns with whichever nodes the scheduler put beside it this time;
  - its CPU time counted: ``usage_usec`` of the cgroup's ``cpu.stat`` under v2, its
    ``cpuacct.usage`` under v1 (a group ``mpt-NODE`` in the ``cpuacct`` hierarchy when that
    is mounted apart from ``cpu``), read by :func:`cpu_seconds`;
  - a hostname ``mpt-NODE`` in a UTS namespace of each process started on it (Open MPI
    needs distinct hostnames, or its first exchange across nodes hangs), and a line in
    ``/etc/hosts`` so that ``mpirun`` on the host finds it.

Processes enter a node through ``jobs/testbed/rsh-agent`` (Open MPI's rsh agent, and
``python -m mpipipe testbed exec``): join the cgroups first, then ``nsenter --net`` (not
``ip netns exec``, which remounts ``/sys`` and hides the cgroup tree), ``unshare --uts``,
set the hostname, exec.

Every name made here starts with ``mpt-`` (hosts lines end with ``# mpt-testbed``), and
:func:`down` removes exactly those, whatever state a crashed run left. One testbed is up
at a time; what is up is described by the state directory ``/run/mpt-testbed``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import ipaddress
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mpipipe.core.mpi.testbed_nodes import PREFIX, STATE

__all__ = ["PREFIX", "AGENT", "TestbedError", "Node", "Testbed", "load", "check_supported", "up", "down",
           "current", "running", "leftovers", "cpu_seconds", "mpirun_args", "slurm_mpirun_args", "node_here",
           "node_command", "add_parser", "main"]

HOSTS_TAG = "# mpt-testbed"
BRIDGE = PREFIX + "br"
LOCK = Path("/run") / (PREFIX + "testbed.lock")
HOSTS = Path("/etc/hosts")
CGROUP_ROOT = Path("/sys/fs/cgroup")
AGENT = Path(__file__).resolve().parents[2] / "jobs" / "testbed" / "rsh-agent"
TOOLS = ("ip", "tc", "nsenter", "unshare")
# The CFS period of a node's quota. Short, so that a node at a fraction of a core runs in
# short slices rather than stalling for most of a long period once its share is used (at
# 100 ms, a node at 0.28 core stalled up to 72 ms at a time, which showed in every step
# time). The kernel wants a quota of at least 1 ms, so nodes under 0.1 core get the long
# period.
PERIOD_US = 10_000
LONG_PERIOD_US = 100_000
MIN_QUOTA_US = 1_000


def period_us(cpu: float) -> int:
    """The CFS period of a node of ``cpu`` cores: :data:`PERIOD_US`, or :data:`LONG_PERIOD_US`
    where the short one would give a quota under the kernel's 1 ms."""
    return PERIOD_US if cpu * PERIOD_US >= MIN_QUOTA_US else LONG_PERIOD_US
# A node's name becomes the host end of its veth, "mpt-" + name: Linux allows 15 characters.
NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,10}$")
NODE_KEYS = {"cpu", "link_mbit", "slots", "cores"}


class TestbedError(ValueError):
    """A testbed file, or the machine, cannot give the testbed: the message says what and how to fix it."""

    __test__ = False  # not a pytest test class despite the name


@dataclass(frozen=True)
class Node:
    """One emulated node: its CPU share (cores, 0.125 = an eighth of one), link rate, MPI
    slots, and the machine's cores it runs on (empty: placed by :meth:`Testbed.cores`)."""

    name: str
    cpu: float
    link_mbit: float
    slots: int = 1
    cores: tuple[int, ...] = ()

    __test__ = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "cores", tuple(self.cores))  # a list from JSON compares equal

    @property
    def host(self) -> str:
        """Its hostname, network namespace, host-side veth and cgroup name: all ``mpt-NAME``."""
        return PREFIX + self.name


@dataclass(frozen=True)
class Testbed:
    """The nodes and the subnet of one testbed file; addresses are given out in file order."""

    nodes: tuple[Node, ...]
    subnet: ipaddress.IPv4Network

    __test__ = False

    @property
    def bridge_address(self) -> ipaddress.IPv4Address:
        """The host's own address on the testbed subnet (mpirun listens there)."""
        return self.subnet.network_address + 1

    def address(self, node: Node) -> ipaddress.IPv4Address:
        """The node's address: the bridge's plus the node's place in the file."""
        return self.subnet.network_address + 2 + self.nodes.index(node)

    def cores(self) -> dict[str, tuple[int, ...]]:
        """Every node's cores: the ones its file names, else the least loaded ones.

        Why pin at all: on a machine of few cores the scheduler moves nodes between
        cores, and two nodes that land on one core take turns for the length of a run.
        Which pairs do changes from run to run; pinned, the placement is the same in
        every run (the machine's own pace still drifts: docs/benchmarks.md). Placement: nodes in order of falling
        share (file order among equals), each on ``ceil(cpu)`` cores with the least
        share placed so far (lowest number among equals), after the nodes that name
        their cores. A core may end up with more share than it has: its nodes then take
        turns on it as CFS decides (``status`` shows the placement).

        Raises:
            TestbedError: a node built in code names cores this machine lacks (a file's
                are checked when it is read).
        """
        machine = os.cpu_count() or 1
        load = [0.0] * machine
        out: dict[str, tuple[int, ...]] = {}
        for n in self.nodes:
            if n.cores:
                out[n.name] = _cores(list(n.cores), n.cpu, machine, f"node {n.name}")
                for c in n.cores:
                    load[c] += n.cpu / len(n.cores)
        for n in sorted((n for n in self.nodes if not n.cores), key=lambda n: -n.cpu):
            k = min(machine, max(1, math.ceil(n.cpu - 1e-9)))
            chosen = tuple(sorted(sorted(range(machine), key=lambda c: (load[c], c))[:k]))
            for c in chosen:
                load[c] += n.cpu / k
            out[n.name] = chosen
        return out

    def node(self, name: str) -> Node:
        """The node called ``name`` (with or without the ``mpt-`` prefix)."""
        for n in self.nodes:
            if name in (n.name, n.host):
                return n
        raise TestbedError(f"no node {name!r} in the testbed; its nodes are {', '.join(n.name for n in self.nodes)}")

    def to_json(self) -> str:
        """The canonical form kept in the state directory (and compared by :func:`running`)."""
        return json.dumps({"subnet": str(self.subnet), "nodes": [asdict(n) for n in self.nodes]})

    @staticmethod
    def from_json(text: str) -> Testbed:
        data = json.loads(text)
        return Testbed(tuple(Node(**n) for n in data["nodes"]), ipaddress.IPv4Network(data["subnet"]))


# -- the testbed file -------------------------------------------------------------------------

def load(path: str | os.PathLike) -> Testbed:
    """Read and check a testbed file (TOML: ``subnet`` and ``[nodes.NAME]`` tables).

    Raises:
        TestbedError: one line naming the file, the key and what to write instead.
    """
    path = Path(path)
    where = str(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise TestbedError(f"cannot read testbed file {where}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise TestbedError(f"testbed file {where} is not valid TOML: {e}") from None
    unknown = set(data) - {"subnet", "nodes"}
    if unknown:
        raise TestbedError(f"{where}: unknown key {sorted(unknown)[0]!r}; a testbed file has 'subnet' "
                           f"and [nodes.NAME] tables")
    try:
        subnet = ipaddress.IPv4Network(data.get("subnet", "10.213.0.0/24"))
    except (ValueError, TypeError) as e:
        raise TestbedError(f"{where}: subnet {data.get('subnet')!r} is not an IPv4 network "
                           f"like '10.213.0.0/24' ({e})") from None
    if not subnet.is_private:
        raise TestbedError(f"{where}: subnet {subnet} is not a private network; use one in 10.0.0.0/8, "
                           f"172.16.0.0/12 or 192.168.0.0/16 so that testbed traffic stays private")
    table = data.get("nodes")
    if not isinstance(table, dict) or not table:
        raise TestbedError(f"{where}: no nodes; add at least one table like "
                           f"[nodes.a] with cpu = 0.5 and link_mbit = 100")
    cores = os.cpu_count() or 1
    nodes = []
    for name, spec in table.items():
        at = f"{where}: nodes.{name}"
        if not NAME_RE.match(name) or name == "br":
            raise TestbedError(f"{at}: a node name is 1 to 11 lowercase letters or digits starting with a "
                               f"letter (not 'br'), since it becomes the network name {PREFIX}NAME")
        if not isinstance(spec, dict):
            raise TestbedError(f"{at} must be a table with cpu and link_mbit")
        bad = set(spec) - NODE_KEYS
        if bad:
            raise TestbedError(f"{at}: unknown key {sorted(bad)[0]!r}; a node has {', '.join(sorted(NODE_KEYS))}")
        for key in ("cpu", "link_mbit"):
            if key not in spec:
                raise TestbedError(f"{at}: {key} is missing (cpu: cores, e.g. 0.125; link_mbit: Mbit/s, e.g. 100)")
            if isinstance(spec[key], bool) or not isinstance(spec[key], int | float) or spec[key] <= 0:
                raise TestbedError(f"{at}.{key} = {spec[key]!r}: must be a number above 0")
        if spec["cpu"] * LONG_PERIOD_US < MIN_QUOTA_US or spec["cpu"] > cores:
            raise TestbedError(f"{at}.cpu = {spec['cpu']}: must be between 0.01 and {cores} "
                               f"(the cores of this machine)")
        if not 0.1 <= spec["link_mbit"] <= 100_000:
            raise TestbedError(f"{at}.link_mbit = {spec['link_mbit']}: must be between 0.1 and 100000 Mbit/s")
        slots = spec.get("slots", 1)
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise TestbedError(f"{at}.slots = {slots!r}: must be a whole number of MPI ranks, at least 1")
        nodes.append(Node(name, float(spec["cpu"]), float(spec["link_mbit"]), slots,
                          _cores(spec.get("cores", []), spec["cpu"], cores, at)))
    if len(nodes) + 2 > subnet.num_addresses - 1:
        raise TestbedError(f"{where}: subnet {subnet} has too few addresses for {len(nodes)} nodes and the "
                           f"host; use a larger one such as /24")
    return Testbed(tuple(nodes), subnet)


def _cores(value: object, cpu: float, machine: int, at: str) -> tuple[int, ...]:
    """A node's ``cores`` list, checked: distinct cores of this machine, enough for its share."""
    cores = value if isinstance(value, list) else [None]
    if any(isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < machine for c in cores) \
            or len(set(cores)) != len(cores):
        raise TestbedError(f"{at}.cores = {value!r}: must be a list of distinct core numbers from 0 to "
                           f"{machine - 1} (this machine's), e.g. [0]; leave it out to let the testbed place "
                           f"the node")
    if cores and cpu > len(cores):
        raise TestbedError(f"{at}: cpu = {cpu} cannot run on {len(cores)} core(s) {cores}; "
                           f"name at least {math.ceil(cpu)} cores or lower cpu")
    return tuple(cores)


# -- the machine ------------------------------------------------------------------------------

def _cmd(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run one system command; a failure becomes a TestbedError quoting the command and its error."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True)
    except FileNotFoundError:
        raise TestbedError(f"{argv[0]} is not installed (apt-get install iproute2 util-linux)") from None
    if check and done.returncode != 0:
        why = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").splitlines()[0]
        raise TestbedError(f"'{shlex.join(argv)}' failed: {why}")
    return done


def check_supported() -> None:
    """Stop, with one line, where a testbed cannot be made: not root, or a tool missing.

    Why: without this a user would see a half-made testbed or, worse, a run silently on
    one host; the testbed never falls back to the single-host path.
    """
    if os.geteuid() != 0:
        raise TestbedError("the testbed needs root (it makes network namespaces, links, cgroups and "
                           "/etc/hosts lines); run it as root")
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise TestbedError(f"the testbed needs {', '.join(TOOLS)}; missing: {', '.join(missing)} "
                           f"(apt-get install iproute2 util-linux)")
    if _parent("cpu") is None:
        raise TestbedError(f"no cgroup CPU controller under {CGROUP_ROOT} (neither v1 cpu/ nor v2 with "
                           f"'cpu' in cgroup.subtree_control); the testbed cannot give nodes a CPU budget")
    if _parent("cpuset") is None:
        raise TestbedError(f"no cgroup cpuset controller under {CGROUP_ROOT} (neither v1 cpuset/ nor v2 with "
                           f"'cpuset' in cgroup.subtree_control); the testbed cannot give nodes cores of their "
                           f"own (under v2: echo +cpuset > {CGROUP_ROOT}/cgroup.subtree_control)")


# A file that only a mounted v1 hierarchy of each controller the testbed uses has.
_V1_FILE = {"cpu": "cpu.cfs_quota_us", "cpuset": "cpuset.cpus"}


def _parent(controller: str) -> Path | None:
    """Where node cgroups of ``controller`` ("cpu": the quota, "cpuset": the cores) go:
    its v1 hierarchy, or the v2 root if that delegates the controller."""
    v1 = CGROUP_ROOT / controller
    if (v1 / _V1_FILE[controller]).exists():
        return v1
    controllers = CGROUP_ROOT / "cgroup.subtree_control"
    if controllers.exists() and controller in controllers.read_text().split():
        return CGROUP_ROOT
    return None


def _groups() -> list[Path]:
    """Every testbed cgroup on this machine, in each hierarchy that can hold one."""
    parents = (CGROUP_ROOT / "cpu", CGROUP_ROOT / "cpuset", CGROUP_ROOT / "cpuacct", CGROUP_ROOT)
    return [g for p in parents if p.is_dir() for g in sorted(p.glob(PREFIX + "*")) if g.is_dir()]


def _accounting_group(cpu_group: Path) -> Path | None:
    """The cgroup of the cpuacct hierarchy a node needs beside its CPU group, or None.

    None where the CPU group counts its own CPU time: under v2 (``cpu.stat``'s
    ``usage_usec``) and under v1 with ``cpu,cpuacct`` mounted together.
    """
    v1 = CGROUP_ROOT / "cpuacct"
    if cpu_group.parent == CGROUP_ROOT or not (v1 / "cpuacct.usage").exists():
        return None
    if v1.resolve() == cpu_group.parent.resolve():
        return None
    return v1 / cpu_group.name


def _usage_s(node_host: str) -> float | None:
    """CPU seconds a node's processes have used since its cgroups were made, or None."""
    stat = CGROUP_ROOT / node_host / "cpu.stat"  # v2
    with contextlib.suppress(OSError, ValueError):
        for line in stat.read_text().splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e6
    for usage in (CGROUP_ROOT / "cpu" / node_host / "cpuacct.usage",  # v1, cpu,cpuacct together
                  CGROUP_ROOT / "cpuacct" / node_host / "cpuacct.usage"):  # v1, apart
        with contextlib.suppress(OSError, ValueError):
            return int(usage.read_text()) / 1e9
    return None


def cpu_seconds(tb: Testbed) -> dict[str, float] | None:
    """Each node's CPU seconds so far (user + system, from its cgroup), or None if unreadable.

    Why: a bench on the testbed wants the CPU a job used, apart from the wall time the
    quota stretched it to; read it before and after the job and take the difference.
    None when any node's counter cannot be read (a testbed made by a version that made
    no cpuacct group under v1): the caller says so rather than guessing.
    """
    found = {node.name: _usage_s(node.host) for node in tb.nodes}
    if any(v is None for v in found.values()):
        return None
    return {k: float(v) for k, v in found.items() if v is not None}


def _set_cores(group: Path, parent: Path, cores: Sequence[int]) -> None:
    if (parent / "cpuset.mems").exists():  # v1: a cpuset takes no task before it has memory nodes
        (group / "cpuset.mems").write_text((parent / "cpuset.mems").read_text().strip() or "0")
    (group / "cpuset.cpus").write_text(",".join(map(str, cores)))


def _set_cpu(group: Path, cpu: float) -> None:
    period = period_us(cpu)
    quota = round(cpu * period)
    if (group / "cpu.cfs_quota_us").exists():
        (group / "cpu.cfs_quota_us").write_text("-1")  # a quota above the new period is refused
        (group / "cpu.cfs_period_us").write_text(str(period))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
    else:
        (group / "cpu.max").write_text(f"{quota} {period}")


# A link's token bucket holds 1 ms of traffic, and at least two full Ethernet frames (tbf
# cuts a larger GSO packet into frames that fit). Why so small: whatever fits in the
# bucket crosses the link at once, not at its rate. With the 64 KiB bucket used before, a
# 32 KiB message crossed a 20 Mbit/s link in 0.05 ms instead of 13 ms, so every
# activation of the ResPipe jobs went unshaped: the link's cost was hidden.
BURST_S = 1e-3
FRAME_BYTES = 1514


def burst_bytes(mbit: float) -> int:
    """The token bucket of a link of ``mbit`` Mbit/s: :data:`BURST_S` of traffic, at least two frames."""
    return max(2 * FRAME_BYTES, int(mbit * 1e6 / 8 * BURST_S))


def _tbf(mbit: float) -> list[str]:
    return ["tbf", "rate", f"{mbit:g}mbit", "burst", str(burst_bytes(mbit)), "latency", "50ms"]


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """One up or down at a time on this machine."""
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def leftovers() -> list[str]:
    """Everything on this machine that carries the testbed prefix (what :func:`down` removes)."""
    found = []
    netns = _cmd("ip", "netns", "list", check=False).stdout.split()
    found += [f"netns {n}" for n in netns if n.startswith(PREFIX)]
    links = _cmd("ip", "-o", "link", "show", check=False).stdout.splitlines()
    for line in links:
        name = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
        if name.startswith(PREFIX):
            found.append(f"link {name}")
    found += [f"cgroup {g}" for g in _groups()]
    if HOSTS.exists():
        found += [f"hosts line {line!r}" for line in HOSTS.read_text().splitlines() if line.endswith(HOSTS_TAG)]
    if STATE.exists():
        found.append(f"state {STATE}")
    return found


def current() -> Testbed | None:
    """The testbed that is up now (from the state directory), or None."""
    try:
        return Testbed.from_json((STATE / "testbed.json").read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def up(tb: Testbed) -> None:
    """Make the testbed: bridge, nodes, rates, CPU budgets, hosts lines, hostfile.

    Raises:
        TestbedError: not supported here, something of a testbed is already up, the subnet
            is in use on this machine, or a command failed; whatever was made is removed.
    """
    check_supported()
    with _locked():
        left = leftovers()
        if left:
            raise TestbedError(f"a testbed is already up or was left behind ({left[0]}, ...); "
                               f"run 'python -m mpipipe testbed down' first")
        _check_subnet_free(tb.subnet)
        try:
            _up(tb)
        except BaseException:
            _down()
            raise


def _check_subnet_free(subnet: ipaddress.IPv4Network) -> None:
    for route in json.loads(_cmd("ip", "-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        dst = route.get("dst", "")
        if dst in ("", "default") or ":" in dst:
            continue
        try:
            net = ipaddress.IPv4Network(dst if "/" in dst else dst + "/32", strict=False)
        except ValueError:
            continue
        if net.overlaps(subnet) and not net.is_loopback:
            raise TestbedError(f"subnet {subnet} overlaps {net} already routed on this machine "
                               f"(dev {route.get('dev', '?')}); pick another subnet in the testbed file")


def _up(tb: Testbed) -> None:
    STATE.mkdir(parents=True)
    (STATE / "nodes").mkdir()
    plen = tb.subnet.prefixlen
    _cmd("ip", "link", "add", BRIDGE, "type", "bridge")
    _cmd("ip", "addr", "add", f"{tb.bridge_address}/{plen}", "dev", BRIDGE)
    _cmd("ip", "link", "set", BRIDGE, "up")
    parent, cpusets = _parent("cpu"), _parent("cpuset")
    assert parent is not None and cpusets is not None  # check_supported
    cores = tb.cores()
    hosts = []
    for node in tb.nodes:
        ns = node.host
        _cmd("ip", "netns", "add", ns)
        _cmd("ip", "link", "add", ns, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _cmd("ip", "link", "set", ns, "master", BRIDGE, "up")
        _cmd("ip", "-n", ns, "addr", "add", f"{tb.address(node)}/{plen}", "dev", "eth0")
        _cmd("ip", "-n", ns, "link", "set", "eth0", "up")
        _cmd("ip", "-n", ns, "link", "set", "lo", "up")
        _cmd("tc", "qdisc", "add", "dev", ns, "root", *_tbf(node.link_mbit))
        _cmd("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", *_tbf(node.link_mbit))
        group = parent / ns
        group.mkdir()
        _set_cpu(group, node.cpu)
        joins = [group / "cgroup.procs"]
        if cpusets != parent:  # v1: the cores are a group of their own, in the cpuset hierarchy
            group = cpusets / ns
            group.mkdir()
            joins.append(group / "cgroup.procs")
        _set_cores(group, cpusets, cores[node.name])
        accounting = _accounting_group(parent / ns)
        if accounting is not None:  # v1 with cpuacct apart from cpu: a group that counts the node's CPU
            accounting.mkdir(exist_ok=True)  # (exist_ok: a down that knew no cpuacct group left it)
            joins.append(accounting / "cgroup.procs")
        # What the rsh agent reads: the files it writes its pid to in order to join the node
        # (the CPU budget's first: node faults read that one).
        (STATE / "nodes" / ns).write_text("".join(f"{j}\n" for j in joins))
        hosts.append(f"{tb.address(node)} {ns} {HOSTS_TAG}")
    with open(HOSTS, "a") as f:  # appended in place: /etc/hosts may be a bind mount
        text = HOSTS.read_text()
        f.write(("" if not text or text.endswith("\n") else "\n") + "\n".join(hosts) + "\n")
    (STATE / "hostfile").write_text("".join(f"{n.host} slots={n.slots}\n" for n in tb.nodes))
    (STATE / "testbed.json").write_text(tb.to_json())


def down() -> list[str]:
    """Remove everything with the testbed prefix: kill the nodes' processes, then remove the
    cgroups, namespaces, links, hosts lines and state. Idempotent; also cleans what a crashed
    run left. Returns what it removed (empty when nothing was up).

    Raises:
        TestbedError: not root, or something could not be removed (named).
    """
    check_supported()
    with _locked():
        return _down()


def _down() -> list[str]:
    removed = leftovers()
    netns = [n for n in _cmd("ip", "netns", "list", check=False).stdout.split() if n.startswith(PREFIX)]
    groups = _groups()
    # Every process of a node: in its cgroup (joined first) or its namespace (entered second).
    give_up = time.monotonic() + 10
    while True:
        pids = set()
        for g in groups:
            with contextlib.suppress(OSError):
                pids |= {int(p) for p in (g / "cgroup.procs").read_text().split()}
        for ns in netns:
            pids |= {int(p) for p in _cmd("ip", "netns", "pids", ns, check=False).stdout.split()}
        pids.discard(os.getpid())
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > give_up:
            raise TestbedError(f"processes {sorted(pids)[:5]} of the testbed survive SIGKILL; remove "
                               f"them and run down again")
        time.sleep(0.05)
    for g in groups:
        for _ in range(100):  # a killed task leaves its cgroup shortly after it dies
            try:
                g.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.05)
        else:
            raise TestbedError(f"cannot remove cgroup {g}: it still holds tasks")
    for line in _cmd("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
        if name.startswith(PREFIX) and name != BRIDGE:
            _cmd("ip", "link", "del", name, check=False)  # also removes the peer inside the node
    for ns in netns:
        _cmd("ip", "netns", "del", ns)
    _cmd("ip", "link", "del", BRIDGE, check=False)
    if HOSTS.exists():
        text = HOSTS.read_text()
        kept = [line for line in text.splitlines() if not line.endswith(HOSTS_TAG)]
        if len(kept) != len(text.splitlines()):
            HOSTS.write_text("".join(line + "\n" for line in kept))  # in place, same inode
    shutil.rmtree(STATE, ignore_errors=True)
    left = leftovers()
    if left:
        raise TestbedError(f"down could not remove {left[0]}")
    return removed


@contextlib.contextmanager
def running(tb: Testbed) -> Iterator[Testbed]:
    """The testbed up for the duration of a ``with``: brought up and torn down here, or, when
    exactly this testbed is up already, used as it is and left up."""
    if current() == tb:
        yield tb
        return
    up(tb)
    try:
        yield tb
    finally:
        down()


# -- running things on it ---------------------------------------------------------------------

def mpirun_args(tb: Testbed) -> list[str]:
    """The mpirun options that run a job across the testbed's nodes (put before ``-n``).

    The hostfile lists the node names; the rsh agent starts Open MPI's daemon inside each
    node; MPI traffic (btl) and the daemons' own traffic (PRRTE's oob) go over the testbed
    subnet only; no tree spawn, so every daemon is started from the host. Ranks fill each
    node's slots in file order (``--map-by slot``); more ranks than slots is mpirun's own
    error, not oversubscription (``--oversubscribe`` would put every rank on the first
    node). ``--bind-to none``: every node sees the machine's cores, and Open MPI would
    bind each node's first rank to the same core; the cgroup is the node's CPU budget.
    """
    return ["--hostfile", str(STATE / "hostfile"), "--map-by", "slot", "--bind-to", "none",
            "--mca", "plm_rsh_agent", str(AGENT),
            "--prtemca", "plm_ssh_no_tree_spawn", "1", *_on_subnet(tb)]


def _on_subnet(tb: Testbed) -> list[str]:
    """The options that keep the daemons' traffic (PRRTE's oob) and MPI's (btl tcp) on the
    testbed subnet, off shared memory: what both ways of launching across nodes share."""
    subnet = str(tb.subnet)
    return ["--prtemca", "oob_tcp_if_include", subnet, "--mca", "btl", "tcp,self",
            "--mca", "btl_tcp_if_include", subnet]


def slurm_mpirun_args(tb: Testbed) -> list[str]:
    """The mpirun options for a job inside a Slurm allocation of the testbed's nodes (one
    slurmd per node, docs/testbed.md "Slurm on the testbed"); put before ``-n``.

    No hostfile and no rsh agent: mpirun reads the allocation from Slurm and starts its
    daemons on the other nodes with srun, through their slurmd, so they are inside their
    nodes already. As in :func:`mpirun_args`, the traffic stays on the testbed subnet and
    there is no core binding. Ranks go round-robin over the nodes (``--map-by node``): with
    ``--nodes=K`` the first K ranks (ResPipe's stages, Stannis's host and first CSDs) get K
    distinct nodes whatever way Slurm spread the tasks. No ``--oversubscribe``: the
    allocation's tasks are the slots (``--overcommit`` gives a node more tasks than CPUs).
    """
    return ["--map-by", "node", "--bind-to", "none", *_on_subnet(tb)]


def node_here() -> tuple[Testbed, Node] | None:
    """The testbed that is up and its node this process runs in (found by hostname: every
    process entered into a node has the node's), or None outside every node."""
    tb = current()
    if tb is None:
        return None
    name = os.uname().nodename
    return next(((tb, n) for n in tb.nodes if n.host == name), None)


def node_command(tb: Testbed, node: str, argv: Sequence[str]) -> list[str]:
    """The command line that runs ``argv`` inside a node (its cgroup, network and hostname)."""
    return [str(AGENT), tb.node(node).host, shlex.join(argv)]


# -- command line -----------------------------------------------------------------------------

def _print_nodes(tb: Testbed) -> None:
    print(f"testbed: {len(tb.nodes)} nodes on {tb.subnet} (host {tb.bridge_address} on {BRIDGE}); "
          f"hostfile {STATE / 'hostfile'}")
    print(f"  {'node':<16}{'address':<16}{'cpu':>7}{'link':>13}{'slots':>7}  cores")
    cores = tb.cores()
    for n in tb.nodes:
        print(f"  {n.host:<16}{str(tb.address(n)):<16}{n.cpu:>7g}{n.link_mbit:>8g} Mbit{n.slots:>7}  "
              f"{','.join(map(str, cores[n.name]))}")


def _cmd_up(args: argparse.Namespace) -> int:
    check_supported()
    tb = load(args.file)
    t0 = time.monotonic()
    up(tb)
    _print_nodes(tb)
    print(f"up in {time.monotonic() - t0:.1f} s; 'python -m mpipipe testbed down' removes it")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    if args.file:
        load(args.file)  # a typo in the file is reported, but down removes whatever is up
    t0 = time.monotonic()
    removed = down()
    print(f"down in {time.monotonic() - t0:.1f} s: removed {len(removed)} items" if removed
          else "down: nothing of a testbed was up")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    tb = current()
    left = leftovers()
    if tb is not None:
        _print_nodes(tb)
    elif left:
        print(f"no testbed is up, but {len(left)} leftovers are ({left[0]}, ...); "
              f"'python -m mpipipe testbed down' removes them")
    else:
        print("no testbed is up")
    return 0


def _command(argv: Sequence[str], what: str) -> list[str]:
    argv = list(argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise TestbedError(f"{what} needs a command after '--'")
    return argv


def _cmd_run(args: argparse.Namespace) -> int:
    check_supported()
    tb = load(args.file)
    cmd = _command(args.cmd, "run")
    env = dict(os.environ, MPIPIPE_TESTBED=str(Path(args.file).resolve()))
    with running(tb):
        return subprocess.run(cmd, env=env).returncode


def _cmd_exec(args: argparse.Namespace) -> int:
    tb = current()
    if tb is None:
        raise TestbedError("no testbed is up; run 'python -m mpipipe testbed up FILE' first")
    return subprocess.run(node_command(tb, args.node, _command(args.cmd, "exec"))).returncode


def _cmd_mpirun_args(args: argparse.Namespace) -> int:
    if args.slurm:
        if args.file:
            raise TestbedError("mpirun-args takes FILE or --slurm, not both (--slurm uses the testbed that is up)")
        here = node_here()
        if here is None:
            raise TestbedError(f"--slurm: this process ({os.uname().nodename}) does not run inside a node of a "
                               f"testbed that is up; run it in a Slurm job on the testbed (docs/testbed.md)")
        print("\n".join(slurm_mpirun_args(here[0])))
        return 0
    if not args.file:
        raise TestbedError("mpirun-args needs a testbed FILE (or --slurm inside a Slurm job on the testbed)")
    print("\n".join(mpirun_args(load(args.file))))
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """The ``testbed`` command of ``python -m mpipipe``: ``up FILE | run FILE -- CMD | exec NODE -- CMD |
    down [FILE] | status | mpirun-args FILE|--slurm``."""
    parser = subparsers.add_parser(
        "testbed", help="the emulated cluster on this machine: up, run, exec, down, status, mpirun-args",
        description="An emulated cluster on this machine: nodes with their own link rate, hostname and "
                    "CPU budget (needs root). Rate only: no delay or loss emulation (netem is not available).")
    sub = parser.add_subparsers(dest="testbed_command", metavar="COMMAND", required=True)
    p = sub.add_parser("up", help="make the testbed of FILE")
    p.add_argument("file")
    p.set_defaults(testbed_func=_cmd_up)
    p = sub.add_parser("run", help="run CMD on the host with the testbed of FILE up (made and removed "
                                   "around CMD unless it is up already); MPIPIPE_TESTBED names FILE")
    p.add_argument("file")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    p.set_defaults(testbed_func=_cmd_run)
    p = sub.add_parser("exec", help="run CMD inside NODE (its cgroup, network and hostname)")
    p.add_argument("node")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    p.set_defaults(testbed_func=_cmd_exec)
    p = sub.add_parser("down", help="remove the testbed and anything a crashed run left (idempotent)")
    p.add_argument("file", nargs="?")
    p.set_defaults(testbed_func=_cmd_down)
    p = sub.add_parser("status", help="show the testbed that is up")
    p.set_defaults(testbed_func=_cmd_status)
    p = sub.add_parser("mpirun-args", help="print, one a line, the mpirun options for the testbed of FILE "
                                           "(--slurm: for a Slurm job on the testbed that is up)")
    p.add_argument("file", nargs="?")
    p.add_argument("--slurm", action="store_true",
                   help="the options for mpirun inside a Slurm allocation of the nodes (run inside a node)")
    p.set_defaults(testbed_func=_cmd_mpirun_args)
    parser.set_defaults(func=main)
    return parser


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM (a CI timeout, kill) unwinds like Ctrl-C, so that 'run' still takes the testbed down."""
    raise KeyboardInterrupt


def main(args: argparse.Namespace) -> int:
    """Run one testbed command; any TestbedError is one line on stderr and exit status 2."""
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return int(args.testbed_func(args))
    except TestbedError as e:
        print(f"python -m mpipipe testbed: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
