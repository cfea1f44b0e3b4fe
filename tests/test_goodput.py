"""ResPipe's goodput model (mpipipe.respipe.goodput) against hand-computed cases and Young and
Daly's optimum interval, and the cost command that prints it. No MPI, no timing asserted:
every case feeds the model fixed costs."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from mpipipe.respipe.costmodel import StageShape
from mpipipe.respipe.goodput import (
    Costs,
    Failures,
    grid,
    pipelined_seconds,
    plain_samples_per_s,
    predict,
    recommend,
    young_daly_R,
)
from mpipipe.tools.launch import ROOT

FAST = 1e6  # Mbit/s: links that cost nothing


def _stages(k: int = 2, replica: int = 10**6, act: int = 100) -> list[StageShape]:
    return [StageShape(act if s < k - 1 else 0, replica) for s in range(k)]


def _costs(compute=(0.1, 0.1), *, pack=1e12, link=FAST, chunks=1, batch=32) -> Costs:
    return Costs(list(compute), batch, chunks, link, pack, detect_s=0.05, takeover_s=0.1)


@pytest.mark.parametrize("compute, m, want", [((1.0, 1.0), 1, 2.0), ((1.0, 1.0), 4, 1.25),
                                              ((1.0, 1.0, 1.0, 1.0), 8, 11 / 8),
                                              ((3.0, 1.0), 2, 3.5)])
def test_a_step_is_the_fill_and_the_slowest_stage_for_the_rest(compute, m, want):
    # Balanced K stages of t: (m + K - 1) t / m; else the fill (every stage once) and m - 1
    # micro-batches at the slowest stage's pace.
    assert pipelined_seconds(compute, m) == pytest.approx(want)


def test_without_failures_goodput_is_the_failure_free_rate_and_nothing_is_lost():
    p = predict(_stages(), _costs(), Failures(0.0), mode="cold", replicate_every=10, backups={0: 1, 1: 1})
    assert p.goodput == pytest.approx(p.samples_per_s) and p.lose_run == 0.0
    assert p.step_s == pytest.approx(0.2)


def test_replicas_cost_their_packing_once_every_R_steps():
    # 1 MB at 10 MB/s: 0.1 s per replica, spread over R steps.
    for r in (1, 4, 10):
        p = predict(_stages(), _costs(pack=1e7), Failures(0.0), mode="cold", replicate_every=r,
                    backups={0: 1, 1: 1})
        assert p.step_s == pytest.approx(0.2 + 0.1 / r)


def test_hot_mode_loses_no_update_and_cold_loses_half_an_interval_on_average():
    f = Failures(1 / 3600)
    hot = predict(_stages(), _costs(), f, mode="hot", replicate_every=10, backups={0: 1, 1: 1})
    cold = predict(_stages(), _costs(), f, mode="cold", replicate_every=10, backups={0: 1, 1: 1})
    assert hot.lost_updates == 0 and cold.lost_updates == 4.5
    assert hot.goodput > cold.goodput  # same bytes on free links: cold also replays a step
    # Waste of stage failures: 2 stages x rate x (detect + takeover + replay + lost work).
    want = 2 / 3600 * (0.15 + 0.2 + 4.5 * 0.2)
    assert cold.waste["stage failures"] == pytest.approx(want, rel=1e-3)


def test_goodput_falls_as_failures_grow():
    rates = [0, 1 / 86400, 1 / 3600, 1 / 600, 1 / 60]
    for mode in ("cold", "hot", "neighbour"):
        g = [predict(_stages(3), _costs((0.1,) * 3), Failures(r), mode=mode, replicate_every=10,
                     backups={0: 1, 1: 1, 2: 1}).goodput for r in rates]
        assert all(a >= b for a, b in zip(g, g[1:], strict=False)), (mode, g)


def test_the_chance_of_losing_the_run_follows_the_holders():
    # No backup: any failure of K ranks within the run loses it.
    lam, steps = 1 / 600, 3000  # run of 600 s at 0.2 s a step
    bare = predict(_stages(), _costs(), Failures(lam, steps=steps), mode="cold", replicate_every=1,
                   backups={})
    assert bare.lose_run == pytest.approx(1 - math.exp(-2 * lam * 600), rel=1e-6)
    one = predict(_stages(), _costs(), Failures(lam, steps=steps), mode="cold", replicate_every=1,
                  backups={0: 1, 1: 1})
    p = 1 - math.exp(-lam * 600)
    assert one.lose_run == pytest.approx(1 - (1 - p * p) ** 2, rel=1e-4)  # (packing: 1 us a step)
    back = predict(_stages(), _costs(), Failures(lam, rejoin_s=30, steps=steps), mode="cold",
                   replicate_every=1, backups={0: 1, 1: 1})
    assert back.lose_run < one.lose_run < bare.lose_run


def test_the_optimum_R_agrees_with_young_and_daly_where_their_formula_holds():
    # Their regime: a replica costs C seconds of the step it is taken at (packing, not
    # overlapped), failures are rare (M >> C), and a failure loses the work since the
    # last replica. Then the best interval is sqrt(2 C M).
    c, t0, mtbf = 1.0, 0.2, 3600.0
    stages = _stages(2, replica=10**8)
    costs = _costs(pack=1e8)  # 1e8 bytes at 1e8 B/s: C = 1 s
    failures = Failures(1 / (2 * mtbf))  # two stage ranks: M = 3600 s between their failures
    rs = range(1, 3000)
    best = max(rs, key=lambda r: predict(stages, costs, failures, mode="cold", replicate_every=r,
                                         backups={0: 1, 1: 1}).goodput)
    want = young_daly_R(c, t0, mtbf)  # about 424 steps
    assert abs(best / want - 1) <= 0.1, (best, want)


def test_the_recommendation_weighs_safety_before_speed():
    stages, costs = _stages(3), _costs((0.1,) * 3, link=100.0)
    preds = grid(stages, costs, Failures(1 / 60, steps=20000), backups={0: 1, 1: 1, 2: 1})
    best, why = recommend(preds, plain_samples_per_s(stages, costs))
    floor = min(p.lose_run for p in preds)
    assert best.lose_run <= max(0.01, floor + 0.01)
    assert all(p.goodput <= best.goodput for p in preds if p.lose_run <= best.lose_run)
    assert f"{best.mode} R={best.R}" in why
    # Failure-free and free links: every setting is as fast; the safest cheapest wins.
    preds = grid(stages, _costs((0.1,) * 3), Failures(0.0), backups={0: 1, 1: 1, 2: 1})
    best, _ = recommend(preds, plain_samples_per_s(stages, _costs((0.1,) * 3)))
    assert best.goodput == pytest.approx(max(p.goodput for p in preds))


def test_hot_mode_wins_when_failures_are_frequent_and_a_step_is_dear():
    # Slow steps (2 s) and a failure a minute per rank: cold loses (R-1)/2 steps a time.
    stages = _stages(2, replica=10**4)
    costs = _costs((1.0, 1.0))
    preds = grid(stages, costs, Failures(1 / 60, rejoin_s=5, steps=100), backups={0: 2, 1: 2},
                 modes=("cold", "hot"), rs=(5, 10, 50))
    best, _ = recommend(preds, plain_samples_per_s(stages, costs))
    assert best.mode == "hot"


def _cost_command(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpipipe", "cost", "--config",
                           str(ROOT / "jobs/configs/respipe-digits.toml"), "--in-shape", "1,8,8",
                           *extra], capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.timeout(300)
def test_the_cost_command_prints_goodput_and_a_recommendation():
    done = _cost_command("--failure-rate", "1/30min", "--link-rate", "100mbit", "--r", "1,10",
                         "--step-time", "20ms", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert {(r["mode"], r["R"]) for r in out["rows"]} == {(m, r) for m in ("cold", "hot", "neighbour")
                                                          for r in (1, 10)}
    assert out["recommended"]["why"].startswith(f"{out['recommended']['mode']} R=")
    # --step-time: the plain pipeline's failure-free step is the one given.
    assert 32 / out["plain_samples_per_s"] == pytest.approx(0.020, rel=1e-3)
    bad = _cost_command("--failure-rate", "often")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--failure-rate" in bad.stderr
