"""The testbed's command line: one clear line and exit 2 for what it cannot do, up and
down around 'run', and a down that cleans what a crashed run left."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mpipipe.tools import emulator
from mpipipe.tools.launch import ROOT, mpirun_env, run_mpi


def _cli(*args: str, user: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mpipipe", "testbed", *args]
    if user is not None:
        cmd = ["setpriv", "--reuid", user, "--regid", user, "--clear-groups", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=mpirun_env(), timeout=timeout)


def _one_error_line(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m mpipipe testbed: error: "), done.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text, words", [
    ('[nodes.a]\ncpu = 0.5\n', ["nodes.a", "link_mbit is missing"]),
    ('[nodes.a]\ncpu = 0.5\nlink_mbit = 10\nrate = 3\n', ["unknown key 'rate'"]),
    ('[nodes.Big_Name]\ncpu = 0.5\nlink_mbit = 10\n', ["nodes.Big_Name", "lowercase"]),
    ('[nodes.a]\ncpu = 0\nlink_mbit = 10\n', ["nodes.a.cpu", "above 0"]),
    ('subnet = "8.8.8.0/24"\n[nodes.a]\ncpu = 0.5\nlink_mbit = 10\n', ["not a private network"]),
    ('subnet = "10.213.0.0/30"\n[nodes.a]\ncpu = 0.5\nlink_mbit = 10\n[nodes.b]\ncpu = 0.5\nlink_mbit = 10\n',
     ["too few addresses"]),
    ('nodes = 3\n', ["no nodes"]),
])
def test_bad_file_is_one_line(tmp_path: Path, text: str, words: list[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    _one_error_line(_cli("up", str(path)), str(path), *words)
    assert emulator.leftovers() == []


@pytest.mark.timeout(60)
def test_without_root_is_one_line_and_no_fallback(three_nodes_file: Path) -> None:
    done = _cli("up", str(three_nodes_file), user="65534")
    _one_error_line(done, "needs root")
    assert emulator.leftovers() == []
    # the launcher refuses a testbed that is not up rather than running on this host alone
    with pytest.raises(emulator.TestbedError, match="not up"):
        run_mpi(3, ["-c", "pass"], timeout=30, testbed=emulator.load(three_nodes_file))


@pytest.mark.timeout(120)
def test_run_brings_up_and_down_and_passes_the_status(three_nodes_file: Path) -> None:
    probe = "cat /run/mpt-testbed/hostfile; echo $MPIPIPE_TESTBED; exit 7"
    done = _cli("run", str(three_nodes_file), "--", "sh", "-c", probe)
    assert done.returncode == 7, done.stderr
    assert done.stdout.split() == ["mpt-a", "slots=1", "mpt-b", "slots=1", "mpt-c", "slots=1",
                                   str(three_nodes_file)]
    assert emulator.leftovers() == []
    # with that testbed up already, run uses it and leaves it up; up again is refused
    assert _cli("up", str(three_nodes_file)).returncode == 0
    try:
        assert _cli("run", str(three_nodes_file), "--", "true").returncode == 0
        assert emulator.current() == emulator.load(three_nodes_file)
        _one_error_line(_cli("up", str(three_nodes_file)), "already up", "down")
        exe = _cli("exec", "c", "--", "hostname")
        assert exe.returncode == 0 and exe.stdout.strip() == "mpt-c"
        _one_error_line(_cli("exec", "z", "--", "true"), "no node 'z'")
    finally:
        assert _cli("down", str(three_nodes_file)).returncode == 0
    assert emulator.leftovers() == []


@pytest.mark.timeout(60)
def test_down_cleans_what_a_crash_left() -> None:
    # parts of a testbed as a killed 'up' may leave them: a namespace with a process in it,
    # a half-made veth, a cgroup, a hosts line, no state directory
    subprocess.run(["ip", "netns", "add", "mpt-crash"], check=True)
    subprocess.run(["ip", "link", "add", "mpt-crash", "type", "veth", "peer", "name", "eth0",
                    "netns", "mpt-crash"], check=True)
    group = Path("/sys/fs/cgroup/cpu/mpt-crash")
    if Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").exists():
        group.mkdir()
    with open("/etc/hosts", "a") as f:
        f.write(f"10.213.0.9 mpt-crash {emulator.HOSTS_TAG}\n")
    stray = subprocess.Popen(["nsenter", "--net=/run/netns/mpt-crash", "sleep", "600"])
    try:
        assert len(emulator.leftovers()) >= 3
        done = _cli("down")
        assert done.returncode == 0, done.stderr
        assert stray.wait(timeout=10) == -9
    finally:
        stray.kill()
    assert emulator.leftovers() == []
    assert "mpt-crash" not in Path("/etc/hosts").read_text()
    assert _cli("down").stdout.strip() == "down: nothing of a testbed was up"
