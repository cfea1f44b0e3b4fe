"""`python -m mpipipe plan`: the dry run shows the cut a run would make, with exact bytes.

Why these checks: a user reads the plan to decide a balance and to size replicas, so every
layer must be listed, and the replica bytes must be those a backup receives
(:func:`mpipipe.core.state.statecodec.layout_of` of the stage module, computed here on a model
built independently with the same seed). Bad input must be one line and exit 2, and the
command must run where MPI is absent (mpi4py never imported).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpipipe.__main__ import main
from mpipipe.core.run import recipe
from mpipipe.core.run.chain import describe
from mpipipe.core.run.configfile import load_config
from mpipipe.core.state.statecodec import layout_of
from mpipipe.pipeline.config import PIPELINE_CHOICES, PIPELINE_DEFAULTS
from mpipipe.pipeline.partition import balance_by_params, split, stage_modules

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "jobs/configs/respipe-digits.toml"
OWN = 'model.factory="tests/models/own.py:own_net"'
ARGS = ["plan", "--config", CONFIG, "--set", OWN, "--in-shape", "1,8,8"]
PREFIX = "python -m mpipipe plan: error: "


@pytest.fixture(autouse=True)
def _at_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """The factory path is relative to the project, as a user at its root writes it."""
    monkeypatch.chdir(ROOT)


def _expected(*sets: str) -> tuple[torch.nn.Sequential, list[int], list[torch.nn.Module], list[int]]:
    """The model, balance, stage modules and replica bytes, built here as a run would."""
    cfg = load_config(CONFIG, [OWN, *sets], PIPELINE_DEFAULTS, PIPELINE_CHOICES)
    torch.manual_seed(cfg["run"]["seed"])
    made = recipe.Recipe(cfg)
    model = made.build_model((1, 8, 8))
    p = cfg["pipeline"]
    v = 2 if p["schedule"] == "interleaved-1f1b" else 1
    balance = list(p["balance"]) or balance_by_params(model, p["stages"], v, p["chunks"])
    stages = stage_modules(split(model, balance), p["stages"])
    nbytes = []
    for module in stages:
        nbytes.append(layout_of(module, made.make_optimizer(module)).nbytes)
    return model, balance, stages, nbytes


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _stage_rows(out: str) -> dict[str, list[str]]:
    """The stage table's rows by their first cell ("0", "1", ..., "all")."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["stage", "layers"])
    rows = {}
    for line in lines[start + 1:]:
        cells = line.split()
        if not cells or not (cells[0].isdigit() or cells[0] == "all"):
            break
        rows[cells[0]] = cells
    return rows


def test_table_lists_every_layer_and_exact_replica_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    model, balance, stages, nbytes = _expected()
    rc, out, err = _run(ARGS, capsys)
    assert rc == 0 and err == ""
    for line in describe(model):  # "3: block1 (7 ops, 1,184 params)"
        index, _, rest = line.partition(": ")
        name = rest.partition(" (")[0]
        assert any(row.split()[:1] == [index] and name in row.split() for row in out.splitlines()), line
    assert f"balance {balance}" in out
    rows = _stage_rows(out)
    assert len(rows) == len(stages) + 1
    for s, module in enumerate(stages):
        cells = rows[str(s)]
        assert int(cells[-1].replace(",", "")) == nbytes[s]
        buffers = int(cells[3].replace(",", ""))
        has_bn = any(isinstance(m, torch.nn.BatchNorm2d) for m in module.modules())
        assert (buffers > 0) == has_bn, (s, cells)
    assert int(rows["all"][-1].replace(",", "")) == sum(nbytes)
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in stages[0].modules())


def test_json_replica_bytes_sum_to_layout(capsys: pytest.CaptureFixture[str]) -> None:
    model, balance, _, nbytes = _expected()
    rc, out, _ = _run([*ARGS, "--json"], capsys)
    assert rc == 0
    plan = json.loads(out)
    assert plan["balance"] == balance
    assert len(plan["layers"]) == len(model)
    assert [s["replica_bytes"] for s in plan["stages"]] == nbytes
    assert sum(s["replica_bytes"] for s in plan["stages"]) == plan["replica_bytes_total"] == sum(nbytes)
    for s in plan["stages"]:  # the replica is parameters, buffers and optimizer state
        assert s["param_bytes"] + s["buffer_bytes"] + s["optimizer_state_bytes"] == s["replica_bytes"]


# Layer times by which the tests below cut (the timer replaced: a cut of real timings
# moves with the machine's noise; tests/test_plan_matches_run.py compares with a run).
TIMES = [0.004, 0.001, 0.001, 0.009, 0.001, 0.009, 0.001, 0.001, 0.002]


def test_interleaved_stage_holds_several_ranges(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from mpipipe.pipeline import partition

    monkeypatch.setattr(partition, "layer_times", lambda module, sample, repeat=5: TIMES)
    sets = ['pipeline.schedule="interleaved-1f1b"', "pipeline.stages=2", 'pipeline.balance_by="time"',
            'optim.name="adam"']
    balance = partition.cut_costs(TIMES, 2, 2, 4)
    model, _, _, nbytes = _expected(*sets, f"pipeline.balance={balance}")
    rc, out, _ = _run([*ARGS, *[a for s in sets for a in ("--set", s)], "--json"], capsys)
    assert rc == 0
    plan = json.loads(out)
    assert plan["balance"] == balance and plan["chunks_per_stage"] == 2
    assert plan["balance_source"] == "time" and plan["layer_costs"] == TIMES
    assert plan["measured_cuts"] == [balance] * 3
    covered = sorted(i for s in plan["stages"] for a, b in s["layers"] for i in range(a, b))
    assert covered == list(range(len(model)))
    assert all(len(s["layers"]) == 2 for s in plan["stages"])
    assert [s["replica_bytes"] for s in plan["stages"]] == nbytes
    rc, out, _ = _run([*ARGS, *[a for s in sets for a in ("--set", s)]], capsys)
    assert (f"balance {balance} (by measured time, as the run cuts: 3 of 3 timings here cut so; "
            f"to make the run cut so: --set 'pipeline.balance={balance}')") in out
    assert "time (ms)" in out.splitlines()[1]


def test_timings_that_disagree_are_named_with_the_set_that_pins_the_cut(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Two cuts seen in three timings: the plan prints the one most gave, and the other."""
    from mpipipe.pipeline import partition

    swapped = [*TIMES[:2], TIMES[3], TIMES[2], *TIMES[4:]]  # layers 2 and 3 trade times
    seen = iter([TIMES, swapped, TIMES])
    monkeypatch.setattr(partition, "layer_times", lambda module, sample, repeat=5: next(seen))
    first, other = partition.cut_costs(TIMES, 3), partition.cut_costs(swapped, 3)
    assert first != other
    rc, out, _ = _run([*ARGS, "--set", 'pipeline.balance_by="time"'], capsys)
    assert rc == 0
    assert (f"balance {first} (by measured time, as the run cuts: 2 of 3 timings here cut so, "
            f"the others {other}:") in out
    assert f"--set 'pipeline.balance={first}'" in out


@pytest.mark.parametrize("extra", [
    ["--set", 'model.factory="tests/models/no_such_file.py:own_net"'],
    ["--set", "pipeline.balance=[4, 4, 4]"],  # 12 layers for a 9-layer model
    ["--set", "pipeline.stages=10"],  # more stages than layers
    ["--set", "pipline.stages=3"],  # unknown key
    ["--in-shape", "1,8"],
])
def test_bad_input_is_one_line_and_exit_2(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run([*ARGS, *extra], capsys)
    assert rc == 2
    assert out == ""
    assert err.startswith(PREFIX) and err.count("\n") == 1, err


def test_never_imports_mpi4py() -> None:
    """A fresh interpreter, so no other test or pytest plugin has imported it first."""
    code = ("import sys\nfrom mpipipe.__main__ import main\n"
            f"rc = main({ARGS!r} + ['--json'])\n"
            "print('MPI4PY', 'mpi4py' in sys.modules, rc)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "MPI4PY False 0"
