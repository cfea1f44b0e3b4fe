"""Fault injection: parse ``kill``/``stall``/``delay``/``slow`` specs and fire them at the right step, seeded.

Two more kinds act on a whole testbed node (see docs/testbed.md): ``node-kill`` SIGKILLs
every process of a node, ``partition`` takes its link down. A node is not a rank, so which
rank fires them is worked out from every rank's host, gathered at start-up
(:func:`check_nodes` records it): the lowest rank on the node.

A ``poisson`` fault is a process of faults: kills (or stalls, or node faults) at seeded
exponential intervals of wall time, every rank expanding it alike
(:mod:`mpipipe.core.mpi.poisson`); each event fires as the concrete fault it stands for.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mpipipe.core.mpi.poisson import Clocked, Event, Process, node_victims, rank_victims
from mpipipe.core.units import format_rate, parse_duration, parse_rate

if TYPE_CHECKING:
    from mpipipe.core.mpi.roles import LaunchPlan

__all__ = ["Fault", "FaultError", "FaultKind", "FaultPlan", "FAULT_KINDS", "parse", "parse_all",
           "check_reachable", "check_nodes", "target_rank", "firing_rank", "kill_node", "set_link", "KINDS",
           "NODE_KINDS", "preview"]

@dataclass(frozen=True)
class FaultKind:
    """What one kind of fault is: its keys, an example, and how it acts on its target.

    Why a table: everything that differs between kinds is here (parsing, the example
    in an error, what the ResPipe log writer must do), so adding a kind is one entry
    plus its firing in :meth:`FaultPlan.at_step` (docs/internals.md).
    """

    name: str
    required: frozenset[str]  # keys the spec must give (besides the target)
    optional: frozenset[str]
    example: str
    on_node: bool = False  # aimed at a testbed node (node=NAME), not at a stage or a rank
    silences: bool = False  # the target stops answering: the log writer may move
    ends_process: bool = False  # the target's process does not come back
    repeats: bool = False  # may fire at every step from its step (delay), not only at it
    process: bool = False  # a process of faults (poisson): draws its targets, in wall time


def _kind(name: str, required: str, optional: str, example: str, **how: bool) -> FaultKind:
    return FaultKind(name, frozenset(required.split()), frozenset(optional.split()), example, **how)


# The target is either a stage (pipeline jobs) or a rank (any job), never both; a node
# fault names a testbed node instead.
FAULT_KINDS: dict[str, FaultKind] = {k.name: k for k in (
    _kind("kill", "step", "micro round build", "kill:stage=1:step=20", silences=True,
          ends_process=True),
    _kind("stall", "step", "seconds micro round build", "stall:stage=1:step=20:seconds=5",
          silences=True),
    _kind("delay", "p seconds", "step", "delay:stage=1:p=0.1:seconds=0.5", repeats=True),
    _kind("slow", "factor", "step", "slow:rank=2:step=10:factor=3"),
    _kind("node-kill", "node step", "", "node-kill:node=b:step=20", on_node=True, silences=True,
          ends_process=True),
    _kind("partition", "node step", "seconds", "partition:node=b:step=20:seconds=10", on_node=True,
          silences=True, ends_process=True),
    _kind("poisson", "rate seed", "rejoin what", "poisson:rate=1/30min:seed=1:rejoin=20s",
          process=True),
)}
KINDS = tuple(FAULT_KINDS)
NODE_KINDS = tuple(k for k, v in FAULT_KINDS.items() if v.on_node)
_INT_KEYS = {"stage", "rank", "step", "micro", "round", "build", "seed"}
WHATS = ("rank", "node")  # what a poisson event takes
DEFAULT_STALL_S = 5.0
DEFAULT_PARTITION_S = 10.0
# A testbed node's name (mpipipe.tools.emulator.NAME_RE), with or without the mpt- prefix.
_NODE_RE = re.compile(r"^(?:mpt-)?([a-z][a-z0-9]{0,10})$")
_hosts: tuple[str, ...] | None = None  # every rank's host, recorded by check_nodes


class FaultError(ValueError):
    """A fault spec is malformed; the message quotes it and shows a correct example."""


@dataclass(frozen=True)
class Fault:
    """One injected fault.

    ``kill``: SIGKILL the target's process at the start of ``step`` (a real crash), or
    with ``micro=M`` in the middle of it, right after the forward of micro-batch M.
    ``stall``: the target stops responding (sleeps outside MPI) for ``seconds`` at ``step``
    (with ``micro=M``: after the forward of micro-batch M).
    ``round=N`` (kill, stall; ResPipe): instead, in the N-th recovery round the target
    runs at or after ``step`` (a round that runs again counts as one more), after it
    has read the round's decision and before it says it is there to build the new
    generation with the other members: a fault during recovery, which the members must
    survive too. With ``build=1``, later in that round: after the member said it is
    there and heard "build", right before its own build call, so that the others wait
    in theirs for it (and give up). Another fault must start the round; if none does,
    the run ends saying the fault did not fire.
    ``delay``: at every step (from ``step``, default 0) the target sleeps ``seconds``
    with probability ``p`` (seeded, so a run is repeatable; a replayed step is not
    delayed again).
    ``slow``: from ``step`` on the target's compute takes ``factor`` times longer.
    ``node-kill``: at the start of ``step``, SIGKILL every process of testbed node ``node``
    from its cgroup, all its ranks at once (Open MPI's daemon is spared: :func:`kill_node`).
    ``partition``: at the start of ``step``, take node ``node``'s link down for ``seconds``
    (default 10): its ranks live on but nobody reaches them, so only a deadline finds
    them. Then the node's processes end as in a node-kill and its link comes back: the
    node never rejoins (mpirun could not end the job while a rank is unreachable, and a
    rank back on the link may have lost the messages that told it it was replaced).
    Both are fired by the lowest rank on the node (:func:`firing_rank`).
    ``poisson``: events at exponential intervals of mean 1/``rate`` seconds of wall time
    since the run's start, seeded by ``seed``; each takes a victim drawn uniformly among
    the ranks that may fail (``what="node"``: the testbed's nodes), and fires at the
    victim's first step boundary at or after its time as a ``kill`` (a ``stall`` of
    ``seconds`` when ``rejoin=T`` was given: the rank comes back), or as a ``node-kill``
    (a ``partition`` of ``seconds``). A victim killed is not drawn again.
    Steps are 0-based optimizer steps.
    """

    kind: str
    stage: int | None = None
    rank: int | None = None
    step: int = 0
    p: float = 0.0
    seconds: float = 0.0
    factor: float = 1.0
    micro: int = -1  # kill, stall: -1 = at the start of the step
    round: int = 0  # kill, stall: N = in the N-th round from ``step`` on (ResPipe)
    build: bool = False  # with round: after the member's READY and GO, before its build
    node: str | None = None  # node-kill, partition: the testbed node's name (no mpt- prefix)
    rate: float = 0.0  # poisson: events per second (its rejoin=T is kept in seconds)
    seed: int = 0  # poisson: the process's own seed
    what: str = "rank"  # poisson: what an event takes, a rank or a testbed node
    origin: str = ""  # a fault a process drew: which event, "poisson #2 at 41.3 s"

    @property
    def how(self) -> FaultKind:
        """This fault's kind, with what it does to its target (:data:`FAULT_KINDS`)."""
        return FAULT_KINDS[self.kind]

    def targets(self, *, stage: int | None, rank: int, hosts: Sequence[str] | None = None) -> bool:
        """True if this fault is aimed at the process playing ``stage`` on world ``rank``
        (a node fault: if ``rank`` is the one that fires it, :func:`firing_rank`)."""
        if self.node is not None:
            return rank == firing_rank(self.node, hosts)
        if self.rank is not None:
            return self.rank == rank
        return stage is not None and self.stage == stage

    def __str__(self) -> str:
        if self.kind == "poisson":
            rejoin = f":rejoin={self.seconds:g}s" if self.seconds else ""
            return f"poisson:rate={_rate_text(self.rate)}:seed={self.seed}{rejoin}:what={self.what}"
        return self._concrete() + (f" ({self.origin})" if self.origin else "")

    def _concrete(self) -> str:
        if self.node is not None:
            extra = f":seconds={self.seconds:g}" if self.kind == "partition" else ""
            return f"{self.kind}:node={self.node}:step={self.step}{extra}"
        where = f"stage={self.stage}" if self.stage is not None else f"rank={self.rank}"
        at = f":micro={self.micro}" if self.micro >= 0 else ""
        at += f":round={self.round}" if self.round else ""
        at += ":build=1" if self.build else ""
        extra = {"kill": f"step={self.step}{at}",
                 "stall": f"step={self.step}{at}:seconds={self.seconds:g}",
                 "delay": f"p={self.p:g}:seconds={self.seconds:g}",
                 "slow": f"step={self.step}:factor={self.factor:g}"}[self.kind]
        return f"{self.kind}:{where}:{extra}"


def _rate_text(rate: float) -> str:
    """A rate as the user would write it ("1/30min") when that reads back exactly, else
    events per second."""
    text = re.sub(r"^1/1(?=[a-z])", "1/", format_rate(rate))  # "1/1h" reads "1/h"
    return text if abs(parse_rate(text) - rate) <= 1e-12 * rate else f"{rate:.12g}"


def _fail(spec: str, why: str, kind: str | None = None) -> FaultError:
    known = FAULT_KINDS.get(kind or "")
    example = known.example if known else ", ".join(k.example for k in FAULT_KINDS.values())
    return FaultError(f"fault spec {spec!r}: {why} (e.g. {example})")


def parse(spec: str) -> Fault:
    """Read one fault spec such as ``kill:stage=1:step=20``.

    Raises:
        FaultError: unknown kind or key, a missing or repeated key, a value that is
            not a number, or a value out of range; the message shows a correct spec.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise _fail(str(spec), "empty")
    parts = [p.strip() for p in spec.strip().split(":")]
    kind = parts[0].lower()
    if kind not in KINDS:
        raise _fail(spec, f"unknown fault kind {parts[0]!r} (known: {', '.join(KINDS)})")
    values = _read_values(spec, kind, parts[1:])
    _check_values(spec, kind, values)
    if kind == "stall":
        values.setdefault("seconds", DEFAULT_STALL_S)
    if kind == "partition":
        values.setdefault("seconds", DEFAULT_PARTITION_S)
        if values["seconds"] <= 0:
            raise _fail(spec, "seconds must be > 0 (how long the link stays down)", kind)
    if "build" in values:
        values["build"] = bool(values["build"])
    if kind == "poisson":
        values["seconds"] = values.pop("rejoin", 0.0)
    return Fault(kind=kind, **{k: v for k, v in values.items()})  # type: ignore[arg-type]


def _read_values(spec: str, kind: str, parts: Sequence[str]) -> dict[str, float | int]:
    """The spec's ``key=value`` parts, each a key its kind allows, given once, read as a
    number (a node: its name without the mpt- prefix)."""
    spec_kind = FAULT_KINDS[kind]
    values: dict[str, float | int] = {}
    for part in parts:
        if "=" not in part:
            raise _fail(spec, f"{part!r} is not key=value", kind)
        key, raw = (s.strip().lower() for s in part.split("=", 1))
        targets = set() if spec_kind.on_node or spec_kind.process else {"stage", "rank"}
        allowed = spec_kind.required | spec_kind.optional | targets
        if key not in allowed:
            raise _fail(spec, f"unknown key {key!r} for {kind} (allowed: {', '.join(sorted(allowed))})",
                        kind)
        if key in values:
            raise _fail(spec, f"key {key!r} given twice", kind)
        if key == "node":
            match = _NODE_RE.match(raw)
            if not match:
                raise _fail(spec, f"node={raw!r} is not a testbed node name (1 to 11 lowercase letters "
                                  f"or digits starting with a letter, as in the testbed file)", kind)
            values[key] = match.group(1)  # type: ignore[assignment]
            continue
        if key in ("rate", "rejoin", "what"):
            values[key] = _process_value(spec, key, raw)  # type: ignore[assignment]
            continue
        try:
            values[key] = int(raw) if key in _INT_KEYS else float(raw)
        except ValueError:
            what = "an integer" if key in _INT_KEYS else "a number"
            raise _fail(spec, f"{key}={raw!r} is not {what}", kind) from None
    return values


def _process_value(spec: str, key: str, raw: str) -> float | str:
    """A poisson key's value: a rate (mpipipe.core.units.parse_rate), a duration
    (parse_duration), or what an event takes."""
    try:
        if key == "rate":
            return parse_rate(raw)
        if key == "rejoin":
            return parse_duration(raw)
    except ValueError as e:
        raise _fail(spec, f"{key}={e}", "poisson") from None
    if raw not in WHATS:
        raise _fail(spec, f"what={raw!r}: give what=rank (a rank dies) or what=node (a testbed "
                          f"node)", "poisson")
    return raw


def _check_values(spec: str, kind: str, values: Mapping[str, float | int]) -> None:
    """One target, every required key, and each value in its range and company."""
    spec_kind = FAULT_KINDS[kind]
    if "rate" in values and values["rate"] == 0:
        raise _fail(spec, "rate=0 never fires: give a positive rate, such as 1/30min or 2/h "
                          "(or drop the fault)", kind)
    if not (spec_kind.on_node or spec_kind.process) and ("stage" in values) == ("rank" in values):
        raise _fail(spec, "name exactly one target, stage=K or rank=R", kind)
    missing = spec_kind.required - set(values)
    if missing:
        raise _fail(spec, f"missing {', '.join(sorted(missing))}", kind)
    for key in ("stage", "rank", "step", "micro", "seed"):
        if key in values and values[key] < 0:
            raise _fail(spec, f"{key} must be >= 0", kind)
    if "round" in values and values["round"] < 1:
        raise _fail(spec, "round must be >= 1 (the N-th round from step on)", kind)
    if "build" in values and (values["build"] != 1 or "round" not in values):
        raise _fail(spec, "build=1 goes with round=N (it fires inside that round)", kind)
    if "round" in values and "micro" in values:
        raise _fail(spec, "give micro= (inside a step) or round=1 (inside a round), not both",
                    kind)
    if kind == "delay" and not 0.0 <= values["p"] <= 1.0:
        raise _fail(spec, "p must be a probability in [0, 1]", kind)
    if "seconds" in values and values["seconds"] < 0:
        raise _fail(spec, "seconds must be >= 0", kind)
    if kind == "slow" and values["factor"] < 1.0:
        raise _fail(spec, "factor must be >= 1 (1 = normal speed)", kind)


def parse_all(specs: Iterable[str]) -> list[Fault]:
    """Parse every spec; the first bad one raises :class:`FaultError`."""
    return [parse(s) for s in specs]


def target_rank(f: Fault, plan: LaunchPlan) -> int | None:
    """The world rank a fault hits at launch (None: a stage the plan does not have, a node,
    or a process, which draws its targets)."""
    if f.node is not None or f.how.process:
        return None
    if f.rank is not None:
        return f.rank
    ranks = plan.ranks_of("stage", f.stage)
    return ranks[0] if ranks else None


def _never(f: Fault, why: str) -> FaultError:
    return FaultError(f"fault {f}: {why}; it would never fire")


def check_reachable(faults: Sequence[Fault], plan: LaunchPlan, *, steps: int | None,
                    chunks: int | None = None, mode: str | None = None) -> None:
    """Refuse every fault that can never fire in this run, before any work starts.

    Why: a fault that silently does nothing makes a resilience experiment look like a
    success. Checked against the world and the plan's roles (a stage that does not
    exist, a rank outside the world, a micro-batch on a rank that runs none, a slow-down
    of a backup, which computes nothing), the run's ``steps`` (0-based fault steps must
    be below it; None: not known yet, not checked), ``chunks`` (micro-batches per step)
    and earlier kills (a fault on a rank killed before it is due). ``mode`` is ResPipe's
    resilience mode (None: not a pipeline job).

    Raises:
        FaultError: the first fault that cannot fire, named, with the reason.
    """
    world = plan.world_size
    stages = sorted({role.index for role in plan.roles if role.kind == "stage"})
    for f in faults:
        if f.how.process:
            _check_process(f, plan)
            continue
        _check_bounds(f, world, stages, steps, chunks)
        _check_role(f, plan, mode)
    _check_kill_order(faults, plan)


def _check_process(f: Fault, plan: LaunchPlan) -> None:
    """A process has ranks to take (its nodes are checked in :func:`check_nodes`, once
    the hosts are known). Why not more: when its events fall is a matter of wall time,
    which no start-up check knows; an event after the run's end is not a fault that
    cannot fire, it is a process that goes on beyond the run."""
    if f.what == "rank" and not rank_victims(plan):
        raise _never(f, f"no rank may be a victim (the plan: {plan.describe()}; spares and "
                        "the host are never drawn)")


def _check_bounds(f: Fault, world: int, stages: Sequence[int], steps: int | None,
                  chunks: int | None) -> None:
    """A fault's rank, stage, step and micro-batch exist in this run, and it changes something."""
    if f.rank is not None and not 0 <= f.rank < world:
        raise _never(f, f"there is no rank {f.rank} (the MPI world has ranks 0..{world - 1})")
    if f.stage is not None and f.stage not in stages:
        have = f"stages 0..{stages[-1]}" if stages else "no stages"
        raise _never(f, f"stage {f.stage} does not exist (the plan has {have})")
    if steps is not None and f.step >= steps:
        what = "starts at" if f.kind in ("delay", "slow") else "is due at"
        raise _never(f, f"it {what} step {f.step}, beyond the run (run.steps = {steps}: "
                        f"steps 0..{steps - 1})")
    if chunks is not None and f.micro >= chunks:
        raise _never(f, f"micro-batch {f.micro} does not exist (pipeline.chunks = {chunks}: "
                        f"micro-batches 0..{chunks - 1})")
    if f.kind == "delay" and f.p == 0:
        raise _never(f, "p=0")
    if f.kind == "slow" and f.factor == 1:
        raise _never(f, "factor=1 slows nothing")


def _check_role(f: Fault, plan: LaunchPlan, mode: str | None) -> None:
    """A fault on a rank does what its role (spare, backup) lets it do; a fault in a
    recovery round needs a job that runs rounds."""
    role = plan.role_of(f.rank) if f.rank is not None else None
    if role is not None and role.kind == "spare":
        raise _never(f, f"rank {f.rank} is a spare, which idles outside the job; aim it "
                        "at a stage or a backup")
    if role is not None and role.kind == "backup":
        if f.kind == "slow":
            raise _never(f, f"rank {f.rank} is a backup of stage {role.index}, which "
                            "computes nothing to slow down; aim it at a stage")
        if f.micro >= 0 and mode != "hot":
            raise _never(f, f"rank {f.rank} is a backup of stage {role.index}: in "
                            f"{mode or 'cold'} mode it runs no micro-batch; drop micro=")
    if f.round and (mode is None or not plan.ranks_of("backup") and mode != "neighbour"):
        raise _never(f, "round=1 fires inside a ResPipe recovery round, and this job "
                        "runs none (no backups, and not neighbour mode)")


def _check_kill_order(faults: Sequence[Fault], plan: LaunchPlan) -> None:
    """No fault aims at a rank that an earlier kill has ended.

    A fault on a rank that an earlier kill has ended: (step, micro) orders them, -1
    (the start of a step) before micro-batch 0; at the same point, listing order. A
    kill in a round may come at any step from its own: nothing may aim at its target
    from that step on.
    """
    for i, kill in enumerate(faults):
        if kill.kind != "kill":
            continue
        dead = target_rank(kill, plan)
        for j, f in enumerate(faults):
            if j == i or target_rank(f, plan) != dead:
                continue
            if kill.round:
                if f.step >= kill.step:
                    raise _never(f, f"its target (rank {dead}) may be killed before, by "
                                    f"{kill}, in any round from step {kill.step} on")
                continue
            at = (f.step, f.micro if f.kind in ("kill", "stall") else -1)
            if at > (kill.step, kill.micro) or (at == (kill.step, kill.micro) and j > i):
                raise _never(f, f"its target (rank {dead}) is killed before, by {kill}")


def firing_rank(node: str, hosts: Sequence[str] | None = None) -> int | None:
    """The world rank that fires a fault aimed at testbed ``node``: the lowest rank whose
    host is ``mpt-NODE`` (``hosts``: every rank's host, default the ones :func:`check_nodes`
    recorded at start-up); None when no rank runs there.

    Why the lowest: one rank must fire, or a partition would be fired again by a rank of
    the node that reaches the step after the link came back.
    """
    hosts = _hosts if hosts is None else hosts
    want = "mpt-" + node
    return next((r for r, h in enumerate(hosts or ()) if h == want), None)


def check_nodes(faults: Sequence[Fault], hosts: Sequence[str], plan: LaunchPlan | None = None) -> None:
    """Refuse a node fault that can never fire (the world is not on a testbed, or no rank
    runs on the node), or that would take a rank no run survives (a Stannis ``host``, as
    ``kill:rank=0`` is refused), and record ``hosts`` so that every rank agrees who fires it.

    Called at start-up once every rank's host is known (after :func:`check_reachable`),
    still before torch is imported. Why here and not in :func:`check_reachable`: the hosts
    are gathered over MPI, which the launch plan's checks do not need.

    Raises:
        FaultError: the first node fault that cannot fire, named, with the reason.
    """
    global _hosts
    # A spare rank never reaches a step, so it cannot fire a fault: it counts as on no node.
    spare = {r for r in range(len(hosts)) if plan is not None and plan.role_of(r).kind == "spare"}
    _hosts = tuple("" if r in spare else h for r, h in enumerate(hosts))
    nodes = [f for f in faults if f.node is not None or (f.how.process and f.what == "node")]
    if not nodes:
        return
    from mpipipe.core.mpi.testbed_nodes import node_hosts

    names = node_hosts()
    if not names or not set(hosts) <= names:
        where = ", ".join(sorted(set(hosts)))
        raise _never(nodes[0], f"the ranks run on {where}, not on the nodes of a testbed that is up; "
                               f"node faults need one (python -m mpipipe testbed, docs/testbed.md)")
    for f in nodes:
        if f.how.process:
            if not node_victims(_hosts, plan):
                raise _never(f, f"no node may be a victim (the ranks run on "
                                f"{', '.join(sorted(set(hosts)))}; a node that runs the host or only "
                                "spare ranks is never drawn)")
            continue
        if firing_rank(f.node, _hosts) is None:  # type: ignore[arg-type]
            only = " but spare ones" if any(hosts[r] == "mpt-" + f.node for r in spare) else ""
            raise _never(f, f"no rank{only} runs on node mpt-{f.node} (the ranks run on "
                            f"{', '.join(sorted(set(hosts)))})")
        lost = [r for r, h in enumerate(hosts) if h == "mpt-" + f.node]
        vital = [r for r in lost if plan is not None and plan.role_of(r).kind == "host"]
        if vital:
            raise FaultError(f"fault {f}: node mpt-{f.node} runs the host (rank {vital[0]}), which no "
                             f"run survives losing; aim it at a node of CSD ranks only")
    _check_node_order(faults, plan)


def _check_node_order(faults: Sequence[Fault], plan: LaunchPlan | None) -> None:
    """Refuse a fault whose rank a node fault has ended before it is due, or a node fault
    whose firing rank a kill has ended before (as :func:`check_reachable` does for kills
    of ranks). A node fault ends its node's ranks at its step (a partition: they answer
    nobody from then on); points are ordered as there."""
    assert _hosts is not None

    def rank_of(f: Fault) -> int | None:
        if f.node is not None:
            return firing_rank(f.node, _hosts)
        return target_rank(f, plan) if plan is not None else f.rank

    def at(f: Fault) -> tuple[int, int]:
        return f.step, (f.micro if f.kind in ("kill", "stall") else -1)

    for i, end in enumerate(faults):
        if end.node is not None:
            dead = {r for r, h in enumerate(_hosts) if h == "mpt-" + end.node}
        elif end.kind == "kill":
            dead = {rank_of(end)}
        else:
            continue
        for j, f in enumerate(faults):
            if j == i or (f.node is None and end.node is None) or rank_of(f) not in dead:
                continue  # (a kill and another fault of ranks: check_reachable's)
            if at(f) > at(end) or (at(f) == at(end) and j > i) or \
                    (end.round and f.step >= end.step):
                raise _never(f, f"its rank {rank_of(f)} is ended before, by {end}")


def _node_procs(node: str) -> Path:
    """The ``cgroup.procs`` file of testbed node ``node`` (named in the testbed's state)."""
    from mpipipe.core.mpi.testbed_nodes import node_procs

    return node_procs(node)


# The launchers' processes a node-kill spares: Open MPI's daemon and mpirun (which runs on
# the first node of a Slurm allocation), and Slurm's daemons (slurmd, the job steps'
# slurmstepd, and the srun mpirun starts its daemons with), when Slurm runs on the testbed.
LAUNCHERS = frozenset({"prted", "prterun", "mpirun", "srun", "slurmd", "slurmstepd"})


def _daemons(pids: set[int]) -> set[int]:
    """The launchers' processes among ``pids`` (:data:`LAUNCHERS`) and their ancestors among
    them (the shell the rsh agent started prted with, or the batch script that runs mpirun,
    whose end mpirun or Slurm would read as a failed daemon or a finished job)."""
    parent, spared = {}, set()
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        parent[pid] = int(rest[1])
        if name in LAUNCHERS:
            spared.add(pid)
    for pid in list(spared):
        while parent.get(pid) in pids:
            pid = parent[pid]
            spared.add(pid)
    return spared


def kill_node(node: str) -> None:
    """SIGKILL every process of testbed node ``node`` but the launchers' (Open MPI's daemon,
    and Slurm's when it runs on the testbed: :data:`LAUNCHERS`) and this one (the caller,
    which fires the fault, ends itself afterwards).

    Every process started on a node joined its cgroup (jobs/testbed/rsh-agent), so the
    cgroup lists them all. The daemon (``prted``) is spared: Open MPI 5's runtime cannot
    survive the loss of a daemon ("PRTE has lost communication with a remote daemon ...
    We cannot recover from this failure"), even under ``--with-ft ulfm``, so a node kill
    that took it (or the shell that started it) would end every job, not test ResPipe.
    Slurm's daemons on the node are spared for the same reason: the job's steps (prted's
    among them) run under them.
    Everything else of the node, its ranks above all, dies at once, which is what the
    survivors see of a dead node.
    """
    procs, me = _node_procs(node), os.getpid()
    for _ in range(200):  # until only this process and the daemon are left
        pids = {int(p) for p in procs.read_text().split()} - {me}
        pids -= _daemons(pids)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def set_link(node: str, up: bool) -> None:
    """Take testbed node ``node``'s link (its ``eth0``) down or bring it back up.

    Run with ``ip -n mpt-NODE``, which works from the host and from inside the node alike
    (root: the testbed gives the node's processes its network namespace). With ``eth0``
    down nothing enters or leaves the node; TCP connections are not reset, they wait.
    """
    done = subprocess.run(["ip", "-n", "mpt-" + node, "link", "set", "eth0", "up" if up else "down"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"cannot set the link of node mpt-{node} {'up' if up else 'down'}: "
                           f"{done.stderr.strip()}")


class FaultPlan:
    """The faults aimed at this process, fired by :meth:`at_step` from the training loop.

    Every rank builds the same plan from the same config, so ranks agree on what
    is injected without a message; random delays draw from a generator seeded by
    (seed, target, step), so a replayed step straggles exactly as before. A process
    (``poisson``) is expanded alike on every rank from the launch ``plan`` (its ranks)
    or the hosts (its nodes); its clock runs from :meth:`start` (``clock``: seconds).
    """

    def __init__(
        self,
        faults: Iterable[Fault],
        *,
        seed: int,
        stage: int | None,
        rank: int,
        on_fire: Callable[[Fault, int, Mapping[str, float]], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        kill: Callable[[], None] | None = None,
        dry: bool = False,
        hosts: Sequence[str] | None = None,
        plan: LaunchPlan | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.all = list(faults)
        # hosts: every rank's host (node faults), default the ones recorded at start-up
        self.mine = [f for f in self.all if f.targets(stage=stage, rank=rank, hosts=hosts)]
        self.seed = int(seed)
        self.stage = stage
        self.rank = rank
        self.on_fire = on_fire
        self._sleep = sleep
        self._kill = kill or (lambda: os.kill(os.getpid(), signal.SIGKILL))
        self._fired: set[tuple[int, int]] = set()  # (fault index, step) of one-shot faults
        self._rounds: dict[int, int] = {}  # round fault index -> rounds run from its step
        self.dry = dry  # only on_fire: a plan that logs another rank's faults (Stannis host)
        self.hosts = hosts
        # The processes (poisson), by their index in ``all``, on a clock that starts at
        # start() (or at the first step boundary).
        self.drawn = Clocked({i: _expand(f, plan, hosts) for i, f in enumerate(self.all)
                              if f.how.process}, clock)

    def start(self) -> None:
        """Start the processes' clock: call it when the run starts (after the ranks met),
        so that every rank counts the same seconds."""
        self.drawn.start()

    def drawn_fault(self, index: int, number: int, step: int) -> Fault:
        """The fault that event ``number`` of process ``index`` (in :attr:`all`) fires at
        ``step``: what the log writer names when another rank tells it one fired."""
        return _drawn(self.all[index], self.drawn.processes[index].event(number), step)

    def in_round(self, step: int, at_build: bool = False) -> float:
        """Fire this process's round faults (``round=N``) due by ``step``: called once a
        round's decision is read (which counts the round), and again with ``at_build``
        once the member heard it is to build (``build=1``). Returns the seconds it slept;
        ``kill`` does not return."""
        slept = 0.0
        for i, f in enumerate(self.mine):
            if not f.round or step < f.step or (i, -2) in self._fired:
                continue
            if not at_build:
                self._rounds[i] = self._rounds.get(i, 0) + 1
            if self._rounds.get(i, 0) >= f.round and f.build == at_build:
                slept += self._kill_or_stall(f, step, (i, -2))
                if f.kind == "kill":
                    return slept  # only reached when kill is replaced in tests
        return slept

    def _kill_or_stall(self, f: Fault, step: int, key: tuple[int, int] | None,
                       detail: Mapping[str, float] | None = None) -> float:
        """Fire one kill or stall (once: ``key`` is marked fired); the seconds slept."""
        if key is not None:
            self._fired.add(key)
        if self.on_fire:
            self.on_fire(f, step, detail or {"seconds": f.seconds})
        if f.kind == "kill":
            self._kill()
            return 0.0  # only reached when kill is replaced in tests
        self._sleep(f.seconds)
        return f.seconds

    def unfired_round_faults(self) -> list[Fault]:
        """This process's round faults that no round fired (said at the end of a run)."""
        return [f for i, f in enumerate(self.mine) if f.round and (i, -2) not in self._fired]

    def slowdown(self, step: int) -> float:
        """The compute slow-down factor in force at ``step`` (1.0 when none)."""
        factor = 1.0
        for f in self.mine:
            if f.kind == "slow" and step >= f.step:
                factor = max(factor, f.factor)
        return factor

    def at_step(self, step: int, micro: int = -1, *, by_rank: bool = False) -> float:
        """Fire this process's faults due at ``step``; returns the seconds it slept.

        Called at the start of a step (``micro`` -1) and after the forward of each
        micro-batch (for kills and stalls placed inside a step). ``kill`` does not
        return. Every fault fires at most once per step, even if the step is replayed
        after a takeover. ``by_rank``: only the faults aimed at this rank by number (a
        backup's: a rank that played a stage and came back as a backup is no longer
        the target of ``stage=K``).
        """
        slept = 0.0
        for i, f in enumerate(self.mine):
            if by_rank and f.rank is None:
                continue
            if f.node is not None and f.step == step and micro < 0 and (i, step) not in self._fired:
                self._fired.add((i, step))
                if self.on_fire:
                    self.on_fire(f, step, {"seconds": f.seconds})
                if self.dry:
                    continue
                return slept + self._end_node(f)  # only returns when kill is replaced in tests
            elif f.kind in ("kill", "stall") and f.step == step and f.micro == micro \
                    and not f.round and (i, step) not in self._fired:
                slept += self._kill_or_stall(f, step, (i, step))
                if f.kind == "kill":
                    return slept  # only reached when kill is replaced in tests
            elif f.kind == "delay" and micro < 0 and step >= f.step \
                    and (i, step) not in self._fired:
                # Once per step: a replayed step does not straggle again (else a delay
                # shorter than detection plus agreement would replay forever).
                self._fired.add((i, step))
                target = f.stage if f.stage is not None else 10_000 + (f.rank or 0)
                rng = np.random.default_rng([self.seed, i, target, step])
                if rng.random() < f.p:
                    if self.on_fire:
                        self.on_fire(f, step, {"seconds": f.seconds})
                    self._sleep(f.seconds)
                    slept += f.seconds
        if micro < 0 and self.drawn.processes:
            slept += self._fire_drawn(step)
        return slept

    def _end_node(self, f: Fault) -> float:
        """A node-kill or partition of ``f.node``, fired here; ends this process (returns
        the seconds slept only when kill is replaced in tests)."""
        assert f.node is not None
        slept = 0.0
        if f.kind == "partition":
            set_link(f.node, up=False)
            self._sleep(f.seconds)  # alive but unreachable, as a stalled rank
            slept = f.seconds
        kill_node(f.node)  # the node's other processes; then this one
        if f.kind == "partition":
            set_link(f.node, up=True)  # for the next job: the node is empty now
        self._kill()
        return slept

    def _fire_drawn(self, step: int) -> float:
        """Fire the earliest event of a process that is due and aimed here (at most one
        per boundary: two events that fell due while this rank was away come one step
        apart); returns the seconds slept. Events aimed at other ranks are passed over."""
        due = self.drawn.due(self._aimed_here)
        if due is None:
            return 0.0
        i, event = due
        f = _drawn(self.all[i], event, step)
        detail = {"seconds": f.seconds, "process": i, "event": event.number}
        if f.node is None:
            return self._kill_or_stall(f, step, None, detail)
        if self.on_fire:
            self.on_fire(f, step, detail)
        return 0.0 if self.dry else self._end_node(f)

    def _aimed_here(self, event: Event) -> bool:
        if isinstance(event.victim, str):
            return firing_rank(event.victim, self.hosts) == self.rank
        return event.victim == self.rank


def preview(f: Fault, plan: LaunchPlan, n: int = 5) -> str:
    """A fault as a dry run shows it (``python -m mpipipe plan``): a process with its first
    ``n`` events and whom it draws from (nodes are known only once the ranks run)."""
    if not f.how.process:
        return str(f)
    every = format_rate(f.rate).removeprefix("1/")
    what = f"stall of {f.seconds:g} s" if f.seconds else "kill"
    if f.what == "node":
        what = f"partition of {f.seconds:g} s" if f.seconds else "node-kill"
        return (f"{f}: a {what} about every {every}, of a testbed node drawn once the ranks run "
                "(never the host's)")
    events = _expand(f, plan, None).first(n)
    first = ", ".join(f"rank {e.victim} at {_clock_text(e.at_s)}" for e in events)
    victims = ", ".join(map(str, rank_victims(plan)))
    return f"{f}: a {what} about every {every}, drawn among ranks {victims}; the first: {first}"


def _clock_text(seconds: float) -> str:
    """Seconds since the run's start as a person reads them: 41.3 s, 12m05s, 2h03m."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def _expand(f: Fault, plan: LaunchPlan | None, hosts: Sequence[str] | None) -> Process:
    """A poisson fault's events, drawn among what it may take: the plan's ranks, or the
    testbed nodes the ranks run on (``hosts``, default the ones recorded at start-up)."""
    if f.what == "node":
        return Process(f.rate, f.seed, node_victims(hosts if hosts is not None else _hosts or (), plan),
                       ends_victim=True)  # a partitioned node ends as a killed one
    if plan is None:
        raise ValueError(f"fault {f}: a process of rank faults needs the launch plan to draw from")
    return Process(f.rate, f.seed, rank_victims(plan), ends_victim=not f.seconds)


def _drawn(p: Fault, event: Event, step: int) -> Fault:
    """The concrete fault a process's event fires at ``step`` (a fault of the chaos
    command's kinds), named after the event."""
    origin = f"poisson #{event.number} at {event.at_s:.1f} s"
    if p.what == "node":
        return Fault("partition" if p.seconds else "node-kill", node=str(event.victim), step=step,
                     seconds=p.seconds, origin=origin)
    return Fault("stall" if p.seconds else "kill", rank=int(event.victim), step=step,
                 seconds=p.seconds, origin=origin)
