"""Stannis's configuration schema and launch plan (loaded by mpipipe's one loader)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mpipipe.core.mpi.faults import FaultError, parse_all
from mpipipe.core.mpi.roles import LaunchPlan, PlanError, Role, RoleKind, register_role_kind
from mpipipe.core.run.lr import SCHEDULES
from mpipipe.core.run.recipe import MODEL_DEFAULTS, OPTIM_DEFAULTS

from .csd import CsdProfile
from .energy import SOURCES
from .hypertune import OBJECTIVES

# Stannis's roles: one host (writes the log, reads the public data) and CSDs 1..N.
HOST = register_role_kind(RoleKind("host", "Stannis", indexed=False, writes_log=True))
CSD = register_role_kind(RoleKind("csd", "Stannis"))

# Gradient bytes per bucket of the exchange: under Open MPI's TCP eager limit (64 KiB with
# its headers), so that a bucket goes out at Isend, without a rendezvous that waits for the
# receiver's attention, and small enough that the last layers' buckets leave while backward
# still runs (WeightedAllreduce's Overlap). Measured on the Stannis testbed (LeNet, 248 KB,
# 25 steps per run): the exchange as the slowest rank sees it took about 100 ms with one
# 4 MiB bucket, about 60 ms with 60 KiB buckets, and about 25 ms with those sent during
# backward. Each bucket costs the host a few MPI calls: raise it for large models.
BUCKET_BYTES = 60 << 10

# Power figures are assumptions for the power model, not measurements: a
# two-socket-class host CPU and an ARM-based CSD (NGD Newport class). Replace
# them with your hardware's figures; the log records which were used.
STANNIS_DEFAULTS: dict[str, dict[str, Any]] = {
    "run": {
        "seed": 0,  # seeds torch, every rank's shuffle and fault injection
        "steps": 200,  # optimizer steps to train
        "eval_every": 50,  # host evaluates on the public test split every N steps (0: end only)
        "log_every": 10,  # plain progress line every N steps when not on a terminal
        "threads": 1,  # torch compute threads of the host (CSDs: csd.threads)
        "watchdog_s": 0.0,  # no progress for this long ends the job, stacks dumped (0: max(60 s, 20 steps))
    },
    "data": {
        "path": "data/stannis-digits",  # holds public/{train,test} and csd<k>/ (stannis prepare)
        "public_to_csds": 0.0,  # share of the public train set also stored on (split over) CSDs
        # random ops on each rank's batches, in order: "random_crop:P", "hflip", "vflip"; [] =
        # none. A sample's draws depend only on (run.seed, the rank's epoch, its record in its
        # data set), so a replay sees the same sample (mpipipe.core.run.batches.transforms)
        "augment": [],
        "mean": [],  # per-channel normalization (x/255 - mean) / std, train and test; [] = none
        "std": [],  # one value per channel each, or both []
    },
    "model": dict(MODEL_DEFAULTS),
    "optim": {
        **OPTIM_DEFAULTS,  # lr is the rate at optim.base_batch, scaled linearly with the global batch
        "base_batch": 64,
        "warmup_steps": 10,  # linear warm-up to the scaled rate (not with optim.scheduler)
    },
    "stannis": {
        "csds": 4,  # N: CSD ranks (the world has 1 + N ranks)
        "global_batch": 128,  # samples per optimizer step over all ranks
        "tune": True,  # HyperTune; false = equal batches (Horovod's default)
        "objective": "throughput",  # throughput | energy | mix
        "mix_weight": 0.5,  # weight of throughput in the mix objective
        "benchmark_batches": [8, 32, 64],  # batch sizes timed in the benchmark phase
        "benchmark_repeats": 3,  # timed steps per batch size (the fastest counts)
        "retune_every": 5,  # share step times every N steps
        # re-tune only on a predicted gain that noise alone would pass about this many
        # times per 100 steps, judged from the measured spread of step times (docs/stannis.md)
        "noise_retunes_per_100": 1.0,
        "min_gain": 0.0,  # ...and at least this relative gain (0: the noise bar alone)
        "imbalance_threshold": 0.0,  # ...and only when 1 - min/max step time exceeds this (0: any)
        # a rank's batch is at least the one whose fitted per-step overhead is at most this
        # share of its step (0: no floor but one sample)
        "overhead_share": 0.5,
        "max_oversample": 2.0,  # a rank's batch share <= this x its share of the records (0: off)
        "bucket_bytes": BUCKET_BYTES,  # gradient bytes per exchange bucket (see BUCKET_BYTES)
        # how gradients are summed: "host" (a star through the host: every CSD link carries
        # its gradients once each way; for CSDs behind the host's faster link) or
        # "allreduce" (MPI's Iallreduce; for ranks on links of equal speed)
        "exchange": "host",
        # true: BatchNorm's running statistics stay each rank's own (as FedBN); false: they
        # are averaged every step with the gradients' batch weights (docs/stannis.md)
        "local_buffers": False,
        "inject": [],  # fault specs, as with --inject (target ranks: rank=R)
    },
    "host": {
        "max_batch": 1024,  # memory cap of the host's batch
        "idle_w": 40.0,  # power model (used when RAPL cannot be read)
        "active_w": 100.0,
        "energy": "auto",  # auto | rapl | model
    },
    "csd": {
        "dirs": [],  # private data directory per CSD (default: <data.path>/csd<k>)
        "slowdown": 8.0,  # emulated: compute time x this (1 on real CSDs)
        "slowdowns": [],  # per-CSD override of slowdown, one per CSD
        "threads": 1,  # torch threads per CSD rank
        "nice": 0,  # emulated CSDs run at this CPU niceness (0: unchanged), see docs/stannis.md
        "bind_cpus": True,  # emulated, one machine: CSDs on the last cores, the host on the rest
        "max_batch": 256,  # memory cap of one CSD's batch
        "idle_w": 5.0,
        "active_w": 10.0,
        "emulated": True,  # false on real CSDs: no stretching, energy source may be RAPL
    },
    "plan": {},  # explicit launch plan: "host" = 0, "csd 1" = 1, ...
}

EXCHANGES = ("host", "allreduce")  # WeightedAllreduce's routes (stannis.exchange)

STANNIS_CHOICES: dict[str, tuple[str, ...]] = {
    "model.name": ("lenet", "vgg", "resnet"),
    "optim.schedule": SCHEDULES,
    "stannis.objective": OBJECTIVES,
    "stannis.exchange": EXCHANGES,
    "host.energy": SOURCES,
}


def csd_profile(cfg: Mapping[str, Any], k: int) -> CsdProfile:
    """The speed and power profile of CSD ``k`` (1-based)."""
    c = cfg["csd"]
    slowdown = c["slowdowns"][k - 1] if c["slowdowns"] else c["slowdown"]
    if not c["emulated"]:
        slowdown = 1.0
    return CsdProfile(slowdown=float(slowdown), threads=int(c["threads"]),
                      idle_w=float(c["idle_w"]), active_w=float(c["active_w"]),
                      emulated=bool(c["emulated"]))


def csd_dir(cfg: Mapping[str, Any], k: int) -> Path:
    """Where CSD ``k`` keeps its private shards."""
    dirs = cfg["csd"]["dirs"]
    return Path(dirs[k - 1]) if dirs else Path(cfg["data"]["path"]) / f"csd{k}"


def stannis_plan(cfg: dict, world_size: int) -> LaunchPlan:
    """Rank 0 is the host, ranks 1..N are CSDs; checked before any work starts.

    Raises:
        PlanError: the world size does not match, a role is missing or doubled,
            a per-CSD list has the wrong length, or a fault spec is bad.
    """
    n = cfg["stannis"]["csds"]
    if n < 0:
        raise PlanError(f"stannis.csds = {n}: need 0 or more CSDs")
    plan = _launch_plan(cfg, world_size, n)
    _check_roles(plan, n)
    _check_csds(cfg, n)
    _check_settings(cfg, n)
    _check_faults(cfg["stannis"]["inject"])
    return plan


def _launch_plan(cfg: dict, world_size: int, n: int) -> LaunchPlan:
    """The explicit ``plan`` table, or host then CSDs 1..n when the world has 1 + n ranks."""
    if cfg["plan"]:
        return LaunchPlan.from_table(cfg["plan"], world_size, (HOST.name, CSD.name),
                                     "a Stannis job has only a host and CSDs")
    if world_size != 1 + n:
        raise PlanError(
            f"the launch plan needs {1 + n} ranks (1 host + {n} CSDs) but the MPI world has "
            f"{world_size}: run mpirun -n {1 + n}, or set stannis.csds={world_size - 1}")
    return LaunchPlan((Role("host"),) + tuple(Role("csd", k) for k in range(1, n + 1)))


def _check_roles(plan: LaunchPlan, n: int) -> None:
    """One host, rank 0, and CSDs 1..n once each: nothing else."""
    if plan.role_of(0) != Role("host"):
        raise PlanError(f"rank 0 is '{plan.role_of(0)}': in a Stannis job rank 0 is the host "
                        "(it writes the log and reads the public data)")
    for r, role in enumerate(plan.roles):
        if role.kind not in ("host", "csd"):
            raise PlanError(f"rank {r} is '{role}': a Stannis job has only a host and CSDs")
        if role.kind == "host" and r != 0:
            raise PlanError(f"rank {r} is a second host; a Stannis job has one host, rank 0")
    indices = sorted(role.index for role in plan.roles if role.kind == "csd")
    if indices != list(range(1, n + 1)):
        raise PlanError(f"the plan's CSDs are {indices}; expected csd 1..{n} once each "
                        f"(stannis.csds = {n})")


def _check_csds(cfg: dict, n: int) -> None:
    """The per-CSD lists give one entry per CSD, and every CSD's profile is valid."""
    for key in ("dirs", "slowdowns"):
        given = cfg["csd"][key]
        if given and len(given) != n:
            raise PlanError(f"csd.{key} lists {len(given)} entries for {n} CSDs; give one per CSD")
    for k in range(1, n + 1):
        try:
            csd_profile(cfg, k)
        except ValueError as e:
            raise PlanError(f"csd {k}: {e}") from None


def _check_settings(cfg: dict, n: int) -> None:
    """The ``stannis.*`` figures (and ``data.public_to_csds``) within their ranges."""
    s = cfg["stannis"]
    if s["global_batch"] < 1 + n:
        raise PlanError(f"stannis.global_batch = {s['global_batch']} leaves some rank without "
                        f"a sample; need at least {1 + n}")
    if s["retune_every"] < 1:
        raise PlanError("stannis.retune_every must be >= 1")
    if s["noise_retunes_per_100"] < 0:
        raise PlanError(f"stannis.noise_retunes_per_100 = {s['noise_retunes_per_100']}: use a "
                        "rate >= 0 (0: never re-tune on a gain that noise could explain)")
    if s["min_gain"] < 0:
        raise PlanError(f"stannis.min_gain = {s['min_gain']}: use a gain >= 0")
    if not 0.0 <= s["imbalance_threshold"] < 1.0:
        raise PlanError(f"stannis.imbalance_threshold = {s['imbalance_threshold']}: use an "
                        "imbalance in [0, 1) (0: any)")
    if not 0.0 <= s["overhead_share"] < 1.0:
        raise PlanError(f"stannis.overhead_share = {s['overhead_share']}: use a share in [0, 1) "
                        "(0: no floor but one sample)")
    if s["max_oversample"] != 0 and s["max_oversample"] < 1:
        raise PlanError(f"stannis.max_oversample = {s['max_oversample']}: use 0 (no cap) or a "
                        "factor >= 1 (a rank's batch share over its share of the records)")
    if not s["benchmark_batches"] or min(s["benchmark_batches"]) < 1:
        raise PlanError("stannis.benchmark_batches must list batch sizes >= 1, e.g. [8, 32]")
    if not 0.0 <= cfg["data"]["public_to_csds"] <= 1.0:
        raise PlanError("data.public_to_csds must be a share in [0, 1]")


def _check_faults(specs: list) -> None:
    """Fault specs Stannis can inject: aimed at a rank or a node, no stages, no partitions."""
    try:
        faults = parse_all(specs)
    except FaultError as e:
        raise PlanError(str(e)) from None
    for f in faults:
        if f.how.process and f.what == "node" and f.seconds:
            raise PlanError(f"fault {f}: Stannis finds a lost CSD by ULFM only (it has no deadline), "
                            "so a node back after rejoin= (a partition) would only stall every rank "
                            "until it ends; drop rejoin= (each event a node-kill)")
        if f.how.process:
            continue  # it draws CSD ranks (never the host) or nodes, checked at start-up
        if f.kind == "partition":
            raise PlanError(f"fault {f}: Stannis finds a lost CSD by ULFM only (it has no deadline), "
                            "so a partition would only stall every rank until it ends; use "
                            f"node-kill:node={f.node}:step={f.step}")
        if f.node is not None:
            continue  # a whole testbed node: checked once the ranks' hosts are known
        if f.rank is None:
            raise PlanError(f"fault {f}: Stannis has no stages; aim it at a rank, e.g. "
                            f"{f.kind}:rank=2:...")
        if f.micro >= 0:
            raise PlanError(f"fault {f}: Stannis steps have no micro-batches; drop micro=")
        # A kill of the host (rank 0) is allowed: the job ends with one error line and
        # the log closed by a survivor (docs/stannis.md, "A CSD that dies").


def emulation(cfg: dict, plan: LaunchPlan) -> dict[str, Any]:
    """What the log's ``emulation`` attribute says: which ranks are emulated CSDs, and how."""
    out: dict[str, Any] = {}
    for r, role in enumerate(plan.roles):
        if role.kind == "csd":
            out[str(r)] = {"role": str(role), **csd_profile(cfg, role.index).describe()}
    if not cfg["csd"]["emulated"]:
        return {}
    return out
