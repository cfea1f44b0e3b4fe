"""The faults a Stannis run injects (``stannis.inject``): this rank's, and on the host
every rank's as well, run dry, so that the host logs each one when it fires."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mpipipe.core.logs.logschema import EventKind
from mpipipe.core.mpi.faults import FaultPlan, parse_all

if TYPE_CHECKING:
    from mpipipe.core.mpi.roles import LaunchPlan


class Injection:
    """This rank's fault plan (``plan``) and the host's dry copies of every rank's."""

    def __init__(self, specs: list[str], seed: int, world_rank: int, size: int, is_host: bool,
                 log: Any, launch: LaunchPlan | None = None) -> None:
        # launch: the launch plan, whose ranks a poisson process draws from
        self.plan = FaultPlan(parse_all(specs), seed=seed, stage=None, rank=world_rank, plan=launch)
        self.is_host = is_host
        self.log = log
        # The host logs every rank's faults from the same plans, run dry.
        self.shadows: dict[int, FaultPlan] = {}
        if is_host:
            for r in range(size):
                self.shadows[r] = FaultPlan(
                    self.plan.all, seed=seed, stage=None, rank=r, sleep=lambda s: None,
                    kill=lambda: None, on_fire=self._logger(r), dry=True, plan=launch)

    def start(self) -> None:
        """Start the poisson processes' clock (this rank's, and the host's copies): when
        training starts, right after a phase every rank took part in. The host logs an
        event when its own clock passes it, the victim fires it on its own: both at
        their step boundary, which may differ by one step when the event falls in the
        few milliseconds between them (docs/stannis.md)."""
        for plan in (self.plan, *self.shadows.values()):
            plan.start()

    def _logger(self, rank: int) -> Callable[[Any, int, dict], None]:
        def log(fault: Any, step: int, detail: dict) -> None:
            self.log.event(EventKind.FAULT_INJECTED, step=step + 1, rank=rank, fault=str(fault),
                           **detail)
        return log

    def announce(self, index: int, members: list[int]) -> None:
        """Host: log the faults that fire on the members at step ``index`` (0-based)."""
        if not self.is_host:
            return
        for shadow in self.shadows.values():
            if shadow.rank in members:
                shadow.at_step(index)
        for f in self.plan.all:
            if f.kind == "slow" and f.step == index and f.rank in members:
                self.log.event(EventKind.FAULT_INJECTED, step=index + 1, rank=f.rank,
                               fault=str(f), factor=f.factor)

    def fire(self, index: int) -> float:
        """This rank's faults of step ``index``; returns its emulated slow-down then."""
        self.plan.at_step(index)
        return self.plan.slowdown(index)
