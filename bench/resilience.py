"""ResPipe resilience on the digits, K = 3: overhead, recovery from a kill and a stall, straggling.

    python bench/resilience.py            # a table, and a PNG of accuracy against time
    python bench/resilience.py --json     # one JSON line
    python bench/resilience.py --out /tmp/resilience.png --steps 600
    python bench/resilience.py --quick    # small: checks the bench runs end to end

Every figure is measured in this one run (ten short training jobs, all launched
with `mpirun --with-ft ulfm` and 6 ranks, so all run the same resilient loop in
the same world size) and reported as a ratio or a time relative to its own run,
because the machine is shared and noisy:

- overhead_r1, overhead_r10, overhead_hot: failure-free wall time per sample over
  the whole run (the summary's samples/s: every step, every replica, every
  evaluation) with one backup per stage (cold R=1, cold R=10, hot R=10), over the
  plain pipeline's, minus 1. The failure-free jobs run in ``--repeat`` (default 7)
  interleaved rounds (plain, r1, r10, hot, then the ResNet-18 pair); each round is a
  pair for every overhead, and the figure is the median of the rounds' overheads with
  a 90 % bootstrap interval (``<key>_interval``, mpipipe/tools/benchkit.py). A median
  at or below 0 is printed "no measurable cost (interval lo..hi)", never as a gain.
  ``<key>_cpu`` is the same overhead in CPU seconds per step: getrusage(RUSAGE_CHILDREN)
  around each job (every rank and mpirun, start-up included: the same in both jobs of a
  pair, so it pulls the CPU overhead towards 0; ``cpu_s_per_step`` gives the medians).
  The plain pipeline runs with the same world size (``baseline_ranks``: its 3 stages
  and 3 spare ranks that idle outside the route, mpipipe/core/mpi/spare.py), so the
  overhead does not count fewer processes sharing the cores as a saving. ``*_median``
  give the former figure (median step time, which with R=10 never sees a replica) for
  comparison, with their intervals
- hot_mirror_compute_vs_base: in hot mode every backup recomputes its stage; on
  this machine that shares the stages' cores. The stages' compute per sample in
  the hot run (the log's per-rank compute_s, which the mirrors redo) over the
  plain pipeline's wall time per sample of the same round: the part of overhead_hot
  that the mirrors' recompute can explain when it cannot run on cores of its own
- recovery_s: from the SIGKILL of stage 1 (R=10, one backup per stage) to the next
  completed step. The kill falls between two replicas (``kill_step``, e.g. 305
  with R=10), so the backup serves stage 1 from the replica of step 300 and that
  stage's ``lost_updates`` updates since are lost (not replayed);
  final_accuracy_kill against final_accuracy_clean (same run without the kill),
  ``accuracy_kill_vs_clean`` their difference; baseline_kill_outcome: what the
  plain pipeline did with the same kill
- recovery_s_hot, final_accuracy_kill_hot: the same kill in hot mode, placed in the
  middle of a step (after the forward of micro-batch 1): the mirror finishes the step
  in flight, nothing is replayed (hot_replayed_steps: 0), against final_accuracy_hot
  of the failure-free hot run
- stall_recovery_steps: from the stall of stage 1 to the next completed step, in
  median step times (deadline = 2 x median step time); stall_recovery_s the same in
  seconds. The fault runs (kill, stall, straggler) run once each: their figures have
  no interval
- overhead_r10_resnet18: overhead_r10 for a user's model: the torchvision-style
  ResNet-18 with BatchNorm of examples/resnet18_respipe.py (model.factory, width 16) on
  random 3x32x32 images, cold R=10 against the plain pipeline, ``--resnet-steps`` steps,
  one pair a round;
  its replicas carry BatchNorm's buffers and the momentum (replica_bytes_per_step_resnet18)
- time_to_accuracy_respipe / _baseline: seconds to reach the accuracy target when
  stage 1 straggles (p = 0.1 per step, 2 s each): ResPipe replaces it after its first
  late step; the plain pipeline waits every time

The plot goes to ``--out``, or without it to a new temporary folder (printed): a bench
never writes over a file of the checkout (``make docs-figures`` passes ``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mpipipe.tools import benchkit  # noqa: E402
from mpipipe.tools.launch import mpirun_env, run_mpi  # noqa: E402

BATCH = 32
TARGET = 0.90  # accuracy for the time-to-accuracy figures
STAGES = 3
R = 10  # replicate_every of the R=10 jobs
ALL = "resilience.backups={0 = 1, 1 = 1, 2 = 1}"
NONE = "resilience.backups={}"
RANKS = 2 * STAGES  # every job: 3 stages and 3 backups, or 3 stages and 3 spares
# The plain pipeline's plan: its stages, then spares that idle outside the route.
SPARES = tuple(f"plan.stage {k}={k}" for k in range(STAGES)) + \
    tuple(f"plan.spare {k}={STAGES + k}" for k in range(RANKS - STAGES))


def kill_step(steps: int) -> int:
    """The step index a kill fires at: mid-run and halfway between two replicas.

    A kill at a multiple of R loses no update by construction; halfway, the cold
    backup starts from a replica R/2 updates old, so the accuracy it reaches
    says something.
    """
    return (steps // 2) // R * R + R // 2


def _train(work: Path, name: str, ranks: int, steps: int, *settings: str,
           ulfm: bool = True) -> tuple[subprocess.CompletedProcess, Path, float]:
    """Run one job; return its result, its log and its CPU seconds (every process of it)."""
    log = work / f"{name}.h5"
    cmd = ["-m", "mpipipe", "train", "--quiet",
            "--config", str(ROOT / "jobs" / "configs" / "respipe-digits.toml"),
            "--set", f'data.path="{work / "digits"}"', "--set", f"run.steps={steps}",
            "--set", f"run.eval_every={max(steps // 24, 1)}", "--set", f"data.batch_size={BATCH}",
            "--log", str(log), "--overwrite"]  # a re-run with the same --keep replaces it
    for s in settings:
        cmd += ["--inject", s[7:]] if s.startswith("inject:") else ["--set", s]
    # A safety net only: six ranks importing torch on a loaded 2-core machine take a minute.
    cpu = benchkit.children_cpu_s()
    result = run_mpi(ranks, cmd, ulfm=ulfm, timeout=240 + 2 * steps)
    return result, log, benchkit.children_cpu_s() - cpu


def _median_step_s(log: Path) -> float:
    from mpipipe.core.logs.runlog import open_log

    t = open_log(log).steps["time"]
    return statistics.median(b - a for a, b in zip(t[:-1], t[1:], strict=True))


def _wall_per_sample(log: Path) -> float:
    """Seconds per sample over the whole run: the inverse of the summary's samples/s."""
    from mpipipe.core.logs.runlog import open_log

    summary = json.loads(open_log(log).attrs["summary"])
    return 1.0 / summary["samples_per_s"]


def _compute_per_sample(log: Path) -> float:
    """The stages' compute seconds per sample, summed over the stages (the log's compute_s)."""
    from mpipipe.core.logs.runlog import open_log

    run = open_log(log)
    total = sum(float(sum(cols["compute_s"])) for cols in run.ranks.values())
    return total / (len(run.steps["step"]) * BATCH)


def _final_accuracy(log: Path) -> float:
    from mpipipe.core.logs.runlog import open_log

    acc = open_log(log).eval["accuracy"]
    return float(acc[-1]) if len(acc) else math.nan


def _time_to(log: Path, target: float) -> float:
    from mpipipe.core.logs.runlog import open_log

    run = open_log(log)
    t0 = float(run.steps["time"][0]) if len(run.steps["time"]) else 0.0
    for t, a in zip(run.eval["time"], run.eval["accuracy"], strict=True):
        if a >= target:
            return float(t) - t0
    return math.nan


def _event(log: Path, kind: str) -> dict:
    from mpipipe.core.logs.runlog import open_log

    found = open_log(log).events_of(kind)
    return found[0]["detail"] if found else {}


def _outcome(result: subprocess.CompletedProcess, log: Path) -> str:
    from mpipipe.core.logs.runlog import open_log

    run = open_log(log)
    steps = int(run.steps["step"][-1]) if len(run.steps["step"]) else 0
    error = next((line.split("error: ", 1)[1] for line in result.stderr.splitlines()
                  if "error: " in line), "")
    if result.returncode == 0:
        return f"completed {steps} steps"
    return f"stopped after step {steps} (exit {result.returncode}): {error.split(':')[0]}"


RESNET18 = ('model.factory="examples/resnet18_respipe.py:ResNet18"', "model.kwargs={width = 16}",
            'optim.schedule="constant"')


# The failure-free overheads: (key, candidate job, its baseline job).
OVERHEADS = (("overhead_r1", "r1", "plain"), ("overhead_r10", "r10", "plain"), ("overhead_hot", "hot", "plain"),
             ("overhead_r10_resnet18", "r10_resnet18", "plain_resnet18"))


def _overheads(runs: dict[str, dict[str, list[float]]], figures: dict) -> None:
    """Each overhead over the rounds' pairs, by wall time per sample, by median step time and
    by CPU seconds per step, each with its interval; plus hot_mirror_compute_vs_base."""
    def pairs(key: str, cand: str, base: str, measure: str) -> None:
        if cand in runs:
            iv = benchkit.paired(runs[base][measure], runs[cand][measure], few_ok=True).shifted(-1)
            benchkit.put(figures, key, iv)
    for key, cand, base in OVERHEADS:
        pairs(key, cand, base, "per_sample")
        pairs(f"{key}_cpu", cand, base, "cpu")
        if "resnet" not in key:
            pairs(f"{key}_median", cand, base, "step")
    benchkit.put(figures, "hot_mirror_compute_vs_base",
                 benchkit.paired(runs["plain"]["per_sample"], runs["hot"]["compute"], few_ok=True))
    figures["cpu_s_per_step"] = {name: round(statistics.median(r["cpu"]), 4) for name, r in runs.items()}


def measure(steps: int, work: Path, repeat: int = benchkit.MIN_PAIRS, resnet_steps: int = 60
            ) -> tuple[dict, dict[str, Path]]:
    """Run the jobs; return the figures and the logs by name."""
    subprocess.run([sys.executable, "-m", "native.convert", "digits", str(work / "digits"), "--overwrite"],
                   cwd=ROOT, env=mpirun_env(), check=True, capture_output=True, timeout=120)
    subprocess.run([sys.executable, "-m", "native.convert", "synthetic", "--shape", "3,32,32",
                    "--count", "2048", str(work / "synthetic32"), "--overwrite", "--quiet"],
                   cwd=ROOT, env=mpirun_env(), check=True, capture_output=True, timeout=120)
    resnet = (*RESNET18, f'data.path="{work / "synthetic32"}"')
    kill_at, stall_at = kill_step(steps), steps // 2
    r10 = (ALL, f"resilience.replicate_every={R}")
    plain = (NONE, *SPARES)
    jobs = {
        "plain": plain,
        "r1": (ALL, "resilience.replicate_every=1"),
        "r10": r10,
        "hot": (*r10, 'resilience.mode="hot"'),
        "kill": (*r10, f"inject:kill:stage=1:step={kill_at}"),
        "hot_kill": (*r10, 'resilience.mode="hot"', f"inject:kill:stage=1:step={kill_at}:micro=1"),
        "plain_kill": (*plain, f"inject:kill:stage=1:step={kill_at}"),
        "stall": (*r10, "resilience.deadline_factor=2",
                  f"inject:stall:stage=1:step={stall_at}:seconds=3"),
        "delay": (*r10, "resilience.deadline_factor=2", "inject:delay:stage=1:p=0.1:seconds=2"),
        "plain_delay": (*plain, "inject:delay:stage=1:p=0.1:seconds=2"),
    }
    clean = ("plain", "r1", "r10", "hot")
    if resnet_steps > 0:
        jobs.update({"plain_resnet18": (*plain, *resnet), "r10_resnet18": (*r10, *resnet)})
        clean += ("plain_resnet18", "r10_resnet18")
    logs, results = {}, {}
    # The failure-free jobs run in `repeat` interleaved rounds, each round a pair for
    # every overhead: a slow minute of the machine slows both jobs of a pair.
    order = [n for _ in range(repeat) for n in clean] + [n for n in jobs if n not in clean]
    runs: dict[str, dict[str, list[float]]] = {}  # job -> measure -> one figure a round
    medians: dict[str, list[float]] = {}
    for i, name in enumerate(order):
        tag = name if name not in medians else f"{name}-{i}"
        n = resnet_steps if "resnet" in name else steps
        result, log, cpu = _train(work, tag, RANKS, n, *jobs[name])
        if name != "plain_kill" and result.returncode != 0:
            raise RuntimeError(f"job {name} failed: {result.stderr[-2000:]}")
        medians.setdefault(name, []).append(_median_step_s(log))
        if name in clean:
            run = runs.setdefault(name, {"per_sample": [], "step": [], "compute": [], "cpu": []})
            run["per_sample"].append(_wall_per_sample(log))
            run["step"].append(medians[name][-1])
            run["compute"].append(_compute_per_sample(log))
            run["cpu"].append(cpu / n)
        results.setdefault(name, result)
        logs.setdefault(name, log)

    stall = _event(logs["stall"], "takeover_recovered")
    kill = _event(logs["kill"], "takeover_recovered")
    hot_kill = _event(logs["hot_kill"], "takeover_recovered")
    takeover = _event(logs["kill"], "takeover")
    figures: dict = {"pairs": repeat}
    _overheads(runs, figures)
    figures.update({
        "baseline_ranks": RANKS,
        "baseline_spares": RANKS - STAGES,
        "cores": len(os.sched_getaffinity(0)),
        "kill_step": kill_at,
        "replicate_every": R,
        "lost_updates": takeover.get("lost_updates"),
        "recovery_s": kill.get("recovery_s", math.nan),
        "final_accuracy_kill": _final_accuracy(logs["kill"]),
        "final_accuracy_clean": _final_accuracy(logs["r10"]),
        "accuracy_kill_vs_clean": _final_accuracy(logs["kill"]) - _final_accuracy(logs["r10"]),
        "recovery_s_hot": hot_kill.get("recovery_s", math.nan),
        "final_accuracy_kill_hot": _final_accuracy(logs["hot_kill"]),
        "final_accuracy_hot": _final_accuracy(logs["hot"]),
        "hot_replayed_steps": int(_event(logs["hot_kill"], "takeover").get("replay_step", 0) >= 0),
        "baseline_kill_outcome": _outcome(results["plain_kill"], logs["plain_kill"]),
        "stall_recovery_s": stall.get("recovery_s", math.nan),
        # in median step times of the failure-free R=10 runs (the median over the rounds)
        "stall_recovery_steps": stall.get("recovery_s", math.nan) / statistics.median(runs["r10"]["step"]),
        "time_to_accuracy_respipe": _time_to(logs["delay"], TARGET),
        "time_to_accuracy_baseline": _time_to(logs["plain_delay"], TARGET),
    })
    if resnet_steps > 0:
        # the cost model's replica bytes per step (R = 10: a tenth of every stage's replica)
        figures["replica_bytes_per_step_resnet18"] = _event(logs["r10_resnet18"], "cost_model").get("replica")
    note = benchkit.few_pairs_note(repeat, "--repeat")
    if note:
        figures["note"] = note
    return figures, logs


def plot(logs: dict[str, Path], out: Path) -> None:
    """Accuracy against time: clean, kill with a backup, the plain pipeline with the kill."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mpipipe.core.logs.runlog import open_log

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for ax, names, title in (
            (ax1, [("r10", "failure-free (ResPipe R=10)"), ("kill", "kill stage 1, backup"),
                   ("plain_kill", "kill stage 1, plain pipeline")], "a dead stage"),
            (ax2, [("delay", "ResPipe (deadline 2x median)"),
                   ("plain_delay", "plain pipeline (waits)")], "stage 1 straggles (p=0.1, 2 s)")):
        for name, label in names:
            run = open_log(logs[name])
            t0 = float(run.steps["time"][0]) if len(run.steps["time"]) else 0.0
            ax.plot(run.eval["time"] - t0, run.eval["accuracy"], marker=".", label=label)
            for e in run.events:
                if e["kind"] in ("takeover", "stage_lost"):
                    ax.axvline(e["time"] - t0, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("seconds since the first step")
        ax.set_ylabel("test accuracy")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle("ResPipe on digits, LeNet in 3 stages (dotted: takeover or lost stage)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def _shown(figures: dict, key: str) -> str:
    """A figure as printed: with its interval if it has one; an overhead at or below 0 as
    "no measurable cost (interval lo..hi)", never as a gain."""
    value = figures[key]
    bounds = figures.get(f"{key}_interval")
    if bounds is not None and value is not None and None not in bounds:
        iv = benchkit.Interval(value, bounds[0], bounds[1], figures["pairs"])
        return benchkit.overhead_text(iv, 4) if key.startswith("overhead_") else iv.text(4)
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON line")
    parser.add_argument("--steps", type=int, default=600, help="steps per job (default 600)")
    parser.add_argument("--out", help="where the accuracy-against-time plot goes (default: a new "
                                      "temporary folder; never a file of the checkout unless given)")
    parser.add_argument("--repeat", type=int, default=benchkit.MIN_PAIRS,
                        help=f"interleaved rounds of the failure-free jobs, each a pair for every overhead "
                             f"(default {benchkit.MIN_PAIRS})")
    parser.add_argument("--keep", metavar="DIR",
                        help="keep the run logs in a new directory under DIR")
    parser.add_argument("--resnet-steps", type=int, default=60,
                        help="steps of the ResNet-18 jobs (0: skip them)")
    parser.add_argument("--quick", action="store_true",
                        help="60 steps, 2 rounds of the failure-free jobs: checks the bench runs end to "
                             "end, its figures and intervals mean little")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeat = 60, 2
    out = benchkit.output_path(args.out, "resilience.png", prefix="respipe-bench-plot-")
    with tempfile.TemporaryDirectory(prefix="respipe-bench-") as tmp:
        # Fresh log paths on every invocation: a run never writes over an old log.
        work = (Path(args.keep) if args.keep else Path(tmp)) / time.strftime("%Y%m%d-%H%M%S")
        work.mkdir(parents=True, exist_ok=False)
        figures, logs = measure(args.steps, work, max(args.repeat, 1), args.resnet_steps)
        plot(logs, out)
    if args.quick and figures.get("note"):
        figures["note"] = benchkit.few_pairs_note(figures["pairs"], "--quick")
    figures["plot"] = str(out)
    if args.json:
        print(json.dumps(figures))
        return 0
    keys = [k for k in figures if not k.endswith("_interval") and k not in ("plot", "note")]
    width = max(len(k) for k in keys)
    if figures.get("note"):
        print(f"note: {figures['note']}")
    for key in keys:
        print(f"{key.ljust(width)}  {_shown(figures, key)}")
    print(f"plot: {out}" + (f"; logs: {work}" if args.keep else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
