"""The emulated computational storage device: a speed profile and a power profile.

There is no CSD on these machines. A CSD rank is an ordinary process whose
each step's compute time is stretched by a slow-down factor: its step lasts
``factor`` times the CPU time its forward and backward passes took (it sleeps
for the rest, so it yields its core instead of stealing it from the host). CPU
time, not wall time, is the base because on a machine with fewer cores than
ranks the wall time also counts the time a rank waited for a core, which a
real device with its own cores would not; runs
with a given number of torch threads, and is charged energy by a power model
(idle and active watts). On real CSDs the factor is 1 and nothing is stretched.
A ``slow`` fault multiplies the factor from a given step on, to emulate other
work on the drive.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from .energy import PowerModel


@dataclass(frozen=True)
class CsdProfile:
    """How one rank is emulated: slow-down factor, threads, power draw."""

    slowdown: float = 1.0
    threads: int = 1
    idle_w: float = 5.0
    active_w: float = 10.0
    emulated: bool = True

    def __post_init__(self) -> None:
        if self.slowdown < 1.0:
            raise ValueError(f"CSD slowdown must be >= 1 (1 = no emulation), got {self.slowdown}")
        if self.threads < 1:
            raise ValueError(f"CSD threads must be >= 1, got {self.threads}")

    @property
    def power(self) -> PowerModel:
        return PowerModel(self.idle_w, self.active_w)

    def describe(self) -> dict[str, Any]:
        """What the HDF5 log's ``emulation`` attribute records for this rank."""
        return asdict(self)


class Stretch:
    """Applies a rank's slow-down factor to each step's measured compute time."""

    def __init__(self, factor: float = 1.0, sleep=time.sleep) -> None:
        if factor < 1.0:
            raise ValueError(f"slow-down factor must be >= 1, got {factor}")
        self.base = factor
        self.extra = 1.0
        self._sleep = sleep

    @property
    def factor(self) -> float:
        """The slow-down in force: the profile's factor times any injected one."""
        return self.base * self.extra

    def slow_by(self, factor: float) -> None:
        """Multiply the factor from now on (a ``slow`` fault)."""
        if factor <= 0:
            raise ValueError(f"slow factor must be > 0, got {factor}")
        self.extra *= factor

    def apply(self, cpu_s: float, wall_s: float | None = None) -> float:
        """Stretch a step whose compute took ``cpu_s`` of CPU and ``wall_s`` so far.

        Sleeps until ``factor * cpu_s`` of wall time has passed (nothing if the
        step already took that long) and returns the compute's wall time after
        stretching. That is what the tuner balances: on a shared machine a rank
        that waits for a core is slower, and the step waits for it all the same.
        """
        target = self.factor * max(cpu_s, 0.0)
        wall = cpu_s if wall_s is None else wall_s
        if target > wall:
            self._sleep(target - wall)
        return max(target, wall)
