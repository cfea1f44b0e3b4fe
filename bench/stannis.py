"""Stannis benchmark: host only, equal batches and HyperTune, each judged against its own bound.

One host and 4 emulated CSDs train LeNet on synthetic 3x32x32 images, global
batch 1536. The CSDs' speed is a model: each CSD step lasts 8x the least CPU
time per sample of its recent similar steps (stannis/csd.py), not a device's
measured speed. All figures come from one MPI job that runs the real Stannis
trainer (`stannis.trainer.Trainer`): first 30 tuned steps so that HyperTune
converges (as it does early in any run), then seven rounds (``--quick``: three, fewer
than an interval needs, and it says so), reporting each ratio as the median of the
rounds' ratios with a 90 % bootstrap interval (``<key>_interval``,
mpipipe/tools/benchkit.py), because the machine is shared and noisy and a figure
measured a minute later is not comparable. Each round is a pair for every ratio (the
two variants of a ratio run in the same round, their order alternating). Each round:

* each rank alone at its tuned batch (context: how much slower the host
  computes beside the CSDs), and the host alone at the global batch (host only);
* equal batches (Horovod's default) and HyperTune over host + 4 CSDs, in
  alternating order from round to round, each with the same settle phase (as
  many steps as the CSD stretch remembers, so that neither starts from a
  one-step base) and the same number of measured steps;
* the ideal of each is a bound from the very steps measured (stannis/bound.py):
  every rank's samples over its busy time, summed over the ranks. Measured /
  ideal is at most 1 by construction; a ratio above 1 means the records
  disagree and is reported as invalid (``tuned_vs_ideal_valid: false``), never
  as a result;
* finally HyperTune again, with a ``slow`` fault that halves one CSD's speed;
  ``retune_steps`` counts the steps from the fault until throughput over 3
  steps, against the bound of those same 3 steps, is back within 10% of the
  ratio HyperTune kept in the rounds (``retune_threshold`` = 0.9 x
  ``tuned_vs_ideal``): how fast it re-balances, apart from how well it
  balances, which ``tuned_vs_ideal`` already says.

``tuned_vs_equal_cpu`` and ``tuned_vs_host_only_cpu`` are the same ratios in CPU seconds
per step (every rank's ``time.process_time`` over the phase's steps, summed; the host
alone: its own): baseline CPU per step over HyperTune's. An emulated CSD sleeps out
its modelled slow-down, so its CPU is its real compute only. A ratio to the bound has
no CPU form (the bound is not a run).

Samples per joule come from the power model (stannis/energy.py) over each
phase's wall time, paired step for step with its samples, and carry "model" in
their keys; RAPL is not read (``host.energy = "model"``): the host package's
counter would include the emulated CSDs' own CPU work.
Run: ``python bench/stannis.py [--json] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mpipipe.tools import benchkit  # noqa: E402
from mpipipe.tools.launch import run_mpi  # noqa: E402

SHAPE = (3, 32, 32)
CSDS = 4
SLOW_RANK = 2
WINDOW = 3  # steps per throughput window after the slow fault
RECOVERED = 0.9  # a window within 10% of the rounds' tuned / ideal counts as recovered
# Rounds, tuning steps before the rounds, measured steps per variant and round, steps
# measured after the slow fault: full and --quick (checks the bench end to end).
SIZES = {"full": {"rounds": benchkit.MIN_PAIRS, "converge": 30, "measured": 15, "slow_phase": 40},
         "quick": {"rounds": 3, "converge": 10, "measured": 5, "slow_phase": 15}}
CSD_SPEED = ("modelled: each emulated CSD step lasts {slowdown:g} x the least CPU time per "
             "sample of its recent steps at a similar batch (stannis/csd.py Stretch)")


def make_data(root: Path, seed: int = 0) -> None:
    """Synthetic images and labels laid out as `stannis prepare` does."""
    from native import DatasetWriter

    rng = np.random.default_rng(seed)
    schema = {"image": ("float32", SHAPE), "label": ("int64", ())}
    for name, n in [("public/train", 4096), ("public/test", 256)] + \
            [(f"csd{k}", 1024) for k in range(1, CSDS + 1)]:
        w = DatasetWriter(root / name, schema, overwrite=True)
        w.write({"image": rng.standard_normal((n, *SHAPE), dtype=np.float32),
                 "label": rng.integers(0, 10, n)})
        w.close()


def write_config(path: Path, data: Path, args: argparse.Namespace) -> None:
    path.write_text(f"""
[run]
steps = 100000
eval_every = 0
log_every = 100000
[data]
path = "{data}"
[model]
name = "lenet"
[optim]
name = "sgd"
lr = 0.01
base_batch = {args.global_batch}
warmup_steps = 0
[stannis]
csds = {CSDS}
global_batch = {args.global_batch}
benchmark_batches = [32, 128]
retune_every = 5
[csd]
slowdown = {args.slowdown}
max_batch = 512
[host]
max_batch = 2048
energy = "model"
""")


# ------------------------------------------------------------------ inside the MPI job


def worker(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    from mpipipe.core.run.cli import Request, start_run
    from stannis.config import STANNIS_CHOICES, STANNIS_DEFAULTS, emulation, stannis_plan
    from stannis.csd import Stretch
    from stannis.energy import PowerModel
    from stannis.trainer import STEP_FIGURES, Trainer, equal_split

    # The bench owns its log (a re-run with the same --keep replaces it).
    size = SIZES[args.size]
    settle = Stretch.MEMORY  # a full stretch memory at the new plan before measuring
    ns = Request(config=args.config, settings=args.set, log=args.log, quiet=True, overwrite=True)
    run = start_run(ns, prog="bench/stannis.py", system="stannis", defaults=STANNIS_DEFAULTS,
                    choices=STANNIS_CHOICES, build_plan=stannis_plan,
                    inject_key=("stannis", "inject"), emulation=emulation)
    run.comm.Set_errhandler(MPI.ERRORS_RETURN)
    tr = Trainer(run)
    raw = run.comm  # bench coordination only; training traffic goes through tr.comm
    cfg = tr.cfg
    B = cfg["stannis"]["global_batch"]
    rank = run.rank
    # Every rank's power model, for the modelled joules of each phase (host only).
    powers = raw.gather((tr.device.meter.model.idle_w, tr.device.meter.model.active_w), root=0)
    col = {name: STEP_FIGURES.index(name) for name in ("compute_s", "batch_size", "busy_s")}

    # Host: every training step's per-rank figures, as the trainer exchanged them.
    records: list[dict] = []
    record = tr.figures.record

    def recording_record(table: np.ndarray, wall: float, step: int) -> list:
        ranks = {r: (int(table[pos, col["batch_size"]]), float(table[pos, col["busy_s"]]),
                     float(table[pos, col["compute_s"]])) for pos, r in enumerate(tr.members)}
        busy = record(table, wall, step)
        records.append({"step": tr.step, "end": time.perf_counter(), "ranks": ranks})
        return busy

    tr.figures.record = recording_record

    def barrier() -> None:
        req = raw.Ibarrier()
        while not req.Test():
            time.sleep(0.001)

    alone_cores = [0.0, 0.0]  # CPU cores the host used when it last trained alone; its CPU s a step

    def alone(who: int, batch: int, steps: int) -> float:
        """Samples/s of rank ``who`` training alone while the others wait."""
        barrier()
        sps = 0.0
        cores = cpu = 0.0
        if rank == who:
            tr.stepper.compute(batch)
            tr.stepper.optimizer.step()
            t, c = time.perf_counter(), time.process_time()
            for _ in range(steps):
                tr.stepper.compute(batch)
                tr.stepper.optimizer.step()
            wall = time.perf_counter() - t
            sps = steps * batch / wall
            cpu = time.process_time() - c
            cores = cpu / wall
        barrier()
        if who == 0:
            alone_cores[0] = raw.bcast(cores, root=who)
            alone_cores[1] = raw.bcast(cpu / steps, root=who)
        return raw.bcast(sps, root=who)

    # Host: re-tunes (plan changes by the tuner) and tuned steps while no fault is
    # injected, in the converging phase and after it: `retunes_per_100_steps` of a
    # steady run counts those after the first tune has converged, and
    # `retunes_per_100_steps_from_start` all of them from the first plan on.
    steady = {"on": False, "steps": 0, "retunes": [], "converge_steps": 0}
    plan_batches = tr.tuning.plan

    def counting(reason: str, step: int, plan=None) -> None:
        old = list(tr.tuning.batches)
        plan_batches(reason, step, plan)
        if steady["on"] and tr.tuning.batches != old:
            steady["retunes"].append((tr.step, reason))

    tr.tuning.plan = counting
    # Host: moves that passed the bar once in a steady phase (a re-tune waits for the next
    # check to confirm it, hypertune.RetuneRule.confirm); those not confirmed are what the
    # confirmation filtered out.
    passed_once: list[tuple[int, str]] = []
    check = tr.tuning.retuner.check

    def watching(step: int, *a, **k):
        decision = check(step, *a, **k)
        if decision is not None and decision.target is None and steady["on"] and \
                "to be confirmed" in decision.reason:
            passed_once.append((step, decision.reason))
        return decision

    tr.tuning.retuner.check = watching

    def together(steps: int, tune: bool) -> dict | None:
        """Train ``steps`` steps of host + CSDs; the host gets the phase's figures.

        The phase ends with the last step's late figures flushed, so that nothing of
        it is left for the next phase. Returns (host) the steps' records, the wall
        time, the judgement against the bound of those steps, the modelled joules
        over the wall time, CPU cores used and the host's compute per sample.
        """
        from stannis.bound import judge

        cfg["stannis"]["tune"] = tune
        barrier()
        tr.figures.restart_clock()  # the busy time of the first step must not count the phase before
        first = len(records)
        if tune and steady["on"]:
            steady["steps"] += steps
        t, c = time.perf_counter(), time.process_time()
        for _ in range(steps):
            tr._one_step(tr.step + steps + 10_000)
        wall = time.perf_counter() - t
        cpu = raw.reduce(time.process_time() - c, root=0)
        tr.flush_figures()
        if rank != 0:
            return None
        mine = records[first:]
        judged = judge([{r: (b, busy) for r, (b, busy, _) in rec["ranks"].items()}
                        for rec in mine], wall)
        compute = {r: sum(rec["ranks"][r][2] for rec in mine if r in rec["ranks"])
                   for r in mine[0]["ranks"]}
        # The power model over the phase's wall time: idle watts throughout, active
        # watts while computing (a CSD's compute time is its emulated device time).
        joules = sum(PowerModel(*powers[r]).joules(wall, compute[r]) for r in compute)
        host_n = sum(rec["ranks"][0][0] for rec in mine)
        return {"t0": t, "records": mine, "wall": wall, "judged": judged,
                "spj_model": judged.sps * wall / joules if joules else 0.0,
                "cores": cpu / wall, "cpu_per_step": cpu / steps,
                "host_s_per_sample": compute[0] / host_n if host_n else
                float("nan")}

    def set_batches(batches: list[int]) -> None:
        if rank == 0:
            tr.tuning.batches = batches
            tr.tuning.retuner.restart(tr.members)  # the tuner judges the new plan on its own steps
        tr.tuning.share()

    def variant(plan: list[int], tune: bool) -> dict | None:
        """One variant at ``plan``: settle, then the measured steps (same for both)."""
        set_batches(plan)
        together(settle, tune=tune)
        return together(size["measured"], tune=tune)

    # The tuner's benchmark phase and first plan, as `stannis train` does.
    cfg["stannis"]["tune"] = True
    tr._start()
    steady["on"] = True
    # Let the tuner converge first, as it does early in any run: the rounds
    # measure HyperTune's steady state, not its first guess from the benchmark phase.
    together(size["converge"], tune=True)
    steady["converge_steps"] = size["converge"]
    tuned_plan = list(tr.tuning.batches)

    rounds = []
    for i in range(size["rounds"]):
        standalone = [alone(r, tuned_plan[r], 3 if r else 8) for r in range(run.size)]
        host_only = alone(0, B, 6)
        host_only_cores, host_only_cpu = alone_cores
        tr.comm.take()
        # Equal first in even rounds, HyperTune first in odd ones: neither always
        # follows the other's plan.
        order = ("equal", "tuned") if i % 2 == 0 else ("tuned", "equal")
        phases = {}
        for name in order:
            if name == "equal":
                phases[name] = variant(equal_split(B, run.size), tune=False)
            else:
                phases[name] = variant(tuned_plan, tune=True)
                tuned_plan = list(tr.tuning.batches)
        if rank != 0:
            continue
        eq, tu = phases["equal"], phases["tuned"]
        # A host alone draws active power all the time (the power model, no CSDs).
        host_spj = host_only / tr.device.meter.model.active_w
        rounds.append({
            "order": list(order), "load_avg": os.getloadavg()[0],
            "standalone": standalone, "host_only": host_only, "host_only_cores": host_only_cores,
            "host_only_cpu_step": host_only_cpu, "equal_cpu_step": eq["cpu_per_step"],
            "tuned_cpu_step": tu["cpu_per_step"],
            "host_spj_model": host_spj,
            "equal": eq["judged"].sps, "equal_ideal": eq["judged"].ideal_sps,
            "equal_vs_ideal": eq["judged"].ratio, "equal_invalid": eq["judged"].reason,
            "equal_spj_model": eq["spj_model"],
            "tuned": tu["judged"].sps, "tuned_ideal": tu["judged"].ideal_sps,
            "tuned_vs_ideal": tu["judged"].ratio, "tuned_invalid": tu["judged"].reason,
            "tuned_spj_model": tu["spj_model"], "tuned_cores": tu["cores"],
            # How much slower the host computes beside the CSDs than alone (same
            # rank, same round): the CSDs' emulated compute shares the machine's cores.
            "host_interference": tu["host_s_per_sample"] * standalone[0],
            "tuned_plan": tuned_plan})

    # One CSD slows down 2x mid-run: count steps until throughput recovers.
    together(10, tune=True)
    steady["on"] = False
    slow_step = tr.step + 1  # the first slowed step (1-based, as in the log)
    # Through the trainer's own fault plan: `_one_step` sets the stretch from it every
    # step, so changing the stretch directly would be undone at the next step.
    from mpipipe.core.mpi.faults import parse_all
    fault = parse_all([f"slow:rank={SLOW_RANK}:step={tr.step}:factor=2"])[0]
    tr.injection.plan.all.append(fault)
    if rank == SLOW_RANK:
        tr.injection.plan.mine.append(fault)
    retunes: list[int] = []  # host: steps at which a new plan was chosen after the fault

    def recording(reason: str, step: int, plan=None) -> None:
        retunes.append(tr.step)
        counting(reason, step, plan)

    tr.tuning.plan = recording
    slow = together(size["slow_phase"], tune=True)
    if rank == 0:
        result = summarise(rounds, slow, slow_step, args)
        n, first = steady["steps"], steady["converge_steps"]
        late = [s for s, _ in steady["retunes"] if s > first]
        result["retunes_per_100_steps"] = round(100 * len(late) / (n - first), 2) \
            if n > first else None
        result["retunes_per_100_steps_from_start"] = \
            round(100 * len(steady["retunes"]) / n, 2) if n else None
        result["_detail"]["steady_retunes"] = len(late)
        result["_detail"]["steady_steps"] = n - first
        result["_detail"]["converge_retunes"] = len(steady["retunes"]) - len(late)
        result["_detail"]["converge_steps"] = first
        result["_detail"]["steady_retune_reasons"] = [f"step {s}: {r}" for s, r in steady["retunes"]]
        taken = {s for s, _ in steady["retunes"]}
        every = cfg["stannis"]["retune_every"]
        result["_detail"]["steady_unconfirmed"] = [
            f"step {s}: {r}" for s, r in passed_once if s > first and s + every not in taken]
        # The spread of single step times each rank's tuner saw last (the noise it allows for).
        result["_detail"]["step_spread"] = {r: round(tr.tuning.retuner.spread_of(r), 3)
                                            for r in tr.members}
        # Each rank's batch floor (overhead at most stannis.overhead_share of its step).
        result["_detail"]["floors"] = [p.min_batch for p in tr.tuning.capped()]
        result["_detail"]["tuned_plan"] = rounds[-1]["tuned_plan"] if rounds else None
        # Context: how soon the tuner reacted (the re-tune takes effect at the next step).
        result["_detail"]["first_retune_after_steps"] = \
            retunes[0] - slow_step + 1 if retunes else None
        Path(args.out).write_text(json.dumps(result))
        tr.log.set_attr("summary", result)
    tr.log.drain()
    run.log.expect_steps(1, tr.step)  # the bench's own phases, not run.steps
    run.log.close()


def recovery(slow: dict, slow_step: int, threshold: float | None) -> tuple[int | None, int]:
    """Steps from the fault until a window of `WINDOW` steps reaches ``threshold`` of its bound.

    Each window is judged against the bound of its own steps (stannis/bound.py),
    so the tuner is judged on how little its ranks wait, at whatever plan it
    chose. Returns the steps (None if never, or if there is no threshold because
    the rounds' ratio was invalid) and how many windows were invalid.
    """
    from stannis.bound import judge

    recs = slow["records"]
    ends = [slow["t0"]] + [r["end"] for r in recs]
    invalid = 0
    for i in range(WINDOW - 1, len(recs)):
        window = recs[i - WINDOW + 1:i + 1]
        j = judge([{r: (b, busy) for r, (b, busy, _) in rec["ranks"].items()} for rec in window],
                  ends[i + 1] - ends[i + 1 - WINDOW])
        if not j.valid:
            invalid += 1
            continue
        if threshold is not None and recs[i]["step"] >= slow_step + WINDOW - 1 and \
                j.ratio >= threshold:
            return recs[i]["step"] - slow_step + 1, invalid
    return None, invalid


def _median(values: list[float]) -> float:
    return float(np.median(values))


def verdict(rounds: list[dict], key: str) -> tuple[benchkit.Interval | None, str]:
    """The median of every round's measured / ideal with its interval, or None and why if any
    round is invalid."""
    bad = [(i, r[key.replace("_vs_ideal", "_invalid")]) for i, r in enumerate(rounds)
           if r[key] is None]
    if bad:
        i, why = bad[0]
        return None, f"round {i + 1} of {len(rounds)}: {why}"
    return benchkit.bootstrap([r[key] for r in rounds], few_ok=True), ""


def _ratios(rounds: list[dict]) -> dict:
    """The ratios of each round's two variants (a pair), median and interval, in samples/s
    and in CPU seconds per step (baseline's CPU per step over HyperTune's)."""
    out: dict = {}
    for key, base in (("tuned_vs_equal", "equal"), ("tuned_vs_host_only", "host_only")):
        benchkit.put(out, key, benchkit.paired([r[base] for r in rounds], [r["tuned"] for r in rounds],
                                               few_ok=True), 3)
        benchkit.put(out, f"{key}_cpu", benchkit.paired([r[f"{base}_cpu_step"] for r in rounds],
                                                        [r["tuned_cpu_step"] for r in rounds],
                                                        ratio=lambda b, c: b / c, few_ok=True), 3)
    return out


def summarise(rounds: list[dict], slow: dict, slow_step: int, args: argparse.Namespace) -> dict:
    med = {k: _median([r[k] for r in rounds])
           for k in ("host_only", "host_spj_model", "equal", "equal_ideal", "equal_spj_model",
                     "tuned", "tuned_ideal", "tuned_spj_model")}
    standalone = np.median(np.array([r["standalone"] for r in rounds]), axis=0)
    tuned_iv, why = verdict(rounds, "tuned_vs_ideal")
    equal_iv, equal_why = verdict(rounds, "equal_vs_ideal")
    tuned_vs_ideal = None if tuned_iv is None else round(tuned_iv.median, 3)
    threshold = None if tuned_vs_ideal is None else round(RECOVERED * tuned_vs_ideal, 3)
    retune_steps, invalid_windows = recovery(slow, slow_step, threshold)
    tail = slow["records"][-10:]
    from stannis.bound import judge
    end_wall = slow["records"][-1]["end"] - (slow["records"][-11]["end"]
                                             if len(slow["records"]) > 10 else slow["t0"])
    slow_end = judge([{r: (b, busy) for r, (b, busy, _) in rec["ranks"].items()}
                      for rec in tail], end_wall)
    return {
        "host_only_sps": round(med["host_only"], 1),
        "equal_sps": round(med["equal"], 1),
        "tuned_sps": round(med["tuned"], 1),
        "ideal_sps": round(med["tuned_ideal"], 1),
        "tuned_vs_ideal": tuned_vs_ideal,
        "tuned_vs_ideal_interval": tuned_iv.bounds(3) if tuned_iv else [None, None],
        "tuned_vs_ideal_valid": tuned_vs_ideal is not None,
        "tuned_vs_ideal_invalid_reason": why or None,
        "equal_vs_ideal": None if equal_iv is None else round(equal_iv.median, 3),
        "equal_vs_ideal_interval": equal_iv.bounds(3) if equal_iv else [None, None],
        "equal_vs_ideal_invalid_reason": equal_why or None,
        # Paired within each round (same load), then the median over the rounds.
        **_ratios(rounds),
        "pairs": len(rounds),
        "note": benchkit.few_pairs_note(len(rounds), "--quick" if args.size == "quick" else "rounds"),
        "retune_steps": retune_steps,
        "retune_threshold": threshold,
        "equal_spj_model": round(med["equal_spj_model"], 2),
        "tuned_spj_model": round(med["tuned_spj_model"], 2),
        "csd_speed_model": CSD_SPEED.format(slowdown=args.slowdown),
        "_detail": {"standalone_sps": [round(float(x), 1) for x in standalone],
                    "alone_sum_sps": round(float(standalone.sum()), 1),
                    "equal_ideal_sps": round(med["equal_ideal"], 1),
                    "host_only_spj_model": round(med["host_spj_model"], 2),
                    "slow_phase_end_vs_ideal": None if slow_end.ratio is None
                    else round(slow_end.ratio, 3),
                    "retune_windows_invalid": invalid_windows,
                    "rounds": rounds, "global_batch": args.global_batch, "size": args.size,
                    "host_interference": round(_median(
                        [r["host_interference"] for r in rounds]), 2),
                    "load_avg": round(_median([r["load_avg"] for r in rounds]), 1),
                    "host_only_cores": round(_median([r["host_only_cores"] for r in rounds]), 2),
                    "tuned_cores": round(_median([r["tuned_cores"] for r in rounds]), 2),
                    "slowdown": args.slowdown},
    }


# ------------------------------------------------------------------ the launcher


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--quick", action="store_const", dest="size", const="quick",
                        default="full", help="fewer rounds and steps: checks the bench runs end "
                                             "to end, its figures mean little")
    parser.add_argument("--global-batch", type=int, default=1536,
                        help="samples per step over all ranks (default 1536: about 130 per CSD)")
    parser.add_argument("--slowdown", type=float, default=8.0, help="CSD slow-down factor")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a trainer setting over the bench's config, as in `stannis train` "
                             "(repeatable), e.g. --set stannis.noise_retunes_per_100=2")
    parser.add_argument("--keep", metavar="DIR", help="keep the data and the run log in DIR")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=sorted(SIZES), help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--log", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0

    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="stannis-bench-"))
    tmp.mkdir(parents=True, exist_ok=True)
    make_data(tmp / "data")
    write_config(tmp / "bench.toml", tmp / "data", args)
    out = tmp / "result.json"
    log = tmp / f"bench-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.h5"  # never an old one
    cmd = [str(Path(__file__).resolve()), "--worker", "--size", args.size,
           "--global-batch", str(args.global_batch), "--slowdown", str(args.slowdown),
           "--config", str(tmp / "bench.toml"), "--log", str(log),
           "--out", str(out)] + [f"--set={kv}" for kv in args.set]
    out.unlink(missing_ok=True)
    proc = run_mpi(1 + CSDS, cmd, timeout=1200)
    if proc.returncode or not out.exists():
        print(f"bench/stannis.py: the MPI job failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return 1
    result = json.loads(out.read_text())
    detail = result.pop("_detail")
    if args.json:
        # Context figures besides the keys: the machine's load and how much
        # slower the host computed beside the CSDs than alone.
        for key in ("load_avg", "host_interference", "host_only_cores", "tuned_cores",
                    "steady_retunes", "steady_steps", "steady_retune_reasons", "steady_unconfirmed",
                    "step_spread", "floors", "tuned_plan",
                    "converge_retunes", "converge_steps",
                    "first_retune_after_steps", "slow_phase_end_vs_ideal",
                    "retune_windows_invalid", "equal_ideal_sps", "host_only_spj_model"):
            result[key] = detail[key]
        result["size"] = args.size
        print(json.dumps(result))
        return 0
    n = len(detail["rounds"])
    print(f"Stannis benchmark{' (--quick: checks it runs, figures mean little)' if args.size == 'quick' else ''}: "
          f"1 host + {CSDS} emulated CSDs, LeNet 3x32x32, global batch {args.global_batch}, "
          f"median of {n} rounds (each ratio: median [90% bootstrap interval] over the rounds)")
    if result.get("note"):
        print(f"  note: {result['note']}")
    print(f"  CSD speed is {result['csd_speed_model']}")
    print("  samples/s per rank, each alone at its tuned batch: " + ", ".join(
        f"{x:,.0f}" for x in detail["standalone_sps"]) + f" (sum {detail['alone_sum_sps']:,.0f})")
    print(f"  {'variant':<14} {'samples/s':>10} {'bound':>10} {'/ bound':>22} "
          f"{'samples/J (modelled)':>21}")

    def ratio(x: float | None, key: str | None = None) -> str:
        if x is None:
            return "INVALID"
        bounds = result.get(f"{key}_interval") if key else None
        return f"{x:.3f}" + (f" [{bounds[0]:.3f}..{bounds[1]:.3f}]" if bounds and None not in bounds else "")

    rows = [("host only", result["host_only_sps"], None, None, detail["host_only_spj_model"]),
            ("equal batches", result["equal_sps"], detail["equal_ideal_sps"],
             ratio(result["equal_vs_ideal"], "equal_vs_ideal"), result["equal_spj_model"]),
            ("HyperTune", result["tuned_sps"], result["ideal_sps"],
             ratio(result["tuned_vs_ideal"], "tuned_vs_ideal"), result["tuned_spj_model"])]
    for name, sps, bound, r, spj in rows:
        print(f"  {name:<14} {sps:>10,.0f} {'' if bound is None else f'{bound:,.0f}':>10} "
              f"{r or '':>22} {spj:>21.2f}")
    print("  bound: every rank's samples over its busy time in the same steps, summed (no rank "
          "waits); measured / bound is at most 1")
    for key in ("tuned_vs_ideal_invalid_reason", "equal_vs_ideal_invalid_reason"):
        if result.get(key):
            print(f"  INVALID ({key.split('_vs')[0]}): {result[key]}")
    for key, what in (("tuned_vs_equal", "equal"), ("tuned_vs_host_only", "host only")):
        print(f"  HyperTune / {what} {ratio(result[key], key)}, in CPU seconds per step "
              f"{ratio(result[key + '_cpu'], key + '_cpu')} (paired per round)")
    print(f"  load average {detail['load_avg']:.1f}; the host computed "
          f"{detail['host_interference']:.2f}x slower per sample beside the CSDs than alone")
    print(f"  CPU cores used: host only {detail['host_only_cores']:.2f}, HyperTune (all ranks) "
          f"{detail['tuned_cores']:.2f}")
    back = (f"after {result['retune_steps']} steps" if result["retune_steps"] is not None
            else "not within the steps measured")
    print(f"  one CSD slowed 2x: a {WINDOW}-step window at {result['retune_threshold']} of its "
          f"own bound (0.9 x HyperTune / bound) {back} "
          f"(first re-tune after {detail['first_retune_after_steps']} steps; last 10 steps at "
          f"{ratio(detail['slow_phase_end_vs_ideal'])} of their bound)")
    print(f"  re-tunes with no fault: {detail['steady_retunes']} in {detail['steady_steps']} "
          f"tuned steps after the first {detail['converge_steps']} (retunes_per_100_steps "
          f"{result['retunes_per_100_steps']}); {detail['converge_retunes']} while converging "
          f"({result['retunes_per_100_steps_from_start']} per 100 steps from the first plan on); "
          f"{len(detail['steady_unconfirmed'])} moves passed the bar once and were not confirmed")
    print(f"  last tuned plan {detail['tuned_plan']}, batch floors {detail['floors']}")
    print("  samples/J are modelled (power model over each phase's wall time; RAPL not read)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
