"""The Stannis bench's ideal: a bound built from the judged steps, never exceeded."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stannis.bound import ideal_sps, judge


def test_a_job_where_no_rank_waits_is_exactly_its_ideal() -> None:
    # Every rank busy for the whole step: the measured throughput is the bound.
    steps = [{0: (1000, 0.1), 1: (130, 0.1), 2: (127, 0.1)}] * 3 + \
            [{0: (990, 0.3), 1: (140, 0.3), 2: (127, 0.3)}]
    wall = 0.1 * 3 + 0.3
    j = judge(steps, wall)
    assert j.ratio == 1.0 and j.valid and j.reason == ""
    assert j.sps == pytest.approx(j.ideal_sps)


def test_waiting_lowers_the_ratio_by_the_time_waited() -> None:
    # The CSD finishes its batch in half the step and waits the rest: it could have
    # trained twice its samples, so the bound counts it at twice its measured rate.
    steps = [{0: (100, 1.0), 1: (50, 0.5)}]
    j = judge(steps, wall_s=1.0)
    assert j.sps == 150.0
    assert ideal_sps(steps) == pytest.approx(100 + 100)
    assert j.ratio == pytest.approx(0.75)


def test_a_busy_time_longer_than_the_wall_time_is_invalid_not_a_result() -> None:
    # 1.135 used to be printed as "HyperTune / ideal"; from inconsistent records
    # it must come out as no ratio at all, with the reason.
    steps = [{0: (100, 1.2), 1: (50, 0.5)}]
    j = judge(steps, wall_s=1.0)
    assert j.ratio is None and not j.valid
    assert "rank 0 was busy 1.2000 s within 1.0000 s" in j.reason
    assert judge([{0: (10, 0.0)}], 1.0).ratio is None  # samples in no busy time
    assert judge([], 1.0).ratio is None
    assert judge([{0: (0, 0.5)}], 1.0).ratio is None  # nothing trained


def test_a_rank_that_left_counts_only_for_the_steps_it_trained() -> None:
    steps = [{0: (100, 1.0), 1: (100, 1.0)}, {0: (200, 1.0)}]
    assert ideal_sps(steps) == pytest.approx(300 / 2.0 + 100 / 1.0)
    assert judge(steps, 2.0).ratio == pytest.approx((400 / 2.0) / 250)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_the_ratio_never_exceeds_one_when_busy_times_fit_in_their_steps(
        ranks: int, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    steps, wall = [], 0.0
    for _ in range(n):
        step_wall = float(rng.uniform(0.01, 2.0))
        wall += step_wall
        # Busy within the step, and at least one rank busy for all of it (or not).
        busy = rng.uniform(0.0, 1.0, ranks) * step_wall
        if rng.random() < 0.5:
            busy[rng.integers(ranks)] = step_wall
        steps.append({r: (int(rng.integers(1, 500)), float(max(busy[r], 1e-6)))
                      for r in range(ranks)})
    j = judge(steps, wall)
    assert j.valid, j.reason
    assert 0.0 < j.ratio <= 1.0
    assert j.sps <= j.ideal_sps * (1 + 1e-12)
