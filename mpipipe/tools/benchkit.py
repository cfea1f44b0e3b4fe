"""What the benchmarks share: a median with a bootstrap interval, CPU seconds of a job, and where outputs go.

Why intervals: on a shared 2-core machine the same code gives figures that move by 10 %
or more from one run to the next (issue 35: ``speedup_vs_single`` 1.539, 1.409, 1.474 a
minute apart; ``overhead_r10`` 0.002 to 0.116). One figure per run lets the machine's
load decide whether a target is met. So every bench (``bench/pipeline.py``,
``bench/resilience.py``, ``bench/stannis.py``, ``bench/cluster.py``) measures a ratio over
at least :data:`MIN_PAIRS` interleaved pairs (baseline, candidate, baseline, candidate,
...), takes each pair's ratio, and reports their median with a seeded percentile
bootstrap interval (:data:`LEVEL`, :data:`RESAMPLES` resamples of the per-pair ratios).
Pairs, not two separate sets of runs: a slow minute hits both halves of a pair, so the
pair's ratio keeps what the code costs and drops most of what the machine did.

A target is met when the median meets it; the interval says how far a rerun may move it.

Why CPU seconds beside wall seconds: a ratio of wall times counts the time other
processes held the cores; CPU time does not (it still shares caches). On one host a
job's CPU time is :func:`children_cpu_s` around it (``getrusage(RUSAGE_CHILDREN)``: every
rank and mpirun, start-up included); on the testbed, the nodes' cgroups
(:func:`mpipipe.tools.emulator.cpu_seconds`).

Why :func:`output_path`: a bench run must never write over a committed file (the docs'
pictures are regenerated only by ``make docs-figures``). Without ``--out`` an output
goes to a new temporary folder.
"""

from __future__ import annotations

import math
import resource
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["MIN_PAIRS", "LEVEL", "RESAMPLES", "SEED", "TooFewPairs", "Interval", "bootstrap", "paired",
           "unpaired", "put", "overhead_text", "children_cpu_s", "output_path", "few_pairs_note"]

MIN_PAIRS = 7  # the fewest pairs a figure's interval rests on (issue 35)
LEVEL = 0.90  # the interval's coverage
RESAMPLES = 2000
SEED = 35  # the bootstrap's seed: the same values give the same interval on every run


class TooFewPairs(ValueError):
    """A figure was asked of fewer than :data:`MIN_PAIRS` pairs without ``few_ok``."""


@dataclass(frozen=True)
class Interval:
    """A median and its bootstrap interval over ``n`` values (pairs' ratios or runs' figures).

    ``n`` counts the finite values only: a run that gave no figure (a failed job: NaN) is
    left out, and ``n`` says so.
    """

    median: float
    lo: float
    hi: float
    n: int
    level: float = LEVEL

    @property
    def enough(self) -> bool:
        """Whether it rests on at least :data:`MIN_PAIRS` values (``--quick`` runs do not)."""
        return self.n >= MIN_PAIRS

    def shifted(self, by: float) -> Interval:
        """The same interval moved by ``by``: a ratio into an overhead (ratio - 1)."""
        return Interval(self.median + by, self.lo + by, self.hi + by, self.n, self.level)

    def bounds(self, digits: int = 4) -> list[float | None]:
        """``[lo, hi]`` for a JSON line (``None`` where there is no figure: NaN is not JSON)."""
        return [None if math.isnan(x) else round(x, digits) for x in (self.lo, self.hi)]

    def text(self, digits: int = 3) -> str:
        """``1.474 (90% 1.402..1.531, 7 pairs)``: the median with its interval, as printed."""
        if math.isnan(self.median):
            return "no figure"
        return (f"{self.median:.{digits}f} ({self.level:.0%} {self.lo:.{digits}f}..{self.hi:.{digits}f}, "
                f"{self.n} pair{'s' if self.n != 1 else ''})")


def bootstrap(values: Sequence[float], *, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = SEED,
              few_ok: bool = False) -> Interval:
    """The median of ``values`` and its percentile bootstrap interval.

    ``resamples`` times, draw len(values) values with replacement (a seeded generator:
    the same values give the same interval) and take their median; the interval runs
    from the ``(1 - level) / 2`` to the ``(1 + level) / 2`` quantile of those medians,
    widened if needed so that it holds the median itself (a percentile interval of a
    median can, for a few values, sit just beside it).

    Raises:
        TooFewPairs: fewer than :data:`MIN_PAIRS` finite values and not ``few_ok``
            (``--quick`` passes ``few_ok`` and says so in its output).
    """
    good = np.array([v for v in values if v is not None and not math.isnan(v)], dtype=float)
    if len(good) < MIN_PAIRS and not few_ok:
        raise TooFewPairs(f"{len(good)} finite values, fewer than the {MIN_PAIRS} an interval needs")
    if len(good) == 0:
        return Interval(math.nan, math.nan, math.nan, 0, level)
    median = float(np.median(good))
    draws = np.random.default_rng(seed).integers(0, len(good), size=(resamples, len(good)))
    medians = np.median(good[draws], axis=1)
    lo, hi = np.quantile(medians, [(1 - level) / 2, (1 + level) / 2])
    return Interval(median, min(float(lo), median), max(float(hi), median), len(good), level)


def paired(base: Sequence[float], cand: Sequence[float],
           ratio: Callable[[float, float], float] = lambda b, c: c / b, **kwargs) -> Interval:
    """:func:`bootstrap` of ``ratio(base[i], cand[i])`` over the pairs, in the order they ran.

    ``ratio`` defaults to candidate / baseline (a time ratio; pass ``lambda b, c: b / c``
    for a speed-up from times). A pair with a zero or NaN side gives no ratio.
    """
    if len(base) != len(cand):
        raise ValueError(f"{len(base)} baselines against {len(cand)} candidates: not pairs")
    ratios = [ratio(b, c) if b and c and not (math.isnan(b) or math.isnan(c)) else math.nan
              for b, c in zip(base, cand, strict=True)]
    return bootstrap(ratios, **kwargs)


def unpaired(base: Sequence[float], cand: Sequence[float], *, level: float = LEVEL, resamples: int = RESAMPLES,
             seed: int = SEED, few_ok: bool = False) -> Interval:
    """median(cand) / median(base) with an interval from resampling each side on its own.

    For figures whose two sides cannot be interleaved run for run (e.g. the cluster's
    Stannis worker, one long job, against its shipping runs). Wider than a paired
    interval of the same runs would be, since the machine's drift is not cancelled. ``n``
    is the smaller side.
    """
    b = np.array([v for v in base if not math.isnan(v)], dtype=float)
    c = np.array([v for v in cand if not math.isnan(v)], dtype=float)
    n = min(len(b), len(c))
    if n < MIN_PAIRS and not few_ok:
        raise TooFewPairs(f"{n} runs on the smaller side, fewer than {MIN_PAIRS}")
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, level)
    median = float(np.median(c) / np.median(b))
    rng = np.random.default_rng(seed)
    ratios = (np.median(c[rng.integers(0, len(c), (resamples, len(c)))], axis=1)
              / np.median(b[rng.integers(0, len(b), (resamples, len(b)))], axis=1))
    lo, hi = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return Interval(median, min(float(lo), median), max(float(hi), median), n, level)


def put(figures: dict, key: str, interval: Interval, digits: int = 4) -> None:
    """``figures[key]`` = the median, ``figures[key + "_interval"]`` = ``[lo, hi]`` (the JSON form)."""
    figures[key] = None if math.isnan(interval.median) else round(interval.median, digits)
    figures[f"{key}_interval"] = interval.bounds(digits)


def overhead_text(interval: Interval, digits: int = 3) -> str:
    """An overhead as printed: a median at or below 0 is "no measurable cost", never a gain.

    Why: a resilient job does strictly more work than the plain one; a negative figure
    is the machine's noise, not a saving.
    """
    if math.isnan(interval.median):
        return "no figure"
    if interval.median <= 0:
        return f"no measurable cost (interval {interval.lo:.{digits}f}..{interval.hi:.{digits}f})"
    return interval.text(digits)


def few_pairs_note(n: int, why: str = "--quick") -> str | None:
    """The line a bench prints (and puts in its JSON) when its figures rest on too few pairs."""
    if n >= MIN_PAIRS:
        return None
    return (f"{why}: {n} pair{'s' if n != 1 else ''}, fewer than the {MIN_PAIRS} an interval needs: "
            f"the intervals mean little")


def children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's children that have ended and been waited for.

    Around a job (``after - before``) it is the job's CPU time: every process of it, the
    ranks and mpirun, start-up included, as long as each was waited for by its parent.
    """
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def output_path(out: str | None, name: str, prefix: str = "mpipipe-bench-") -> Path:
    """Where a bench writes ``name``: ``out`` if the user gave one, else a new temporary folder.

    Never a default path in the checkout: a bench run must not write over a committed
    file (``make docs-figures`` passes ``--out docs/...`` explicitly). The folder is
    made afresh, so nothing already there is replaced.
    """
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path
    return Path(tempfile.mkdtemp(prefix=prefix)) / name
