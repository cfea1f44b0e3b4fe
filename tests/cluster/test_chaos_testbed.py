"""``chaos --testbed``: a random fault campaign across the nodes of an emulated cluster,
with whole-node faults (node-kill, partition) among the drawn ones, for both systems.

The command brings the testbed up and takes it down itself. The seeds are chosen so
that the few scenarios include node faults (a partition and node kills for ResPipe,
node kills of CSDs for Stannis); every run must end as the docs promise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mpipipe.tools import emulator

ROOT = Path(__file__).resolve().parents[2]
# Ranks fill slots in file order: a takes ranks 0-2, b 3-5, c 6-7.
NODES = """\
subnet = "10.214.0.0/24"
[nodes.a]
cpu = 1.0
link_mbit = 1000
slots = 3
[nodes.b]
cpu = 1.0
link_mbit = 1000
slots = 3
[nodes.c]
cpu = 1.0
link_mbit = 1000
slots = 2
"""


def _campaign(tmp_path: Path, system: str, config: str, *extra: str) -> list[dict]:
    bed = tmp_path / "bed.toml"
    bed.write_text(NODES)
    cmd = [sys.executable, "-m", system, "chaos", "--config", str(ROOT / config),
           "--testbed", str(bed), "--steps", "30", "--json", "--out", str(tmp_path / "out"),
           *extra]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert emulator.current() is None  # brought down again
    return rows


@pytest.mark.timeout(1600)
def test_a_respipe_campaign_on_a_testbed_survives_node_faults(tmp_path: Path) -> None:
    rows = _campaign(tmp_path, "mpipipe", "jobs/configs/respipe-digits.toml",
                     "--set", f'data.path="{ROOT / "data/digits"}"', "--stages", "3",
                     "--modes", "cold,hot", "--runs", "3", "--seed", "3")
    assert len(rows) == 3
    assert all(r["verdict"] in ("exact", "bound", "lost-stage") for r in rows), rows
    faults = [f for r in rows for f in r["faults"]]
    assert any(f.startswith("partition:") for f in faults), faults
    assert any(f.startswith("node-kill:") for f in faults), faults


@pytest.mark.timeout(1600)
def test_a_stannis_campaign_on_a_testbed_survives_node_kills_of_csds(tmp_path: Path) -> None:
    rows = _campaign(tmp_path, "stannis", "jobs/configs/stannis-digits.toml",
                     "--set", "csd.slowdown=2.0", "--runs", "2", "--seed", "1")
    assert [r["verdict"] for r in rows] == ["completed", "completed"], rows
    assert all(any(f.startswith("node-kill:") for f in r["faults"]) for r in rows), rows
