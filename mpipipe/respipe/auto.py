"""``resilience.mode = "auto"`` and ``replicate_every = "auto"``: the goodput model chooses.

Why: the user knows how often their nodes fail (``resilience.failure_rate``), not which
R pays for it on their links; the goodput model (:mod:`mpipipe.respipe.goodput`) weighs
the two once the stages' compute and the link rate are measured. At start-up one rank
measures and chooses, and every rank takes its answer (timings differ from rank to rank;
the choice must not). The log records the choice, its inputs and the reason
(``resilience_chosen``). After a takeover the round's coordinator may choose R again
(:func:`rechoose`): the failures seen so far, or a step time far from the one the model
was given, are new inputs.

Which modes ``"auto"`` weighs: cold and hot when the plan has backup ranks (hot only
with a schedule of one chunk per rank); neighbour when it has none. A mode changes what
runs on every rank, so it is chosen once, at start-up; R may change at any round.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mpipipe.respipe import goodput

__all__ = ["AutoRequest", "Choice", "Retune", "requested", "choose", "resolved", "rechoose",
           "retune_reason", "cpu_budget", "cpu_factors", "RETUNE_FAILURES", "RETUNE_STEP"]

# Where the model's input and the run disagree by more than this factor, R is chosen again.
DRIFT = 1.5
# The failures seen are "far" from the configured rate when the Poisson process would give
# that many or more with at most this chance.
SURPRISE = 0.01
PROBE_BYTES = 4 << 20  # the link probe at start-up (link_rate = "auto")


def requested(cfg: Mapping[str, Any]) -> bool:
    """Does the configuration ask the run to choose its mode or R?"""
    sec = cfg.get("resilience", {})
    return sec.get("mode") == "auto" or sec.get("replicate_every") == "auto"


@dataclass(frozen=True)
class AutoRequest:
    """What ``"auto"`` chooses from, and the user's inputs to the model."""

    modes: tuple[str, ...]
    rs: tuple[int, ...]
    failure_rate: float  # per rank per second
    link_mbit: float | None  # None: measured at start-up

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], *, has_backups: bool, virtual: bool
                    ) -> AutoRequest | None:
        """Read and check the ``auto`` keys; None when nothing is ``"auto"``.

        Raises:
            ValueError: a key that cannot take effect, a missing failure rate, or a bad
                rate (one line naming the key).
        """
        from mpipipe.core.units import parse_link_rate, parse_rate

        sec = cfg["resilience"]
        rate_text, link_text = str(sec.get("failure_rate", "")), str(sec.get("link_rate", "auto"))
        if not requested(cfg):
            if rate_text:
                raise ValueError('resilience.failure_rate is read only when resilience.mode or '
                                 'replicate_every is "auto"; drop it, or set one of them to "auto"')
            if link_text != "auto":
                raise ValueError('resilience.link_rate is read only when resilience.mode or '
                                 'replicate_every is "auto"; drop it, or set one of them to "auto"')
            return None
        if not rate_text:
            raise ValueError('"auto" weighs failures against replication: give resilience.'
                             'failure_rate, the failures per rank you expect, e.g. "1/30min" '
                             '(or "0" for none)')
        try:
            rate = parse_rate(rate_text)
        except ValueError as e:
            raise ValueError(f"resilience.failure_rate: {e}") from None
        try:
            link = None if link_text == "auto" else parse_link_rate(link_text)
        except ValueError as e:
            raise ValueError(f"resilience.link_rate: {e}") from None
        mode = sec["mode"]
        if mode == "auto":
            modes: tuple[str, ...] = (("cold",) if virtual else ("cold", "hot")) if has_backups \
                else ("neighbour",)
        else:
            modes = (mode,)
        if sec["replicate_every"] == "auto":
            if not has_backups and mode != "neighbour" and "neighbour" not in modes:
                raise ValueError('resilience.replicate_every = "auto" with no backup ranks in '
                                 f'{mode} mode: no replica is sent; give resilience.backups, '
                                 'or use mode = "neighbour" or "auto"')
            rs = goodput.GRID_R
        else:
            rs = (int(sec["replicate_every"]),)
        return cls(modes, tuple(rs), rate, link)


@dataclass(frozen=True)
class Choice:
    """The setting chosen, with what the model was given and why (logged)."""

    mode: str
    replicate_every: int
    why: str
    compute_s: tuple[float, ...]
    link_mbit: float
    pack_bytes_per_s: float
    failure_rate: float
    step_s: float  # the model's failure-free step of the choice
    goodput: float

    def detail(self) -> dict[str, Any]:
        """The ``resilience_chosen`` event's detail."""
        return {"mode": self.mode, "replicate_every": self.replicate_every, "why": self.why,
                "failure_rate_per_s": self.failure_rate, "link_mbit": self.link_mbit,
                "step_s": self.step_s, "goodput": self.goodput,
                "compute_s": ",".join(f"{c:.6g}" for c in self.compute_s)}


def resolved(cfg: Mapping[str, Any], choice: Choice) -> dict[str, Any]:
    """A copy of ``cfg`` with the chosen mode and R in place of ``"auto"``."""
    out = copy.deepcopy(dict(cfg))
    out["resilience"]["mode"] = choice.mode
    out["resilience"]["replicate_every"] = choice.replicate_every
    return out


def _best(request: AutoRequest, shapes: Sequence[Any], costs: Mapping[str, goodput.Costs],
          rate: float, backups: Mapping[int, int], steps: int) -> tuple[goodput.Prediction, str]:
    """The recommendation over the request's modes and Rs; ``costs`` by mode (a hot
    mirror's compute shares its node's cores), the plain pipeline's under ``""``."""
    preds = []
    for mode in request.modes:
        held = dict.fromkeys(range(len(shapes)), 1) if mode == "neighbour" else dict(backups)
        preds += goodput.grid(shapes, costs[mode], goodput.Failures(rate, steps=steps),
                              backups=held, modes=(mode,), rs=request.rs)
    return goodput.recommend(preds, goodput.plain_samples_per_s(shapes, costs[""]))


def cpu_budget() -> float:
    """The cores this process may use: its affinity, capped by its cgroup's CPU quota
    (the testbed gives each node a share of a core that way; cgroup v2 or v1)."""
    import os
    from pathlib import Path

    cores = float(len(os.sched_getaffinity(0)))
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return cores
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            files = [Path("/sys/fs/cgroup") / path.lstrip("/") / "cpu.max"]
        elif "cpu" in controllers.split(","):
            base = Path("/sys/fs/cgroup") / controllers / path.lstrip("/")
            files = [base / "cpu.cfs_quota_us", base / "cpu.cfs_period_us"]
        else:
            continue
        try:
            if len(files) == 1:
                quota, period = files[0].read_text().split()[:2]
            else:
                quota, period = (f.read_text().strip() for f in files)
            if quota not in ("max", "-1"):
                cores = min(cores, int(quota) / int(period))
        except (OSError, ValueError):
            continue
    return cores


def cpu_factors(plan: Any, places: Sequence[tuple[str, float]], k: int) -> dict[str, list[float]]:
    """How much slower each stage computes than rank 0 did when it measured alone, by mode:
    the ranks that compute on a node share its cores (a hot mirror computes; a cold
    backup waits). ``places``: each rank's (host, cores), as gathered at start-up."""
    stages = [plan.ranks_of("stage", j)[0] for j in range(k)]
    mirrors = list(plan.ranks_of("backup"))
    alone = min(1.0, places[0][1])
    out: dict[str, list[float]] = {}
    for mode, busy in (("", stages), ("hot", stages + mirrors)):
        on: dict[str, int] = {}
        for r in busy:
            on[places[r][0]] = on.get(places[r][0], 0) + 1
        out[mode] = [alone / min(1.0, places[r][1] / on[places[r][0]]) for r in stages]
    return out


def choose(run: Any, pipe: Any, request: AutoRequest, *, in_shape: Sequence[int],
           make_optimizer: Any, backups: Mapping[int, int], steps: int, batch_size: int
           ) -> Choice:
    """Measure on rank 0 (the stages' compute on copies of their modules, one core; the
    link between stages 0 and 1 unless given) and choose; every rank gets rank 0's
    answer. Collective over ``run.comm``.

    Why copies: a forward in training mode moves BatchNorm's statistics, and the run's
    modules must start exactly as a run without ``"auto"`` would.
    """
    link = request.link_mbit
    if link is None:
        from mpipipe.core.mpi.linkrate import measure

        src = run.plan.ranks_of("stage", 0)[0]
        dst = run.plan.ranks_of("stage", 1)[0] if pipe.k > 1 else src
        if src != dst:
            nbytes, seconds = measure(run.comm, src, dst, PROBE_BYTES, 1 << 20)
            link = nbytes * 8 / 1e6 / max(seconds, 1e-9)
        else:
            link = 1e6  # one stage: no link to measure, none to pay for
    import socket

    places = run.comm.allgather((socket.gethostname(), cpu_budget()))
    answer: Choice | None = None
    if run.rank == 0:
        answer = _measure_and_choose(pipe, request, link, in_shape=in_shape,
                                     make_optimizer=make_optimizer, backups=backups, steps=steps,
                                     batch_size=batch_size,
                                     factors=cpu_factors(run.plan, places, pipe.k))
    return run.comm.bcast(answer, root=0)


def _measure_and_choose(pipe: Any, request: AutoRequest, link: float, *,
                        in_shape: Sequence[int], make_optimizer: Any,
                        backups: Mapping[int, int], steps: int, batch_size: int,
                        factors: Mapping[str, Sequence[float]]) -> Choice:
    from mpipipe.respipe.costmodel import stage_shapes

    parts = copy.deepcopy(list(pipe.partitions))
    shapes, in_bytes = stage_shapes(parts, in_shape, make_optimizer)
    compute, pack = goodput.measure_costs(parts, in_shape, make_optimizer, pipe.k,
                                          batch_size=batch_size, chunks=pipe.chunks)
    label = 8 if pipe.labels == "travel" and pipe.k > 1 else 0
    costs = {mode: goodput.Costs([c * f for c, f in zip(compute, factors[mode], strict=True)],
                                 batch_size, pipe.chunks, link, pack, label_bytes=label,
                                 input_bytes=in_bytes) for mode in factors}
    costs.update({m: costs[""] for m in ("cold", "neighbour")})
    best, why = _best(request, shapes, costs, request.failure_rate, backups, steps)
    return Choice(best.mode, best.R, why, tuple(costs[best.mode].compute_s), link, pack,
                  request.failure_rate, best.step_s, best.goodput)


RETUNE_FAILURES, RETUNE_STEP = 1, 2  # why R was chosen again (bits of Decision.retuned)


def rechoose(request: AutoRequest, chosen: Choice, *, shapes: Sequence[Any],
             batch_size: int, chunks: int, labels: int, input_bytes: int,
             backups: Mapping[int, int], steps: int, failures: int, elapsed_s: float,
             ranks: int, step_s: float | None) -> tuple[Choice, int, float] | None:
    """At a takeover round: a new choice of R (same mode) when the run has drifted from the
    model's input; None when it has not (or R is not ``"auto"``). Also returns why (the
    ``RETUNE_*`` bits) and the factor put on the stages' compute.

    Drift: more failures than the configured rate makes likely (a Poisson tail of at most
    ``SURPRISE``), the rate then taken as failures / elapsed time per rank; or a measured
    step (``step_s``) ``DRIFT`` times off the model's, the stages' compute then scaled so
    that the model's step is the one measured. Pure: the coordinator calls it and puts
    the answer in its decision.
    """
    if len(request.rs) < 2 or elapsed_s <= 0:
        return None
    why, rate = 0, chosen.failure_rate
    if failures > 0 and _poisson_tail(failures, chosen.failure_rate * ranks * elapsed_s) <= SURPRISE:
        rate = failures / (ranks * elapsed_s)
        why |= RETUNE_FAILURES
    scale = 1.0
    if step_s is not None and step_s > 0 and chosen.step_s > 0 and \
            max(step_s / chosen.step_s, chosen.step_s / step_s) >= DRIFT:
        scale = step_s / chosen.step_s
        why |= RETUNE_STEP
    if not why:
        return None
    costs = goodput.Costs([c * scale for c in chosen.compute_s], batch_size, chunks,
                          chosen.link_mbit, chosen.pack_bytes_per_s, label_bytes=labels,
                          input_bytes=input_bytes)
    same_mode = replace(request, modes=(chosen.mode,))
    best, text = _best(same_mode, shapes, {chosen.mode: costs, "": costs}, rate, backups, steps)
    new = replace(chosen, replicate_every=best.R, why=text, compute_s=tuple(costs.compute_s),
                  failure_rate=rate, step_s=best.step_s, goodput=best.goodput)
    return new, why, scale


def retune_reason(why: int, failures: int, elapsed_s: float, step_s: float, model_s: float) -> str:
    """The log's words for the ``RETUNE_*`` bits."""
    out = []
    if why & RETUNE_FAILURES:
        out.append(f"{failures} failure(s) in {elapsed_s:.0f} s: more than the failure rate "
                   "given makes likely")
    if why & RETUNE_STEP:
        out.append(f"a measured step of {1000 * step_s:.1f} ms, where the model had "
                   f"{1000 * model_s:.1f} ms")
    return "; ".join(out)


class Retune:
    """R chosen again at takeover rounds: the round's coordinator proposes it in its
    decision (:meth:`propose`), and every member takes it when it applies the decision
    (:meth:`applied`), so all agree from the same step on. Only R: a mode changes what
    runs on every rank, so it stays as chosen at start-up.

    Each member counts the ranks the rounds it applied left out (the failures) from the
    start of training; the coordinator adds those of its own round.
    """

    def __init__(self, request: AutoRequest, choice: Choice, *, in_shape: Sequence[int],
                 make_optimizer: Any, batch_size: int, labels: int, steps: int) -> None:
        import time

        self.request, self.choice = request, choice
        self.in_shape, self.make_optimizer = tuple(in_shape), make_optimizer
        self.batch_size, self.labels, self.steps = batch_size, labels, steps
        self.failures = 0
        self.start = time.monotonic()

    def _elapsed(self) -> float:
        import time

        return time.monotonic() - self.start

    def propose(self, d: Any, m: Any) -> Any:
        """The coordinator's decision ``d`` with R chosen again if the run drifted."""
        from mpipipe.respipe.costmodel import stage_shapes

        if d.lost_stage >= 0 or d.merge >= 0:  # (a merge changes the stages: kept as it is)
            return d
        gone = len(set(m.members) - set(d.members))
        shapes, in_bytes = stage_shapes(m.pipe.partitions, self.in_shape, self.make_optimizer)
        backups = {k: len(v) for k, v in d.backups.items()}
        answer = rechoose(self.request, self.choice, shapes=shapes, batch_size=self.batch_size,
                          chunks=m.pipe.chunks, labels=self.labels, input_bytes=in_bytes,
                          backups=backups, steps=self.steps, failures=self.failures + gone,
                          elapsed_s=self._elapsed(), ranks=len(m.members),
                          step_s=m.median_step() or None)
        if answer is None:
            return d
        new, why, scale = answer
        return replace(d, replicate_every=new.replicate_every, retuned=why,
                       failure_rate=new.failure_rate, compute_scale=scale,
                       model_step_s=new.step_s)

    def applied(self, d: Any, gone: Sequence[int], m: Any, log_event: Any) -> None:
        """Every member: count the round's failures; take a new R, and log it with why."""
        from mpipipe.core.logs.logschema import EventKind
        from mpipipe.respipe.settings import Settings

        self.failures += len(gone)
        if not d.replicate_every:
            return
        before = self.choice
        reason = retune_reason(d.retuned, self.failures, self._elapsed(), m.median_step(),
                               before.step_s)
        self.choice = replace(before, replicate_every=d.replicate_every,
                              failure_rate=d.failure_rate, step_s=d.model_step_s,
                              compute_s=tuple(c * d.compute_scale for c in before.compute_s))
        settings: Settings = m.settings
        m.settings = replace(settings, replicate_every=d.replicate_every)
        log_event(EventKind.RESILIENCE_CHOSEN, d.step, m.wrank, mode=before.mode,
                  replicate_every=d.replicate_every, previous=before.replicate_every,
                  why=f"chosen again at generation {d.gen}: {reason}",
                  failure_rate_per_s=d.failure_rate, step_s=d.model_step_s)


def _poisson_tail(n: int, mean: float) -> float:
    """P(X >= n) for X ~ Poisson(mean)."""
    if mean <= 0:
        return 0.0 if n > 0 else 1.0
    term, below = math.exp(-mean), 0.0
    for i in range(n):
        below += term
        term *= mean / (i + 1)
    return max(0.0, 1.0 - below)
