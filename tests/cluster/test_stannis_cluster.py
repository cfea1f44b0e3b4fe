"""Stannis across testbed nodes: the host and each CSD on a node of its own, one CSD node
killed whole (``node-kill``): it is dropped, the survivors are re-tuned, the run completes.

The CSDs' speed here is their node's CPU quota (a real budget), not the stretched step of
the one-host emulation, so ``csd.slowdown`` is 1. Nothing asserts timings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mpipipe.core.logs.runlog import open_log
from mpipipe.tools import emulator
from mpipipe.tools.launch import ROOT, run_mpi

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


@pytest.mark.timeout(600)
def test_csd_node_killed_is_dropped_retuned_and_the_run_completes(bed: emulator.Testbed, stannis_split: Path,
                                                                  assert_csd_dropped, tmp_path: Path) -> None:
    data = stannis_split
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
    assert_csd_dropped(run, 3, STEPS)
    assert emulator.current() is not None  # only the node's processes died, not the testbed
