"""Learning-rate schedules: the rate of every optimizer step as a function of its index.

Why a pure function of the step index: a step that is replayed after a takeover,
a backup that mirrors its stage and a run resumed from a checkpoint all apply the
rate the failure-free run would have, with no scheduler state to replicate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["SCHEDULES", "decay", "rate_at", "set_lr"]

SCHEDULES = ("constant", "cosine")


def decay(step: int, total: int, schedule: str) -> float:
    """The factor on the base rate at 0-based ``step`` of ``total``.

    ``constant`` keeps it at 1; ``cosine`` falls from 1 at the first step towards 0
    at the last (half a cosine period), which settles the final model instead of
    leaving it wherever a constant-rate run happens to stop.
    """
    if schedule == "constant" or total <= 0:
        return 1.0
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(max(step, 0), total) / total))
    raise ValueError(f"unknown learning-rate schedule {schedule!r}; choose one of "
                     f"{', '.join(SCHEDULES)}")


def rate_at(optim: Mapping[str, Any], step: int, total: int) -> float:
    """The rate of 0-based ``step`` of ``total`` under an ``[optim]`` section (lr, schedule)."""
    return float(optim["lr"]) * decay(step, total, optim.get("schedule", "constant"))


def set_lr(optimizer: Any, lr: float) -> None:
    """Set the rate of every parameter group of ``optimizer`` (if it has any)."""
    for group in getattr(optimizer, "param_groups", ()):
        group["lr"] = lr
