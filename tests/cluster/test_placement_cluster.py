"""ResPipe's plan check across testbed nodes: a backup on its stage's node is refused with
one line naming the ranks and the node; allowed, the run goes on and its log records
each rank's host."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mpipipe.core.logs.runlog import open_log
from mpipipe.tools import emulator
from mpipipe.tools.launch import ROOT, run_mpi

# Node a takes two ranks; b and c one each (ranks fill slots in file order).
NODES = """\
subnet = "10.213.0.0/24"
[nodes.a]
cpu = 0.5
link_mbit = 1000
slots = 2
[nodes.b]
cpu = 0.5
link_mbit = 1000
[nodes.c]
cpu = 0.5
link_mbit = 1000
"""
# Stage 1 and its backup on ranks 0 and 1: both on node a.
SAME_NODE_PLAN = ["plan.stage 1=0", "plan.backup 1=1", "plan.stage 0=2", "plan.stage 2=3"]


def _train(digits: Path, log: Path, tb: emulator.Testbed, *settings: str):
    cmd = ["-m", "mpipipe", "train", "--quiet", "--config", str(ROOT / "jobs/configs/respipe-digits.toml"),
           "--set", f'data.path="{digits}"', "--set", "run.steps=3", "--set", "run.eval_every=0",
           "--set", "resilience.backups={1=1}", "--log", str(log)]
    for s in settings:
        cmd += ["--set", s]
    return run_mpi(4, cmd, timeout=240, testbed=tb)


@pytest.mark.timeout(300)
def test_backup_on_its_stage_node_is_refused(bed: emulator.Testbed, digits: Path, tmp_path: Path) -> None:
    result = _train(digits, tmp_path / "refused.h5", bed, *SAME_NODE_PLAN)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors == ["mpipipe train: error: ranks 1 and 0 are both on node mpt-a but backup 1 shadows "
                      "stage 1: a failure of that node would lose both. Place them on different nodes "
                      "(rank order fills the hostfile's slots; see [plan]), or set "
                      "resilience.allow_same_node = true"], result.stderr[-2000:]


@pytest.mark.timeout(300)
def test_allowed_same_node_runs_and_logs_hosts(bed: emulator.Testbed, digits: Path, tmp_path: Path) -> None:
    log = tmp_path / "allowed.h5"
    result = _train(digits, log, bed, *SAME_NODE_PLAN, "resilience.allow_same_node=true")
    assert result.returncode == 0, result.stderr[-2000:]
    data = open_log(log)
    assert json.loads(data.attrs["hosts"]) == ["mpt-a", "mpt-a", "mpt-b", "mpt-c"]
    assert data.attrs["status"] == "completed"
