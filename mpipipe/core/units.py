"""Rates and durations as users write them: ``1/30min``, ``2/h``, ``100mbit``, ``90s``.

Why one module: the cost command's ``--failure-rate`` and ``--link-rate``, the ``poisson``
fault spec and the configuration all take these, and a value must mean the same
everywhere. Each parser raises ``ValueError`` with a line that shows the accepted forms.
"""

from __future__ import annotations

import re

__all__ = ["parse_duration", "parse_rate", "parse_link_rate", "format_rate"]

_SECONDS = {"": 1.0, "ms": 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "hour": 3600.0,
            "d": 86400.0, "day": 86400.0}
_NUMBER = r"(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)"
_DURATION = re.compile(rf"\s*{_NUMBER}?\s*([a-z]*)\s*")
_LINK = {"bit": 1e-6, "kbit": 1e-3, "mbit": 1.0, "gbit": 1e3}


def parse_duration(text: str) -> float:
    """``"50ms"``, ``"90s"``, ``"20m"``, ``"30min"``, ``"1h"``, ``"2d"`` or plain seconds -> seconds (> 0).

    Raises:
        ValueError: anything else, or a duration that is not positive.
    """
    m = _DURATION.fullmatch(str(text).lower())
    if not m or m.group(2) not in _SECONDS or (m.group(1) is None and not m.group(2)):
        raise ValueError(f"{text!r} is not a duration: give one such as 50ms, 90s, 20m, 30min, 1h or 2d")
    seconds = float(m.group(1) or 1) * _SECONDS[m.group(2)]
    if seconds <= 0:
        raise ValueError(f"{text!r}: a duration must be positive")
    return seconds


def parse_rate(text: str) -> float:
    """A rate of events -> events per second: ``"1/30min"`` (one per 30 minutes),
    ``"2/h"``, ``"0.5/min"``, or a plain number of events per second. ``"0"`` is none.

    Raises:
        ValueError: anything else, or a negative rate.
    """
    s = str(text).strip().lower()
    try:
        if "/" in s:
            count, per = s.split("/", 1)
            rate = float(count) / parse_duration(per)
        else:
            rate = float(s)
    except ValueError:
        raise ValueError(f"{text!r} is not a rate: give events per time, such as 1/30min, 2/h, "
                         "0.5/min, or per second as a plain number (0: none)") from None
    if not rate >= 0:
        raise ValueError(f"{text!r}: a rate cannot be negative")
    return rate


def parse_link_rate(text: str) -> float:
    """A link's rate -> Mbit/s: ``"100mbit"``, ``"1gbit"``, ``"500kbit"`` (or ``100mbit/s``,
    ``100mbps``), or a plain number of Mbit/s.

    Raises:
        ValueError: anything else, or a rate that is not positive.
    """
    s = str(text).strip().lower().removesuffix("/s")
    s = s[:-3] + "bit" if s.endswith("bps") else s
    m = re.fullmatch(rf"{_NUMBER}\s*([a-z]*)", s)
    unit = "mbit" if m and not m.group(2) else (m.group(2) if m else "")
    if not m or unit not in _LINK:
        raise ValueError(f"{text!r} is not a link rate: give one such as 100mbit, 1gbit or 500kbit")
    mbit = float(m.group(1)) * _LINK[unit]
    if mbit <= 0:
        raise ValueError(f"{text!r}: a link rate must be positive")
    return mbit


def format_rate(per_s: float) -> str:
    """Events per second as a person reads it: ``"1/30min"``, ``"1/12s"``, ``"none"``."""
    if per_s <= 0:
        return "none"
    gap = 1.0 / per_s
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if gap >= size:
            return f"1/{gap / size:.3g}{unit}"
    return f"1/{gap:.3g}s"
