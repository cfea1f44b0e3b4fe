"""ResPipe's goodput model: useful samples per second under a failure rate, for each mode and R.

Why: replicate often (small R, or hot mode) and a failure costs little, but every step
pays in bytes and CPU; replicate rarely and the reverse holds. The byte model
(:mod:`mpipipe.respipe.costmodel`) says what a setting sends; this model turns it, with a
link rate, the stages' measured compute and a Poisson failure rate, into the figure a
user wants to maximise, and into the chance of losing the run. Its terms are written
out in docs/goodput.md; a test checks it against Young and Daly's optimum interval in
the regime where that formula holds.

Terms, per (mode, R) (all times in seconds, λ failures per second per rank):

- failure-free step ``t``: the pipelined compute (one micro-batch through every stage,
  the other ``m - 1`` at the slowest stage's pace), plus what a step waits for on the links, or
  the busiest link's bytes if longer (:func:`costmodel.step_seconds`, replicas and hot
  relays included at ``1/R`` and per step), plus packing a replica (``bytes / pack
  rate``) once every R steps;
- waste per failure of a stage's rank: detection, the takeover round, the replica
  re-sent to the remaining backups, and in cold and neighbour mode the replayed step and
  the lost updates, ``(R - 1) / 2`` steps on average (a lost update of one stage is
  counted as a lost step: conservative, the other stages kept theirs); hot mode loses
  none and finishes the step in flight;
- waste per failure of a backup: detection and a round (plus a replayed step in cold
  mode); per rejoin (``rejoin_s`` given): a round and the re-sync of its replica;
- goodput = ``batch / t x (1 - Σ rate x waste)``; in neighbour mode a lost stage's
  layers join its neighbour's, so the steps after the first loss are slower (the
  expected share of the run after it, from the Poisson process);
- the chance of losing the run: a stage is lost when every rank holding it (its own and
  its backups; in neighbour mode its own and its neighbour) has failed, within the run
  (no rejoin) or within ``rejoin_s`` of each other (a failed rank rejoins after it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mpipipe.respipe import costmodel
from mpipipe.respipe.costmodel import StageShape

__all__ = ["Costs", "Failures", "Prediction", "predict", "grid", "recommend", "plain_samples_per_s",
           "scaled_to_plain_step", "young_daly_R", "pipelined_seconds", "measure_costs", "SAFE_LOSS", "GRID_R"]

GRID_R = (1, 2, 3, 5, 10, 20, 30, 50, 100, 200, 500, 1000)
SAFE_LOSS = 0.01  # a setting that loses the run more often than this (and than needed) is not recommended
# Measured on these machines (docs/benchmarks.md): ULFM reports a killed rank in about
# 0.04 s, and a takeover round with its rebuild takes about 0.06 s.
DETECT_S = 0.05
TAKEOVER_S = 0.1


@dataclass(frozen=True)
class Costs:
    """What one step costs, measured: the model's inputs other than the failures.

    ``compute_s``: each stage's forward and backward of one whole mini-batch on one
    core; ``pack_bytes_per_s``: how fast a stage copies its state into a replica.
    """

    compute_s: Sequence[float]
    batch_size: int
    chunks: int
    link_mbit: float
    pack_bytes_per_s: float = 1e9
    detect_s: float = DETECT_S
    takeover_s: float = TAKEOVER_S
    label_bytes: int = 0
    input_bytes: int = 0


@dataclass(frozen=True)
class Failures:
    """A Poisson failure process: ``rate`` failures per second of each rank; a failed
    rank comes back as a backup after ``rejoin_s`` (None: never); ``run_s`` the run's
    length for the chance of losing it (None: ``steps`` failure-free steps)."""

    rate: float = 0.0
    rejoin_s: float | None = None
    run_s: float | None = None
    steps: int = 1000


@dataclass(frozen=True)
class Prediction:
    """The model's figures for one (mode, R)."""

    mode: str
    R: int
    step_s: float  # failure-free step
    samples_per_s: float  # failure-free
    goodput: float  # useful samples per second under the failures
    lose_run: float  # chance that some stage runs out of holders
    lost_updates: float  # expected lost updates per stage failure
    waste: Mapping[str, float] = field(default_factory=dict)  # share of time, by cause

    def row(self) -> dict[str, Any]:
        return {"mode": self.mode, "R": self.R, "step_s": self.step_s,
                "samples_per_s": self.samples_per_s, "goodput": self.goodput,
                "lose_run": self.lose_run, "lost_updates": self.lost_updates,
                "waste": dict(self.waste)}


def pipelined_seconds(compute_s: Sequence[float], chunks: int) -> float:
    """One step's compute through a synchronous pipeline (GPipe, 1F1B) of ``chunks``
    micro-batches: the first micro-batch goes through every stage (the fill), the other
    ``chunks - 1`` follow at the pace of the slowest stage. Balanced stages of ``t`` each
    give the familiar ``(chunks + K - 1) t / chunks``."""
    if not compute_s or chunks < 1:
        raise ValueError("a pipeline needs at least one stage and one micro-batch")
    return (sum(compute_s) + (chunks - 1) * max(compute_s)) / chunks


def _holders(mode: str, backups: Mapping[int, int], k: int) -> list[int]:
    """How many ranks hold each stage (the stage's own included)."""
    if mode == "neighbour":
        return [2 if backups.get(s, 0) > 0 and k > 1 else 1 for s in range(k)]
    return [1 + backups.get(s, 0) for s in range(k)]


def _lose(holders: Sequence[int], rate: float, run_s: float, rejoin_s: float | None) -> float:
    """The chance that some stage loses all its holders within ``run_s``."""
    if rate <= 0 or run_s <= 0:
        return 0.0
    p = -math.expm1(-rate * run_s)  # one rank fails within the run
    keep = 1.0
    for h in holders:
        lost = p ** h
        if rejoin_s is not None:  # all h down at once: rate h λ (λ T)^(h-1)
            lost = min(lost, -math.expm1(-run_s * h * rate * (rate * rejoin_s) ** (h - 1)))
        keep *= 1.0 - lost
    return 1.0 - keep


def predict(stages: Sequence[StageShape], costs: Costs, failures: Failures, *, mode: str,
            replicate_every: int, backups: Mapping[int, int]) -> Prediction:
    """The goodput of one (mode, R) for the stages' shapes and the measured costs.

    Raises:
        ValueError: a bad mode, R, link rate, or compute times that do not match the stages.
    """
    k, r = len(stages), int(replicate_every)
    if len(costs.compute_s) != k:
        raise ValueError(f"{len(costs.compute_s)} stage compute times for {k} stages")
    backups = {int(s): int(n) for s, n in backups.items() if int(n) > 0}
    cost = costmodel.predict(stages, batch_size=costs.batch_size, backups=backups,
                             replicate_every=r, mode=mode, label_bytes=costs.label_bytes,
                             input_bytes=costs.input_bytes)
    step = _step_seconds(stages, costs, cost, list(costs.compute_s), r, backups)
    lam = max(0.0, failures.rate)
    lost = (r - 1) / 2 if mode != "hot" and backups else 0.0
    replay = 0.0 if mode == "hot" else step
    resync = max((s.replica for s in stages), default=0) / (costs.link_mbit * 1e6 / 8)
    recover = costs.detect_s + costs.takeover_s
    n_backups = sum(backups.values()) if mode != "neighbour" else 0
    waste = {"stage failures": lam * k * (recover + replay + resync + lost * step),
             "backup failures": lam * n_backups * (recover + replay)}
    if failures.rejoin_s is not None:
        waste["rejoins"] = lam * (k + n_backups) * (costs.takeover_s + replay + resync)
    useful = max(0.0, 1.0 - sum(waste.values()))
    run_s = failures.run_s if failures.run_s is not None else failures.steps * step
    mean_step = step
    if mode == "neighbour" and k > 1 and lam > 0:  # K - 1 stages once two are one
        slow = _after_merge(stages, costs, r, backups)
        x = lam * k * run_s
        after = 1.0 - (-math.expm1(-x)) / x  # expected share of the run after the first loss
        mean_step = (1 - after) * step + after * slow
        waste["neighbour merge"] = 1.0 - step / mean_step
    lose = _lose(_holders(mode, backups, k), lam, run_s, failures.rejoin_s)
    return Prediction(mode, r, step, costs.batch_size / step,
                      costs.batch_size / mean_step * useful, lose, lost, waste)


def _after_merge(stages: Sequence[StageShape], costs: Costs, r: int,
                 backups: Mapping[int, int]) -> float:
    """The failure-free step after the costliest neighbour merge: stage i + 1's layers
    joined to stage i's (one stage fewer, the pair's compute and replica on one rank)."""
    comp = list(costs.compute_s)
    i = max(range(len(comp) - 1), key=lambda j: comp[j] + comp[j + 1])
    a, b = stages[i], stages[i + 1]
    joined = StageShape(b.act_out, a.params + b.params, a.state + b.state)
    shapes = [*stages[:i], joined, *stages[i + 2:]]
    merged = replace(costs, compute_s=[*comp[:i], comp[i] + comp[i + 1], *comp[i + 2:]])
    kept = {s - (s > i): 1 for s in backups}  # the protected stages, renumbered
    cost = costmodel.predict(shapes, batch_size=costs.batch_size, backups=kept,
                             replicate_every=r, mode="neighbour",
                             label_bytes=costs.label_bytes, input_bytes=costs.input_bytes)
    return _step_seconds(shapes, merged, cost, list(merged.compute_s), r, kept)


def _step_seconds(stages: Sequence[StageShape], costs: Costs, cost: costmodel.Cost,
                  compute_s: list[float], r: int, backups: Mapping[int, int]) -> float:
    """A failure-free step: pipelined compute and link time, plus packing a replica
    every R steps (the stage that packs the most bytes; packed once for all holders)."""
    exposed = costmodel.exposed_bytes(stages, batch_size=costs.batch_size, chunks=costs.chunks)
    t = costmodel.step_seconds(cost.links, link_mbit=costs.link_mbit,
                               compute_s=pipelined_seconds(compute_s, costs.chunks),
                               exposed=exposed)
    packed = max((stages[s].replica for s in backups), default=0)
    return t + packed / costs.pack_bytes_per_s / r


def grid(stages: Sequence[StageShape], costs: Costs, failures: Failures, *,
         backups: Mapping[int, int], modes: Sequence[str] = ("cold", "hot", "neighbour"),
         rs: Sequence[int] = GRID_R) -> list[Prediction]:
    """:func:`predict` for every mode and R (hot mode at every R: its replicas go out too)."""
    return [predict(stages, costs, failures, mode=m, replicate_every=r, backups=backups)
            for m in modes for r in rs]


def plain_samples_per_s(stages: Sequence[StageShape], costs: Costs) -> float:
    """The plain pipeline's failure-free samples per second (no backup, no replica): the
    baseline every setting's goodput is compared with."""
    cost = costmodel.predict(stages, batch_size=costs.batch_size, label_bytes=costs.label_bytes,
                             input_bytes=costs.input_bytes)
    return costs.batch_size / _step_seconds(stages, costs, cost, list(costs.compute_s), 1, {})


def scaled_to_plain_step(stages: Sequence[StageShape], costs: Costs, step_s: float) -> Costs:
    """``costs`` with the stages' compute scaled (all alike) so that the plain pipeline's
    failure-free step takes ``step_s`` at the link rate: a step measured on the user's
    nodes (``cost --step-time``, a bench's plain run) stands in for this machine's compute.
    Bisection: the step grows with the compute.

    Raises:
        ValueError: ``step_s`` is shorter than the links alone take (the message says how long).
    """
    def step(scale: float) -> float:
        return costs.batch_size / plain_samples_per_s(
            stages, replace(costs, compute_s=[c * scale for c in costs.compute_s]))

    if step(0.0) >= step_s:
        raise ValueError(f"shorter than the links alone take at {costs.link_mbit:g} Mbit/s "
                         f"({1000 * step(0.0):.1f} ms)")
    lo, hi = 0.0, 1.0
    while step(hi) < step_s:
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) < step_s else (lo, mid)
    return replace(costs, compute_s=[c * hi for c in costs.compute_s])


def recommend(predictions: Sequence[Prediction], plain: float, safe_loss: float = SAFE_LOSS
              ) -> tuple[Prediction, str]:
    """The setting to run, and why in one line: the highest goodput among the settings
    whose chance of losing the run is at most ``safe_loss``, or, if none is, at most
    ``safe_loss`` above the safest one's."""
    if not predictions:
        raise ValueError("no setting to choose from")
    floor = min(p.lose_run for p in predictions)
    limit = safe_loss if floor <= safe_loss else floor + safe_loss
    safe = [p for p in predictions if p.lose_run <= limit + 1e-12]
    best = max(safe, key=lambda p: (p.goodput, -p.lose_run, -p.R))
    why = (f"{best.mode} R={best.R}: the highest predicted goodput, {best.goodput:,.0f} samples/s "
           f"({100 * best.goodput / plain:.0f}% of the plain pipeline's without failures), among the "
           f"settings that lose the run with a chance of at most {100 * limit:.3g}%")
    if floor > safe_loss:
        why += (f" (none is below {100 * safe_loss:.3g}%: give stages more backups, or "
                "let failed ranks rejoin)")
    return best, why


def young_daly_R(replica_s: float, step_s: float, mtbf_s: float) -> float:
    """Young and Daly's optimum interval sqrt(2 C M), in steps: C the seconds one replica
    costs, M the mean time between the failures it protects against."""
    return math.sqrt(2 * replica_s * mtbf_s) / step_s


def measure_costs(parts: Sequence[Any], in_shape: Sequence[int], make_optimizer: Any,
                  stages_k: int, *, batch_size: int, chunks: int, repeats: int = 5
                  ) -> tuple[list[float], float]:
    """Each stage's forward, backward and optimizer step of one mini-batch on one core, and
    the rate at which a state is copied into a replica: (seconds per stage, bytes/s).

    ``parts``: the model's chunks in order (stage s holds s, s + K, ...), or a pipeline's
    stage modules. The caller passes copies where the modules must not change (a forward
    in training mode moves BatchNorm's statistics). Why measure: the model needs the
    stages' compute, and the cost command runs without MPI. The median of ``repeats``
    after one warm-up.
    """
    import statistics
    import time

    import torch

    from mpipipe.pipeline.partition import StageChunks

    if parts and all(isinstance(p, StageChunks) for p in parts):
        k, v = len(parts), len(parts[0].chunks)
        parts = [parts[c % k].chunks[c // k] for c in range(v * k)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(batch_size, *in_shape)
        ins = []
        with torch.no_grad():
            for part in parts:
                ins.append(x)
                x = part(x)
        seconds = [0.0] * stages_k
        for c, part in enumerate(parts):
            inp = ins[c].clone().requires_grad_(ins[c].is_floating_point())
            optimizer = make_optimizer(part) if any(p.requires_grad for p in part.parameters()) \
                else None
            times = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                out = part(inp)
                out.float().sum().backward()
                if optimizer is not None:
                    optimizer.step()
                times.append(time.perf_counter() - t0)
                part.zero_grad(set_to_none=True)
            seconds[c % stages_k] += statistics.median(times[1:])
        pack = _pack_rate(list(parts), make_optimizer, stages_k, repeats)
    finally:
        torch.set_num_threads(threads)
    return seconds, pack


def _pack_rate(parts: list[Any], make_optimizer: Any, stages_k: int, repeats: int) -> float:
    """Bytes per second that the largest stage's state packs into its replica message
    (:meth:`StageState.pack`, as a replica is sent)."""
    import statistics
    import time

    from torch import nn

    from mpipipe.core.state.stagestate import StageState

    states = [StageState(nn.ModuleList(parts[s::stages_k]), make_optimizer)
              for s in range(stages_k)]
    state = max(states, key=lambda st: st.nbytes)
    out = state.pack()
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        state.pack(out)
        times.append(time.perf_counter() - t0)
    return state.nbytes / max(statistics.median(times[1:]), 1e-9)
