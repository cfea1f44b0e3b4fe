"""An upper bound on a synchronous job's throughput, built from the very steps it judges.

In a step of synchronous data-parallel training every rank computes its batch,
then waits for the slowest one in the gradient exchange. Had no rank ever
waited, rank r would have trained its ``B_r`` samples (summed over the steps)
in its busy time ``T_r`` (summed over the same steps), so the job could not
have run faster than ``sum_r B_r / T_r`` samples/s. And since every rank's busy
time lies inside the steps' wall time ``W`` (``T_r <= W``), the measured
``sum_r B_r / W`` can never exceed that sum: the ratio of the two is at most 1
by construction, and a ratio above 1 means the records contradict each other
(a busy time longer than the wall time it lies in), never a tuner that beat its
ideal. Nothing here is measured separately, at another time or at another
plan, so the bound cannot drift away from what it judges.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Judgement", "ideal_sps", "judge", "TOLERANCE"]

#: Relative slack for float rounding only: a ratio within it of 1 is 1.
TOLERANCE = 1e-9

#: One step: world rank -> (batch, busy seconds) of every rank that trained in it.
Step = Mapping[int, tuple[int, float]]


@dataclass(frozen=True)
class Judgement:
    """Measured samples/s against the bound of the same steps.

    ``ratio`` is measured / bound in [0, 1], or None when the records are
    inconsistent; ``reason`` then says why (empty when valid).
    """

    sps: float
    ideal_sps: float
    ratio: float | None
    reason: str = ""

    @property
    def valid(self) -> bool:
        return self.ratio is not None


def _per_rank(steps: Sequence[Step]) -> dict[int, tuple[int, float]]:
    """Samples and busy seconds of every rank, summed over ``steps``."""
    out: dict[int, tuple[int, float]] = {}
    for step in steps:
        for r, (batch, busy) in step.items():
            b, t = out.get(r, (0, 0.0))
            out[r] = (b + int(batch), t + float(busy))
    return out


def ideal_sps(steps: Sequence[Step]) -> float:
    """``sum_r B_r / T_r``: samples/s had no rank ever waited (inf if a rank trained in no time)."""
    total = 0.0
    for b, t in _per_rank(steps).values():
        if b > 0:
            total += b / t if t > 0 else float("inf")
    return total


def judge(steps: Sequence[Step], wall_s: float) -> Judgement:
    """Samples/s of ``steps`` that took ``wall_s`` seconds, against their own bound.

    Why a judgement and not a bare ratio: a ratio above 1 is not a result but a
    sign that busy and wall times were measured inconsistently, and must be
    reported as invalid rather than printed as a tuner beating its ideal.
    """
    per_rank = _per_rank(steps)
    samples = sum(b for b, _ in per_rank.values())
    if wall_s <= 0 or not steps:
        return Judgement(0.0, 0.0, None, f"no steps to judge (wall time {wall_s:g} s)")
    sps = samples / wall_s
    ideal = ideal_sps(steps)
    if samples == 0:
        return Judgement(sps, ideal, None, "no samples were trained")
    idle = [r for r, (b, t) in per_rank.items() if b > 0 and t <= 0]
    if idle:
        return Judgement(sps, ideal, None, f"rank {idle[0]} trained samples in no busy time")
    over = [(t / wall_s, r) for r, (b, t) in per_rank.items() if b > 0]
    worst, rank = max(over)
    ratio = sps / ideal
    if ratio > 1 + TOLERANCE or worst > 1 + TOLERANCE:
        busy = per_rank[rank][1]
        return Judgement(sps, ideal, None,
                         f"rank {rank} was busy {busy:.4f} s within {wall_s:.4f} s of wall time: "
                         f"the records disagree, so measured/ideal ({ratio:.3f}) is no result")
    return Judgement(sps, ideal, min(ratio, 1.0))
