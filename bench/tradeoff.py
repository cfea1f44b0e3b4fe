"""ResPipe's trade-off validated on the testbed: goodput under Poisson failures (issue 35).

Called by bench/cluster.py (``--only goodput``, or in its whole run). For each failure
rate of the job (none, about one per 10 minutes of run, about one per minute), on the
ResPipe testbed at 100 Mbit/s, it runs in interleaved rounds:

- the plain pipeline, failure-free (the model's calibration: the stages' compute is
  scaled so that the model's plain step is this run's, as ``cost --step-time`` does);
- every fixed (mode, R) of the grid, under ``--inject poisson:rate=...:seed=...:rejoin=3s``
  (a failed rank stalls 3 s, is replaced, and rejoins as a backup);
- ``mode = "auto"``, ``replicate_every = "auto"`` with the same rate, which chooses.

Measured goodput of a run = its samples (rows x batch) less the updates its takeovers
lost (x batch), over its span from the first row to the last (a run that lost a stage
counts what it trained). Each setting's figure is the median over the rounds, with a
90 % bootstrap interval (unpaired: the rounds of two settings share no pace).

- ``auto_vs_best_fixed``: the auto runs' median over the best fixed setting's, at each
  rate; the key is the worst rate's (goal >= 0.95).
- ``goodput_model_error``: the worst |model / measured median - 1| over every fixed
  setting and rate (goal <= 0.15); the model is mpipipe.respipe.goodput.predict with
  the failure rate per rank = the job's rate / ranks.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mpipipe.tools import benchkit

GRID_MODES = ("cold", "hot")
GRID_R = (1, 3, 10, 30)
REJOIN_S = 3.0
SIZES = {
    "full": {"rates": (0.0, 1 / 600, 1 / 60), "rs": GRID_R, "modes": GRID_MODES,
             "rounds": benchkit.MIN_PAIRS, "steps": 300},
    "quick": {"rates": (0.0, 1 / 60), "rs": (1, 10), "modes": GRID_MODES, "rounds": 1, "steps": 200},
}


def _rate_text(per_s: float) -> str:
    return "0" if per_s <= 0 else f"1/{1 / per_s:g}s"


def measured_goodput(log: Path, batch: int) -> tuple[float, int, bool]:
    """(goodput, updates lost, stage lost) of one run, from its log."""
    from mpipipe.core.logs.runlog import open_log

    try:
        run = open_log(log)
    except Exception:  # noqa: BLE001 - no log: the job died before it wrote one
        return math.nan, 0, True
    times = [float(t) for t in run.steps["time"]]
    if len(times) < 2:
        return math.nan, 0, True
    lost = sum(int(e["detail"].get("lost_updates", 0)) for e in run.events_of("takeover"))
    span = times[-1] - times[0]
    useful = (len(times) - 1 - lost) * batch  # the first row starts the clock
    return useful / span, lost, str(run.attrs.get("status", "")).startswith("failed")


def _model(work: Path, plain_step_s: float, rate_per_job: float, ranks: int, batch: int,
           modes: Sequence[str], rs: Sequence[int]) -> dict[tuple[str, int], float]:
    """The goodput model's prediction of every (mode, R), calibrated on the plain run."""
    from mpipipe.core.run.configfile import load_config
    from mpipipe.pipeline.config import PIPELINE_CHOICES, PIPELINE_DEFAULTS
    from mpipipe.respipe import costmodel, goodput

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(str(root / "jobs/configs/respipe-digits.toml"),
                      [f'data.path="{work / "digits"}"', f"data.batch_size={batch}"],
                      PIPELINE_DEFAULTS, PIPELINE_CHOICES)
    cut = costmodel.cut_from_config(cfg)
    k, chunks = cfg["pipeline"]["stages"], cfg["pipeline"]["chunks"]
    shapes, in_bytes = costmodel.stage_shapes(cut.parts, cut.in_shape, cut.make_optimizer, stages=k)
    compute, pack = goodput.measure_costs(cut.parts, cut.in_shape, cut.make_optimizer, k,
                                          batch_size=batch, chunks=chunks)
    costs = goodput.Costs(compute, batch, chunks, 100.0, pack, label_bytes=8, input_bytes=in_bytes,
                          detect_s=goodput.DETECT_S + 0.5)  # a stall: found by the deadline
    costs = goodput.scaled_to_plain_step(shapes, costs, plain_step_s)
    failures = goodput.Failures(rate_per_job / ranks, rejoin_s=REJOIN_S)
    backups = dict.fromkeys(range(k), 1)
    return {(m, r): goodput.predict(shapes, costs, failures, mode=m, replicate_every=r,
                                    backups=backups).goodput for m in modes for r in rs}


def measure(bench: Any, tb_for: Any, size_name: str, settings_of: Any, step_of: Any, ranks: int,
            batch: int) -> dict[str, Any]:
    """The grid of runs and its figures (see the module's docstring).

    ``bench``: bench/cluster.py's Bench (its ``train`` runs one job); ``tb_for(rate)``
    the testbed; ``settings_of(mode, r)`` the --set lines of a fixed setting;
    ``step_of(log)`` a failure-free run's step time.
    """
    from mpipipe.tools import emulator

    size = SIZES[size_name]
    steps_before, bench.steps = bench.steps, size["steps"]
    got: dict[tuple[float, str, int], list[float]] = {}
    plain: dict[float, list[float]] = {}
    lost_runs: dict[str, int] = {}
    seed = 0
    tb = tb_for(100)
    try:
        with emulator.running(tb):
            for rnd in range(size["rounds"]):
                for rate in size["rates"]:
                    _, log = bench.train(tb, f"gp-plain-{rate:.4g}-{rnd}", *settings_of("plain", 0))
                    plain.setdefault(rate, []).append(step_of(log))
                    for mode, r in [(m, r) for m in size["modes"] for r in size["rs"]] + [("auto", 0)]:
                        seed += 1
                        sets = list(settings_of("cold" if mode == "auto" else mode, max(r, 1)))
                        if mode == "auto":
                            sets += ['resilience.mode="auto"', 'resilience.replicate_every="auto"',
                                     f'resilience.failure_rate="{_rate_text(rate / ranks)}"',
                                     'resilience.link_rate="100mbit"']
                        if rate > 0:
                            sets.append(f"inject:poisson:rate={_rate_text(rate)}:seed={seed}:rejoin={REJOIN_S:g}s")
                        name = f"gp-{mode}-r{r}-{rate:.4g}-{rnd}"
                        _, log = bench.train(tb, name, *sets, expect_ok=False)
                        value, _, lost_stage = measured_goodput(log, batch)
                        got.setdefault((rate, mode, r), []).append(value)
                        if lost_stage:
                            lost_runs[name] = 1
    finally:
        bench.steps = steps_before
    return figures(bench, got, plain, size, ranks, batch, sorted(lost_runs))


def figures(bench: Any, got: dict[tuple[float, str, int], list[float]], plain: dict[float, list[float]],
            size: dict[str, Any], ranks: int, batch: int, lost: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"goodput_rates_per_s": list(size["rates"]), "goodput_lost_runs": lost,
                           "goodput_rounds": size["rounds"]}
    worst_auto, worst_err = math.inf, 0.0
    table = {}
    for rate in size["rates"]:
        fixed = {(m, r): v for (rt, m, r), v in got.items() if rt == rate and m != "auto"}
        medians = {key: statistics.median(v) for key, v in fixed.items() if v}
        best = max(medians, key=lambda key: medians[key])
        auto = got.get((rate, "auto", 0), [])
        ratio = benchkit.unpaired(fixed[best], auto, few_ok=True)
        tag = _rate_text(rate)
        benchkit.put(out, f"auto_vs_best_fixed_{tag}", ratio)
        worst_auto = min(worst_auto, ratio.median)
        step = statistics.median([s for s in plain[rate] if not math.isnan(s)])
        model = _model(bench.work, step, rate, ranks, batch, size["modes"], size["rs"])
        for key, value in medians.items():
            err = abs(model[key] / value - 1) if value > 0 else math.inf
            worst_err = max(worst_err, err)
            table[f"{tag}/{key[0]}/{key[1]}"] = {"measured": round(value, 1), "model": round(model[key], 1),
                                                   "interval": benchkit.bootstrap(fixed[key], few_ok=True).bounds(1)}
        table[f"{tag}/auto"] = {"measured": round(statistics.median(auto), 1) if auto else None,
                                "best_fixed": f"{best[0]} R={best[1]}"}
    out["auto_vs_best_fixed"] = round(worst_auto, 4)
    out["goodput_model_error"] = round(worst_err, 4)
    out["goodput_grid"] = table
    return out
