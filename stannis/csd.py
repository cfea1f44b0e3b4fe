"""The emulated computational storage device: a speed profile and a power profile.

There is no CSD on these machines. A CSD rank is an ordinary process whose
each step's compute time is stretched by a slow-down factor: its step lasts
``factor`` times the CPU time its forward and backward passes take (it sleeps
for the rest, so it yields its core instead of stealing it from the host). CPU
time, not wall time, is the base because on a machine with fewer cores than
ranks the wall time also counts the time a rank waited for a core, which a
real device with its own cores would not. The CPU time is the fastest per
sample of the rank's recent steps at a similar batch size, not each step's
own: emulated CSDs sharing one core evict each other's caches, and the factor
would multiply that artefact of the emulation (a real drive computes on its
own cores) eightfold.
The rank runs with a given number of torch threads, is bound to its own cores
when all ranks share one machine (`cpu_binding`), and is charged energy by a
power model (idle and active watts). Emulated CSDs bound to the same core take
turns to compute (`CoreTurns`): when they all start a step at once, the kernel
would slice the core between them every few milliseconds and each one's CPU
time would grow by a third from evicted caches, an artefact a drive with its
own cores does not have; taking turns costs nothing, as each sleeps most of its
stretched step anyway. On real CSDs the factor is 1 and nothing is stretched.
A ``slow`` fault multiplies the factor from a given step on, to emulate other
work on the drive.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections import deque
from collections.abc import Sequence
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

    #: How many recent steps the CPU-time base is the fastest of.
    MEMORY = 8
    #: Steps whose batch size is within this share of the current one count as similar.
    NEAR = 0.25

    def __init__(self, factor: float = 1.0, sleep=time.sleep) -> None:
        if factor < 1.0:
            raise ValueError(f"slow-down factor must be >= 1, got {factor}")
        self.base = factor
        self.extra = 1.0
        self._sleep = sleep
        self._recent: deque[tuple[int, float]] = deque(maxlen=self.MEMORY)

    @property
    def factor(self) -> float:
        """The slow-down in force: the profile's factor times any injected one."""
        return self.base * self.extra

    def slow_by(self, factor: float) -> None:
        """Multiply the factor from now on (a ``slow`` fault)."""
        if factor <= 0:
            raise ValueError(f"slow factor must be > 0, got {factor}")
        self.extra *= factor

    def apply(self, cpu_s: float, wall_s: float | None = None, batch: int = 0) -> float:
        """Stretch a step whose compute took ``cpu_s`` of CPU and ``wall_s`` so far.

        Sleeps until ``factor`` times the CPU-time base has passed (nothing if the
        step already took that long) and returns the compute's wall time after
        stretching. The base is the least CPU time per sample of the last
        `MEMORY` steps whose batch was within `NEAR` of this ``batch`` (this one
        included), times ``batch``: when the tuner moves a few samples, the base
        carries over instead of starting again from one noisy step. (Scaling also
        scales the per-step overhead: after a batch shrinks by up to `NEAR`, the
        base is low by at most that share of the overhead, a few percent here.)
        The returned time is what the tuner balances: on a shared machine a rank
        that waits for a core is slower, and the step waits for it all the same.
        """
        cpu_s = max(cpu_s, 0.0)
        if batch > 0:  # an empty step says nothing about the cost of samples
            self._recent.append((batch, cpu_s))
        similar = [c * batch / b for b, c in self._recent
                   if b > 0 and abs(b - batch) <= self.NEAR * batch]
        target = self.factor * min(similar, default=cpu_s)
        wall = cpu_s if wall_s is None else wall_s
        if target > wall:
            self._sleep(target - wall)
        return max(target, wall)


def cpu_binding(index: int, duties: Sequence[float], cpus: Sequence[int]) -> list[int]:
    """The CPUs rank ``index`` (0 = host, k = CSD k) is bound to when all share one machine.

    A real CSD computes on the drive's own cores and never slows the host; on
    one machine the emulated CSDs get the last cores, one each while there are
    enough, shared round-robin otherwise, and the host keeps the rest (at least
    one). ``duties`` are the CSDs' busy fractions (threads / slow-down factor):
    when they do not fit on the CSDs' cores, binding would make them slower
    than emulated, so nobody is bound (every rank gets all ``cpus``).
    """
    cpus = sorted(cpus)
    k = min(len(duties), len(cpus) - 1)
    if k < 1 or sum(duties) > k:
        return cpus
    host, devices = cpus[:len(cpus) - k], cpus[len(cpus) - k:]
    return host if index == 0 else [devices[(index - 1) % k]]


class CoreTurns:
    """A lock that emulated CSDs sharing one core hold while they compute.

    An ``flock`` on a file every member opens before any of them unlinks it
    (``release_name``), so no file outlives the job and the kernel frees the
    lock of a member that dies holding it. A rank without a shared core gets a
    no-op (``CoreTurns(None)``).
    """

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600) if path else None

    @staticmethod
    def name(job: str, cpus: Sequence[int]) -> str:
        """The lock file of one core set in one job (``job`` is unique per run)."""
        return os.path.join(tempfile.gettempdir(),
                            f"stannis-{job}-cpu{'-'.join(map(str, sorted(cpus)))}.lock")

    def release_name(self) -> None:
        """Unlink the file once every member has it open (the lock lives on)."""
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> CoreTurns:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
