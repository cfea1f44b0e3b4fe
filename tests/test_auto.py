"""resilience.mode / replicate_every = "auto" (mpipipe.respipe.auto): the keys checked, the
choice's inputs, R chosen again at rounds; and end to end, a run whose choice was measured
equals the run configured with that choice, bit for bit. Nothing here asserts a time."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from jobs import checkpoint_tensors, completed_once
from mpipipe.core.run.configfile import ConfigError, load_config
from mpipipe.pipeline.config import PIPELINE_CHOICES, PIPELINE_DEFAULTS
from mpipipe.respipe import auto
from mpipipe.respipe.costmodel import StageShape
from mpipipe.respipe.messages import Decision
from mpipipe.tools.launch import ROOT, run_mpi

CONFIG = str(ROOT / "jobs/configs/respipe-digits.toml")


def _cfg(*sets: str) -> dict:
    return load_config(CONFIG, list(sets), PIPELINE_DEFAULTS, PIPELINE_CHOICES)


def _request(*sets: str, backups: bool = True, virtual: bool = False):
    return auto.AutoRequest.from_config(_cfg(*sets), has_backups=backups, virtual=virtual)


def test_auto_weighs_the_modes_the_plan_allows():
    rate = 'resilience.failure_rate="1/30min"'
    both = _request('resilience.mode="auto"', 'resilience.replicate_every="auto"', rate)
    assert both.modes == ("cold", "hot") and len(both.rs) > 5
    assert both.failure_rate == pytest.approx(1 / 1800) and both.link_mbit is None
    assert _request('resilience.mode="auto"', rate, backups=False).modes == ("neighbour",)
    assert _request('resilience.mode="auto"', rate, virtual=True).modes == ("cold",)
    fixed_r = _request('resilience.mode="auto"', "resilience.replicate_every=10", rate,
                       'resilience.link_rate="100mbit"')
    assert fixed_r.rs == (10,) and fixed_r.link_mbit == 100
    assert _request() is None  # nothing "auto": nothing to choose


@pytest.mark.parametrize("sets, says", [
    (['resilience.mode="auto"'], "give resilience.failure_rate"),
    (['resilience.failure_rate="1/h"'], "failure_rate is read only when"),
    (['resilience.link_rate="1gbit"'], "link_rate is read only when"),
    (['resilience.mode="auto"', 'resilience.failure_rate="often"'], "resilience.failure_rate: 'often'"),
    (['resilience.replicate_every="auto"', 'resilience.failure_rate="1/h"',
      'resilience.link_rate="fast"'], "resilience.link_rate: 'fast'"),
])
def test_a_key_that_cannot_take_effect_or_a_bad_rate_is_one_line(sets, says):
    with pytest.raises(ValueError, match=says):
        _request(*sets)


def test_replicas_chosen_where_none_is_sent_is_refused():
    with pytest.raises(ValueError, match="no replica is sent"):
        _request('resilience.replicate_every="auto"', 'resilience.failure_rate="1/h"', backups=False)


def test_replicate_every_takes_an_integer_or_auto_only():
    with pytest.raises(ConfigError, match='must be an integer or "auto"'):
        _cfg('resilience.replicate_every="often"')
    assert _cfg('resilience.replicate_every="auto"')["resilience"]["replicate_every"] == "auto"


def test_a_hot_mirror_shares_its_nodes_cores_and_a_cold_backup_does_not():
    plan = SimpleNamespace(ranks_of=lambda kind, k=None: {("stage", 0): [0], ("stage", 1): [1],
                                                          ("backup", None): [2, 3]}[(kind, k)])
    one_host = [("h", 2.0)] * 4  # 2 cores for 2 stages (cold) or 4 busy ranks (hot)
    f = auto.cpu_factors(plan, one_host, 2)
    assert f[""] == [1.0, 1.0] and f["hot"] == [2.0, 2.0]
    # The testbed: a node each, half a core each: as slow as rank 0 measured (on its own half).
    nodes = [(f"n{r}", 0.5) for r in range(4)]
    assert auto.cpu_factors(plan, nodes, 2) == {"": [1.0, 1.0], "hot": [1.0, 1.0]}


def test_the_poisson_tail_is_exact_for_small_counts():
    mean = 0.5
    assert auto._poisson_tail(1, mean) == pytest.approx(1 - math.exp(-mean))
    assert auto._poisson_tail(2, mean) == pytest.approx(1 - math.exp(-mean) * (1 + mean))
    assert auto._poisson_tail(0, mean) == pytest.approx(1.0)  # at least none: certain


def _choice(r: int = 500, rate: float = 1 / 86400, step_s: float = 0.01) -> auto.Choice:
    return auto.Choice("cold", r, "start", (0.01, 0.01, 0.01), 1000.0, 1e9, rate, step_s, 3200.0)


_SHAPES = [StageShape(256, 40_000, 40_000), StageShape(256, 40_000, 40_000), StageShape(0, 40_000, 40_000)]


def _rechoose(choice: auto.Choice, *, failures: int, elapsed: float, step_s: float | None):
    request = auto.AutoRequest(("cold",), (1, 2, 5, 10, 50, 100, 500), choice.failure_rate, None)
    return auto.rechoose(request, choice, shapes=_SHAPES, batch_size=32, chunks=4, labels=8,
                         input_bytes=256, backups={0: 1, 1: 1, 2: 1}, steps=10_000,
                         failures=failures, elapsed_s=elapsed, ranks=6, step_s=step_s)


def test_r_is_chosen_again_only_when_the_run_drifts_from_the_model():
    assert _rechoose(_choice(), failures=0, elapsed=100, step_s=0.011) is None
    # One failure in 10 minutes of 6 ranks, where one a day per rank was given, is not
    # unlikely enough (4%); two are (0.08%). R comes down.
    assert _rechoose(_choice(), failures=1, elapsed=600, step_s=0.011) is None
    new, why, scale = _rechoose(_choice(), failures=2, elapsed=600, step_s=0.011)
    assert why == auto.RETUNE_FAILURES and scale == 1.0
    assert new.failure_rate == pytest.approx(2 / 3600) and new.replicate_every < 500
    # A step twice the model's: the compute is scaled to it.
    new, why, scale = _rechoose(_choice(), failures=0, elapsed=600, step_s=0.02)
    assert why == auto.RETUNE_STEP and scale == pytest.approx(2.0)
    assert new.compute_s == pytest.approx((0.02, 0.02, 0.02))


def test_a_round_carries_the_new_r_and_every_member_takes_it_with_the_log_saying_why():
    request = auto.AutoRequest(("cold",), (1, 5, 50, 500), 1 / 86400, None)
    retune = auto.Retune(request, _choice(), in_shape=(1, 8, 8), make_optimizer=lambda m: None,
                         batch_size=32, labels=8, steps=10_000)
    retune.start -= 600  # ten minutes of training, one failure in them already
    retune.failures = 1
    parts = [torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 16)),
             torch.nn.Sequential(torch.nn.Linear(16, 16)), torch.nn.Sequential(torch.nn.Linear(16, 10))]
    m = SimpleNamespace(members=[0, 1, 2, 3, 4, 5], pipe=SimpleNamespace(partitions=parts, chunks=4),
                        median_step=lambda: 0.011, wrank=0, settings=None)
    d = Decision(gen=1, step=40, go_on=False, lost_stage=-1, merge=-1, shrink=True, reason="failed",
                 suspect=1, t_detect=0.0, waited_s=0.0, members=(0, 2, 3, 4, 5), route=(0, 4, 2),
                 choices={1: 40}, silent=(), admit=-1, admit_stage=-1,
                 backups={0: (3,), 1: (), 2: (5,)}, log=0)
    proposed = retune.propose(d, m)
    assert proposed.retuned == auto.RETUNE_FAILURES and 0 < proposed.replicate_every < 500
    assert Decision.decode(proposed.encode()) == proposed  # it travels as it is
    from mpipipe.respipe.settings import Settings
    m.settings = Settings(backups={0: 1, 1: 1, 2: 1}, replicate_every=500)
    events = []
    retune.applied(proposed, [1], m, lambda kind, step, rank, **detail: events.append((kind, step, detail)))
    assert m.settings.replicate_every == proposed.replicate_every
    assert retune.failures == 2 and retune.choice.replicate_every == proposed.replicate_every
    [(kind, step, detail)] = events
    assert kind == "resilience_chosen" and step == 40 and detail["previous"] == 500
    assert "2 failure(s)" in detail["why"]
    # The next round, with no new failure and the step as the model has it: R stays.
    m.members, m.median_step = [0, 2, 3, 4, 5], lambda: retune.choice.step_s
    again = retune.propose(replace(d, gen=2, members=(0, 2, 3, 4, 5)), m)
    assert again.replicate_every == 0 and again.retuned == 0


@pytest.mark.timeout(600)
def test_a_measured_choice_trains_exactly_as_the_same_setting_configured(respipe_args, tmp_path):
    # The measurement runs on copies of the stages: the run's model must start, and train,
    # exactly as a run configured with the setting "auto" chose.
    chosen_log = tmp_path / "auto.h5"
    result = run_mpi(6, respipe_args(chosen_log, 'resilience.backups="all"', 'resilience.mode="auto"',
                                     'resilience.replicate_every="auto"',
                                     'resilience.failure_rate="1/30min"', steps=12), ulfm=True,
                     timeout=300)
    run = completed_once(result, chosen_log, 12)
    [event] = run.events_of("resilience_chosen")
    mode, r = event["detail"]["mode"], int(event["detail"]["replicate_every"])
    assert event["detail"]["why"].startswith(f"{mode} R={r}")
    fixed_log = tmp_path / "fixed.h5"
    result = run_mpi(6, respipe_args(fixed_log, 'resilience.backups="all"', f'resilience.mode="{mode}"',
                                     f"resilience.replicate_every={r}", steps=12), ulfm=True, timeout=300)
    fixed = completed_once(result, fixed_log, 12)
    assert list(run.steps["loss"]) == list(fixed.steps["loss"])
    for a, b in zip(checkpoint_tensors(tmp_path / "auto-ckpt"), checkpoint_tensors(tmp_path / "fixed-ckpt"),
                    strict=True):
        assert torch.equal(a, b)


@pytest.mark.long
@pytest.mark.skip(reason="open bug: beside two busy loops, 1 run in 6 ended 'stage 1 has no backup left' "
                         "after the kill at step 30 with R=1000 chosen (R beyond the kill step); to "
                         "find before this test runs again")
@pytest.mark.timeout(600)
def test_failures_beyond_the_given_rate_bring_r_down_at_the_takeover(respipe_args, tmp_path):
    # One a day per rank given; a kill a few seconds in is far beyond it (the Poisson tail of
    # one failure in seconds of 6 ranks is below 1%): the takeover's round chooses R again.
    log = tmp_path / "retune.h5"
    result = run_mpi(6, respipe_args(log, 'resilience.backups="all"', 'resilience.replicate_every="auto"',
                                     'resilience.failure_rate="1/day"', "inject:kill:stage=1:step=30",
                                     steps=40), ulfm=True, timeout=300)
    run = completed_once(result, log, 40)
    first, again = run.events_of("resilience_chosen")
    assert first["step"] == 0 and again["step"] >= 30
    assert again["detail"]["previous"] == first["detail"]["replicate_every"]
    assert again["detail"]["replicate_every"] < first["detail"]["replicate_every"]
    assert "failure(s)" in again["detail"]["why"]


@pytest.mark.parametrize("rate, want", [(0.0, "large R"), (1 / 20, "small R or hot")])
def test_auto_picks_a_large_r_without_failures_and_a_small_one_or_hot_when_they_are_frequent(rate, want):
    from mpipipe.respipe import goodput

    request = auto.AutoRequest(("cold", "hot"), goodput.GRID_R, rate, 100.0)
    costs = goodput.Costs([0.05, 0.05, 0.05], 32, 4, 100.0, 1e9, label_bytes=8, input_bytes=256)
    best, why = auto._best(request, _SHAPES, {"cold": costs, "hot": costs, "": costs}, rate,
                           {0: 1, 1: 1, 2: 1}, steps=20_000)
    if want == "large R":
        assert best.R >= 100, why
    else:
        assert best.mode == "hot" or best.R <= 3, why
    assert why.startswith(f"{best.mode} R={best.R}: the highest predicted goodput")
