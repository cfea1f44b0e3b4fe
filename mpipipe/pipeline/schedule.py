"""Micro-batch schedules as data: the ordered forward/backward actions one rank runs in a step.

A schedule is a function of (rank, K ranks, v virtual stages per rank, m micro-batches)
that returns that rank's :class:`Action` list. Every schedule the project knows is in
:data:`REGISTRY`, with a one-line description; the configuration's choices for
``pipeline.schedule`` and every error naming the schedules are read from it, so adding
a schedule is one builder and one registry entry (docs/pipeline.md says how).

Model chunks ("virtual stages") are numbered 0 .. v*K - 1 in model order; rank k holds
chunks k, k + K, k + 2K, ... An :class:`Action` names the chunk it runs, so a schedule
with one chunk per rank (v = 1) and one with several use the same executor.

This module imports neither torch nor MPI: the configuration check reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

__all__ = ["Op", "Action", "Schedule", "REGISTRY", "SCHEDULES", "gpipe", "onef1b",
           "interleaved_1f1b", "actions", "get", "virtual_stages", "check_virtual", "makespan"]


class Op(IntEnum):
    """What an action does with one micro-batch on one chunk."""

    FORWARD = 0
    BACKWARD = 1


@dataclass(frozen=True, slots=True)
class Action:
    """Run `op` for micro-batch `micro` on model chunk (virtual stage) `stage`."""

    op: Op
    micro: int
    stage: int

    def __str__(self) -> str:
        return f"{'F' if self.op == Op.FORWARD else 'B'}{self.micro}@{self.stage}"


Builder = Callable[[int, int, int, int], list[Action]]  # (rank, k, v, m) -> actions


@dataclass(frozen=True)
class Schedule:
    """A registered schedule: its builder and what it is for.

    `virtual` is False for schedules that run one chunk per rank (v must be 1), True for
    schedules that need v >= 2 chunks per rank (a balance of v x K entries; ResPipe's hot
    and neighbour modes, which work on one chunk per rank, refuse them).
    """

    name: str
    build: Builder
    description: str
    virtual: bool = False


def _check(rank: int, k: int, v: int, m: int) -> None:
    if k < 1:
        raise ValueError(f"need at least one rank, got K = {k}")
    if not 0 <= rank < k:
        raise ValueError(f"rank {rank} is not in 0..{k - 1}")
    if v < 1:
        raise ValueError(f"need at least one chunk per rank, got v = {v}")
    if m < 1:
        raise ValueError(f"need at least one micro-batch, got {m}")


def gpipe(rank: int, k: int, v: int, m: int) -> list[Action]:
    """Fill-drain (GPipe): all m forwards, then all m backwards.

    Every stage keeps the activations of all m micro-batches until the drain.
    """
    _check(rank, k, v, m)
    return ([Action(Op.FORWARD, i, rank) for i in range(m)]
            + [Action(Op.BACKWARD, i, rank) for i in range(m)])


def onef1b(rank: int, k: int, v: int, m: int) -> list[Action]:
    """One-forward-one-backward (PipeDream-flush): same maths as GPipe, less memory.

    Stage s first runs min(k - s - 1, m) warm-up forwards, then alternates one forward
    and one backward, then drains the remaining backwards; at most k - s micro-batches
    are in flight on stage s instead of m.
    """
    _check(rank, k, v, m)
    warm = min(k - rank - 1, m)
    out = [Action(Op.FORWARD, i, rank) for i in range(warm)]
    for i in range(m - warm):
        out += [Action(Op.FORWARD, warm + i, rank), Action(Op.BACKWARD, i, rank)]
    out += [Action(Op.BACKWARD, i, rank) for i in range(m - warm, m)]
    return out


def interleaved_1f1b(rank: int, k: int, v: int, m: int) -> list[Action]:
    """Interleaved 1F1B (Narayanan et al. 2021, as Megatron-LM and torch's
    ScheduleInterleaved1F1B order it): each rank holds v chunks and runs micro-batches
    in rounds of K, chunk after chunk, so the bubble shrinks from (K-1)/(m+K-1) of a step
    towards (K-1)/(v*m+K-1).

    Forwards go round by round: K micro-batches through the rank's first chunk, the same
    K through its second, ..., then the next K. Backwards go the same way from the last
    chunk. Rank r warms up with (v - 1) * K + 2 * (K - 1 - r) forwards (at most v*m),
    then alternates one forward and one backward, then drains. m must be a multiple of K.
    """
    _check(rank, k, v, m)
    if m % k:
        raise ValueError(f"interleaved-1f1b needs a number of micro-batches that is a "
                         f"multiple of the {k} ranks, got {m}")
    total = v * m
    warm = min((v - 1) * k + 2 * (k - 1 - rank), total)

    def forward(n: int) -> Action:
        group = n // k
        return Action(Op.FORWARD, (group // v) * k + n % k, (group % v) * k + rank)

    def backward(n: int) -> Action:
        group = n // k
        return Action(Op.BACKWARD, (group // v) * k + n % k, (v - 1 - group % v) * k + rank)

    out = [forward(n) for n in range(warm)]
    for n in range(total - warm):
        out += [forward(warm + n), backward(n)]
    out += [backward(n) for n in range(total - warm, total)]
    return out


REGISTRY: dict[str, Schedule] = {s.name: s for s in (
    Schedule("gpipe", gpipe, "fill-drain: all forwards, then all backwards; holds m "
             "micro-batches' activations"),
    Schedule("1f1b", onef1b, "one forward, one backward after a warm-up; same maths as "
             "gpipe, at most K in flight"),
    Schedule("interleaved-1f1b", interleaved_1f1b, "1F1B over v chunks per rank (balance "
             "of v x K entries, chunks a multiple of K): a smaller bubble, v times the "
             "messages", virtual=True),
)}

SCHEDULES: tuple[str, ...] = tuple(REGISTRY)  # the choices of pipeline.schedule


def get(name: str) -> Schedule:
    """The registered schedule `name`.

    Raises:
        ValueError: no schedule of that name (the message lists the known ones).
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; choose one of "
                         f"{', '.join(SCHEDULES)}") from None


def actions(name: str, rank: int, k: int, m: int, v: int = 1) -> list[Action]:
    """The action list of schedule `name` for `rank` of `k` ranks with `v` chunks each."""
    return get(name).build(rank, k, v, m)


def virtual_stages(name: str, chunks: int, k: int) -> int:
    """v, the chunks per rank, for a balance of `chunks` entries over `k` ranks.

    Raises:
        ValueError: the entries do not divide over the ranks as the schedule needs (one
            chunk per rank; or a multiple of K, at least 2K, for interleaved schedules).
    """
    schedule = get(name)
    if not schedule.virtual:
        if chunks != k:
            raise ValueError(f"schedule {name!r} runs one chunk per rank: the balance needs "
                             f"{k} entries (one per stage), got {chunks}")
        return 1
    if chunks % k or chunks // k < 2:
        raise ValueError(f"schedule {name!r} needs v >= 2 chunks per rank: a balance of "
                         f"v x {k} entries (e.g. {2 * k}), got {chunks}")
    return chunks // k


def check_virtual(name: str, k: int, v: int, m: int) -> None:
    """Every check of (schedule, K, v, m) that needs no model: raises ValueError."""
    virtual_stages(name, v * k, k)
    actions(name, 0, k, m, v)


def makespan(name: str, k: int, v: int, m: int, forward: list[float],
             backward: list[float]) -> float:
    """The time one step of schedule `name` takes if chunk c's forward of one micro-batch
    takes forward[c] and its backward backward[c], and messages take no time.

    Why: with several chunks per rank the best cut is not the one with the smallest
    largest chunk (what each rank does in total matters, and the warm-up order), so the
    balancer compares cuts by the step they make. Sends never wait; an action starts
    when its rank is free and its input (or output gradient) is there; a backward
    also needs its own forward done.

    Raises:
        ValueError: the schedule's action lists deadlock, or a backward comes before
            its forward (a bug in a builder).
    """
    lists = [actions(name, r, k, m, v) for r in range(k)]
    last = v * k - 1
    pos, free = [0] * k, [0.0] * k
    done: dict[tuple[int, int, int], float] = {}
    moved = True
    while moved:
        moved = False
        for r in range(k):
            while pos[r] < len(lists[r]):
                a = lists[r][pos[r]]
                if a.op == Op.FORWARD:
                    need = None if a.stage == 0 else (0, a.stage - 1, a.micro)
                    cost = forward[a.stage]
                else:
                    if (0, a.stage, a.micro) not in done:
                        raise ValueError(f"schedule {name!r}: rank {r} runs {a} before its "
                                         f"forward")
                    need = None if a.stage == last else (1, a.stage + 1, a.micro)
                    cost = backward[a.stage]
                if need is not None and need not in done:
                    break
                start = max(free[r], done[need] if need is not None else 0.0)
                free[r] = done[(int(a.op), a.stage, a.micro)] = start + cost
                pos[r] += 1
                moved = True
    if pos != [len(x) for x in lists]:
        raise ValueError(f"schedule {name!r} deadlocks with K = {k}, v = {v}, m = {m}")
    return max(free)
