"""Pipeline throughput: single process vs mpipipe (GPipe, 1F1B, interleaved 1F1B) vs torch.distributed.pipelining.

    python bench/pipeline.py            # a table
    python bench/pipeline.py --json     # one JSON line

Everything is measured in this one run, with one compute thread per rank, and reported
as ratios, because the machine is shared and noisy:

- speedup_vs_single: best mpipipe K=2 schedule / single-process training on one thread
- speedup_vs_single_2threads: the same against a single process with 2 compute threads,
  which uses the two cores the pipeline gets
- speedup_vs_best_single: against the better of the two single-process baselines (the
  pipeline's honest speed-up: not "a second core")
- vs_torch_pipelining: best mpipipe schedule / best torch.distributed.pipelining schedule
  (gloo backend, same model, cut, mini-batch and micro-batches)
- speedup_interleaved_vs_single: mpipipe interleaved 1F1B (v = 2 chunks per rank, the
  model cut in 2K chunks by time: the cut whose simulated step is shortest) /
  single-process training on one thread
- interleaved_vs_torch: mpipipe interleaved 1F1B / torch's ScheduleInterleaved1F1B on the
  same 2K chunks
- transport_vs_raw: mpipipe Transport / raw mpi4py Send/Recv, 1 MB ping-pong
- resnet18_speedup_vs_single (and resnet18_vs_torch_pipelining): the same speed-up for a
  user's model, the torchvision-style ResNet-18 with BatchNorm of
  examples/resnet18_respipe.py (given as model.factory, traced into a chain), at
  ``--resnet-width`` channels (16: a quarter of the real 64, so that a round fits the
  time), 32x32 inputs, the same K, mini-batch and micro-batches; ``--resnet-rounds``

Every ratio is measured over ``--rounds`` (default 7) interleaved rounds: each round runs
every variant once (the single process, then each schedule of ours and torch's, then the
ping-pong), so each round is a pair (baseline, candidate) for every ratio. The figure is
the median of the rounds' ratios with a 90 % bootstrap interval (``<key>_interval``,
mpipipe/tools/benchkit.py); a round's time is the mean over its ``--steps`` timed steps.
The best schedule (of GPipe and 1F1B; of the two single processes) is the one with the
best median over the rounds, then paired round by round. ``<key>_cpu`` (and its interval)
is the same ratio in CPU seconds per step: each rank's ``time.process_time`` over the
same steps, summed over the ranks (the single process: rank 0's, both its threads; the
other rank sleeps meanwhile and is not counted). A target is met when the median meets
it. ``--quick`` runs 3 rounds (fewer than the 7 an interval needs; it says so).

The parallel parts run under `mpirun -n 2` (this script started again with --worker).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mpipipe.tools import benchkit  # noqa: E402
from mpipipe.tools.launch import run_mpi  # noqa: E402

K = 2  # stages (one rank each) for every parallel figure
V = 2  # chunks per rank of the interleaved schedule


def _gloo_env() -> dict[str, str]:
    """Where torch.distributed's gloo rendezvous meets (the peer benchmark needs it)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000)}


RESNET18 = "examples/resnet18_respipe.py:ResNet18"  # a user's model, by its factory


def _model_and_batch(args: argparse.Namespace):
    import torch

    from mpipipe.core.run import recipe
    from mpipipe.pipeline.config import PIPELINE_DEFAULTS

    torch.manual_seed(0)
    in_shape = (3, 32, 32)
    cfg = {k: dict(v) for k, v in PIPELINE_DEFAULTS.items()}
    if args.model == "resnet18":
        cfg["model"].update(factory=str(ROOT / RESNET18), kwargs={"width": args.resnet_width})
    else:
        cfg["model"].update(name=args.model)
    model = recipe.Recipe(cfg).build_model(in_shape)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, *in_shape, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    return model, x, y, in_shape


def _balance(args: argparse.Namespace, model, x, v: int = 1) -> list[int]:
    from mpipipe.pipeline.partition import balance_by_time

    return balance_by_time(model, x[: args.batch // args.chunks], K, v=v, m=args.chunks)


def _timed(step, warmup: int, steps: int, sync=lambda: None) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) per step, over `steps` timed steps after
    `warmup` untimed ones.

    The mean of the round, not its fastest step: the round is one pair of the figure's
    interval, and the interval (not a hand-picked step) says how much the machine moved it.
    """
    for _ in range(warmup):
        step()
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
        sync()
    return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


# ---- the worker: both ranks under mpirun, every variant interleaved round by round --------
def _idle_until(comm, root_busy) -> None:
    """Rank != 0 waits for rank 0's single-process run without taking a core."""
    request = comm.Ibarrier()
    if comm.rank == 0:
        root_busy()
        request.Wait()
        return
    while not request.Test():
        time.sleep(0.005)


def worker(args: argparse.Namespace) -> None:
    import copy

    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    from mpipipe import Pipeline
    from mpipipe.core.mpi.transport import ACT, Transport
    from mpipipe.pipeline.partition import split

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rank, size = world.rank, world.size
    dist.init_process_group("gloo", rank=rank, world_size=size)
    model, x, y, in_shape = _model_and_batch(args)
    balance = world.bcast(_balance(args, model, x) if rank == 0 else None, root=0)
    interleaved = world.bcast(_balance(args, model, x, V) if rank == 0 else None, root=0)
    loss_fn = torch.nn.CrossEntropyLoss()
    wall: dict[str, list[float]] = {}  # seconds per step (ping-pong: per round trip), one a round
    cpu: dict[str, list[float]] = {}  # this rank's CPU seconds over the same

    def record(name: str, timed: tuple[float, float]) -> None:
        wall.setdefault(name, []).append(timed[0])
        cpu.setdefault(name, []).append(timed[1])

    # single process (rank 0 alone; the other rank sleeps), on 1 and on 2 threads
    single_model = copy.deepcopy(model)
    single_opt = torch.optim.SGD(single_model.parameters(), lr=0.01, momentum=0.9)

    def single_step() -> None:
        single_opt.zero_grad()
        loss_fn(single_model(x), y).backward()
        single_opt.step()

    def single_on(threads: int) -> tuple[float, float]:
        torch.set_num_threads(threads)
        try:
            return _timed(single_step, 1, args.steps)
        finally:
            torch.set_num_threads(1)

    # mpipipe, one pipeline per schedule on its own communicator
    ours = {}
    for schedule, cut in (("gpipe", balance), ("1f1b", balance), ("interleaved-1f1b", interleaved)):
        pipe = Pipeline(copy.deepcopy(model), cut, args.chunks, schedule, world.Dup(),
                        in_shape=in_shape)
        ours[schedule] = (pipe, torch.optim.SGD(pipe.parameters(), lr=0.01, momentum=0.9))

    def our_step(schedule: str) -> None:
        pipe, opt = ours[schedule]
        pipe.step(x, y, loss_fn)
        opt.step()

    # torch.distributed.pipelining on gloo, same cut
    peer = {}
    for schedule, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        part = split(copy.deepcopy(model), balance)[rank]
        stage = PipelineStage(part, rank, size, torch.device("cpu"))
        peer[schedule] = (cls(stage, args.chunks, loss_fn=loss_fn),
                          torch.optim.SGD(part.parameters(), lr=0.01, momentum=0.9))
    # torch's interleaved 1F1B on the same 2K chunks: rank r holds chunks r and r + K
    chunks = split(copy.deepcopy(model), interleaved)
    mine = [chunks[c] for c in range(rank, V * K, K)]
    stages = [PipelineStage(part, c, V * K, torch.device("cpu"))
              for c, part in zip(range(rank, V * K, K), mine, strict=True)]
    peer["interleaved-1f1b"] = (
        ScheduleInterleaved1F1B(stages, args.chunks, loss_fn=loss_fn),
        torch.optim.SGD([p for part in mine for p in part.parameters()], lr=0.01, momentum=0.9))

    def peer_step(schedule: str) -> None:
        sched, opt = peer[schedule]
        opt.zero_grad()
        if rank == 0:
            sched.step(x)
        elif rank == size - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        opt.step()

    # transport vs raw mpi4py: 1 MB ping-pong
    other = 1 - rank
    n = (1 << 20) // 4
    raw_buf = np.ones(n, np.float32)
    send_t, recv_t = torch.ones(n), torch.empty(n)
    link = Transport(world.Dup())
    reps, tag_step = 50, [0]

    def raw_pingpong() -> None:
        for _ in range(reps):
            if rank == 0:
                world.Send(raw_buf, other, 7)
                world.Recv(raw_buf, other, 7)
            else:
                world.Recv(raw_buf, other, 7)
                world.Send(raw_buf, other, 7)

    def our_pingpong() -> None:
        for _ in range(reps):
            i = tag_step[0] = tag_step[0] + 1
            if rank == 0:
                link.send(send_t, other, kind=ACT, step=i)
                link.recv(recv_t, other, kind=ACT, step=i)
            else:
                link.recv(recv_t, other, kind=ACT, step=i)
                link.send(send_t, other, kind=ACT, step=i)
            link.flush()

    for _ in range(args.rounds):
        for threads, name in ((1, "single"), (2, "single_2threads")):
            holder: list[tuple[float, float]] = []
            _idle_until(world, lambda h=holder, n=threads: h.append(single_on(n)))
            record(name, holder[0] if rank == 0 else (0.0, 0.0))  # the sleeping rank: no CPU counted
        for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
            world.Barrier()
            record(f"ours_{schedule}", _timed(lambda s=schedule: our_step(s), 1, args.steps,
                                              world.Barrier))
            dist.barrier()
            record(f"torch_{schedule}", _timed(lambda s=schedule: peer_step(s), 1,
                                               args.steps, dist.barrier))
        for name, fn in (("raw", raw_pingpong), ("transport", our_pingpong)):
            world.Barrier()
            t, c = _timed(fn, 0, 1)
            record(name, (t / reps, c / reps))
    # CPU seconds summed over the ranks, round by round; wall time is rank 0's
    every = world.gather(cpu, root=0)
    if rank == 0:
        total = {name: [sum(r[name][i] for r in every) for i in range(args.rounds)] for name in cpu}
        print(json.dumps({"wall": wall, "cpu": total, "balance": balance, "interleaved": interleaved,
                          # the cores rank 0 (2 threads) may use
                          "cpus": len(os.sched_getaffinity(0))}), flush=True)
    dist.destroy_process_group()


# ---- driver -------------------------------------------------------------------------------
def _launch(args: argparse.Namespace) -> dict:
    cmd = [__file__, "--worker",
           "--model", args.model, "--batch", str(args.batch), "--chunks", str(args.chunks),
           "--steps", str(args.steps), "--rounds", str(args.rounds),
           "--resnet-width", str(args.resnet_width)]
    result = run_mpi(K, cmd, env=_gloo_env(), timeout=1800)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise SystemExit(f"bench/pipeline.py: error: the mpirun worker failed "
                         f"(exit {result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(lines[-1])


# Each ratio: (key, baseline, candidate). Variants are the worker's names; "ours" and
# "peer" stand for the best of GPipe and 1F1B (by median over the rounds), "best_single"
# for the better single process. Every one is a speed-up: baseline time / candidate time.
RATIOS = (("speedup_vs_single", "single", "ours"),
          ("speedup_vs_single_2threads", "single_2threads", "ours"),
          ("speedup_vs_best_single", "best_single", "ours"),
          ("vs_torch_pipelining", "peer", "ours"),
          ("speedup_interleaved_vs_single", "single", "ours_interleaved-1f1b"),
          ("interleaved_vs_torch", "torch_interleaved-1f1b", "ours_interleaved-1f1b"),
          ("transport_vs_raw", "raw", "transport"))
RESNET_RATIOS = (("resnet18_speedup_vs_single", "single", "ours"),
                 ("resnet18_vs_torch_pipelining", "peer", "ours"))


def _resolve(r: dict) -> dict[str, str]:
    """The variant each alias stands for: the faster by median seconds per step."""
    def faster(*names: str) -> str:
        return min(names, key=lambda n: statistics.median(r["wall"][n]))
    return {"ours": faster("ours_gpipe", "ours_1f1b"), "peer": faster("torch_gpipe", "torch_1f1b"),
            "best_single": faster("single", "single_2threads")}


def _ratios(r: dict, ratios, figures: dict) -> dict[str, benchkit.Interval]:
    """Each ratio's interval over the rounds, in wall and in CPU seconds per step, into figures."""
    names = _resolve(r)
    shown = {}
    for key, base, cand in ratios:
        base, cand = names.get(base, base), names.get(cand, cand)
        for clock, suffix in (("wall", ""), ("cpu", "_cpu")):
            iv = benchkit.paired(r[clock][base], r[clock][cand], ratio=lambda b, c: b / c, few_ok=True)
            benchkit.put(figures, key + suffix, iv, 3)
            shown[key + suffix] = iv
    return shown


def _sps(r: dict, name: str, batch: int) -> float:
    return round(batch / statistics.median(r["wall"][name]), 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--model", default="vgg", help="zoo model (default vgg, CIFAR shape)")
    parser.add_argument("--batch", type=int, default=64, help="mini-batch size")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches per mini-batch")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=benchkit.MIN_PAIRS,
                        help=f"interleaved rounds, each a pair for every ratio (default {benchkit.MIN_PAIRS})")
    parser.add_argument("--quick", action="store_true",
                        help="3 rounds of 2 steps: checks the bench runs end to end, its figures "
                             "and intervals mean little")
    parser.add_argument("--resnet-width", type=int, default=16,
                        help="channels of the ResNet-18's stem (the real one: 64; default 16)")
    parser.add_argument("--resnet-rounds", type=int, default=benchkit.MIN_PAIRS,
                        help=f"rounds of the ResNet-18 measurement (default {benchkit.MIN_PAIRS}; 0: skip it)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds, args.resnet_rounds = 2, 3, min(args.resnet_rounds, 2)
    if args.worker:
        worker(args)
        return 0

    r = _launch(args)
    resnet = None
    if args.resnet_rounds > 0:
        resnet = _launch(argparse.Namespace(**{**vars(args), "model": "resnet18",
                                               "rounds": args.resnet_rounds}))
    names = _resolve(r)
    figures: dict = {
        "single_sps": _sps(r, "single", args.batch),
        "single_2threads_sps": _sps(r, "single_2threads", args.batch),
        "gpipe_sps": _sps(r, "ours_gpipe", args.batch),
        "onef1b_sps": _sps(r, "ours_1f1b", args.batch),
        "interleaved_sps": _sps(r, "ours_interleaved-1f1b", args.batch),
        "torch_pipelining_sps": _sps(r, names["peer"], args.batch),
        "torch_interleaved_sps": _sps(r, "torch_interleaved-1f1b", args.batch),
    }
    shown = _ratios(r, RATIOS, figures)
    figures.update(cpus_rank0=r["cpus"], pairs=args.rounds)
    if resnet is not None:
        figures.update({
            "resnet18_width": args.resnet_width,
            "resnet18_single_sps": _sps(resnet, "single", args.batch),
            "resnet18_best_sps": _sps(resnet, _resolve(resnet)["ours"], args.batch),
        })
        shown.update(_ratios(resnet, RESNET_RATIOS, figures))
        figures.update(resnet18_balance=resnet["balance"], resnet18_pairs=args.resnet_rounds)
    fewest = min(args.rounds, args.resnet_rounds) if resnet is not None else args.rounds
    note = benchkit.few_pairs_note(fewest, "--quick" if args.quick else "--rounds or --resnet-rounds")
    if note:
        figures["note"] = note
    if args.json:
        print(json.dumps(figures))
        return 0
    print(f"model {args.model} (3x32x32), mini-batch {args.batch}, {args.chunks} micro-batches, "
          f"K={K}, balance {r['balance']} (interleaved, v={V}: {r['interleaved']}), "
          f"one thread per rank (the single process also on 2), {args.rounds} interleaved rounds "
          f"of {args.steps} steps: median samples/s, ratios as median (90% bootstrap interval)")
    if r["cpus"] < 2:
        print(f"  note: rank 0 could use {r['cpus']} core: the 2-thread baseline had no second core")
    if note:
        print(f"  note: {note}")
    rows = [("single process, 1 thread", "single_sps"),
            ("single process, 2 threads", "single_2threads_sps"),
            ("mpipipe gpipe", "gpipe_sps"),
            ("mpipipe 1f1b", "onef1b_sps"),
            ("mpipipe interleaved-1f1b", "interleaved_sps"),
            (f"torch.distributed.pipelining {names['peer'][6:]} (gloo)", "torch_pipelining_sps"),
            ("torch.distributed.pipelining interleaved 1f1b", "torch_interleaved_sps")]
    for name, key in rows:
        print(f"  {name:<44} {figures[key]:9.1f} samples/s")
    print(f"  1 MB ping-pong round trip: raw mpi4py {statistics.median(r['wall']['raw']) * 1e6:.0f} us, "
          f"Transport {statistics.median(r['wall']['transport']) * 1e6:.0f} us")
    print(f"  {'ratio':<44} {'wall time':<34} CPU seconds per step")
    for key, *_ in RATIOS:
        print(f"  {key:<44} {shown[key].text():<34} {shown[key + '_cpu'].text()}")
    if resnet is not None:
        print(f"ResNet-18 (width {args.resnet_width}, BatchNorm, from {RESNET18}), balance "
              f"{resnet['balance']}: single {figures['resnet18_single_sps']:.1f} samples/s, best mpipipe "
              f"{figures['resnet18_best_sps']:.1f}")
        for key, *_ in RESNET_RATIOS:
            print(f"  {key:<44} {shown[key].text():<34} {shown[key + '_cpu'].text()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
