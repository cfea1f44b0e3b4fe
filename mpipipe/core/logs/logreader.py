"""Reading a run log back: :func:`open_log` checks the format and the groups the schema
requires and returns the columns as numpy arrays (:class:`RunData`), for reports and
tests.

A log is read without HDF5's file lock (:func:`open_for_reading`), so that it can be
read while its run writes it (docs/hdf5-log.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mpipipe.core.logs.logformat import FORMAT, FORMAT_VERSION, LogError
from mpipipe.core.logs.logschema import GROUPS, EventKind

__all__ = ["RunData", "open_log", "open_for_reading"]


@dataclass
class RunData:
    """A run log read back into memory (numpy columns), for reports and tests."""

    path: Path
    attrs: dict[str, Any]
    config: dict[str, Any]
    steps: dict[str, np.ndarray]
    eval: dict[str, np.ndarray]
    ranks: dict[int, dict[str, np.ndarray]]
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def system(self) -> str:
        return str(self.attrs.get("system", "?"))

    def events_of(self, kind: EventKind | str) -> list[dict[str, Any]]:
        """The events of one kind, in log order (any string: a file may hold kinds of an older writer)."""
        return [e for e in self.events if e["kind"] == kind]


def _columns(group: h5py.Group, where: str) -> dict[str, np.ndarray]:
    cols = {}
    for name, ds in group.items():
        if not isinstance(ds, h5py.Dataset):
            raise LogError(f"{where}/{name} is not a dataset")
        cols[name] = ds[()]
    lengths = {len(v) for v in cols.values()}
    if len(lengths) > 1:
        # a run killed between two column writes: keep the rows every column has
        n = min(lengths)
        cols = {k: v[:n] for k, v in cols.items()}
    return cols


def open_for_reading(path: Path) -> h5py.File:
    """Open a log read-only without HDF5's file lock, so that a log can be read while its
    run writes it (docs/hdf5-log.md). A process that has the file open already (its own
    writer) must open it with the lock setting it used: HDF5 shares the open file."""
    try:
        return h5py.File(path, "r", locking=False)
    except OSError as e:
        if "locking flag" not in str(e):
            raise
        return h5py.File(path, "r")


def open_log(path: str | Path) -> RunData:
    """Read a run log written by :class:`~mpipipe.core.logs.runlog.RunLog`.

    Raises:
        LogError: the file is missing, not HDF5, not a run log, of a newer
            format, or lacks a group the schema requires; the message names it.
    """
    p = Path(path)
    if not p.exists():
        raise LogError(f"{p}: no such file")
    try:
        f = open_for_reading(p)
    except OSError as e:
        raise LogError(f"{p}: not a readable HDF5 file ({e})") from None
    with f:
        _check(f, p)
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
        try:
            config = json.loads(attrs.get("config", "{}"))
        except json.JSONDecodeError:
            raise LogError(f"{p}: root attribute 'config' is not JSON") from None
        steps = _columns(f["steps"], "/steps")
        evals = _columns(f["eval"], "/eval")
        ranks = {}
        for name, group in f["ranks"].items():
            if not name.isdigit():
                raise LogError(f"{p}: /ranks/{name} is not a rank number")
            ranks[int(name)] = _columns(group, f"/ranks/{name}")
        events = _events(_columns(f["events"], "/events"))
    return RunData(p, attrs, config, steps, evals, dict(sorted(ranks.items())), events)


def _check(f: h5py.File, p: Path) -> None:
    """Refuse a file that is not a run log this reader knows, naming what is wrong."""
    if f.attrs.get("format") != FORMAT:
        raise LogError(
            f"{p}: not an mpipipe run log (root attribute 'format' is "
            f"{f.attrs.get('format')!r}, expected {FORMAT!r})"
        )
    version = int(f.attrs.get("format_version", 0))
    if version > FORMAT_VERSION:
        raise LogError(f"{p}: log format version {version} is newer than this reader ({FORMAT_VERSION})")
    for name in GROUPS:
        if name not in f or not isinstance(f[name], h5py.Group):
            raise LogError(f"{p}: group /{name} is missing")


def _events(ev: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """The /events columns as one dict per event, the detail parsed (kept raw where it is
    not JSON: a damaged detail must not hide the event)."""
    events = []
    for i in range(len(ev.get("kind", []))):
        kind = ev["kind"][i]
        detail = ev["detail"][i]
        kind = kind.decode() if isinstance(kind, bytes) else str(kind)
        detail = detail.decode() if isinstance(detail, bytes) else str(detail)
        try:
            parsed = json.loads(detail) if detail else {}
        except json.JSONDecodeError:
            parsed = {"raw": detail}
        events.append({"step": int(ev["step"][i]), "time": float(ev["time"][i]), "kind": kind,
                       "rank": int(ev["rank"][i]), "detail": parsed})
    return events
