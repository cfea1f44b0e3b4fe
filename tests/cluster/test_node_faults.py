"""Whole-node faults on a testbed: ``node-kill`` (every process of a node SIGKILLed) and
``partition`` (a node's link down: its ranks live on, unreachable).

ResPipe runs 20 steps of LeNet on the digits in 3 stages, each stage on a node of its own
and the backup of stage 1 on node c, with stage 2 (never on its stage's node). Node d runs
no rank. Runs are shared within the module (cached by name). Nothing asserts timings.
"""

from __future__ import annotations

import json
import subprocess
from functools import cache
from pathlib import Path

import pytest
import torch

from mpipipe.core.logs.runlog import open_log
from mpipipe.tools import emulator
from mpipipe.tools.launch import run_mpi

# Ranks fill slots in file order: stage 0 (rank 0) on a, stage 1 (rank 1) on b, stage 2
# (rank 2) and the backup of stage 1 (rank 3) on c; d is empty.
NODES = """\
subnet = "10.213.0.0/24"
[nodes.a]
cpu = 1.0
link_mbit = 1000
[nodes.b]
cpu = 1.0
link_mbit = 1000
[nodes.c]
cpu = 1.0
link_mbit = 1000
slots = 2
[nodes.d]
cpu = 0.5
link_mbit = 1000
"""
STEPS, BATCH = 20, 32
R1 = ("resilience.backups={1 = 1}", "resilience.replicate_every=1")
HOSTS = ["mpt-a", "mpt-b", "mpt-c", "mpt-c"]


@pytest.fixture(scope="module")
def runs(bed: emulator.Testbed, respipe_args, tmp_path_factory: pytest.TempPathFactory):
    """run(name, *settings, ulfm=..., on_testbed=...) -> (CompletedProcess, log, checkpoints)."""
    base = tmp_path_factory.mktemp("nodefaults")

    @cache
    def run(name: str, *settings: str, ulfm: bool = True, on_testbed: bool = True,
            timeout: float = 300) -> tuple[subprocess.CompletedProcess, Path, Path]:
        log = base / f"{name}.h5"
        cmd = respipe_args(log, *settings, steps=STEPS, batch=BATCH)
        result = run_mpi(4, cmd, ulfm=ulfm, timeout=timeout, testbed=bed if on_testbed else None)
        return result, log, base / f"{name}-ckpt"

    return run


def _params(ckpt: Path) -> list[dict[str, torch.Tensor]]:
    return [torch.load(ckpt / f"stage-{k}.pt", weights_only=False)["params"] for k in range(3)]


def _same_params(ckpt: Path, clean_ckpt: Path) -> None:
    for got, want in zip(_params(ckpt), _params(clean_ckpt), strict=True):
        for key in want:
            assert (got[key] - want[key]).abs().max().item() <= 1e-5, key


def _errors(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if "error:" in line]


@pytest.mark.timeout(900)
def test_node_kill_of_a_stage_node_completes_and_equals_the_failure_free_run(runs) -> None:
    clean, clean_log, clean_ckpt = runs("clean", *R1)
    assert clean.returncode == 0, clean.stderr[-3000:]
    assert json.loads(open_log(clean_log).attrs["hosts"]) == HOSTS
    result, log, ckpt = runs("node-kill", *R1, "inject:node-kill:node=b:step=7")
    assert result.returncode == 0, result.stderr[-3000:]
    run = open_log(log)
    assert run.attrs["status"] == "completed"
    fired = run.events_of("fault_injected")
    assert [(e["rank"], e["detail"]["fault"]) for e in fired] == [(1, "node-kill:node=b:step=7")]
    takeover = run.events_of("takeover")[0]
    assert takeover["detail"]["stage"] == 1 and takeover["detail"]["replaced"] == 1
    assert takeover["rank"] == 3  # the backup, on node c
    assert run.steps["samples"].sum() == STEPS * BATCH
    assert list(run.steps["step"]) == list(range(1, STEPS + 1))
    _same_params(ckpt, clean_ckpt)
    assert emulator.current() is not None  # the testbed itself is untouched: only processes died
    # What ULFM found is a dead rank: node b's stage, at the step of the fault.
    detected = run.events_of("failure_detected")
    assert detected and detected[0]["rank"] == 1 and detected[0]["detail"]["how"] == "ulfm"


@pytest.mark.timeout(900)
def test_partition_of_a_stage_node_is_found_by_the_deadline_and_its_rank_demoted(runs) -> None:
    clean, _, clean_ckpt = runs("clean", *R1)
    assert clean.returncode == 0, clean.stderr[-3000:]
    result, log, ckpt = runs("partition", *R1, "resilience.deadline_s=1.5",
                             "inject:partition:node=b:step=7:seconds=6")
    assert result.returncode == 0, result.stderr[-3000:]
    run = open_log(log)
    assert run.attrs["status"] == "completed"
    fired = run.events_of("fault_injected")
    assert [(e["rank"], e["detail"]["fault"]) for e in fired] == [(1, "partition:node=b:step=7:seconds=6")]
    # Found by the deadline (silence), not by ULFM: the rank was alive all along.
    late = run.events_of("late")
    assert late and late[0]["rank"] == 1 and late[0]["detail"]["how"] == "deadline"
    assert not run.events_of("failure_detected"), run.events_of("failure_detected")
    takeover = run.events_of("takeover")[0]
    assert takeover["detail"]["stage"] == 1 and takeover["detail"]["replaced"] == 1
    assert run.steps["samples"].sum() == STEPS * BATCH
    _same_params(ckpt, clean_ckpt)
    # After the partition the node's processes ended and its link came back up.
    link = subprocess.run(["ip", "-n", "mpt-b", "-o", "link", "show", "eth0"], capture_output=True,
                          text=True, check=True).stdout
    assert "state UP" in link or ",UP" in link, link


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault, on_testbed, why", [
    ("node-kill:node=d:step=3", True, "fault node-kill:node=d:step=3: no rank runs on node mpt-d "
                                      "(the ranks run on mpt-a, mpt-b, mpt-c); it would never fire"),
    ("partition:node=e:step=3", True, "fault partition:node=e:step=3:seconds=10: no rank runs on "
                                      "node mpt-e (the ranks run on mpt-a, mpt-b, mpt-c); it would "
                                      "never fire"),
    ("node-kill:node=b:step=20", True, "fault node-kill:node=b:step=20: it is due at step 20, beyond "
                                       "the run (run.steps = 20: steps 0..19); it would never fire"),
    ("partition:node=b:step=2:seconds=0", True, "fault spec 'partition:node=b:step=2:seconds=0': "
                                                "seconds must be > 0"),
    ("node-kill:node=b:rank=1:step=2", True, "unknown key 'rank' for node-kill (allowed: node, step)"),
    ("node-kill:node=b:step=3", False, "not on the nodes of a testbed that is up; node faults need one"),
])
def test_a_node_fault_that_cannot_fire_is_refused_with_one_line(runs, fault: str, on_testbed: bool,
                                                                why: str) -> None:
    result, log, _ = runs(f"refused-{fault}", *R1, f"inject:{fault}", ulfm=False,
                          on_testbed=on_testbed, timeout=180)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = _errors(result)
    assert len(errors) == 1 and errors[0].startswith("mpipipe train: error: ") and why in errors[0], \
        result.stderr[-3000:]
    assert not log.exists()  # refused before the log was opened
