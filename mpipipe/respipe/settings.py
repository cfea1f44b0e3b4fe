"""The ``[resilience]`` section of a run's configuration, read and checked once.

Why its own module: the trainer, the pure decision (mpipipe.respipe.decide) and the
command all read it; none of them should need the others for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mpipipe.core.mpi.faults import Fault


@dataclass(frozen=True)
class Settings:
    """The ``[resilience]`` knobs, checked."""

    backups: Mapping[int, int]
    replicate_every: int = 1
    mode: str = "cold"
    deadline_s: float = 30.0
    deadline_factor: float = 0.0
    faults: tuple[Fault, ...] = ()

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], stages: int, chunks: int = 1) -> Settings:
        """Read and check ``cfg["resilience"]``.

        Raises:
            ValueError: R < 1, a deadline <= 0, or a bad fault spec (names the key).
        """
        from mpipipe.core.mpi.faults import parse_all
        from mpipipe.pipeline.plan import backup_counts
        from mpipipe.pipeline.schedule import get as get_schedule

        sec = cfg["resilience"]
        r = int(sec["replicate_every"])
        if r < 1:
            raise ValueError(f"resilience.replicate_every = {r}: must be >= 1")
        if float(sec["deadline_s"]) <= 0:
            raise ValueError(f"resilience.deadline_s = {sec['deadline_s']}: must be > 0")
        if float(sec["deadline_factor"]) < 0:
            raise ValueError("resilience.deadline_factor must be >= 0 (0: fixed deadline only)")
        if sec["mode"] == "neighbour" and backup_counts(sec.get("backups", {}), stages):
            raise ValueError("resilience.mode = \"neighbour\" needs no backup ranks (each "
                             "stage's neighbour holds its replica): set resilience.backups = {}")
        sched = cfg.get("pipeline", {}).get("schedule")
        if sec["mode"] != "cold" and sched is not None and get_schedule(sched).virtual:
            raise ValueError(f'resilience.mode = "{sec["mode"]}" runs one chunk per rank: '
                             f'schedule "{sched}" needs resilience.mode = "cold"')
        # Whether each fault can fire was checked at start-up (cli.check_faults).
        faults = tuple(parse_all(sec.get("inject", [])))
        return cls(backup_counts(sec.get("backups", {}), stages), r, sec["mode"],
                   float(sec["deadline_s"]), float(sec["deadline_factor"]), faults)
