"""HyperTune's pure rules: fitting, equal step times, memory caps, objectives, LR."""

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stannis.hypertune import (
    MAD_TO_SD,
    RankProfile,
    Retuner,
    RetuneRule,
    StepModel,
    TuneError,
    batch_floor,
    damp,
    equalise,
    evaluate,
    fit_step_model,
    gain,
    gain_threshold,
    imbalance,
    noise_z,
    refit,
    relative_spread,
    scale_factors,
    scaled_lr,
    share_caps,
    should_retune,
    sudden,
    tune,
    with_floors,
)

HOST = StepModel(0.0, 0.001)  # 1000 samples/s
CSD = StepModel(0.0, 0.008)   # 1/8 of the host


def _host_and_csds(n: int = 4, cap: int = 10_000, **power) -> list[RankProfile]:
    host = RankProfile(HOST, cap, idle_w=power.get("host_idle", 0.0),
                       active_w=power.get("host_active", 0.0))
    csd = RankProfile(CSD, cap, idle_w=power.get("csd_idle", 0.0),
                      active_w=power.get("csd_active", 0.0))
    return [host] + [csd] * n


def test_fit_recovers_a_known_line() -> None:
    m = fit_step_model([8, 32, 128], [0.01 + 8 * 0.002, 0.01 + 32 * 0.002, 0.01 + 128 * 0.002])
    assert m.overhead_s == pytest.approx(0.01)
    assert m.per_sample_s == pytest.approx(0.002)
    assert m.peak_sps == pytest.approx(500)


def test_fit_with_noise_never_gives_negative_terms() -> None:
    m = fit_step_model([8, 16], [0.05, 0.04])  # time fell as the batch grew
    assert m.overhead_s == 0 and m.per_sample_s > 0
    m = fit_step_model([10, 20], [0.010, 0.030])  # negative intercept
    assert m.overhead_s == 0 and m.per_sample_s > 0


def test_fit_rejects_bad_input() -> None:
    with pytest.raises(TuneError):
        fit_step_model([], [])
    with pytest.raises(TuneError):
        fit_step_model([0, 8], [0.1, 0.2])


def test_host_and_four_eighth_speed_csds_reach_the_ideal() -> None:
    profiles = _host_and_csds()
    plan = tune(profiles, 192)
    assert plan.batches == (128, 16, 16, 16, 16)
    assert plan.samples_per_s == pytest.approx(1500)  # 1 + 4/8 host units
    equal = evaluate(profiles, (39, 39, 38, 38, 38))
    assert equal.samples_per_s < 0.65 * 1000  # the slowest rank sets the pace
    assert plan.samples_per_s / equal.samples_per_s > 2.0


def test_step_times_are_equal_up_to_one_sample() -> None:
    profiles = [RankProfile(StepModel(0.002 * i, 0.001 * (i + 1)), 1000) for i in range(5)]
    batches = equalise(profiles, 500)
    times = [p.model.time(b) for p, b in zip(profiles, batches, strict=True)]
    assert sum(batches) == 500
    assert max(times) - min(times) <= max(p.model.per_sample_s for p in profiles)


def test_memory_cap_is_respected() -> None:
    profiles = _host_and_csds(cap=10_000)
    profiles[0] = RankProfile(HOST, 64)
    plan = tune(profiles, 192)
    assert plan.batches[0] == 64
    assert sum(plan.batches) == 192
    assert plan.batches[1:] == (32, 32, 32, 32)


def test_caps_below_global_batch_run_everyone_at_cap() -> None:
    profiles = [RankProfile(HOST, 10), RankProfile(CSD, 5)]
    assert tune(profiles, 100).batches == (10, 5)


def test_min_batches_above_global_batch_is_an_error() -> None:
    profiles = [RankProfile(HOST, 10, min_batch=8), RankProfile(CSD, 10, min_batch=8)]
    with pytest.raises(TuneError, match="global batch"):
        tune(profiles, 10)


def test_unknown_objective_is_named() -> None:
    with pytest.raises(TuneError, match="speed"):
        tune(_host_and_csds(), 64, objective="speed")


def test_energy_objective_moves_work_to_cheap_ranks() -> None:
    # The host is fast but hungry; CSDs draw little. Idle power is small, so
    # a longer step on the CSDs costs less than keeping the host busy.
    profiles = _host_and_csds(host_idle=1.0, host_active=200.0, csd_idle=0.5, csd_active=5.0)
    fast = tune(profiles, 192, objective="throughput")
    frugal = tune(profiles, 192, objective="energy")
    assert frugal.samples_per_joule > fast.samples_per_joule
    assert frugal.batches[0] < fast.batches[0]
    assert frugal.samples_per_s <= fast.samples_per_s
    mixed = tune(profiles, 192, objective="mix", mix_weight=0.5)
    assert frugal.samples_per_joule >= mixed.samples_per_joule >= fast.samples_per_joule
    assert tune(profiles, 192, objective="mix", mix_weight=1.0).batches == fast.batches


def test_energy_objective_with_costly_idle_stays_fast() -> None:
    # When idle power dominates, finishing sooner is also the cheapest.
    profiles = _host_and_csds(host_idle=100.0, host_active=110.0, csd_idle=50.0, csd_active=51.0)
    assert tune(profiles, 192, objective="energy").batches == tune(profiles, 192).batches


def test_imbalance_and_threshold() -> None:
    assert imbalance([0.1, 0.1, 0.1]) == 0
    assert imbalance([0.1, 0.2]) == pytest.approx(0.5)
    assert imbalance([0.1, 0.0]) == 0  # an idle rank is not a straggler
    assert should_retune([0.1, 0.2], 0.25)
    assert not should_retune([0.1, 0.11], 0.25)


def test_slowdown_is_refitted_and_rebalanced() -> None:
    profiles = _host_and_csds()
    plan = tune(profiles, 192)
    times = [p.model.time(b) for p, b in zip(profiles, plan.batches, strict=True)]
    times[2] *= 2  # CSD 2 slowed by other work on its drive
    assert should_retune(times, 0.25)
    again = tune(refit(profiles, plan.batches, times), 192)
    assert again.batches[2] < plan.batches[2]
    assert sum(again.batches) == 192
    # New ideal: 1000 + 3 * 125 + 62.5 samples/s.
    assert again.samples_per_s == pytest.approx(1437.5, rel=0.02)


def test_dropping_a_rank_rebalances_the_survivors() -> None:
    profiles = _host_and_csds()
    plan = tune(profiles[:4], 192)
    assert sum(plan.batches) == 192 and len(plan.batches) == 4


def test_linear_lr_scaling_with_warmup() -> None:
    assert scaled_lr(0.1, 32, 128, step=0, warmup_steps=4) == pytest.approx(0.1 + 0.3 / 4)
    assert scaled_lr(0.1, 32, 128, step=3, warmup_steps=4) == pytest.approx(0.4)
    assert scaled_lr(0.1, 32, 128, step=100, warmup_steps=4) == pytest.approx(0.4)
    assert scaled_lr(0.1, 32, 64, step=0, warmup_steps=0) == pytest.approx(0.2)


@settings(max_examples=60, deadline=None)
@given(
    per_sample=st.lists(st.floats(1e-4, 1e-1), min_size=1, max_size=6),
    overhead=st.floats(0.0, 0.05),
    caps=st.lists(st.integers(1, 300), min_size=6, max_size=6),
    global_batch=st.integers(6, 800),
)
def test_tuned_plan_respects_caps_and_beats_equal_split(per_sample, overhead, caps,
                                                       global_batch) -> None:
    profiles = [RankProfile(StepModel(overhead, s), c) for s, c in zip(per_sample, caps,
                                                                       strict=False)]
    plan = tune(profiles, global_batch)
    assert all(p.min_batch <= b <= p.max_batch for p, b in zip(profiles, plan.batches,
                                                               strict=True))
    assert sum(plan.batches) == min(global_batch, sum(p.max_batch for p in profiles))
    n = len(profiles)
    share = [min(p.max_batch, plan.global_batch // n) for p in profiles]
    if sum(share) == plan.global_batch:
        assert plan.step_s <= evaluate(profiles, share).step_s + 1e-12
    assert math.isfinite(plan.samples_per_s)


def test_refit_scales_the_whole_step_and_keeps_correct_models() -> None:
    p = RankProfile(StepModel(0.01, 0.002), 100)
    same = refit([p], [10], [p.model.time(10)])[0]
    assert same.model.overhead_s == pytest.approx(0.01)
    assert same.model.per_sample_s == pytest.approx(0.002)
    slow = refit([p], [10], [3 * p.model.time(10)])[0]
    assert slow.model.overhead_s == pytest.approx(0.03)
    assert slow.model.per_sample_s == pytest.approx(0.006)
    idle = refit([p], [0], [0.0])[0]
    assert idle == p


def test_gain_per_objective() -> None:
    profiles = _host_and_csds(host_idle=40.0, host_active=100.0, csd_idle=5.0, csd_active=10.0)
    equal = evaluate(profiles, (39, 39, 38, 38, 38))
    tuned = tune(profiles, 192)
    assert gain(equal, tuned) > 1.0
    assert gain(tuned, tuned) == pytest.approx(0.0)
    assert gain(equal, tuned, "energy") > 0
    assert gain(equal, tuned, "mix", 0.5) > 0


def test_damp_moves_part_way_and_keeps_the_sum() -> None:
    assert damp((10, 10, 10), (4, 16, 10), 0.5) == (7, 13, 10)
    out = damp((1, 70, 57), (66, 1, 61), 0.5)
    assert sum(out) == 128
    assert all(min(a, b) <= x <= max(a, b) for a, b, x in zip((1, 70, 57), (66, 1, 61), out,
                                                            strict=True))
    assert damp((10, 10), (4, 16), 1.0) == (4, 16)
    assert damp((10, 10, 10), (15, 15), 0.5) == (15, 15)  # a rank was dropped: no damping


def test_share_caps_follow_each_ranks_share_of_the_records() -> None:
    # The bench's layout: host 4096 records, four CSDs 1024 each (1/8 of all data each).
    assert share_caps([4096] + [1024] * 4, 1536, 2.0) == [1536, 384, 384, 384, 384]
    assert share_caps([3, 1], 10, 1.0) == [8, 3]  # ceil: the global batch always fits
    assert share_caps([5, 0], 10, 2.0) == [20, 0]
    assert share_caps([5, 1], 10, 0) == [10, 10]  # 0 turns the cap off
    with pytest.raises(TuneError, match="max_oversample"):
        share_caps([5, 1], 10, 0.5)
    with pytest.raises(TuneError, match="record counts"):
        share_caps([0, 0], 10, 2.0)


@settings(max_examples=80, deadline=None)
@given(records=st.lists(st.integers(0, 10_000), min_size=1, max_size=8).filter(lambda r: sum(r)),
       global_batch=st.integers(1, 4096), factor=st.floats(1.0, 8.0))
def test_share_caps_always_hold_the_global_batch(records, global_batch, factor) -> None:
    caps = share_caps(records, global_batch, factor)
    assert sum(caps) >= global_batch
    total = sum(records)
    for n, cap in zip(records, caps, strict=True):
        assert cap <= factor * global_batch * n / total + 1


def test_a_rank_that_looks_free_per_sample_cannot_fill_the_batch() -> None:
    # What a CI run once fitted on 8x8 digits: steps almost all overhead, and one CSD's
    # per-sample cost lost in the noise. Uncapped, that CSD takes nearly the whole batch
    # from its eighth of the data; capped at twice its share it takes 32 of 128.
    models = [StepModel(0.010, 2e-4)] + [StepModel(0.012, 4e-4)] * 2 + \
        [StepModel(0.010, 1e-6), StepModel(0.012, 4e-4)]
    uncapped = tune([RankProfile(m, 256) for m in models], 128)
    assert uncapped.batches[3] > 64
    caps = share_caps([512] + [128] * 4, 128, 2.0)
    capped = tune([RankProfile(m, c) for m, c in zip(models, caps, strict=True)], 128)
    assert capped.batches[3] == 32 and sum(capped.batches) == 128


def test_launch_plan_rejects_an_oversample_factor_below_one() -> None:
    from mpipipe.core.mpi.roles import PlanError
    from mpipipe.core.run.configfile import load_config
    from stannis.config import STANNIS_DEFAULTS, stannis_plan

    cfg = load_config(None, ["stannis.max_oversample=0.5"], STANNIS_DEFAULTS)
    with pytest.raises(PlanError, match=r"stannis.max_oversample = 0.5: use 0 \(no cap\)"):
        stannis_plan(cfg, 5)
    for ok in ("0", "1", "2.5"):
        stannis_plan(load_config(None, [f"stannis.max_oversample={ok}"], STANNIS_DEFAULTS), 5)


@pytest.mark.parametrize("setting, message", [
    ("stannis.noise_retunes_per_100=-1", r"stannis.noise_retunes_per_100 = -1(\.0)?: use a rate >= 0"),
    ("stannis.overhead_share=1", r"stannis.overhead_share = 1(\.0)?: use a share in \[0, 1\)"),
    ("stannis.min_gain=-0.1", r"stannis.min_gain = -0.1: use a gain >= 0"),
    ("stannis.imbalance_threshold=1.5", r"stannis.imbalance_threshold = 1.5: use an imbalance"),
])
def test_launch_plan_rejects_a_bad_retune_rule(setting: str, message: str) -> None:
    from mpipipe.core.mpi.roles import PlanError
    from mpipipe.core.run.configfile import load_config
    from stannis.config import STANNIS_DEFAULTS, stannis_plan

    with pytest.raises(PlanError, match=message):
        stannis_plan(load_config(None, [setting], STANNIS_DEFAULTS), 5)
    for ok in ("stannis.noise_retunes_per_100=0", "stannis.overhead_share=0"):
        stannis_plan(load_config(None, [ok], STANNIS_DEFAULTS), 5)


def test_a_rank_that_changed_speed_is_sudden_noise_is_not() -> None:
    p = RankProfile(StepModel(0.0, 0.001), 1000)
    factors = scale_factors([p, p, p], [100, 0, 100], [0.2, 0.5, 0.11])
    assert factors == [pytest.approx(2.0), 1.0, pytest.approx(1.1)]  # no work: no evidence
    assert sudden(factors)  # a `slow:factor=2` fault looks like this
    assert not sudden([1.1, 0.9, 1.3])  # a misfit or a noisy window
    assert sudden([1.0, 0.6])  # interference that ended: the rank is faster than modelled


def test_launch_plan_rejects_a_fault_inside_a_micro_batch() -> None:
    from mpipipe.core.mpi.roles import PlanError
    from mpipipe.core.run.configfile import load_config
    from stannis.config import STANNIS_DEFAULTS, stannis_plan

    cfg = load_config(None, ['stannis.inject=["kill:rank=2:step=3:micro=1"]'], STANNIS_DEFAULTS)
    with pytest.raises(PlanError, match="Stannis steps have no micro-batches; drop micro="):
        stannis_plan(cfg, 5)
    stannis_plan(load_config(None, ['stannis.inject=["kill:rank=2:step=3"]'],
                             STANNIS_DEFAULTS), 5)


# -- re-tune on change, not on noise (issue 37, item 4) ---------------------------------

def test_batch_floor_is_where_overhead_is_half_the_step() -> None:
    m = StepModel(0.010, 0.001)  # 10 ms a step, 1 ms a sample
    assert batch_floor(m) == 10  # 10 ms overhead + 10 ms of samples
    assert m.overhead_s / m.time(batch_floor(m)) <= 0.5 < m.overhead_s / m.time(9)
    assert batch_floor(m, 0.25) == 30  # overhead at most a quarter of the step
    assert batch_floor(StepModel(0.0, 0.001)) == 1  # no overhead: no floor
    assert batch_floor(m, 0.0) == 1  # 0 turns the floor off


def test_floors_bind_the_plan_and_shrink_in_proportion_when_they_cannot_fit() -> None:
    # The demo's benchmark fit (ResNet on 8x8 digits, CSDs at 1/8): each CSD step is
    # mostly overhead. Without floors the tuner gave the CSDs one sample each.
    models = [StepModel(0.0059, 0.00031), StepModel(0.0745, 0.0027), StepModel(0.0601, 0.0031),
              StepModel(0.0852, 0.0024), StepModel(0.0697, 0.0030)]
    bare = [RankProfile(m, 256) for m in models]
    assert tune(bare, 128).batches[1:] == (1, 1, 1, 1)
    floored, fits = with_floors(bare, 128)
    assert fits and [p.min_batch for p in floored] == [batch_floor(m) for m in models]
    plan = tune(floored, 128)
    assert sum(plan.batches) == 128
    for p, b in zip(floored, plan.batches, strict=True):
        assert b >= p.min_batch and p.model.overhead_s <= 0.5 * p.model.time(b)
    small, fits = with_floors(bare, 64)  # floors of 20..36 cannot all fit in 64
    assert not fits and sum(p.min_batch for p in small) <= 64
    assert all(p.min_batch >= 1 for p in small)
    assert tune(small, 64).global_batch == 64
    # A floor never exceeds the rank's cap, and refitting keeps it (both terms scale).
    capped, _ = with_floors([RankProfile(models[1], 10)], 128)
    assert capped[0].min_batch == 10
    assert batch_floor(refit(bare, [1] * 5, [0.3] * 5)[1].model) == batch_floor(models[1])


def test_noise_rule_figures() -> None:
    # 1 false re-tune per 100 steps, a check every 5 steps, 5 ranks: 1% per rank and check.
    assert noise_z(1.0, 5, 5) == pytest.approx(2.326, abs=1e-3)
    assert noise_z(0.0, 5, 5) == math.inf
    # One step that waited for a core does not make every step look noisy.
    assert relative_spread([1.0, 1.01, 0.99, 1.0, 3.0]) < 0.02
    assert relative_spread([1.0]) == 0.0
    # The host holds 3/4 of the samples: its noise moves the candidate's step too, so a
    # CSD that looks slowest is the case that sets the bar.
    bar = gain_threshold([0.04, 0.0, 0.0], [0.75, 0.125, 0.125], 2.0)
    assert bar == pytest.approx(2.0 * math.hypot(0.04 * 0.75, 0.0))
    assert gain_threshold([0.0, 0.0], [0.5, 0.5], 2.0, granularity=0.01) == 0.01


BENCH_HOST = StepModel(0.002, 0.0002)  # bench-like: LeNet on 3x32x32, CSDs at 1/8
BENCH_CSD = StepModel(0.016, 0.0016)
# What the benchmark phase fitted: off in shape (overhead vs per sample), as real fits are.
BENCH_FIT = [StepModel(0.001, 0.00022)] + [StepModel(0.020, 0.0014)] * 4


class _SharedMachine:
    """Step-time noise as the bench's log shows it on a loaded 2-core machine.

    The host: lognormal noise of 5% a step, and now and then (10% of steps) a burst of
    other load that makes 3 to 8 steps 10-30% slower. An emulated CSD: nearly equal
    steps (its stretch takes the least CPU time of its recent steps) whose level shifts
    now and then (15% of steps) by a lognormal 6%, and stays there for a while.
    """

    def __init__(self, rng: random.Random, ranks: int) -> None:
        self.rng = rng
        self.burst = [0] * ranks
        self.burst_k = [1.0] * ranks
        self.level = [1.0] * ranks

    def __call__(self, rank: int) -> float:
        rng = self.rng
        if rank == 0:
            if self.burst[0] == 0 and rng.random() < 0.1:
                self.burst[0] = rng.randint(3, 8)
                self.burst_k[0] = 1.1 + 0.2 * rng.random()
            k = self.burst_k[0] if self.burst[0] > 0 else 1.0
            self.burst[0] = max(0, self.burst[0] - 1)
            return k * rng.lognormvariate(0.0, 0.05)
        if rng.random() < 0.15:
            self.level[rank] = rng.lognormvariate(0.0, 0.06)
        return self.level[rank] * rng.lognormvariate(0.0, 0.002)


def _simulate(true: list[StepModel], fitted: list[StepModel], global_batch: int, steps: int,
              sigma: float, seed: int, slow: tuple[int, int] | None = None,
              every: int = 5, shared: bool = False, factor: float = 2.0,
              rule: RetuneRule | None = None) -> tuple[list[tuple[int, list[int]]],
                                                       list[RankProfile]]:
    """Drive the host's Retuner as the trainer does, with seeded noisy step times.

    Each step time is the rank's true time (x ``factor`` from ``slow = (rank, step)`` on) times
    lognormal noise of ``sigma``, and 3% of steps wait up to 3x longer (a busy core);
    with ``shared``, times the noise of :class:`_SharedMachine` instead of the lognormal.
    Returns every plan in force (step taken, batches) and the constrained profiles.
    """
    rng = random.Random(seed)
    machine = _SharedMachine(rng, len(true)) if shared else None
    ranks = list(range(len(true)))
    profiles = [RankProfile(m, 2048) for m in fitted]

    def constrain(ps: list[RankProfile]) -> list[RankProfile]:
        return with_floors(ps, global_batch)[0]

    batches = list(tune(constrain(profiles), global_batch).batches)
    plans = [(0, batches)]
    tuner = Retuner(rule or RetuneRule(every=every))
    tuner.restart(ranks)
    for step in range(1, steps + 1):
        for r, (m, b) in enumerate(zip(true, batches, strict=True)):
            k = factor if slow is not None and r == slow[0] and step >= slow[1] else 1.0
            t = k * m.time(b) * (machine(r) if machine else rng.lognormvariate(0.0, sigma))
            if rng.random() < 0.03:
                t *= 1.0 + 2.0 * rng.random()
            tuner.record(r, b, t)
        decision = tuner.check(step, ranks, batches, profiles, constrain, global_batch)
        if decision is None:
            continue
        profiles = decision.profiles
        if decision.target is not None and list(decision.target) != batches:
            batches = list(decision.target)
            plans.append((step, batches))
            tuner.restart(ranks)
    return plans, constrain(profiles)


@pytest.mark.parametrize("sigma", [0.03, 0.1, 0.2])
def test_a_steady_noisy_run_retunes_at_most_twice_per_100_steps(sigma: float) -> None:
    true = [BENCH_HOST] + [BENCH_CSD] * 4
    for seed in range(10):
        plans, _ = _simulate(true, BENCH_FIT, 1536, 300, sigma, seed)
        retunes = len(plans) - 1  # after the first plan
        assert retunes <= 2 * 300 / 100, (seed, plans)


@pytest.mark.parametrize("sigma", [0.03, 0.1])
def test_a_csd_that_slows_2x_is_followed_within_10_steps(sigma: float) -> None:
    true = [BENCH_HOST] + [BENCH_CSD] * 4
    for seed in range(10):
        plans, _ = _simulate(true, BENCH_FIT, 1536, 200, sigma, seed, slow=(2, 101))
        before = [b for s, b in plans if s < 101][-1]
        after = [(s, b) for s, b in plans if s >= 101]
        assert after, (seed, plans)
        step, batches = after[0]
        assert step - 100 <= 10, (seed, plans)
        assert batches[2] < 0.7 * before[2], (seed, plans)  # about half the work


def test_the_floor_holds_in_every_plan_of_an_overhead_bound_run() -> None:
    # The demo's measured fit (ResNet on 8x8 digits): a CSD step is mostly overhead.
    models = [StepModel(0.0059, 0.00031), StepModel(0.0745, 0.0027), StepModel(0.0601, 0.0031),
              StepModel(0.0852, 0.0024), StepModel(0.0697, 0.0030)]
    for seed in range(5):
        plans, profiles = _simulate(models, models, 128, 150, 0.1, seed, slow=(3, 60))
        for _, batches in plans:
            assert sum(batches) == 128
            for p, b in zip(profiles, batches, strict=True):
                assert b >= p.min_batch >= batch_floor(p.model) > 1
        assert len(plans) - 1 <= 3, plans  # the slow-down, and at most a correction or two


def test_a_slow_down_early_in_the_run_is_followed_too() -> None:
    # At step 11 the tuner has seen one drift between windows; the jump must not be
    # taken for noise and raise the bar that the move it calls for has to pass (the
    # MPI test of every CSD slowed 8x at step 10 found that).
    true = [BENCH_HOST] + [BENCH_CSD] * 4
    for seed in range(10):
        plans, _ = _simulate(true, true, 1536, 40, 0.05, seed, slow=(2, 11))
        after = [(s, b) for s, b in plans if s >= 11]
        assert after and after[0][0] - 10 <= 10, (seed, plans)
        assert after[0][1][2] < 0.7 * plans[0][1][2], (seed, plans)


@pytest.mark.parametrize("seed", range(10))
def test_a_steady_run_on_a_shared_machine_retunes_at_most_twice_per_100_steps(seed: int) -> None:
    # The bench's noise (issue 37): host load bursts of a few steps, CSD levels that
    # shift now and then and are flat in between. After the first 30 steps (the tune
    # from the benchmark's first guess), at most 2 re-tunes per 100 steps.
    true = [BENCH_HOST] + [BENCH_CSD] * 4
    plans, _ = _simulate(true, BENCH_FIT, 1536, 330, 0.0, seed, shared=True)
    late = [s for s, _ in plans if s > 30]
    assert len(late) <= 2 * 300 / 100, plans


@pytest.mark.parametrize("seed", range(10))
def test_a_csd_that_slows_2x_on_a_shared_machine_is_followed_within_10_steps(seed: int) -> None:
    true = [BENCH_HOST] + [BENCH_CSD] * 4
    plans, _ = _simulate(true, BENCH_FIT, 1536, 200, 0.0, seed, slow=(2, 101), shared=True)
    before = [b for s, b in plans if s < 101][-1]
    after = [(s, b) for s, b in plans if s >= 101]
    assert after and after[0][0] - 100 <= 10, plans
    assert after[0][1][2] < 0.7 * before[2], plans


def _drive(tuner: Retuner, profiles: list[RankProfile], batches: list[int], times: list[float],
           steps: range) -> list[tuple[int, tuple[int, ...]]]:
    """Feed exact step times (one per rank) for ``steps``; return the moves the tuner made."""
    ranks = list(range(len(batches)))

    def constrain(ps: list[RankProfile]) -> list[RankProfile]:
        return ps

    moves = []
    for step in steps:
        for r in ranks:
            tuner.record(r, batches[r], times[r])
        d = tuner.check(step, ranks, batches, profiles, constrain, sum(batches))
        if d is not None:
            profiles[:] = d.profiles
            if d.target is not None:
                moves.append((step, d.target))
                batches[:] = d.target
                tuner.restart(ranks)
    return moves


def _in_balance() -> tuple[Retuner, list[RankProfile], list[int]]:
    """A host and one CSD in balance for 20 steps, without noise: no re-tune yet."""
    models = [StepModel(0.0, 0.001), StepModel(0.0, 0.008)]
    profiles = [RankProfile(m, 10_000) for m in models]
    batches = [800, 100]
    tuner = Retuner(RetuneRule())
    tuner.restart([0, 1])
    assert _drive(tuner, profiles, batches, [0.8, 0.8], range(1, 21)) == []
    return tuner, profiles, batches


def test_a_move_that_passes_the_bar_once_waits_for_the_next_check() -> None:
    # Host and one CSD in balance, no noise; then the host is 20% slower. One check
    # that sees it is not enough (a burst of load passes once); the next one is.
    tuner, profiles, batches = _in_balance()
    burst = _drive(tuner, profiles, batches, [0.96, 0.8], range(21, 26))  # 5 slow steps
    assert burst == [] and tuner.pending is not None and tuner.pending[0] == 25
    assert _drive(tuner, profiles, batches, [0.8, 0.8], range(26, 51)) == []  # it passed
    moves = _drive(tuner, profiles, batches, [0.96, 0.8], range(51, 71))  # it stays
    assert moves and moves[0][0] == 60 and moves[0][1][0] < 800


def test_a_sudden_change_is_followed_at_once() -> None:
    tuner, profiles, batches = _in_balance()
    moves = _drive(tuner, profiles, batches, [0.8, 1.6], range(21, 26))  # the CSD slows 2x
    assert moves == [(25, moves[0][1])] and moves[0][1][1] < 60


def test_a_shift_of_a_flat_level_counts_as_noise() -> None:
    # An emulated CSD: equal steps, whose level shifts by 10% (its stretch base moved).
    # The shift enters the drift record, so the next one is not taken for a change.
    models = [StepModel(0.0, 0.001), StepModel(0.0, 0.008)]
    profiles = [RankProfile(m, 10_000) for m in models]
    tuner = Retuner(RetuneRule())
    tuner.restart([0, 1])
    batches = [800, 100]
    for k, level in enumerate([0.8, 0.88, 0.8, 0.88, 0.8, 0.88]):
        _drive(tuner, profiles, batches, [0.8, level], range(5 * k + 1, 5 * k + 6))
    assert tuner.drift_of(1) == pytest.approx(MAD_TO_SD * math.log(1.1), rel=1e-6)
