"""The benchmarks' shared statistics (mpipipe/tools/benchkit.py): no timing, pure Python.

And that no bench writes into the checkout unless ``--out`` says so: each bench's default
output is a new temporary folder, never a path under the project root.
"""

from __future__ import annotations

import ast
import math
import random
from pathlib import Path

import numpy as np
import pytest

from mpipipe.tools import benchkit
from mpipipe.tools.benchkit import MIN_PAIRS, Interval, bootstrap, overhead_text, paired, unpaired

ROOT = Path(__file__).resolve().parents[1]
BENCHES = ("bench/pipeline.py", "bench/resilience.py", "bench/stannis.py", "bench/cluster.py", "native/bench.py")


def test_constant_ratios_give_a_point():
    iv = bootstrap([1.25] * MIN_PAIRS)
    assert (iv.median, iv.lo, iv.hi, iv.n) == (1.25, 1.25, 1.25, MIN_PAIRS)


@pytest.mark.parametrize("seed", range(20))
def test_the_median_lies_inside_its_interval(seed):
    rng = random.Random(seed)
    values = [rng.lognormvariate(0, 0.3) for _ in range(rng.randint(MIN_PAIRS, 15))]
    iv = bootstrap(values)
    assert iv.lo <= iv.median <= iv.hi
    assert iv.median == pytest.approx(float(np.median(values)))


def test_the_same_seed_gives_the_same_interval():
    values = [1.0, 1.3, 0.9, 1.1, 1.6, 1.05, 0.95, 1.2]
    assert bootstrap(values) == bootstrap(list(values))
    assert bootstrap(values, seed=1) == bootstrap(values, seed=1)
    # 2000 resamples: another seed moves the bounds by an order statistic at most
    assert all(abs(bootstrap(values, seed=s).lo - bootstrap(values).lo) <= 0.1 for s in range(5))


def test_fewer_than_seven_pairs_are_refused_unless_flagged():
    with pytest.raises(benchkit.TooFewPairs):
        bootstrap([1.0] * (MIN_PAIRS - 1))
    iv = bootstrap([1.0, 2.0], few_ok=True)
    assert iv.n == 2 and not iv.enough
    assert bootstrap([1.0] * MIN_PAIRS).enough
    assert benchkit.few_pairs_note(2) and "fewer than the 7" in benchkit.few_pairs_note(2)
    assert benchkit.few_pairs_note(MIN_PAIRS) is None


def test_failed_runs_are_left_out_and_counted():
    iv = bootstrap([1.0, math.nan, 1.0, None, 1.0], few_ok=True)
    assert iv.n == 3 and iv.median == 1.0
    empty = bootstrap([math.nan], few_ok=True)
    assert empty.n == 0 and math.isnan(empty.median) and empty.bounds() == [None, None]


def test_the_interval_covers_a_known_median_at_about_its_level():
    """The bootstrap on a known distribution: log-normal ratios whose true median is 1.2.

    Over 200 seeded samples of 15 pairs, a 90 % interval should hold the true median in
    roughly 90 % of them (a percentile bootstrap of a median undercovers a little for
    small samples: 80 % is the floor allowed here); and it narrows as pairs are added.
    """
    rng = np.random.default_rng(0)
    true = 1.2
    hits, widths = 0, {15: [], 60: []}
    for i in range(200):
        for n in widths:
            sample = true * np.exp(rng.normal(0.0, 0.1, n))
            iv = bootstrap(sample.tolist(), seed=i)
            widths[n].append(iv.hi - iv.lo)
            if n == 15:
                hits += iv.lo <= true <= iv.hi
    assert 0.80 <= hits / 200 <= 0.99
    assert np.median(widths[60]) < np.median(widths[15])


def test_paired_ratios_follow_the_pairs():
    base = [10.0, 20.0, 10.0, 20.0, 10.0, 20.0, 10.0]  # the machine's pace doubles every other pair
    cand = [11.0, 22.0, 11.0, 22.0, 11.0, 22.0, 11.0]
    iv = paired(base, cand)
    assert iv.median == pytest.approx(1.1) and iv.hi - iv.lo == pytest.approx(0.0, abs=1e-12)
    speedup = paired(base, cand, ratio=lambda b, c: b / c)
    assert speedup.median == pytest.approx(1 / 1.1)
    with pytest.raises(ValueError):
        paired([1.0, 2.0], [1.0])
    assert paired([1.0, 0.0, math.nan], [1.0, 1.0, 1.0], few_ok=True).n == 1


def test_unpaired_ratio_of_medians():
    iv = unpaired([2.0] * 7, [3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0])
    assert (iv.median, iv.lo, iv.hi) == (1.5, 1.5, 1.5)
    noisy = unpaired([1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02], [2.0, 2.2, 1.8, 2.1, 1.9, 2.0, 2.05])
    assert noisy.lo < 2.0 < noisy.hi
    with pytest.raises(benchkit.TooFewPairs):
        unpaired([1.0] * 7, [1.0] * 3)


def test_an_overhead_at_or_below_zero_is_never_a_gain():
    ratio = bootstrap([0.9, 0.95, 1.02, 0.97, 0.99, 0.93, 1.01])
    text = overhead_text(ratio.shifted(-1))
    assert text.startswith("no measurable cost (interval -") and "gain" not in text
    assert overhead_text(Interval(0.08, 0.05, 0.12, 7)) == "0.080 (90% 0.050..0.120, 7 pairs)"


def test_put_writes_the_median_and_its_interval():
    figures: dict = {}
    benchkit.put(figures, "overhead_r10", Interval(0.031234, -0.01, 0.0712345, 7))
    assert figures == {"overhead_r10": 0.0312, "overhead_r10_interval": [-0.01, 0.0712]}
    benchkit.put(figures, "x", Interval(math.nan, math.nan, math.nan, 0))
    assert figures["x"] is None and figures["x_interval"] == [None, None]


def test_output_path_default_is_a_new_temporary_folder(tmp_path):
    first, second = benchkit.output_path(None, "plot.png"), benchkit.output_path(None, "plot.png")
    assert first != second and not first.exists() and first.parent.is_dir()
    assert ROOT not in first.parents
    asked = benchkit.output_path(str(tmp_path / "sub" / "plot.png"), "plot.png")
    assert asked == tmp_path / "sub" / "plot.png" and asked.parent.is_dir()
    for path in (first, second):
        path.parent.rmdir()


def _defaults(path: Path) -> list[tuple[str, str]]:
    """(option, default source) of every ``add_argument(..., default=...)`` in a bench."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args:
            for kw in node.keywords:
                if kw.arg == "default":
                    found.append((ast.literal_eval(node.args[0]) if isinstance(node.args[0], ast.Constant)
                                  else "?", ast.unparse(kw.value)))
    return found


@pytest.mark.parametrize("bench", BENCHES)
def test_no_bench_writes_into_the_checkout_by_default(bench):
    """No option's default is a path under the project root (``ROOT / ...``, ``docs/``, ``runs/``):
    outputs go to ``--out`` or a temporary folder (benchkit.output_path)."""
    for option, default in _defaults(ROOT / bench):
        assert "ROOT" not in default and "docs" not in default and "runs" not in default, (option, default)
