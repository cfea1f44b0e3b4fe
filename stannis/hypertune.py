"""HyperTune: per-rank batch sizes that equalise step times (our reconstruction).

Everything here is a pure function of measured numbers, so the rule can be
unit-tested without MPI. The papers give only abstracts; the rule is ours:

* each rank's compute time per step is modelled as ``overhead + b * per_sample``
  (fitted from a short benchmark at a few batch sizes);
* for a fixed global batch ``B`` the tuner hands out samples one at a time to
  the rank whose step would then finish first (``throughput``), which makes
  step times as equal as integers allow and minimises the step time, hence
  maximises ``B / step_time``; per-rank memory caps bound each ``b_i``;
* ``energy`` minimises joules per step instead: every rank draws idle power for
  the whole step and its active-minus-idle power while it computes, so the
  tuner may stretch the step to move samples to the ranks that are cheap per
  sample; ``mix`` weighs the two, each normalised by its own optimum;
* while training, the host keeps every rank's busy time per step
  (:class:`Retuner`); every few steps it smooths each rank's time (a windowed
  median at the plan in force), scales each rank's step model to it, and takes
  the plan that the recomputed batches promise only if its predicted gain beats
  what the measured spread of step times could fake (:func:`gain_threshold`):
  noise on a shared machine must not make batch sizes flap, a rank that really
  changed speed must be followed within a few steps;
* no rank gets a batch so small that fixed per-step overhead dominates its
  step: a rank's batch is at least :func:`batch_floor`, the batch at which the
  fitted overhead is at most ``overhead_share`` of the step (:func:`with_floors`);
* a rank's share of the global batch is capped at ``max_oversample`` times its
  share of all training records (:func:`share_caps`): the update is the
  gradient of the union batch, and a rank whose fitted cost per sample comes out
  near zero (its steps are all overhead, or noise) must not fill the batch with
  its own private data, which would train on one drive's records and starve the
  rest.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

OBJECTIVES = ("throughput", "energy", "mix")
#: A rank this many times slower (or faster) than its step model has changed speed.
SUDDEN_JUMP = 1.5
#: MAD x this estimates the standard deviation of normal data (1 / Phi^-1(3/4)).
MAD_TO_SD = 1.4826
#: The median of n normal samples has this many times the standard error of their mean
#: (sqrt(pi / 2), large n); a window's smoothed time is its median.
MEDIAN_SE = math.sqrt(math.pi / 2)


class TuneError(ValueError):
    """The tuner was asked for something impossible (names the constraint)."""


@dataclass(frozen=True)
class StepModel:
    """Compute time of one step on one rank: ``overhead_s + batch * per_sample_s``."""

    overhead_s: float
    per_sample_s: float

    def time(self, batch: int) -> float:
        """Seconds of compute for a step of ``batch`` samples (0 for an empty batch)."""
        return 0.0 if batch <= 0 else self.overhead_s + batch * self.per_sample_s

    @property
    def peak_sps(self) -> float:
        """Samples/s at a very large batch, where the overhead no longer counts."""
        return 1.0 / self.per_sample_s


@dataclass(frozen=True)
class RankProfile:
    """What the tuner knows about one rank: speed, memory cap and power draw."""

    model: StepModel
    max_batch: int
    min_batch: int = 1
    idle_w: float = 0.0
    active_w: float = 0.0


@dataclass(frozen=True)
class Plan:
    """Batch sizes for every rank and what the step model predicts for them."""

    batches: tuple[int, ...]
    step_s: float
    samples_per_s: float
    joules_per_step: float
    samples_per_joule: float

    @property
    def global_batch(self) -> int:
        return sum(self.batches)


def fit_step_model(batch_sizes: Sequence[int], times_s: Sequence[float]) -> StepModel:
    """Least-squares fit of ``time = overhead + b * per_sample`` from a benchmark.

    The overhead is clamped at 0 (noise can make the intercept negative) and the
    per-sample time is kept positive, so every fitted rank can take samples.

    Raises:
        TuneError: no points, mismatched lengths or non-positive values.
    """
    if len(batch_sizes) != len(times_s) or not batch_sizes:
        raise TuneError("fit_step_model needs equal, non-empty lists of batch sizes and times")
    if min(batch_sizes) <= 0 or min(times_s) <= 0:
        raise TuneError(f"batch sizes and times must be positive, got {list(batch_sizes)} "
                        f"and {list(times_s)}")
    n = len(batch_sizes)
    if n == 1 or len(set(batch_sizes)) == 1:
        return StepModel(0.0, sum(times_s) / sum(batch_sizes))
    mb = sum(batch_sizes) / n
    mt = sum(times_s) / n
    sbb = sum((b - mb) ** 2 for b in batch_sizes)
    sbt = sum((b - mb) * (t - mt) for b, t in zip(batch_sizes, times_s, strict=True))
    slope = sbt / sbb
    intercept = mt - slope * mb
    if slope <= 0 or intercept < 0:
        # Noise swamped the trend: fall back to a line through the origin.
        slope = sum(times_s) / sum(batch_sizes) if slope <= 0 else \
            sum(b * t for b, t in zip(batch_sizes, times_s, strict=True)) / \
            sum(b * b for b in batch_sizes)
        intercept = 0.0
    return StepModel(intercept, slope)


def evaluate(profiles: Sequence[RankProfile], batches: Sequence[int]) -> Plan:
    """Predict step time, samples/s and samples/J of given batch sizes.

    All ranks wait for the slowest one (the allreduce is a barrier), so the
    step lasts ``max_i t_i(b_i)``; each rank draws idle power throughout and
    its extra active power only while it computes.
    """
    times = [p.model.time(b) for p, b in zip(profiles, batches, strict=True)]
    step = max(times) if times else 0.0
    joules = sum(p.idle_w * step + (p.active_w - p.idle_w) * t
                 for p, t in zip(profiles, times, strict=True))
    total = sum(batches)
    return Plan(
        batches=tuple(int(b) for b in batches),
        step_s=step,
        samples_per_s=total / step if step > 0 else 0.0,
        joules_per_step=joules,
        samples_per_joule=total / joules if joules > 0 else 0.0,
    )


def _check(profiles: Sequence[RankProfile], global_batch: int) -> int:
    if not profiles:
        raise TuneError("no ranks to tune")
    for i, p in enumerate(profiles):
        if p.min_batch < 0 or p.max_batch < p.min_batch:
            raise TuneError(f"rank {i}: need 0 <= min_batch <= max_batch, got "
                            f"{p.min_batch} and {p.max_batch}")
    floor = sum(p.min_batch for p in profiles)
    if global_batch < floor:
        raise TuneError(f"global batch {global_batch} is below the sum of per-rank minimum "
                        f"batches ({floor}); raise stannis.global_batch or lower min_batch")
    # Memory caps win over the requested global batch.
    return min(global_batch, sum(p.max_batch for p in profiles))


def equalise(profiles: Sequence[RankProfile], global_batch: int,
             limit_s: float | None = None) -> tuple[int, ...]:
    """Split ``global_batch`` so that the slowest rank's step is as short as possible.

    Greedy: each next sample goes to the rank whose step would then end first.
    For increasing step-time functions this minimises the maximum exactly, and
    leaves step times equal up to one sample's time. With ``limit_s`` no rank is
    filled past that step time (used by the energy search).

    Raises:
        TuneError: the minimum batches exceed the global batch.
    """
    total = _check(profiles, global_batch)
    batches = [p.min_batch for p in profiles]
    heap = [(p.model.time(b + 1), i) for i, (p, b) in enumerate(zip(profiles, batches,
                                                                     strict=True))
            if b < p.max_batch]
    heapq.heapify(heap)
    left = total - sum(batches)
    while left > 0 and heap:
        t, i = heapq.heappop(heap)
        if limit_s is not None and t > limit_s:
            break
        batches[i] += 1
        left -= 1
        if batches[i] < profiles[i].max_batch:
            heapq.heappush(heap, (profiles[i].model.time(batches[i] + 1), i))
    return tuple(batches)


def _cheapest_within(profiles: Sequence[RankProfile], total: int, limit_s: float) -> \
        tuple[int, ...] | None:
    """Fill the ranks cheapest in joules per sample first, none past ``limit_s``."""
    batches = [p.min_batch for p in profiles]
    if any(p.model.time(b) > limit_s for p, b in zip(profiles, batches, strict=True)):
        return None
    left = total - sum(batches)
    order = sorted(range(len(profiles)),
                   key=lambda i: (profiles[i].active_w - profiles[i].idle_w)
                   * profiles[i].model.per_sample_s)
    for i in order:
        p = profiles[i]
        room = (limit_s - p.model.overhead_s) / p.model.per_sample_s
        fit = max(0, min(p.max_batch, int(room + 1e-9)) - batches[i])
        take = min(left, fit)
        batches[i] += take
        left -= take
    return tuple(batches) if left == 0 else None


def tune(profiles: Sequence[RankProfile], global_batch: int, objective: str = "throughput",
         mix_weight: float = 0.5) -> Plan:
    """Choose per-rank batch sizes for ``global_batch`` under ``objective``.

    ``throughput`` maximises samples/s; ``energy`` maximises samples per joule;
    ``mix`` maximises ``w * sps / best_sps + (1 - w) * spj / best_spj`` with
    ``w = mix_weight``. The global batch is kept (it sets the learning rate)
    unless the memory caps cannot hold it, in which case every rank runs at its
    cap.

    Raises:
        TuneError: unknown objective, bad weight, or minimum batches above the
            global batch.
    """
    if objective not in OBJECTIVES:
        raise TuneError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    if not 0.0 <= mix_weight <= 1.0:
        raise TuneError(f"mix_weight must be in [0, 1], got {mix_weight}")
    total = _check(profiles, global_batch)
    fastest = evaluate(profiles, equalise(profiles, total))
    if objective == "throughput":
        return fastest
    # Longer steps let cheap ranks take more samples; scan step-time limits.
    candidates = [fastest]
    slowest = max(p.model.time(p.max_batch) for p in profiles)
    steps = 64
    for k in range(1, steps + 1):
        limit = fastest.step_s + (slowest - fastest.step_s) * k / steps
        batches = _cheapest_within(profiles, total, limit)
        if batches is not None:
            candidates.append(evaluate(profiles, batches))
    frugal = max(candidates, key=lambda c: c.samples_per_joule)
    if objective == "energy":
        return frugal
    best_sps, best_spj = fastest.samples_per_s, frugal.samples_per_joule

    def score(c: Plan) -> float:
        return (mix_weight * c.samples_per_s / best_sps
                + (1 - mix_weight) * c.samples_per_joule / best_spj)

    return max(candidates, key=score)


def share_caps(records: Sequence[int], global_batch: int, max_oversample: float) -> \
        list[int]:
    """Per-rank batch caps that keep the union batch close to the data's make-up.

    Rank ``i`` holds ``records[i]`` of all training records; its batch may be at
    most ``ceil(max_oversample * global_batch * records[i] / sum(records))``, so
    its records are drawn at most ``max_oversample`` times as often as an even
    draw over all data would (a rank may always take fewer: slow ranks do). For
    ``max_oversample >= 1`` the caps add up to at least ``global_batch``, so the
    global batch always fits. ``max_oversample = 0`` turns the cap off.

    Raises:
        TuneError: a factor in (0, 1), negative record counts, or no records at all.
    """
    if max_oversample == 0:
        return [global_batch] * len(records)
    if max_oversample < 1:
        raise TuneError(f"max_oversample must be 0 (off) or >= 1, got {max_oversample}")
    if min(records, default=0) < 0 or sum(records) <= 0:
        raise TuneError(f"record counts must be >= 0 with a positive sum, got {list(records)}")
    total = sum(records)
    return [math.ceil(max_oversample * global_batch * n / total - 1e-9) for n in records]


def imbalance(step_times: Sequence[float]) -> float:
    """Share of the step the fastest busy rank spends waiting: ``1 - min/max``.

    Ranks with no work (time 0) are left out; fewer than two busy ranks give 0.
    """
    busy = [t for t in step_times if t > 0]
    if len(busy) < 2 or max(busy) <= 0:
        return 0.0
    return 1.0 - min(busy) / max(busy)


def scale_factors(profiles: Sequence[RankProfile], batches: Sequence[int],
                  observed_s: Sequence[float]) -> list[float]:
    """Observed over predicted compute time per rank (1 for ranks with no work or no data)."""
    out = []
    for p, b, t in zip(profiles, batches, observed_s, strict=True):
        predicted = p.model.time(b)
        out.append(t / predicted if b > 0 and t > 0 and predicted > 0 else 1.0)
    return out


def refit(profiles: Sequence[RankProfile], batches: Sequence[int],
          observed_s: Sequence[float]) -> list[RankProfile]:
    """Scale each busy rank's step model so that it predicts the observed compute time.

    A rank slowed by other work on its drive (or by an emulated slow-down) runs
    its whole step slower, overhead included, so both terms are scaled by
    ``observed / predicted``. When the model was right the factor is 1 and
    nothing changes. Ranks that did no work keep their model.
    """
    return [replace(p, model=StepModel(p.model.overhead_s * k, p.model.per_sample_s * k))
            for p, k in zip(profiles, scale_factors(profiles, batches, observed_s), strict=True)]


def sudden(factors: Sequence[float], jump: float = SUDDEN_JUMP) -> bool:
    """True when some rank runs ``jump`` times slower or faster than its model says.

    Such a rank changed speed (a ``slow`` fault, other work on its drive, a
    finished interference), so the tuner moves all the way at once; smaller
    misfits are model noise or shape, and a move that reverses the previous one
    is damped instead.
    """
    return any(k >= jump or k <= 1.0 / jump for k in factors)


def gain(current: Plan, candidate: Plan, objective: str = "throughput",
         mix_weight: float = 0.5) -> float:
    """Relative improvement of ``candidate`` over ``current`` under ``objective``.

    The trainer switches plans only when this passes a margin, so measurement
    noise does not make batch sizes flap back and forth.
    """
    def ratio(a: float, b: float) -> float:
        return a / b if b > 0 else (math.inf if a > 0 else 1.0)

    sps = ratio(candidate.samples_per_s, current.samples_per_s)
    spj = ratio(candidate.samples_per_joule, current.samples_per_joule)
    if objective == "throughput":
        return sps - 1.0
    if objective == "energy":
        return spj - 1.0
    return mix_weight * sps + (1 - mix_weight) * spj - 1.0


def damp(old: Sequence[int], target: Sequence[int], alpha: float) -> tuple[int, ...]:
    """Move ``alpha`` of the way from ``old`` to ``target`` batches, keeping their sum.

    Used when the last re-tune overshot (a rank's batch changed direction):
    a step model that is off in shape, not just in scale, would otherwise make
    batch sizes swing back and forth. Each result lies between its old and
    target value, so caps and minimums still hold.
    """
    if len(old) != len(target) or sum(old) != sum(target) or alpha >= 1.0:
        return tuple(int(t) for t in target)
    raw = [o + alpha * (t - o) for o, t in zip(old, target, strict=True)]
    out = [math.floor(x) for x in raw]
    left = sum(target) - sum(out)
    for i in sorted(range(len(raw)), key=lambda i: out[i] - raw[i])[:left]:
        out[i] += 1
    return tuple(out)


def batch_floor(model: StepModel, overhead_share: float = 0.5) -> int:
    """The smallest batch whose step spends at most ``overhead_share`` of its time on overhead.

    A step of ``b`` samples lasts ``o + b p``; its fixed part is at most a share
    ``s`` of it when ``b >= o (1 - s) / (s p)``, i.e. ``b >= o / p`` for s = 1/2
    (as much time on the samples as on the step's fixed cost). A smaller batch
    buys little: one sample on a rank whose step is all overhead costs a whole
    step for one sample. ``overhead_share`` 0 or >= 1, or a fit without overhead,
    gives 1 (no floor beyond "at least one sample").
    """
    if not 0.0 < overhead_share < 1.0 or model.overhead_s <= 0 or model.per_sample_s <= 0:
        return 1
    b = model.overhead_s * (1.0 - overhead_share) / (overhead_share * model.per_sample_s)
    return max(1, math.ceil(b - 1e-9))


def with_floors(profiles: Sequence[RankProfile], global_batch: int,
                overhead_share: float = 0.5) -> tuple[list[RankProfile], bool]:
    """Profiles whose ``min_batch`` is each rank's :func:`batch_floor`, within its cap.

    The floor depends only on the ratio overhead / per-sample cost, which
    :func:`refit` keeps (it scales both), so it is the benchmark's measurement
    for the whole run. When the floors do not fit in ``global_batch`` they are
    scaled down in proportion (every rank still trains on its data, which is
    Stannis's point) and the second value is False: the global batch is too
    small for these ranks to work efficiently, and the caller should say so.
    """
    floors = [min(p.max_batch, max(p.min_batch, batch_floor(p.model, overhead_share)))
              for p in profiles]
    fits = sum(floors) <= global_batch
    if not fits:
        scale = global_batch / sum(floors)
        floors = [min(f, max(p.min_batch, math.floor(f * scale)))
                  for p, f in zip(profiles, floors, strict=True)]
    return [replace(p, min_batch=f) for p, f in zip(profiles, floors, strict=True)], fits


def relative_spread(times: Sequence[float]) -> float:
    """Robust relative standard deviation of single step times: ``1.4826 MAD / median``.

    Median and MAD, not mean and standard deviation: on a shared machine a step
    now and then waits for a core (or the host evaluates), and one such step
    must not make the tuner think every step is that noisy. 0 for fewer than two
    times or a zero median.
    """
    if len(times) < 2:
        return 0.0
    med = statistics.median(times)
    if med <= 0:
        return 0.0
    return MAD_TO_SD * statistics.median(abs(t - med) for t in times) / med


def median_se(spread: float, n: int) -> float:
    """Relative standard error of the median of ``n`` steps whose relative spread is ``spread``.

    ``sqrt(pi / 2) spread / sqrt(n)``: the median's large-sample error for
    normal noise (a little pessimistic for n = 5, where it is 1.20 rather than 1.25).
    """
    return MEDIAN_SE * spread / math.sqrt(max(n, 1))


def noise_z(noise_retunes_per_100: float, every: int, ranks: int) -> float:
    """Standard errors a gain must beat so that noise re-tunes about that often.

    A check every ``every`` steps may raise a false alarm with probability
    ``a = noise_retunes_per_100 * every / 100``; any of ``ranks`` estimates can
    raise it, so each gets ``a / ranks`` (Bonferroni) and the bar is the normal
    quantile ``Phi^-1(1 - a / ranks)``. Default figures (1 per 100 steps, every 5,
    5 ranks): a = 0.05, 0.01 per rank, z = 2.33. 0 per 100 steps: an infinite bar
    (never a re-tune on a gain that noise could explain).
    """
    if noise_retunes_per_100 <= 0:
        return math.inf
    a = min(noise_retunes_per_100 * every / 100.0, 1.0) / max(ranks, 1)
    return statistics.NormalDist().inv_cdf(1.0 - a) if a < 0.5 else 0.0


def gain_threshold(se: Sequence[float], shares: Sequence[float], z: float,
                   granularity: float = 0.0) -> float:
    """The predicted gain that noise alone passes with probability about ``Phi(-z)`` per rank.

    ``se``: each rank's relative standard error of its smoothed time; ``shares``:
    each rank's share of the candidate plan's samples. The current plan's step
    is the slowest rank's measured time, ``t_k``; the candidate's is set by all
    ranks at once, since equal step times make its length depend on rank r's
    time with elasticity ``shares[r]``. So the log of the predicted gain errs
    by ``e_k - sum_r shares[r] e_r``, with standard deviation
    ``sqrt(sum_r (1[r = k] - shares[r])^2 se_r^2)``; the bar is ``z`` of those
    for the worst ``k`` (any rank can look slowest), and never below
    ``granularity`` (the gain of one sample's time, which integer batches cannot
    resolve). For the energy and mix objectives it is the same bar, an
    approximation.
    """
    worst = 0.0
    for k in range(len(se)):
        var = sum(((1.0 if r == k else 0.0) - w) ** 2 * e ** 2
                  for r, (w, e) in enumerate(zip(shares, se, strict=True)))
        worst = max(worst, math.sqrt(var))
    return max(z * worst, granularity)


@dataclass(frozen=True)
class RetuneRule:
    """When the host re-tunes (see :class:`Retuner`; ``stannis.*`` keys of the same names).

    ``noise_retunes_per_100``: how many re-tunes per 100 steps noise alone may
    cause (:func:`noise_z` turns it into the bar): half of the goal of at most
    2 per 100 steady steps, the other half left for convergence after the first
    plan. ``min_gain``, ``imbalance_threshold``: optional fixed bars on top
    (0: none). ``memory``: checks whose spreads are pooled (their median) per
    rank: a window of 5 steps alone gives a spread that is itself noisy.
    ``confirm``: a move must pass the bar at two checks in a row (``every`` steps
    apart), unless some rank runs :data:`SUDDEN_JUMP` times slower or faster than
    its step model (then at once): a burst of other load on a shared machine lasts
    a few steps, a real change stays.
    """

    every: int = 5
    noise_retunes_per_100: float = 1.0
    min_gain: float = 0.0
    imbalance_threshold: float = 0.0
    memory: int = 4
    confirm: bool = True

    @property
    def window(self) -> int:
        """Steps at the plan in force that a smoothed time may rest on."""
        return 4 * self.every


@dataclass(frozen=True)
class Decision:
    """What one check of the :class:`Retuner` found.

    ``profiles``: every member's step model scaled to its smoothed time (the
    caller keeps them); ``target``: the new batches, or None to keep the plan;
    ``reason``: why (for the ``retune`` event), also when the plan is kept.
    """

    profiles: list[RankProfile]
    target: tuple[int, ...] | None
    reason: str
    gain: float
    threshold: float
    changed_speed: bool = False


@dataclass
class Retuner:
    """The host's re-tune decisions from per-step busy times (pure: no MPI, no clock).

    Per rank it keeps the last ``4 every`` steps run at the plan in force.
    Every ``every`` steps :meth:`check` smooths each rank's time: the median of
    that window, unless its newest ``every`` steps differ from the older ones by
    more than noise allows (then the rank changed speed and only the newest
    count). The noise is measured two ways, both from the steps since the last
    check (they do not overlap with the check's before): the spread of single
    steps within them (:func:`relative_spread`, pooled over the last ``memory``
    checks) and how far their median moved from the previous check's at the
    same batch (:meth:`drift_of`, over the last ``4 memory`` checks; every move
    below :data:`SUDDEN_JUMP` counts). It scales each step model to its smoothed
    time, tunes again, and moves only if the predicted gain beats
    :func:`gain_threshold` for the ranks' standard errors at two checks in a row
    (``rule.confirm``), or at one when a rank is :data:`SUDDEN_JUMP` times off its
    model. A move that reverses the previous one within two checks is damped to
    half way unless some rank changed speed (the step model is off in shape, not
    in scale).
    """

    rule: RetuneRule = field(default_factory=RetuneRule)
    windows: dict[int, deque[tuple[int, float]]] = field(default_factory=dict)
    spreads: dict[int, deque[float]] = field(default_factory=dict)
    #: per rank: |log| of the ratio of consecutive checks' medians at one batch
    drifts: dict[int, deque[float]] = field(default_factory=dict)
    #: per rank: (batch, median of the newest ``every`` steps) at the last check
    previous: dict[int, tuple[int, float]] = field(default_factory=dict)
    last_change: list[int] = field(default_factory=list)
    last_change_step: int = -(10 ** 9)
    #: (step, batches) of a move that passed the bar at the last check, not yet taken
    pending: tuple[int, tuple[int, ...]] | None = None

    def restart(self, members: Sequence[int]) -> None:
        """A new plan is in force: judge the next decision on its steps only."""
        self.windows = {r: deque(maxlen=self.rule.window) for r in members}
        self.pending = None
        for kept in (self.spreads, self.drifts, self.previous):
            for r in list(kept):
                if r not in members:
                    del kept[r]

    def forget_moves(self) -> None:
        """The members changed (a rank was dropped): no move to damp against."""
        self.last_change = []

    def record(self, rank: int, batch: int, seconds: float) -> None:
        """One step's busy time of ``rank`` at ``batch`` (empty steps say nothing)."""
        if batch > 0 and seconds > 0:
            self.windows.setdefault(rank, deque(maxlen=self.rule.window)).append(
                (batch, seconds))

    def spread_of(self, rank: int) -> float:
        """The rank's pooled spread: the median over its last checks' spreads."""
        past = self.spreads.get(rank)
        return statistics.median(past) if past else 0.0

    def drift_of(self, rank: int) -> float:
        """Robust standard deviation of the change of a window's median from one check to
        the next at the same batch (0 until there is one).

        This is the noise that matters: on a shared machine the load comes and goes,
        so consecutive windows differ by more than the spread within a window says
        (an emulated CSD's steps are nearly equal within a window, and all of them
        drift with the machine's load).
        """
        past = self.drifts.get(rank)
        if past is None or len(past) < self.rule.memory:
            # Too few moves of its own: one of them would be the whole estimate (a move
            # of 1.4x at the first checks made the bar 85% in an MPI test, and a CSD
            # slowed 5x was not followed). Until then, the moves of every rank, pooled.
            past = [d for kept in self.drifts.values() for d in kept]
        return MAD_TO_SD * statistics.median(past) if past else 0.0

    def _smoothed(self, rank: int, batch: int, z: float) -> tuple[float, float, bool] | None:
        """(smoothed time, its relative standard error, changed) at ``batch``; None if short.

        Also pools the spread of the newest ``every`` steps into the rank's.
        """
        every = self.rule.every
        times = [t for b, t in self.windows.get(rank, ()) if b == batch]
        if len(times) < every:
            return None
        recent, older = times[-every:], times[:-every]
        new = statistics.median(recent)
        self.spreads.setdefault(rank, deque(maxlen=self.rule.memory)).append(
            relative_spread(recent))
        spread, drift = self.spread_of(rank), self.drift_of(rank)
        changed = False
        if len(older) >= every:
            old = statistics.median(older)
            # The newest window against the older ones: the larger of the two noises.
            sd = max(math.hypot(median_se(spread, len(older)), median_se(spread, every)), drift)
            changed = old > 0 and new > 0 and abs(math.log(new / old)) > z * sd
        last = self.previous.get(rank)
        if last is not None and last[0] == batch and last[1] > 0 and new > 0 and \
                abs(math.log(new / last[1])) < math.log(SUDDEN_JUMP):
            # Every move of the level enters the record, also one the test above calls
            # a change: an emulated CSD's steps are nearly equal within a window, so
            # its spread says "no noise" and every shift of its level looked like a
            # change; left out, those shifts never entered the record, which stayed
            # near 0 and called the next shift a change again (the bench re-tuned 4
            # times per 100 steady steps that way). Only a sudden jump (a `slow`
            # fault) is left out: it must not raise the bar that the move it calls for
            # has to pass (early in a run one jump would dominate the record).
            self.drifts.setdefault(rank, deque(maxlen=4 * self.rule.memory)).append(
                abs(math.log(new / last[1])))
        self.previous[rank] = (batch, new)
        if changed:
            return new, max(median_se(spread, every), drift / math.sqrt(2)), True
        # A smoothed time's error: the median's, or a window's drift, whichever is
        # larger. A window's level errs by drift / sqrt 2 (the drift is measured between
        # two windows). More windows do not shrink it: the load of a shared machine
        # shifts for tens of seconds at a time, so neighbouring windows err alike.
        return statistics.median(times), max(median_se(spread, len(times)),
                                             drift / math.sqrt(2)), False

    def check(self, step: int, members: Sequence[int], batches: Sequence[int],
              profiles: Sequence[RankProfile],
              constrain: Callable[[list[RankProfile]], list[RankProfile]],
              global_batch: int, objective: str = "throughput",
              mix_weight: float = 0.5) -> Decision | None:
        """Decide at the end of ``step``; None when it is not time or a window is short.

        ``profiles``: the members' current step models (uncapped);
        ``constrain``: turns them into the profiles the plan obeys (caps, floors).
        """
        rule = self.rule
        if step % rule.every:
            return None
        busy = [(r, b) for r, b in zip(members, batches, strict=True) if b > 0]
        if any(len([t for bb, t in self.windows.get(r, ()) if bb == b]) < rule.every
               for r, b in busy):
            return None
        z = noise_z(rule.noise_retunes_per_100, rule.every, len(busy))
        smoothed = {r: self._smoothed(r, b, z) for r, b in busy}
        observed = [smoothed[r][0] if r in smoothed else 0.0 for r in members]
        se = [smoothed[r][1] if r in smoothed else 0.0 for r in members]
        factors = scale_factors(profiles, batches, observed)
        fitted = refit(profiles, batches, observed)
        capped = constrain(list(fitted))
        current = evaluate(capped, batches)
        candidate = tune(capped, global_batch, objective, mix_weight)
        better = gain(current, candidate, objective, mix_weight)
        bar = max(gain_threshold(se, _shares(candidate), z, _grain(capped, current, candidate)),
                  rule.min_gain)
        level = imbalance(observed)
        changed = sorted(r for r, x in smoothed.items() if x[2])
        changed_speed = sudden(factors) or bool(changed)
        # Each rank's smoothed time over what its step model predicted at the last check:
        # which rank's speed moved, and by how much.
        reason = (f"predicted gain {better:.1%} > {bar:.1%} (noise: z {z:.2f}, standard errors "
                  f"{', '.join(f'{e:.1%}' for e in se)}; times over the models "
                  f"{', '.join(f'{k:.2f}' for k in factors)})")
        if better <= bar:
            self.pending = None
            return Decision(fitted, None, reason.replace(" > ", " <= ", 1), better, bar,
                            changed_speed)
        if level <= rule.imbalance_threshold:
            self.pending = None
            return Decision(fitted, None, f"imbalance {level:.2f} <= {rule.imbalance_threshold}",
                            better, bar, changed_speed)
        target = candidate.batches
        if rule.confirm:
            confirmed = self._confirm(step, batches, target, factors, reason)
            if confirmed is None:
                return Decision(fitted, None, reason + ", to be confirmed at the next check",
                                better, bar, changed_speed)
            reason = confirmed
        self.pending = None
        target, reason = self._move(step, batches, target, changed_speed, reason)
        if changed:
            reason += f", ranks {changed} changed speed (newest steps only)"
        return Decision(fitted, tuple(target), reason, better, bar, changed_speed)

    def _confirm(self, step: int, batches: Sequence[int], target: Sequence[int],
                 factors: Sequence[float], reason: str) -> str | None:
        """The reason extended when the move may go now; None (and the move kept) to wait.

        Hysteresis in time: a move passes the bar at two checks in a row, moving
        every rank the same way both times, unless a rank's speed jumped (a
        `slow` fault: then at once). A burst of other load that lasts a few steps
        passes once and is gone by the next check.
        """
        change = [t - b for t, b in zip(target, batches, strict=True)]
        last = self.pending
        if sudden(factors):
            return reason + f", a rank {SUDDEN_JUMP:g}x off its model: at once"
        if last is not None and step - last[0] <= self.rule.every and all(
                c * (p - b) >= 0 for c, p, b in zip(change, last[1], batches, strict=True)):
            return reason + f", confirmed (passed at step {last[0]} too)"
        self.pending = (step, tuple(target))
        return None

    def _move(self, step: int, batches: Sequence[int], target: Sequence[int],
              changed_speed: bool, reason: str) -> tuple[Sequence[int], str]:
        """Take the move to ``target`` (damped if it reverses a recent one); remember it."""
        change = [t - b for t, b in zip(target, batches, strict=True)]
        recent = step - self.last_change_step <= 2 * self.rule.every
        reverses = any(c * p < 0 for c, p in zip(change, self.last_change, strict=False))
        if recent and reverses and not changed_speed:
            # The last move overshot: the step models are off in shape; go half way.
            # (Not when a rank changed speed: then the whole move is what it needs.)
            target = damp(batches, target, 0.5)
            reason += ", damped"
        self.last_change = [t - b for t, b in zip(target, batches, strict=True)]
        self.last_change_step = step
        return target, reason


def _shares(candidate: Plan) -> list[float]:
    """Each rank's share of the candidate plan's samples."""
    total = sum(candidate.batches)
    return [b / total if total else 0.0 for b in candidate.batches]


def _grain(capped: Sequence[RankProfile], current: Plan, candidate: Plan) -> float:
    """One sample's time on the rank that sets the step: integer batches cannot do better."""
    step_s = candidate.step_s or current.step_s
    return max((p.model.per_sample_s for p, b in zip(capped, candidate.batches,
                                                     strict=True) if b > 0),
               default=0.0) / step_s if step_s > 0 else 0.0


def should_retune(step_times: Sequence[float], threshold: float) -> bool:
    """True when the imbalance of the shared step times passes ``threshold``."""
    return imbalance(step_times) > threshold


def scaled_lr(base_lr: float, base_batch: int, global_batch: int, step: int,
              warmup_steps: int) -> float:
    """Linear scaling rule with linear warm-up (Goyal et al. 2017).

    The target rate is ``base_lr * global_batch / base_batch``; over the first
    ``warmup_steps`` steps the rate climbs linearly from ``base_lr`` to it, which
    keeps early steps with a large global batch stable.
    """
    if base_batch <= 0:
        raise TuneError(f"base_batch must be positive, got {base_batch}")
    target = base_lr * global_batch / base_batch
    if warmup_steps <= 0 or step >= warmup_steps:
        return target
    return base_lr + (target - base_lr) * (step + 1) / warmup_steps
