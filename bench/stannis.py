"""Stannis benchmark: host only, equal batches, HyperTune and the ideal, measured in one run.

One host and 4 emulated CSDs at 1/8 of the host's speed train LeNet on
synthetic 3x32x32 images. Every figure comes from the same invocation, one
variant after the other, because the machine is shared and noisy:

* standalone samples/s of the host and of one CSD (this process, no MPI), at
  the global batch size; the ideal is their sum over all ranks;
* host only: ``python -m stannis train`` with no CSDs;
* equal batches (Horovod's default) and HyperTune, 1 host + 4 CSDs;
* in the HyperTune run, a ``slow`` fault halves one CSD's speed mid-run, and
  the benchmark counts the steps until throughput (over 3 steps) is back
  within 10% of the new ideal.

Samples per joule come from the power model (see docs/stannis.md).
Run: ``python bench/stannis.py [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = (3, 32, 32)
CSDS = 4


def make_data(root: Path, seed: int = 0) -> None:
    """Synthetic images and labels: public/{train,test} and csd1..csd4, as stannis prepare lays out."""
    from native import DatasetWriter

    rng = np.random.default_rng(seed)
    schema = {"image": ("float32", SHAPE), "label": ("int64", ())}
    for name, n in [("public/train", 4096), ("public/test", 256)] + \
            [(f"csd{k}", 1024) for k in range(1, CSDS + 1)]:
        w = DatasetWriter(root / name, schema, overwrite=True)
        w.write({"image": rng.standard_normal((n, *SHAPE), dtype=np.float32),
                 "label": rng.integers(0, 10, n)})
        w.close()


def standalone_sps(data: Path, batch: int, slowdown: float, steps: int = 4) -> float:
    """Samples/s of one rank training alone (no MPI), with the emulated slow-down."""
    import torch

    from mpipipe.models import build_model
    from stannis.csd import Stretch
    from stannis.data import BatchStream, open_split

    torch.set_num_threads(1)
    torch.manual_seed(0)
    reader = open_split(data / "public/train")
    stream = BatchStream([(reader, np.arange(len(reader)))], seed=0)
    model = build_model("lenet", 10, SHAPE)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    stretch = Stretch(slowdown)

    def step() -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        x, y = stream.next(batch)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        stretch.apply(time.thread_time() - c0, time.perf_counter() - t0)
        opt.step()

    step()  # warm-up
    t = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch / (time.perf_counter() - t)


def write_config(path: Path, data: Path, args: argparse.Namespace) -> None:
    path.write_text(f"""
[run]
steps = 30
eval_every = 0
log_every = 1000
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


def train(config: Path, log: Path, n: int, *sets: str, inject: tuple[str, ...] = ()) -> None:
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMP_NUM_THREADS": "1", "OMPI_MCA_mpi_yield_when_idle": "1",
           "PYTHONPATH": str(ROOT)}
    cmd = [str(Path(sys.executable).parent / "mpirun"), "--oversubscribe", "-n", str(n),
           sys.executable, "-m", "stannis", "train", "--config", str(config), "--log", str(log),
           "--quiet"]
    for s in sets:
        cmd += ["--set", s]
    for spec in inject:
        cmd += ["--inject", spec]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(f"bench/stannis.py: a training run failed:\n{proc.stderr[-3000:]}")


def window(log: Path, first: int, last: int) -> tuple[float, float]:
    """Samples/s and samples/J over steps first..last (1-based, inclusive)."""
    from mpipipe.runlog import open_log

    run = open_log(log)
    steps, t, samples = run.steps["step"], run.steps["time"], run.steps["samples"]
    sel = (steps >= first) & (steps <= last)
    start = t[np.searchsorted(steps, first) - 1]  # end of the step before the window
    sps = samples[sel].sum() / (t[sel][-1] - start)
    joules = sum(r["joules"][(r["step"] >= first) & (r["step"] <= last)].sum()
                 for r in run.ranks.values())
    return float(sps), float(samples[sel].sum() / joules)


def steps_to_recover(log: Path, slow_step: int, target_sps: float, span: int = 3) -> int | None:
    """Steps after the first slowed step until throughput over ``span`` steps reaches target."""
    from mpipipe.runlog import open_log

    run = open_log(log)
    steps, t, samples = run.steps["step"], run.steps["time"], run.steps["samples"]
    for i in range(len(steps)):
        if steps[i] < slow_step + span - 1 or i < span:
            continue
        sps = samples[i - span + 1:i + 1].sum() / (t[i] - t[i - span])
        if sps >= target_sps:
            return int(steps[i] - slow_step + 1)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--global-batch", type=int, default=768)
    parser.add_argument("--slowdown", type=float, default=8.0, help="CSD slow-down factor")
    parser.add_argument("--keep", metavar="DIR", help="keep data and logs in DIR")
    args = parser.parse_args()

    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="stannis-bench-"))
    tmp.mkdir(parents=True, exist_ok=True)
    data = tmp / "data"
    make_data(data)
    config = tmp / "bench.toml"
    write_config(config, data, args)
    B = args.global_batch

    host_alone = standalone_sps(data, B, 1.0)
    csd_alone = standalone_sps(data, B, args.slowdown, steps=2)
    ideal = host_alone + CSDS * csd_alone

    train(config, tmp / "host.h5", 1, "stannis.csds=0", "stannis.tune=false", "run.steps=20")
    host_only, host_spj = window(tmp / "host.h5", 6, 20)
    train(config, tmp / "equal.h5", 1 + CSDS, "stannis.tune=false", "run.steps=25")
    equal, equal_spj = window(tmp / "equal.h5", 6, 25)
    slow_at = 40  # 0-based step index of the fault = 1-based step 41
    train(config, tmp / "tuned.h5", 1 + CSDS, "stannis.tune=true", "run.steps=75",
          inject=(f"slow:rank=2:step={slow_at}:factor=2",))
    tuned, tuned_spj = window(tmp / "tuned.h5", 16, slow_at)
    new_ideal = ideal - csd_alone / 2
    retune_steps = steps_to_recover(tmp / "tuned.h5", slow_at + 1, 0.9 * new_ideal)

    result = {
        "host_only_sps": round(host_only, 1),
        "equal_sps": round(equal, 1),
        "tuned_sps": round(tuned, 1),
        "ideal_sps": round(ideal, 1),
        "tuned_vs_ideal": round(tuned / ideal, 3),
        "tuned_vs_equal": round(tuned / equal, 3),
        "tuned_vs_host_only": round(tuned / host_only, 3),
        "retune_steps": retune_steps,
        "equal_spj": round(equal_spj, 2),
        "tuned_spj": round(tuned_spj, 2),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"Stannis benchmark: 1 host + {CSDS} emulated CSDs at 1/{args.slowdown:g} speed, "
          f"LeNet 3x32x32, global batch {B}")
    print(f"  standalone samples/s: host {host_alone:,.0f}, one CSD {csd_alone:,.0f}")
    rows = [("host only", host_only, host_spj), ("equal batches", equal, equal_spj),
            ("HyperTune", tuned, tuned_spj), ("ideal", ideal, float("nan"))]
    print(f"  {'variant':<14} {'samples/s':>10} {'samples/J':>10}")
    for name, sps, spj in rows:
        print(f"  {name:<14} {sps:>10,.0f} {spj:>10.2f}")
    print(f"  HyperTune / ideal {result['tuned_vs_ideal']:.2f}, / equal "
          f"{result['tuned_vs_equal']:.2f}, / host only {result['tuned_vs_host_only']:.2f}")
    print(f"  one CSD slowed 2x at step {slow_at + 1}: back within 10% of the new ideal "
          f"after {retune_steps} steps")
    if not args.keep:
        print(f"  logs: {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
