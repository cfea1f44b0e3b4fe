"""HyperTune's pure rules: fitting, equal step times, memory caps, objectives, LR."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stannis.hypertune import (
    RankProfile,
    StepModel,
    TuneError,
    damp,
    equalise,
    evaluate,
    fit_step_model,
    gain,
    imbalance,
    refit,
    scale_factors,
    scaled_lr,
    share_caps,
    should_retune,
    sudden,
    tune,
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
    from mpipipe.core.config import load_config
    from mpipipe.core.roles import PlanError
    from stannis.config import STANNIS_DEFAULTS, stannis_plan

    cfg = load_config(None, ["stannis.max_oversample=0.5"], STANNIS_DEFAULTS)
    with pytest.raises(PlanError, match=r"stannis.max_oversample = 0.5: use 0 \(no cap\)"):
        stannis_plan(cfg, 5)
    for ok in ("0", "1", "2.5"):
        stannis_plan(load_config(None, [f"stannis.max_oversample={ok}"], STANNIS_DEFAULTS), 5)


@pytest.mark.parametrize("setting, message", [
    ("stannis.settle_threshold=1.5", r"stannis.settle_threshold = 1.5: use an imbalance in \[0, 1\)"),
    ("stannis.settle_min_gain=-0.1", r"stannis.settle_min_gain = -0.1: use a gain >= 0"),
])
def test_launch_plan_rejects_a_bad_settling_bar(setting: str, message: str) -> None:
    from mpipipe.core.config import load_config
    from mpipipe.core.roles import PlanError
    from stannis.config import STANNIS_DEFAULTS, stannis_plan

    with pytest.raises(PlanError, match=message):
        stannis_plan(load_config(None, [setting], STANNIS_DEFAULTS), 5)
    stannis_plan(load_config(None, ["stannis.settle_threshold=0"], STANNIS_DEFAULTS), 5)


def test_a_rank_that_changed_speed_is_sudden_noise_is_not() -> None:
    p = RankProfile(StepModel(0.0, 0.001), 1000)
    factors = scale_factors([p, p, p], [100, 0, 100], [0.2, 0.5, 0.11])
    assert factors == [pytest.approx(2.0), 1.0, pytest.approx(1.1)]  # no work: no evidence
    assert sudden(factors)  # a `slow:factor=2` fault looks like this
    assert not sudden([1.1, 0.9, 1.3])  # a misfit or a noisy window
    assert sudden([1.0, 0.6])  # interference that ended: the rank is faster than modelled


class _Events:
    """What the trainer logs and prints, kept for the test."""

    def __init__(self) -> None:
        self.retunes: list[dict] = []
        self.progress = self

    def event(self, kind: str, **detail) -> None:
        if kind == "retune":
            self.retunes.append(detail)

    def message(self, text: str) -> None:
        pass


def _trainer_host(settle_threshold: float):
    """The host's tuning state of a Trainer, without MPI: 1 host + 4 CSDs at 1/8."""
    from collections import deque

    from stannis.config import STANNIS_DEFAULTS
    from stannis.trainer import Trainer

    tr = Trainer.__new__(Trainer)
    tr.cfg = {"stannis": dict(STANNIS_DEFAULTS["stannis"], global_batch=256, max_oversample=0,
                              settle_threshold=settle_threshold)}
    tr.members = [0, 1, 2, 3, 4]
    tr.records = dict.fromkeys(tr.members, 10_000)
    tr.profiles = {r: RankProfile(HOST if r == 0 else CSD, 1000) for r in tr.members}
    tr.batches = list(tune(list(tr.profiles.values()), 256).batches)
    tr.window = {r: deque(maxlen=5) for r in tr.members}
    tr.step, tr.last_change, tr.last_change_step, tr.settling = 0, [], 0, False
    tr.log = tr.run = _Events()
    return tr


def _turn(tr, true: dict[int, StepModel]) -> None:
    """Five steps timed with the ranks' true speeds, then the tuner's check."""
    for _ in range(5):
        for r, b in zip(tr.members, tr.batches, strict=True):
            tr.window[r].append((b, true[r].time(b)))
    tr.step += 5
    tr._maybe_retune()


@pytest.mark.parametrize("settle_threshold", [0.1, 0.0])
def test_after_a_speed_change_the_tuner_settles_once_at_the_lower_bar(settle_threshold):
    tr = _trainer_host(settle_threshold)
    slow = {0: HOST, 1: CSD, 2: StepModel(0.0, 0.016), 3: CSD, 4: CSD}  # CSD 2 at half speed
    _turn(tr, slow)
    assert len(tr.log.retunes) == 1
    assert "settling" not in tr.log.retunes[0]["reason"]
    # The move was planned from the old plan's steps; now the host also runs 15% slower
    # than its model said: an imbalance under the usual bar, over the settle bar.
    slower = {**slow, 0: StepModel(0.0, 0.00115)}
    _turn(tr, slower)
    settled = [e for e in tr.log.retunes if "settling" in e["reason"]]
    assert len(settled) == (1 if settle_threshold else 0)
    # Once only: the same kind of residual imbalance later leaves the plan alone.
    n = len(tr.log.retunes)
    _turn(tr, {**slower, 0: StepModel(0.0, 0.00132)})
    assert len(tr.log.retunes) == n


def test_launch_plan_rejects_a_fault_inside_a_micro_batch() -> None:
    from mpipipe.core.config import load_config
    from mpipipe.core.roles import PlanError
    from stannis.config import STANNIS_DEFAULTS, stannis_plan

    cfg = load_config(None, ['stannis.inject=["kill:rank=2:step=3:micro=1"]'], STANNIS_DEFAULTS)
    with pytest.raises(PlanError, match="Stannis steps have no micro-batches; drop micro="):
        stannis_plan(cfg, 5)
    stannis_plan(load_config(None, ['stannis.inject=["kill:rank=2:step=3"]'],
                             STANNIS_DEFAULTS), 5)
