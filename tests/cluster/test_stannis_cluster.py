"""Stannis across testbed nodes: the host and each CSD on a node of its own, one CSD node
killed whole (``node-kill``): it is dropped, the survivors are re-tuned, the run completes.

The CSDs' speed here is their node's CPU quota (a real budget), not the stretched step of
the one-host emulation, so ``csd.slowdown`` is 1. Nothing asserts timings.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mpipipe import testbed
from mpipipe.launch import ROOT, mpirun_env, run_mpi
from mpipipe.runlog import open_log

# The host first, so it gets rank 0 (Stannis's host rank); CSD k is rank k.
NODES = """\
subnet = "10.213.0.0/24"
[nodes.host]
cpu = 1.0
link_mbit = 1000
[nodes.csd1]
cpu = 0.5
link_mbit = 100
[nodes.csd2]
cpu = 0.5
link_mbit = 100
[nodes.csd3]
cpu = 0.5
link_mbit = 100
[nodes.csd4]
cpu = 0.5
link_mbit = 100
"""
CONFIG = ROOT / "jobs" / "configs" / "stannis-digits.toml"
STEPS = 30


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stannis")
    subprocess.run([sys.executable, "-m", "stannis", "prepare", "--source", str(root / "digits"),
                    "--out", str(root / "split"), "--csds", "4"],
                   check=True, env=mpirun_env(), cwd=ROOT, timeout=120, capture_output=True)
    return root / "split"


@pytest.mark.timeout(600)
def test_csd_node_killed_is_dropped_retuned_and_the_run_completes(bed: testbed.Testbed, data: Path,
                                                                  tmp_path: Path) -> None:
    log = tmp_path / "stannis-node-kill.h5"
    cmd = ["-m", "stannis", "train", "--config", str(CONFIG), "--log", str(log),
           "--set", f'data.path="{data}"', "--set", f"run.steps={STEPS}", "--set", "run.eval_every=0",
           "--set", "csd.slowdown=1.0", "--inject", "node-kill:node=csd3:step=15"]
    proc = run_mpi(5, cmd, ulfm=True, timeout=480, testbed=bed)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run = open_log(log)
    assert run.attrs["status"] == "completed"
    assert json.loads(run.attrs["hosts"]) == ["mpt-host", "mpt-csd1", "mpt-csd2", "mpt-csd3", "mpt-csd4"]
    assert int(run.steps["step"][-1]) == STEPS
    fired = run.events_of("fault_injected")
    assert [(e["rank"], e["detail"]["fault"]) for e in fired] == [(3, "node-kill:node=csd3:step=15")]
    dropped = run.events_of("csd_dropped")
    assert [e["rank"] for e in dropped] == [3]
    split = json.loads((data / "split.json").read_text())
    assert dropped[0]["detail"]["samples_lost"] == split["records"]["csd3"]
    after = [e for e in run.events_of("retune") if "dropped" in e["detail"]["reason"]]
    assert after and len(after[0]["detail"]["new"]) == 4
    assert sum(after[0]["detail"]["new"]) == sum(after[0]["detail"]["old"])  # survivors take the batch
    assert len(run.ranks[3]["step"]) < STEPS and len(run.ranks[4]["step"]) == STEPS
    assert testbed.current() is not None  # only the node's processes died, not the testbed
