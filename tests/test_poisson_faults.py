"""Failures as a process (``poisson:rate=...:seed=...``) without MPI: the spec, the seeded
sequence every rank expands alike, its rate, its victims, how an event fires, and the
refusals. A real run under a process is in tests/test_faults_log.py.

Every statistical bound here is computed from the distribution (a six-sigma band, a
chi-square quantile at p = 1e-6) and the draws are seeded, so no test can flake: a seed
either passes for ever or fails for ever.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import mpipipe.pipeline.plan  # noqa: F401 - declares the stage, backup and spare role kinds
import stannis.config  # noqa: F401 - declares the host and csd role kinds
from mpipipe.core.mpi import faults as inject
from mpipipe.core.mpi.faults import FaultError, FaultPlan, check_nodes, check_reachable, parse
from mpipipe.core.mpi.poisson import Process, node_victims, rank_victims
from mpipipe.core.mpi.roles import LaunchPlan, Role

# 5 ranks: stages 0..2, a backup of stage 1, a spare.
RESPIPE = LaunchPlan((Role("stage", 0), Role("stage", 1), Role("stage", 2), Role("backup", 1),
                      Role("spare", 0)))
STANNIS = LaunchPlan((Role("host"), Role("csd", 1), Role("csd", 2), Role("csd", 3)))
# chi-square quantiles at 1 - 1e-6 (scipy.stats.chi2.ppf(1 - 1e-6, dof))
CHI2_1E6 = {3: 30.665, 9: 44.811}


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


# -- the spec ---------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, rate, seconds, what, text", [
    ("poisson:rate=1/30min:seed=1", 1 / 1800, 0.0, "rank", "poisson:rate=1/30min:seed=1:what=rank"),
    ("poisson:rate=2/h:seed=7:rejoin=20s", 2 / 3600, 20.0, "rank",
     "poisson:rate=1/30min:seed=7:rejoin=20s:what=rank"),
    ("poisson:rate=0.3:seed=0:what=node", 0.3, 0.0, "node", "poisson:rate=0.3:seed=0:what=node"),
    (" POISSON : rate=1/90s : seed=2 : rejoin=1m : what=node ", 1 / 90, 60.0, "node",
     "poisson:rate=1/1.5min:seed=2:rejoin=60s:what=node"),
])
def test_a_process_spec_parses_and_reads_back(spec, rate, seconds, what, text) -> None:
    f = parse(spec)
    assert (f.kind, f.what, f.seconds, f.rank, f.stage, f.node) == ("poisson", what, seconds, None, None, None)
    assert f.rate == pytest.approx(rate, rel=1e-12)
    assert str(f) == text
    assert parse(str(f)) == f  # what the log's config shows parses back the same


@pytest.mark.parametrize("spec, why", [
    ("poisson:rate=0:seed=1", "rate=0 never fires: give a positive rate"),
    ("poisson:rate=0/h:seed=1", "rate=0 never fires"),
    ("poisson:seed=1", "missing rate"),
    ("poisson:rate=1/h", "missing seed"),
    ("poisson:rate=often:seed=1", "rate='often' is not a rate: give events per time"),
    ("poisson:rate=-1:seed=1", "rate='-1': a rate cannot be negative"),
    ("poisson:rate=1/h:seed=x", "seed='x' is not an integer"),
    ("poisson:rate=1/h:seed=-1", "seed must be >= 0"),
    ("poisson:rate=1/h:seed=1:rejoin=0s", "rejoin='0s': a duration must be positive"),
    ("poisson:rate=1/h:seed=1:rejoin=soon", "rejoin='soon' is not a duration"),
    ("poisson:rate=1/h:seed=1:what=disk", "what='disk': give what=rank"),
    ("poisson:rate=1/h:seed=1:rank=2", "unknown key 'rank' for poisson (allowed: rate, rejoin, seed, what)"),
    ("poisson:rate=1/h:seed=1:step=2", "unknown key 'step' for poisson"),
    ("poisson:rate=1/h:seed=1:seed=2", "key 'seed' given twice"),
])
def test_a_bad_process_spec_is_one_line_naming_what_is_wrong(spec, why) -> None:
    with pytest.raises(FaultError) as e:
        parse(spec)
    text = str(e.value)
    assert why in text and "(e.g. poisson:rate=1/30min:seed=1:rejoin=20s)" in text and "\n" not in text


# -- the sequence -------------------------------------------------------------------------------

def _fired_by_every_rank(spec: str, plan: LaunchPlan, until_s: float, step_s: float = 0.25
                         ) -> dict[int, list[tuple[int, str]]]:
    """Each rank's plan stepped through ``until_s`` seconds (a boundary every ``step_s``):
    rank -> [(event number, the fault it fired as)], kills and sleeps replaced."""
    fired: dict[int, list[tuple[int, str]]] = {}
    for r in range(plan.world_size):
        if plan.role_of(r).spec.idle:
            continue  # a spare never reaches a step
        clock, out = Clock(), fired.setdefault(r, [])
        fp = FaultPlan([parse(spec)], seed=0, stage=None, rank=r, plan=plan, clock=clock,
                       sleep=lambda s: None, kill=lambda: None,
                       on_fire=lambda f, step, d, out=out: out.append((d["event"], str(f))))
        fp.start()
        for step in range(int(until_s / step_s) + 1):
            clock.t = step * step_s
            fp.at_step(step)
    return fired


def test_every_rank_expands_the_same_events_and_each_fires_on_its_victim_once() -> None:
    spec = "poisson:rate=1/2s:seed=11:rejoin=3s"
    fired = _fired_by_every_rank(spec, RESPIPE, until_s=60.0)
    events = Process(0.5, 11, rank_victims(RESPIPE), ends_victim=False).until(60.0 - 0.25)
    assert len(events) > 10
    # every event due before the last boundary fired exactly once, on its victim, as a stall
    # of 3 s named after the event
    got = sorted((n, r) for r, evs in fired.items() for n, _ in evs)
    assert got[:len(events)] == [(e.number, e.victim) for e in events]
    for r, evs in fired.items():
        for n, text in evs:
            e = events[n - 1] if n <= len(events) else None
            assert e is None or text.startswith(f"stall:rank={r}:step=") and \
                text.endswith(f":seconds=3 (poisson #{n} at {e.at_s:.1f} s)"), text
    # each rank's own plan would name any other rank's event alike (the writer's view)
    fp = FaultPlan([parse(spec)], seed=0, stage=0, rank=0, plan=RESPIPE)
    for evs in fired.values():
        for n, text in evs:
            step = int(text.split(":step=")[1].split(":")[0])
            assert str(fp.drawn_fault(0, n, step)) == text


def test_the_same_seed_draws_the_same_events_and_another_seed_others() -> None:
    victims = rank_victims(RESPIPE)
    a = Process(0.1, 5, victims, ends_victim=False).first(50)
    assert a == Process(0.1, 5, victims, ends_victim=False).first(50)
    assert [e.at_s for e in a] != [e.at_s for e in Process(0.1, 6, victims, ends_victim=False).first(50)]
    # times scale with the rate: the same seed at ten times the rate is ten times as dense
    fast = Process(1.0, 5, victims, ends_victim=False).first(50)
    assert [e.at_s for e in fast] == pytest.approx([e.at_s / 10 for e in a])
    assert [e.victim for e in fast] == [e.victim for e in a]


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_the_gaps_are_exponential_at_the_rate(seed: int) -> None:
    rate, n = 1 / 1800, 1000
    events = Process(rate, seed, [0, 1, 2], ends_victim=False).first(n)
    gaps = np.diff([0.0] + [e.at_s for e in events])
    # The mean of n exponential gaps has mean 1/rate and standard deviation 1/(rate sqrt n):
    # six of those either side.
    assert abs(gaps.mean() - 1 / rate) <= 6 / (rate * math.sqrt(n))
    # Chi-square against the exponential over 10 bins of equal probability (9 degrees of
    # freedom, 100 expected per bin).
    edges = -np.log(1 - np.arange(1, 10) / 10) / rate
    counts = np.bincount(np.searchsorted(edges, gaps), minlength=10)
    assert ((counts - n / 10) ** 2 / (n / 10)).sum() < CHI2_1E6[9]


def test_victims_are_only_ranks_that_may_fail_drawn_uniformly() -> None:
    assert rank_victims(RESPIPE) == [0, 1, 2, 3]  # never the spare
    assert rank_victims(STANNIS) == [1, 2, 3]  # never the host
    n = 1000
    events = Process(1.0, 3, rank_victims(RESPIPE), ends_victim=False).first(n)
    counts = np.bincount([e.victim for e in events], minlength=5)
    assert counts[4] == 0
    assert ((counts[:4] - n / 4) ** 2 / (n / 4)).sum() < CHI2_1E6[3]
    assert {e.victim for e in Process(1.0, 3, rank_victims(STANNIS), ends_victim=False).first(200)} \
        == {1, 2, 3}


def test_a_killed_victim_is_not_drawn_again_and_the_process_ends_with_the_last() -> None:
    for seed in range(20):
        events = Process(1.0, seed, [0, 1, 2, 3], ends_victim=True).first(10)
        assert sorted(e.victim for e in events) == [0, 1, 2, 3]
    fired = _fired_by_every_rank("poisson:rate=1/s:seed=4", RESPIPE, until_s=200.0)
    assert sorted(r for r, evs in fired.items() for _ in evs) == [0, 1, 2, 3]
    assert all(text.startswith(f"kill:rank={r}:") for r, evs in fired.items() for _, text in evs)


def test_node_victims_are_the_testbed_nodes_but_the_hosts() -> None:
    hosts = ["mpt-a", "mpt-b", "mpt-b", "mpt-c", ""]  # "": a spare
    assert node_victims(hosts, RESPIPE) == ["a", "b", "c"]
    assert node_victims(["mpt-h", "mpt-a", "mpt-a", "mpt-b"], STANNIS) == ["a", "b"]
    assert node_victims(["box", "box"], None) == []


# -- firing -------------------------------------------------------------------------------------

def test_an_event_fires_at_the_first_boundary_at_or_after_its_time_one_per_boundary() -> None:
    spec = parse("poisson:rate=1/s:seed=2:rejoin=5s")
    plan_ = LaunchPlan((Role("stage", 0),))  # one victim: every event is rank 0's
    events = Process(1.0, 2, [0], ends_victim=False).first(3)
    clock, slept, fired = Clock(), [], []
    fp = FaultPlan([spec], seed=0, stage=0, rank=0, plan=plan_, clock=clock, sleep=slept.append,
                   on_fire=lambda f, step, d: fired.append((step, d["event"])))
    fp.start()
    clock.t = events[0].at_s - 1e-6
    assert fp.at_step(0) == 0.0 and not fired
    clock.t = events[0].at_s
    assert fp.at_step(1, micro=0) == 0.0 and not fired  # inside a step: never
    assert fp.at_step(1) == 5.0 and fired == [(1, 1)] and slept == [5.0]
    assert fp.at_step(1) == 0.0  # a replayed step does not fire it again
    clock.t = events[2].at_s  # away for a while: two events due, one per boundary
    assert fp.at_step(2) == 5.0 and fp.at_step(3) == 5.0 and fp.at_step(4) == 0.0
    assert fired == [(1, 1), (2, 2), (3, 3)]


def test_the_clock_starts_at_the_first_boundary_when_not_started() -> None:
    clock = Clock()
    clock.t = 1000.0
    fired: list[int] = []
    fp = FaultPlan([parse("poisson:rate=1/s:seed=2")], seed=0, stage=0, rank=0,
                   plan=LaunchPlan((Role("stage", 0),)), clock=clock, kill=lambda: fired.append(1))
    fp.at_step(0)
    assert not fired and fp.drawn.elapsed() == 0.0


def test_a_node_process_fires_on_the_lowest_rank_of_the_node_and_a_dry_plan_only_logs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hosts = ["mpt-a", "mpt-b", "mpt-b", "mpt-a"]
    events = Process(1.0, 9, ["a", "b"], ends_victim=True).first(5)
    assert sorted(e.victim for e in events) == ["a", "b"]
    firing = {"a": 0, "b": 1}
    for rejoin, kind in (("", "node-kill"), (":rejoin=4s", "partition")):
        for r in range(4):
            clock, fired = Clock(), []
            fp = FaultPlan([parse(f"poisson:rate=1/s:seed=9:what=node{rejoin}")], seed=0, stage=None,
                           rank=r, hosts=hosts, dry=True, clock=clock,
                           on_fire=lambda f, step, d, fired=fired: fired.append(str(f)),
                           sleep=lambda s: pytest.fail("a dry plan sleeps"),
                           kill=lambda: pytest.fail("a dry plan kills"))
            fp.start()
            for step in range(40):
                clock.t = step * 0.5
                fp.at_step(step)
            want = [e for e in events if firing[e.victim] == r]
            assert [t.split(":step=")[0] for t in fired] == [f"{kind}:node={e.victim}" for e in want]
            assert all(f"(poisson #{e.number} at " in t for e, t in zip(want, fired, strict=True))


# -- refusals -----------------------------------------------------------------------------------

def test_a_process_with_no_rank_to_take_is_refused() -> None:
    check_reachable([parse("poisson:rate=1/h:seed=1")], RESPIPE, steps=20)
    check_reachable([parse("poisson:rate=1/h:seed=1")], STANNIS, steps=20)
    with pytest.raises(FaultError, match=r"^fault poisson:rate=1/h:seed=1:what=rank: no rank may be a "
                                         r"victim \(the plan: 0=host; .*it would never fire$"):
        check_reachable([parse("poisson:rate=1/h:seed=1")], LaunchPlan((Role("host"),)), steps=20)


def test_a_node_process_off_a_testbed_or_with_only_the_hosts_node_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mpipipe.core.mpi import testbed_nodes

    monkeypatch.setattr(inject, "_hosts", None)
    with pytest.raises(FaultError, match=r"^fault poisson:rate=1/h:seed=1:what=node: the ranks run on "
                                         r"host1, not on the nodes of a testbed that is up; .*never fire$"):
        check_nodes([parse("poisson:rate=1/h:seed=1:what=node")], ["host1", "host1"])
    check_nodes([parse("poisson:rate=1/h:seed=1")], ["host1"])  # of ranks: no node needed
    monkeypatch.setattr(testbed_nodes, "node_hosts", lambda: frozenset({"mpt-h", "mpt-a"}))
    two = LaunchPlan((Role("host"), Role("csd", 1)))
    with pytest.raises(FaultError, match=r"no node may be a victim \(the ranks run on mpt-h; a node "
                                         r"that runs the host or only spare ranks is never drawn\)"):
        check_nodes([parse("poisson:rate=1/h:seed=1:what=node")], ["mpt-h", "mpt-h"], two)
    check_nodes([parse("poisson:rate=1/h:seed=1:what=node")], ["mpt-h", "mpt-a"], two)


def test_stannis_takes_a_process_and_refuses_a_node_process_that_rejoins() -> None:
    from mpipipe.core.mpi.roles import PlanError
    from mpipipe.core.run.configfile import load_config
    from stannis.config import STANNIS_DEFAULTS, stannis_plan

    for spec in ("poisson:rate=1/min:seed=1", "poisson:rate=1/min:seed=1:rejoin=5s",
                 "poisson:rate=1/min:seed=1:what=node"):
        cfg = load_config(None, [f'stannis.inject=["{spec}"]'], STANNIS_DEFAULTS)
        assert stannis_plan(cfg, 5).world_size == 5
    cfg = load_config(None, ['stannis.inject=["poisson:rate=1/min:seed=1:what=node:rejoin=5s"]'],
                      STANNIS_DEFAULTS)
    with pytest.raises(PlanError, match=r"Stannis finds a lost CSD by ULFM only .*drop rejoin="):
        stannis_plan(cfg, 5)


def test_a_process_beside_step_faults_passes_the_start_up_check() -> None:
    check_reachable([parse("kill:stage=1:step=5"), parse("poisson:rate=1/min:seed=1"),
                     parse("stall:rank=3:step=2")], RESPIPE, steps=20, chunks=4, mode="cold")


def test_the_dry_run_shows_a_process_with_its_first_events(monkeypatch, capsys) -> None:
    from pathlib import Path

    from mpipipe.__main__ import main

    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the factory path is the project's
    argv = ["plan", "--config", "jobs/configs/respipe-digits.toml", "--set",
            'model.factory="tests/models/own.py:own_net"', "--in-shape", "1,8,8", "--set",
            'resilience.inject=["poisson:rate=1/min:seed=4:rejoin=10s", "kill:stage=1:step=5"]']
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    at = out.index("faults (resilience.inject; a process's times count from the run's start):")
    first = Process(1 / 60, 4, [0, 1, 2, 3, 4, 5], ends_victim=False).first(5)
    shown = ", ".join(f"rank {e.victim} at {inject._clock_text(e.at_s)}" for e in first)
    assert out[at + 1:] == [
        "  poisson:rate=1/min:seed=4:rejoin=10s:what=rank: a stall of 10 s about every 1min, drawn "
        f"among ranks 0, 1, 2, 3, 4, 5; the first: {shown}",
        "  kill:stage=1:step=5"]
    assert main([*argv[:-1], 'resilience.inject=["poisson:rate=0/h:seed=4"]']) == 2
    assert "rate=0 never fires" in capsys.readouterr().err
