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
* while training, ranks share their compute times every few steps; when the
  imbalance ``1 - min/max`` passes a threshold each rank's step model is scaled
  to what was observed, the batches are recomputed, and the new plan is taken
  at the next step boundary if it predicts a clear gain (hysteresis: noise on
  a shared machine must not make batch sizes flap);
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
from collections.abc import Sequence
from dataclasses import dataclass, replace

OBJECTIVES = ("throughput", "energy", "mix")
#: A rank this many times slower (or faster) than its step model has changed speed.
SUDDEN_JUMP = 1.5


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
