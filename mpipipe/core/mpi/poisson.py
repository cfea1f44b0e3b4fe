"""Failures as a process: the seeded sequence of (time, victim) events of a ``poisson`` fault.

Why a sequence every rank expands alike, and not a draw at run time: ranks agree on
which rank fails when without a message (as on every other fault), the log writer can
name a fault another rank fired from two numbers, and a run is repeatable from its
spec. The gaps between events are exponential with mean ``1 / rate`` (a Poisson process
in wall time since the run's start); each event's victim is drawn uniformly among the
victims still standing. The spec, its firing and its checks are in
:mod:`mpipipe.core.mpi.faults` (``poisson:rate=...:seed=...``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mpipipe.core.mpi.roles import LaunchPlan

__all__ = ["Event", "Process", "Clocked", "rank_victims", "node_victims"]

# Mixed into the generator's seed so that a process seeded S draws apart from the other
# generators a run seeds with the same number (delays, shuffles).
_STREAM = 0x9E1550


@dataclass(frozen=True)
class Event:
    """One event of a process: the ``number``-th (from 1), due ``at_s`` seconds after the
    run's start, aimed at ``victim`` (a world rank, or a testbed node's bare name)."""

    number: int
    at_s: float
    victim: int | str


class Process:
    """The events of one process, drawn lazily and kept (the writer names old ones).

    ``ends_victim``: an event takes its victim for good (a kill, a node-kill, a partition),
    so later events draw among the others only, and the process ends when none is left;
    otherwise (a stall) the victim comes back and may be drawn again.
    """

    def __init__(self, rate: float, seed: int, victims: Sequence[int | str], *,
                 ends_victim: bool) -> None:
        if rate <= 0:
            raise ValueError(f"a Poisson process needs a positive rate, not {rate!r}")
        self.rate = float(rate)
        self.victims = tuple(victims)
        self.events: list[Event] = []
        self._draws = self._draw(int(seed), ends_victim)
        self._over = False

    def _draw(self, seed: int, ends_victim: bool) -> Iterator[Event]:
        rng = np.random.default_rng([_STREAM, seed])
        standing, t, number = list(self.victims), 0.0, 0
        while standing:
            t += float(rng.exponential(1.0 / self.rate))
            number += 1
            victim = standing[int(rng.integers(len(standing)))]
            if ends_victim:
                standing.remove(victim)
            yield Event(number, t, victim)

    def _more(self) -> bool:
        """Draw one more event; False once the process is over (no victim left)."""
        if self._over:
            return False
        event = next(self._draws, None)
        if event is None:
            self._over = True
            return False
        self.events.append(event)
        return True

    def draw_until(self, t: float) -> None:
        """Draw events until one falls after ``t`` seconds (or the process is over)."""
        while (not self.events or self.events[-1].at_s <= t) and self._more():
            pass

    def until(self, t: float) -> list[Event]:
        """Every event due at or before ``t`` seconds."""
        self.draw_until(t)
        return [e for e in self.events if e.at_s <= t]

    def first(self, n: int) -> list[Event]:
        """The first ``n`` events (fewer if the process ends before)."""
        while len(self.events) < n and self._more():
            pass
        return self.events[:n]

    def event(self, number: int) -> Event:
        """The ``number``-th event (from 1).

        Raises:
            IndexError: the process ends before it.
        """
        if number < 1 or not self.first(number)[number - 1:]:
            raise IndexError(f"the process has no event #{number}")
        return self.events[number - 1]


class Clocked:
    """One rank's processes on its clock: which of their events are due there.

    ``processes``: by the index of their fault in the plan's list. Each keeps the first
    event this rank has not yet passed, so a boundary costs a clock read and the events
    due since the last one.
    """

    def __init__(self, processes: Mapping[int, Process], clock: Callable[[], float]) -> None:
        self.processes = dict(processes)
        self._next = dict.fromkeys(self.processes, 0)
        self._clock = clock
        self._t0: float | None = None

    def start(self) -> None:
        """Start the clock (the run's start)."""
        self._t0 = self._clock()

    def elapsed(self) -> float:
        """Seconds since :meth:`start` (started now if it was not called)."""
        if self._t0 is None:
            self.start()
        return self._clock() - self._t0  # type: ignore[operator]

    def due(self, aimed_here: Callable[[Event], bool]) -> tuple[int, Event] | None:
        """The earliest due event that ``aimed_here`` accepts, as (process index, event),
        passed for good with every other rank's event before it; None when none is due."""
        now = self.elapsed()
        for i, proc in self.processes.items():
            proc.draw_until(now)
            k, events = self._next[i], proc.events
            while k < len(events) and events[k].at_s <= now:
                event, k = events[k], k + 1
                if aimed_here(event):
                    self._next[i] = k
                    return i, event
            self._next[i] = k
        return None


def rank_victims(plan: LaunchPlan) -> list[int]:
    """The ranks an event may take: every rank but spares (which idle outside the job) and
    a Stannis ``host`` (which no run survives losing: ``kill:rank=0`` of a Stannis job
    ends it)."""
    return [r for r, role in enumerate(plan.roles) if not role.spec.idle and role.kind != "host"]


def node_victims(hosts: Sequence[str], plan: LaunchPlan | None) -> list[str]:
    """The testbed nodes (bare names, sorted) an event may take: every node a rank of the
    job runs on (``hosts``: every rank's host, spares blanked as :func:`faults.check_nodes`
    records them) but a node that runs a Stannis ``host``."""
    vital = {hosts[r] for r in range(len(hosts))
             if plan is not None and r < plan.world_size and plan.role_of(r).kind == "host"}
    return sorted({h[len("mpt-"):] for h in hosts if h.startswith("mpt-") and h not in vital})
