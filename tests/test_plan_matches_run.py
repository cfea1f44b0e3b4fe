"""`python -m mpipipe plan` prints the cut a run makes (issue 37, item 3).

Why two tests, and neither compares two timings of a model whose layers cost alike:
timings are noisy, so a plan and a run of such a model may cut differently however
they measure, and a test that compares them would fail now and then for no fault.
Instead:

- the run records the per-layer times it cut by (``balance_costs``) beside its cut, and
  the plan given those very times (its timer replaced) prints the run's cut: the two
  cut with one function, deterministically, on the user's own model (tests/models/own.py);
- on a model whose slowest layer outlasts all the others together
  (tests/models/lopsided.py), where noise cannot move the cut, the plan and the run,
  each timing for itself, give one cut, and it is not the cut by parameters: the plan
  really times the layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mpipipe.__main__ import main
from mpipipe.core.logs.runlog import open_log
from mpipipe.tools.launch import ROOT, run_mpi

CONFIG = str(ROOT / "jobs" / "configs" / "pipeline-digits.toml")  # balance_by = "time"
OWN = f'model.factory="{ROOT / "tests/models/own.py"}:own_net"'
LOPSIDED = f'model.factory="{ROOT / "tests/models/lopsided.py"}:lopsided"'


def _train(digits: Path, log: Path, factory: str) -> tuple[list[int], list[float]]:
    """A 3-stage run of 2 steps of ``factory``: the cut it used and the times it cut by."""
    argv = ["-m", "mpipipe", "train", "--quiet", "--config", CONFIG, "--log", str(log),
            "--set", f'data.path="{digits}"', "--set", factory, "--set", "run.steps=2",
            "--set", "run.eval_every=0", "--set", "run.checkpoint_every=0"]
    done = run_mpi(3, argv, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    attrs = open_log(log).attrs
    return json.loads(attrs["balance"]), [float(c) for c in json.loads(attrs["balance_costs"])]


def _plan(digits: Path, factory: str, capsys: pytest.CaptureFixture[str]) -> dict:
    rc = main(["plan", "--config", CONFIG, "--set", f'data.path="{digits}"', "--set", factory,
               "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


@pytest.mark.timeout(300)
def test_the_plan_given_the_runs_times_prints_the_runs_cut(digits, tmp_path, capsys, monkeypatch):
    balance, costs = _train(digits, tmp_path / "own.h5", OWN)
    assert len(costs) == sum(balance) and all(c > 0 for c in costs)
    from mpipipe.pipeline import partition

    calls = []

    def the_runs_times(module, sample, repeat=5):
        calls.append(tuple(sample.shape))
        return costs

    monkeypatch.setattr(partition, "layer_times", the_runs_times)
    plan = _plan(digits, OWN, capsys)
    assert (plan["balance"], plan["balance_source"]) == (balance, "time")
    assert plan["layer_costs"] == costs
    # timed on what a run times: one micro-batch (batch 32 / 4 chunks) of the digits' shape
    assert set(calls) == {(8, 1, 8, 8)}


@pytest.mark.timeout(300)
def test_plan_and_run_cut_a_lopsided_factory_model_alike(digits, tmp_path, capsys):
    plan = _plan(digits, LOPSIDED, capsys)
    balance, costs = _train(digits, tmp_path / "lopsided.h5", LOPSIDED)
    assert plan["balance"] == balance == [4, 1, 2], (plan["layer_costs"], costs)
    assert plan["measured_cuts"] == [balance] * 3
    # and the plan did time the layers: by parameters it would cut elsewhere
    rc = main(["plan", "--config", CONFIG, "--set", f'data.path="{digits}"', "--set", LOPSIDED,
               "--set", 'pipeline.balance_by="params"', "--json"])
    out, _ = capsys.readouterr()
    assert rc == 0 and json.loads(out)["balance"] != balance
