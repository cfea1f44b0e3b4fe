"""The chaos command's own parts, without MPI: scenarios are drawn from their own seed and
can always fire, budgets parse, and the judge's verdicts follow the fault list alone."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pytest

from mpipipe.__main__ import build_parser
from mpipipe.tools.campaign import Job, Scenario, parse_budget
from mpipipe.tools.launch import ROOT

CONFIG = str(ROOT / "jobs" / "configs" / "respipe-digits.toml")


def _campaign(*extra: str):
    from mpipipe.respipe.chaos import _Campaign

    return _Campaign(build_parser().parse_args(["chaos", "--config", CONFIG, *extra]))


def test_scenario_i_is_the_same_whatever_the_campaign_around_it():
    camp = _campaign("--stages", "3,4")
    a = [camp.draw(random.Random(f"7:{i}"), i) for i in range(30)]
    b = _campaign("--stages", "3,4", "--runs", "99").draw(random.Random("7:17"), 17)
    assert (a[17].sets, a[17].faults) == (b.sets, b.faults)
    assert len({tuple(s.faults) for s in a}) > 20  # not the same scenario over and over


def test_every_drawn_fault_can_fire_and_every_kind_and_target_is_drawn():
    from mpipipe.core.mpi.faults import parse_all
    from mpipipe.core.run.cli import check_faults
    from mpipipe.core.run.configfile import load_config
    from mpipipe.pipeline.config import PIPELINE_CHOICES, PIPELINE_DEFAULTS
    from mpipipe.pipeline.plan import pipeline_plan

    camp = _campaign("--stages", "3,4")
    kinds, on_backup, same_step, modes = set(), 0, 0, set()
    for i in range(200):
        sc = camp.draw(random.Random(f"0:{i}"), i)
        assert 1 <= len(sc.faults) <= 3
        cfg = load_config(CONFIG, sc.sets, PIPELINE_DEFAULTS, PIPELINE_CHOICES)
        plan = pipeline_plan(cfg, sc.world)
        check_faults(cfg, plan, sc.faults, int(sc.knobs["N"]))  # raises if one never fires
        faults = parse_all(sc.faults)
        kinds |= {f.kind for f in faults}
        on_backup += any(f.rank is not None and f.rank >= sc.knobs["K"] and f.kind != "slow"
                         for f in faults)
        steps = [f.step for f in faults if f.kind in ("kill", "stall")]
        same_step += len(steps) != len(set(steps))
        modes.add(sc.knobs["mode"])
    assert kinds == {"kill", "stall", "delay", "slow"}
    assert modes == {"cold", "hot", "neighbour"}
    assert on_backup > 10 and same_step > 5


@pytest.mark.parametrize("text,seconds", [("20m", 1200), ("90s", 90), ("1h", 3600), ("45", 45),
                                          (None, None)])
def test_budgets(text, seconds):
    assert parse_budget(text) == seconds


def test_a_bad_budget_is_named():
    with pytest.raises(argparse.ArgumentTypeError, match="--budget 'soon'"):
        parse_budget("soon")


@pytest.mark.parametrize("args,message", [
    (["--modes", "warm"], "--modes 'warm': choose from cold, hot, neighbour"),
    (["--stages", "1"], "at least 2 stages"),
])
def test_bad_options_are_one_line(args, message):
    from mpipipe.respipe.chaos import _Campaign

    with pytest.raises(ValueError, match=message):
        _Campaign(build_parser().parse_args(["chaos", "--config", CONFIG, *args]))


def _scenario(mode: str, faults: list[str], holders: dict[int, list[int]]) -> Scenario:
    from mpipipe.core.mpi.faults import parse_all

    targets = sorted({f.rank if f.rank is not None else f.stage for f in parse_all(faults)})
    return Scenario(0, 6, [], faults, {"K": 3, "mode": mode, "R": 1, "N": 20},
                    {"targets": targets, "stage_ranks": [0, 1, 2], "holders": holders})


HOLDERS = {0: [0, 3], 1: [1, 4], 2: [2, 5]}


@pytest.mark.parametrize("mode,faults,allowed", [
    ("cold", ["kill:stage=1:step=5"], False),  # its backup is left
    ("cold", ["kill:rank=4:step=3", "kill:stage=1:step=9"], True),  # both holders of stage 1
    ("cold", ["stall:rank=4:step=3", "kill:stage=0:step=9"], False),  # different stages
    ("neighbour", ["kill:stage=1:step=5"], False),
    ("neighbour", ["kill:stage=1:step=5", "kill:stage=2:step=8"], True),
])
def test_a_lost_stage_is_allowed_only_when_every_holder_was_hit(mode, faults, allowed):
    from mpipipe.respipe.chaos import _stage_may_be_lost

    assert _stage_may_be_lost(_scenario(mode, faults, HOLDERS)) is allowed


def _job(tmp_path: Path, rc: int | None, stderr: str = "") -> Job:
    return Job(rc, 1.0, "", stderr, tmp_path / "absent.h5")


def test_verdicts_without_a_log(tmp_path):
    from mpipipe.respipe.chaos import _Reference, judge

    sc = _scenario("cold", ["kill:stage=1:step=5"], HOLDERS)
    args = (tmp_path, _Reference([], []))
    assert judge(sc, _job(tmp_path, None), *args).name == "HANG"
    trace = "Traceback (most recent call last):\n  File \"x\", line 1\nRuntimeError: boom\n"
    crash = judge(sc, _job(tmp_path, 1, trace), *args)
    assert (crash.name, crash.why) == ("CRASH", "traceback: RuntimeError: boom")
    refused = judge(sc, _job(tmp_path, 2, "mpipipe train: error: fault kill:stage=1:step=5: "
                                           "it is due at step 5, beyond the run\n"), *args)
    assert refused.name == "refused"
    assert judge(sc, _job(tmp_path, 1, "something\n"), *args).name == "CRASH"


STANNIS = str(ROOT / "jobs" / "configs" / "stannis-digits.toml")


def test_stannis_scenarios_hit_csds_at_retunes_and_now_and_then_the_host():
    import stannis.__main__ as cli
    from mpipipe.core.run.configfile import load_config
    from stannis.chaos import _Campaign
    from stannis.config import STANNIS_CHOICES, STANNIS_DEFAULTS, stannis_plan

    args = cli._parser().parse_args(["chaos", "--config", STANNIS, "--host-kills", "0.2"])
    camp = _Campaign(args)
    host, at_retune, together = 0, 0, 0
    for i in range(200):
        sc = camp.draw(random.Random(f"3:{i}"), i)
        cfg = load_config(STANNIS, [*sc.sets, f"stannis.inject={sc.faults!r}".replace("'", '"')],
                          STANNIS_DEFAULTS, STANNIS_CHOICES)
        stannis_plan(cfg, sc.world)  # every drawn fault passes Stannis's own checks
        host += sc.facts["host_killed"]
        steps = [int(p.split("=")[1]) for f in sc.faults for p in f.split(":")
                 if p.startswith("step=")]
        at_retune += any(s % 5 in (0, 1) for s in steps)
        together += len(steps) != len(set(steps))
    assert 20 <= host <= 60  # 0.2 of 200, well inside the binomial's spread
    assert at_retune > 100 and together > 10


def test_a_nan_loss_is_allowed_only_where_three_ranks_went_at_once(monkeypatch, tmp_path):
    """docs/respipe.md: a step's loss lives on three ranks; a row's loss may be NaN only
    when all of them went at once (testbed seed 7 #2: node b, with the log's writer, the
    last stage and the loss keeper, killed at step 70)."""
    from types import SimpleNamespace

    from mpipipe.core.mpi import testbed_nodes
    from mpipipe.tools import campaign, emulator

    run = SimpleNamespace(steps={"step": [1, 2, 3], "loss": [0.1, float("nan"), 0.3]})
    assert "non-finite loss at steps [2]" in campaign.rows_once(run, 3)
    assert campaign.rows_once(run, 3, frozenset({2, 3})) == ""
    bed_file = tmp_path / "bed.toml"
    bed_file.write_text("".join(f'[nodes.{n}]\ncpu = 1.0\nlink_mbit = 1000\nslots = {k}\n'
                                for n, k in (("a", 3), ("b", 3), ("c", 2), ("d", 2))))
    bed = emulator.load(bed_file)
    monkeypatch.setattr(testbed_nodes, "node_hosts", lambda: frozenset(n.host for n in bed.nodes))
    camp = _campaign("--stages", "3,4", "--testbed", str(bed_file))
    sc = camp.draw(random.Random("7:2"), 2)
    assert sc.faults == ["node-kill:node=a:step=49", "node-kill:node=b:step=70"]
    assert sc.facts["nan_ok"] == [49, 50, 70, 71]
    assert _campaign("--stages", "3,4").draw(random.Random("7:2"), 2).facts["nan_ok"] == []
