"""Stannis benchmark: host only, equal batches, HyperTune and the ideal, measured in one run.

One host and 4 emulated CSDs at 1/8 of the host's speed train LeNet on
synthetic 3x32x32 images, global batch 1536. All figures come from one MPI job
that runs the real Stannis trainer (`stannis.train.Trainer`): first 30 tuned
steps so that HyperTune converges (as it does early in any run), then five
rounds of alternating phases, reporting the median, because the machine is
shared and noisy and a figure measured a minute later is not comparable:

* the ideal: every rank trains on its own at the batch size HyperTune gave
  it, all at the same time for 1.5 s, with no gradient exchange; the ideal is
  the sum of their samples/s, i.e. perfect overlap with no cost for
  synchronisation, under the same sharing of the machine's cores as the
  other phases (per-sample cost depends on the batch size, so each rank is
  timed at its own). Each rank is also timed alone while the others wait
  (``isolated_ideal_sps`` in the detail): on this VM the two vCPUs slow each
  other, so that sum is higher, by what the CSDs' real compute takes from the
  host, which real drives with their own cores would not take;
* host only: the host trains alone at the global batch;
* equal batches (Horovod's default) and HyperTune over host + 4 CSDs;
* finally HyperTune again, with a ``slow`` fault that halves one CSD's speed;
  ``retune_steps`` counts the steps from the fault until throughput over 3
  steps is back within 10% of the new ideal.

Samples per joule come from the power model (see docs/stannis.md).
Run: ``python bench/stannis.py [--json]``.
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

from mpipipe.launch import run_mpi  # noqa: E402

SHAPE = (3, 32, 32)
CSDS = 4
ROUNDS = 5
CONVERGE_STEPS = 30
SLOW_RANK = 2
SLOW_PHASE_STEPS = 40  # tuned steps measured after the slow fault


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
""")


# ------------------------------------------------------------------ inside the MPI job


def worker(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    from mpipipe.cli import start_run
    from stannis.config import STANNIS_CHOICES, STANNIS_DEFAULTS, emulation, stannis_plan
    from stannis.train import Trainer, equal_split

    # The bench owns its log (a re-run with the same --keep replaces it).
    ns = argparse.Namespace(config=args.config, set=args.set, log=args.log, quiet=True, resume=None,
                            inject=[], overwrite=True)
    run = start_run(ns, prog="bench/stannis.py", system="stannis", defaults=STANNIS_DEFAULTS,
                    choices=STANNIS_CHOICES, build_plan=stannis_plan,
                    inject_key=("stannis", "inject"), emulation=emulation)
    run.comm.Set_errhandler(MPI.ERRORS_RETURN)
    tr = Trainer(run)
    raw = run.comm  # bench coordination only; training traffic goes through tr.comm
    cfg = tr.cfg
    B = cfg["stannis"]["global_batch"]
    rank = run.rank

    def barrier() -> None:
        req = raw.Ibarrier()
        while not req.Test():
            time.sleep(0.001)

    def alone(who: int, batch: int, steps: int) -> float:
        """Samples/s of rank ``who`` training alone while the others wait."""
        barrier()
        sps = 0.0
        cores = 0.0
        if rank == who:
            tr._compute(batch)
            tr.optimizer.step()
            t, c = time.perf_counter(), time.process_time()
            for _ in range(steps):
                tr._compute(batch)
                tr.optimizer.step()
            wall = time.perf_counter() - t
            sps = steps * batch / wall
            cores = (time.process_time() - c) / wall
        barrier()
        if who == 0:
            alone_cores[0] = raw.bcast(cores, root=who)
        return raw.bcast(sps, root=who)

    def concurrent(batches: list[int], seconds: float) -> list[float]:
        """Samples/s of every rank training on its own, all at once, with no exchange.

        Each rank computes and steps for ``seconds`` at its batch size; nothing
        is synchronised between them, so this is the ideal's "no cost for
        synchronisation", measured under the same sharing of the machine's
        cores as the runs it is compared with.
        """
        barrier()
        b = batches[rank]
        tr._compute(b)
        tr.optimizer.step()
        t = time.perf_counter()
        n = 0
        while time.perf_counter() - t < seconds:
            tr._compute(b)
            tr.optimizer.step()
            n += 1
        sps = n * b / (time.perf_counter() - t)
        barrier()
        return raw.allgather(sps)

    last_host_s_per_sample = [float("nan")]
    alone_cores = [0.0]  # CPU cores the host used when it last trained alone
    together_cores = [0.0]  # CPU cores all ranks together used in the last together()

    def together(steps: int, tune: bool) -> tuple[float, float]:
        """Samples/s and samples/J of host + CSDs over ``steps`` training steps."""
        cfg["stannis"]["tune"] = tune
        barrier()
        tr._cycle = None  # the busy time of the first step must not count the phase before
        before = {r: dict(t) for r, t in tr.totals.items()}
        t, c = time.perf_counter(), time.process_time()
        for _ in range(steps):
            tr._one_step(tr.step + steps + 10_000, cfg["stannis"], cfg["optim"])
        wall = time.perf_counter() - t
        cpu = raw.reduce(time.process_time() - c, root=0)
        if rank == 0:
            together_cores[0] = cpu / wall
        if rank == 0:  # the host's compute seconds per sample, for the interference figure
            host_s = tr.totals[0]["busy_s"] - before.get(0, {}).get("busy_s", 0.0)
            host_n = tr.totals[0]["samples"] - before.get(0, {}).get("samples", 0)
            last_host_s_per_sample[0] = host_s / host_n if host_n else float("nan")
        samples = sum(tr.totals[r]["samples"] - before.get(r, {}).get("samples", 0)
                      for r in tr.totals)
        joules = sum(tr.totals[r]["joules"] - before.get(r, {}).get("joules", 0.0)
                     for r in tr.totals)
        out = (samples / wall, samples / joules if joules else 0.0) if rank == 0 else None
        return raw.bcast(out, root=0)

    def set_batches(batches: list[int]) -> None:
        if rank == 0:
            tr.batches = batches
        tr._share_plan()

    # The tuner's benchmark phase and first plan, as `stannis train` does.
    cfg["stannis"]["tune"] = True
    tr._start()
    # Let the tuner converge first, as it does early in any run: the rounds
    # measure HyperTune's steady state, not its first guess from the benchmark phase.
    together(CONVERGE_STEPS, tune=True)
    tuned_plan = list(tr.batches)

    rounds = []
    for _ in range(ROUNDS):
        standalone = [alone(r, tuned_plan[r], 3 if r else 8) for r in range(run.size)]
        independent = concurrent(tuned_plan, 1.5)
        host_only = alone(0, B, 6)
        host_only_cores = alone_cores[0]
        tr.comm.take()
        # A host alone draws its own power only: the model's joules for the host.
        host_spj = B / (tr.meter.model.active_w * B / host_only) if host_only else 0.0
        set_batches(equal_split(B, run.size))
        equal, equal_spj = together(8, tune=False)
        set_batches(tuned_plan)
        together(5, tune=True)  # settle after the switch back (includes a re-tune check)
        tuned, tuned_spj = together(15, tune=True)
        tuned_cores = together_cores[0]
        # How much slower the host computes beside the CSDs than alone (same rank,
        # same round): the CSDs' emulated compute shares the machine's cores.
        host_interference = last_host_s_per_sample[0] * standalone[0] if rank == 0 else 0.0
        tuned_plan = list(tr.batches)
        rounds.append({"host_interference": host_interference, "load_avg": os.getloadavg()[0],
                       "host_only_cores": host_only_cores, "tuned_cores": tuned_cores,
                       "standalone": standalone, "independent": independent,
                       "host_only": host_only, "host_spj": host_spj,
                       "equal": equal, "equal_spj": equal_spj, "tuned": tuned,
                       "tuned_spj": tuned_spj})

    # One CSD slows down 2x mid-run: count steps until throughput recovers.
    cfg["stannis"]["tune"] = True
    barrier()
    together(10, tune=True)
    slow_step = tr.step + 1  # the first slowed step (1-based, as in the log)
    # Through the trainer's own fault plan: `_one_step` sets the stretch from it every
    # step, so changing the stretch directly would be undone at the next step.
    from mpipipe.inject import parse_all
    fault = parse_all([f"slow:rank={SLOW_RANK}:step={tr.step}:factor=2"])[0]
    tr.faults.all.append(fault)
    if rank == SLOW_RANK:
        tr.faults.mine.append(fault)
    retunes: list[int] = []  # host: steps at which a new plan was chosen after the fault
    plan_batches = tr._plan_batches

    def recording(reason: str, plan=None) -> None:
        retunes.append(tr.step)
        plan_batches(reason, plan)

    tr._plan_batches = recording
    together(SLOW_PHASE_STEPS, tune=True)
    tr.flush_figures()
    if rank == 0:
        result = summarise(rounds, tr.history, slow_step, args)
        # Context: how soon the tuner reacted (the re-tune takes effect at the next step).
        result["_detail"]["first_retune_after_steps"] = \
            retunes[0] - slow_step + 1 if retunes else None
        Path(args.out).write_text(json.dumps(result))
        tr.log.set_attr("summary", result)
    tr.log.drain()
    run.log.expect_steps(1, tr.step)  # the bench's own phases, not run.steps
    run.log.close()


def summarise(rounds: list[dict], history: list[tuple[int, int, float]], slow_step: int,
              args: argparse.Namespace) -> dict:
    med = {k: float(np.median([r[k] for r in rounds]))
           for k in ("host_only", "host_spj", "equal", "equal_spj", "tuned", "tuned_spj")}
    standalone = np.median(np.array([r["standalone"] for r in rounds]), axis=0)
    independent = np.median(np.array([r["independent"] for r in rounds]), axis=0)
    ideal = float(independent.sum())
    new_ideal = ideal - independent[SLOW_RANK] / 2
    steps = [h[0] for h in history]
    retune_steps = None
    span = 3
    for i in range(span, len(history)):
        if steps[i] < slow_step + span - 1:
            continue
        sps = sum(h[1] for h in history[i - span + 1:i + 1]) / (history[i][2] - history[i - span][2])
        if sps >= 0.9 * new_ideal:
            retune_steps = steps[i] - slow_step + 1
            break
    return {
        "host_only_sps": round(med["host_only"], 1),
        "equal_sps": round(med["equal"], 1),
        "tuned_sps": round(med["tuned"], 1),
        "ideal_sps": round(ideal, 1),
        "tuned_vs_ideal": round(med["tuned"] / ideal, 3),
        "tuned_vs_equal": round(med["tuned"] / med["equal"], 3),
        "tuned_vs_host_only": round(med["tuned"] / med["host_only"], 3),
        "retune_steps": retune_steps,
        "equal_spj": round(med["equal_spj"], 2),
        "tuned_spj": round(med["tuned_spj"], 2),
        "_detail": {"standalone_sps": [round(float(x), 1) for x in standalone],
                    "independent_sps": [round(float(x), 1) for x in independent],
                    "isolated_ideal_sps": round(float(standalone.sum()), 1),
                    "host_only_spj": round(med["host_spj"], 2),
                    "rounds": rounds, "global_batch": args.global_batch,
                    "host_interference": round(float(np.median(
                        [r["host_interference"] for r in rounds])), 2),
                    "load_avg": round(float(np.median([r["load_avg"] for r in rounds])), 1),
                    "host_only_cores": round(float(np.median(
                        [r["host_only_cores"] for r in rounds])), 2),
                    "tuned_cores": round(float(np.median([r["tuned_cores"] for r in rounds])), 2),
                    "slowdown": args.slowdown},
    }


# ------------------------------------------------------------------ the launcher


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--global-batch", type=int, default=1536,
                        help="samples per step over all ranks (default 1536: about 130 per CSD)")
    parser.add_argument("--slowdown", type=float, default=8.0, help="CSD slow-down factor")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a trainer setting over the bench's config, as in `stannis train` "
                             "(repeatable), e.g. --set stannis.imbalance_threshold=0.1")
    parser.add_argument("--keep", metavar="DIR", help="keep the data and the run log in DIR")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
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
    cmd = [str(Path(__file__).resolve()), "--worker",
           "--global-batch", str(args.global_batch), "--slowdown", str(args.slowdown),
           "--config", str(tmp / "bench.toml"), "--log", str(tmp / "bench.h5"),
           "--out", str(out)] + [f"--set={kv}" for kv in args.set]
    proc = run_mpi(1 + CSDS, cmd, timeout=1200)
    if proc.returncode or not out.exists():
        print(f"bench/stannis.py: the MPI job failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return 1
    result = json.loads(out.read_text())
    detail = result.pop("_detail")
    if args.json:
        # Two context figures besides the keys: the machine's load and how
        # much slower the host computed beside the CSDs than alone.
        result["load_avg"] = detail["load_avg"]
        result["host_interference"] = detail["host_interference"]
        result["host_only_cores"] = detail["host_only_cores"]
        result["tuned_cores"] = detail["tuned_cores"]
        result["first_retune_after_steps"] = detail["first_retune_after_steps"]
        print(json.dumps(result))
        return 0
    print(f"Stannis benchmark: 1 host + {CSDS} emulated CSDs at 1/{args.slowdown:g} speed, "
          f"LeNet 3x32x32, global batch {args.global_batch}, median of {ROUNDS} rounds")
    print("  samples/s per rank, all training at once without exchanging (the ideal): "
          + ", ".join(f"{x:,.0f}" for x in detail["independent_sps"]))
    print("  samples/s per rank, each alone: " + ", ".join(
        f"{x:,.0f}" for x in detail["standalone_sps"])
        + f" (sum {detail['isolated_ideal_sps']:,.0f})")
    print(f"  {'variant':<14} {'samples/s':>10} {'samples/J':>10}")
    rows = [("host only", result["host_only_sps"], detail["host_only_spj"]),
            ("equal batches", result["equal_sps"], result["equal_spj"]),
            ("HyperTune", result["tuned_sps"], result["tuned_spj"]),
            ("ideal", result["ideal_sps"], float("nan"))]
    for name, sps, spj in rows:
        print(f"  {name:<14} {sps:>10,.0f} {spj:>10.2f}")
    print(f"  HyperTune / ideal {result['tuned_vs_ideal']:.2f}, / equal "
          f"{result['tuned_vs_equal']:.2f}, / host only {result['tuned_vs_host_only']:.2f}")
    print(f"  load average {detail['load_avg']:.1f}; the host computed "
          f"{detail['host_interference']:.2f}x slower per sample beside the CSDs than alone")
    print(f"  CPU cores used: host only {detail['host_only_cores']:.2f}, HyperTune (all ranks) "
          f"{detail['tuned_cores']:.2f}")
    back = (f"after {result['retune_steps']} steps" if result["retune_steps"] is not None
            else f"not within the {SLOW_PHASE_STEPS} steps measured")
    print(f"  one CSD slowed 2x: back within 10% of the new ideal {back} (first re-tune "
          f"after {detail['first_retune_after_steps']} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
