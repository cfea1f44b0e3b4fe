"""Slurm across the testbed's nodes: one slurmd inside each node, slurmctld on the host
(tests/slurm/privslurm.py), and the real job scripts submitted with sbatch.

ResPipe (3 stages and a backup of stage 1, ``--nodes=3``) must run its stages on three
distinct nodes and survive a node-kill of stage 1's node; Stannis (a host and 3 CSDs,
``--nodes=4``) must run every rank on a node of its own. Nothing asserts timings; every
wait has a time limit, and the daemons are stopped by pid whatever happens.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mpipipe.core.logs.runlog import open_log
from mpipipe.tools import emulator
from mpipipe.tools.launch import ROOT, mpirun_env

sys.path.insert(0, str(ROOT / "tests" / "slurm"))
import check_logs  # noqa: E402
import privslurm  # noqa: E402

# Four nodes, half a core, 1000 Mbit/s and one slot each (the module's testbed: conftest.bed).
NODES = 'subnet = "10.213.0.0/24"\n' + "".join(f"[nodes.{n}]\ncpu = 0.5\nlink_mbit = 1000\n" for n in "abcd")
RESPIPE_STEPS, STANNIS_STEPS = 20, 10
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE"}


def _why_no_slurm() -> str | None:
    missing = [t for t in ("munged", "mungekey", "slurmctld", "slurmd", "sbatch") if shutil.which(t) is None]
    return f"Slurm is not installed (missing {', '.join(missing)}): run make test-slurm once" if missing else None


@pytest.fixture(scope="module")
def slurm(bed: emulator.Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[privslurm.Cluster]:
    """The private cluster, one slurmd per node of ``bed``; stopped by pid at the end."""
    why = _why_no_slurm()
    if why is not None:  # as conftest: a skip under make test-cluster would hide that nothing ran
        if os.environ.get("MPIPIPE_REQUIRE_CLUSTER") == "1":
            pytest.fail(why)
        pytest.skip(why)
    state = tmp_path_factory.mktemp("slurm")
    try:
        yield privslurm.start(state, on_testbed=True, first_id=privslurm.first_job_id(ROOT / "runs"))
    finally:
        privslurm.stop(state)


def _field(cluster: privslurm.Cluster, job: str, name: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True,
                         env=cluster.env(), timeout=10).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith(name + "=")), "")


def _run_job(cluster: privslurm.Cluster, *args: str, timeout: float = 240) -> tuple[str, str, str]:
    """sbatch ARGS from the project root and wait for the job: (job id, final state, output)."""
    (ROOT / "runs").mkdir(exist_ok=True)
    env = mpirun_env(cluster.env())
    env["MPIPIPE_VENV"] = str(Path(sys.executable).parent.parent)
    done = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip().split(";")[0]
    give_up, state = time.monotonic() + timeout, ""
    while time.monotonic() < give_up:
        state = _field(cluster, job, "JobState")
        if state in FINAL:
            break
        time.sleep(1)
    out_file = Path(_field(cluster, job, "StdOut"))
    output = out_file.read_text(errors="replace") if out_file.is_file() else "(no output file)"
    if state not in FINAL:
        subprocess.run(["scancel", job], env=cluster.env(), timeout=10)
        pytest.fail(f"job {job} not finished after {timeout:g} s (state {state}); output:\n{output[-4000:]}"
                    f"\n{cluster.logs(20)}")
    return job, state, output


@pytest.mark.timeout(420)
def test_respipe_sbatch_across_three_nodes_survives_a_node_kill(slurm: privslurm.Cluster, digits: Path) -> None:
    job, state, output = _run_job(
        slurm, "--nodes=3", "--ntasks=4", "--nodelist=mpt-a,mpt-b,mpt-c", "jobs/respipe.sbatch",
        "jobs/configs/respipe-digits.toml", "--set", f'data.path="{digits}"',
        "--set", f"run.steps={RESPIPE_STEPS}", "--set", "run.eval_every=0",
        "--set", "resilience.backups={1=1}", "--inject", "node-kill:node=b:step=8", "--quiet")
    assert state == "COMPLETED", output[-4000:]
    log = ROOT / "runs" / job / "respipe.h5"
    # Ranks round-robin over the nodes: stages 0..2 on a, b, c; the backup of stage 1 on a.
    hosts = json.loads(open_log(log).attrs["hosts"])
    assert hosts[:3] == ["mpt-a", "mpt-b", "mpt-c"], hosts
    assert check_logs.check(str(log), system="mpipipe", steps=RESPIPE_STEPS,
                            events=("failure_detected", "takeover")) == []


@pytest.mark.timeout(420)
def test_stannis_sbatch_puts_the_host_and_each_csd_on_its_own_node(
        slurm: privslurm.Cluster, digits: Path, tmp_path: Path) -> None:
    data = tmp_path / "stannis-digits"
    subprocess.run([sys.executable, "-m", "stannis", "prepare", "--source", str(digits), "--out", str(data),
                    "--csds", "3"],
                   cwd=ROOT, env=mpirun_env(), check=True, capture_output=True, timeout=120)
    job, state, output = _run_job(
        slurm, "--nodes=4", "--ntasks=4", "jobs/stannis.sbatch", "jobs/configs/stannis-digits.toml",
        "--set", f'data.path="{data}"', "--set", "stannis.csds=3", "--set", f"run.steps={STANNIS_STEPS}",
        "--set", "run.eval_every=0", "--quiet")
    assert state == "COMPLETED", output[-4000:]
    log = ROOT / "runs" / job / "stannis.h5"
    hosts = json.loads(open_log(log).attrs["hosts"])
    assert sorted(hosts) == ["mpt-a", "mpt-b", "mpt-c", "mpt-d"], hosts
    assert check_logs.check(str(log), system="stannis", steps=STANNIS_STEPS) == []


@pytest.mark.timeout(60)
def test_slurm_mpirun_args_only_inside_a_node(bed: emulator.Testbed) -> None:
    cli = [sys.executable, "-m", "mpipipe", "testbed", "mpirun-args", "--slurm"]
    inside = subprocess.run(emulator.node_command(bed, "b", cli), capture_output=True, text=True, cwd=ROOT,
                            env=mpirun_env(), timeout=30)
    assert inside.returncode == 0, inside.stderr
    assert inside.stdout.split() == emulator.slurm_mpirun_args(bed)
    outside = subprocess.run(cli, capture_output=True, text=True, cwd=ROOT, env=mpirun_env(), timeout=30)
    assert outside.returncode == 2
    assert "does not run inside a node" in outside.stderr
