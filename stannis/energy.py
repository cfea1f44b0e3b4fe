"""Per-rank energy per step: Linux RAPL counters where readable, else a power model.

RAPL (``/sys/class/powercap/intel-rapl:N/energy_uj``) is readable by root only
since Linux 5.10, counts the whole CPU package (every process on it, not this
rank alone), wraps around at ``max_energy_range_uj``, and is absent in most VMs
and on ARM. Where it cannot be read, each rank's energy comes from its power
profile: idle watts for the whole step plus (active - idle) watts while it
computes. Every meter says which of the two it is (``source``), and the log
records that per rank, so measured and modelled joules are never mixed silently.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

POWERCAP = Path("/sys/class/powercap")
SOURCES = ("auto", "rapl", "model")


class EnergyError(ValueError):
    """An energy source was asked for that this machine cannot provide."""


@dataclass(frozen=True)
class PowerModel:
    """Idle and active watts of one device class (a host CPU, one CSD)."""

    idle_w: float
    active_w: float

    def __post_init__(self) -> None:
        if self.idle_w < 0 or self.active_w < self.idle_w:
            raise EnergyError(f"power model needs 0 <= idle_w <= active_w, got idle_w={self.idle_w}"
                              f" active_w={self.active_w}")

    def joules(self, wall_s: float, busy_s: float) -> float:
        """Energy of ``wall_s`` seconds of which ``busy_s`` were spent computing."""
        busy = min(max(busy_s, 0.0), max(wall_s, 0.0))
        return self.idle_w * max(wall_s, 0.0) + (self.active_w - self.idle_w) * busy


class Rapl:
    """The package-level RAPL energy counters of this machine (whole packages, not this rank)."""

    def __init__(self, domains: list[Path]) -> None:
        self.domains = domains
        self.ranges = [int((d / "max_energy_range_uj").read_text()) for d in domains]

    @classmethod
    def open(cls, root: Path = POWERCAP) -> Rapl | None:
        """The readable package domains under ``root``, or None if there are none."""
        try:
            candidates = sorted(p for p in root.glob("intel-rapl:*") if p.name.count(":") == 1)
        except OSError:
            return None
        domains = []
        for d in candidates:
            try:
                int((d / "energy_uj").read_text())
                int((d / "max_energy_range_uj").read_text())
            except (OSError, ValueError):
                continue
            domains.append(d)
        return cls(domains) if domains else None

    def read_uj(self) -> list[int]:
        """Current counter of every domain, in microjoules."""
        return [int((d / "energy_uj").read_text()) for d in self.domains]

    def joules_between(self, before: list[int], after: list[int]) -> float:
        """Joules between two readings, allowing each counter to wrap once."""
        total = 0
        for b, a, r in zip(before, after, self.ranges, strict=True):
            total += a - b if a >= b else a + (r - b)
        return total / 1e6


class EnergyMeter:
    """Joules of one rank per step, from RAPL or from its power model (``source`` says which)."""

    def __init__(self, model: PowerModel, rapl: Rapl | None = None) -> None:
        self.model = model
        self.rapl = rapl
        self._t = time.perf_counter()
        self._uj = rapl.read_uj() if rapl else None

    @property
    def source(self) -> str:
        return "rapl" if self.rapl else "model"

    def start(self) -> None:
        """Mark the start of a step."""
        self._t = time.perf_counter()
        if self.rapl:
            self._uj = self.rapl.read_uj()

    def stop(self, busy_s: float) -> float:
        """Joules since :meth:`start`; ``busy_s`` is this rank's compute time (model only)."""
        now = time.perf_counter()
        wall = now - self._t
        if self.rapl and self._uj is not None:
            after = self.rapl.read_uj()
            joules = self.rapl.joules_between(self._uj, after)
            self._uj = after
        else:
            joules = self.model.joules(wall, busy_s)
        self._t = now
        return joules


def make_meter(model: PowerModel, source: str = "auto", *, emulated: bool = False,
               root: Path = POWERCAP) -> EnergyMeter:
    """The meter for one rank.

    ``auto`` reads RAPL when it is readable and the rank runs on its own
    hardware; an emulated CSD always uses its power model, because RAPL would
    measure the host's package, not the device it stands for.

    Raises:
        EnergyError: ``source`` is unknown, or ``rapl`` was required but no
            counter under ``root`` can be read (not root, a VM, or ARM).
    """
    if source not in SOURCES:
        raise EnergyError(f"energy source {source!r}: choose one of {', '.join(SOURCES)}")
    if source == "model" or (source == "auto" and emulated):
        return EnergyMeter(model)
    rapl = Rapl.open(root)
    if rapl is None and source == "rapl":
        raise EnergyError(f"energy source 'rapl' needs readable {root}/intel-rapl:*/energy_uj "
                          "(root on Linux >= 5.10, bare metal x86); use 'auto' or 'model'")
    return EnergyMeter(model, rapl)
