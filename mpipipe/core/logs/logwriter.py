"""The writer of an open run log: it creates the file, appends rows and events to its
extendable datasets and flushes after every call, so that a run killed at any moment
leaves a file that reads up to its last completed step.

One :class:`LogWriter` holds one open file, from the moment it opens (made new, or
opened again by a resumed run or by a rank that took the log over) until it closes or
lets go; :class:`~mpipipe.core.logs.runlog.RunLog` decides when that is. The writer
checks nothing against the schema: the log checks every record where it is made, on
every rank, before it reaches a writer.
"""

from __future__ import annotations

import json
import math
import platform
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from h5py import h5s

from mpipipe.core.logs.logformat import FORMAT, FORMAT_VERSION
from mpipipe.core.logs.logschema import (
    EVAL_COLUMNS,
    EVENT_COLUMNS,
    GROUPS,
    RANK_COLUMNS,
    STEP_COLUMNS,
    STR,
    EventKind,
    dtypes,
)
from mpipipe.core.logs.progress import spans

__all__ = ["Clock", "LogWriter", "package_versions", "jsonable", "last_step"]

# The columns of each group (mpipipe/core/logs/logschema.py declares them, with their meanings).
_STEP_FIELDS = dtypes(STEP_COLUMNS)
_EVAL_FIELDS = dtypes(EVAL_COLUMNS)
_RANK_FIELDS = dtypes(RANK_COLUMNS)
_BASE_RANK_FIELDS = dtypes(c for c in RANK_COLUMNS if c.required)
_EVENT_FIELDS = dtypes(EVENT_COLUMNS)

# The writing methods by the name a record waiting for the file is kept under (in memory
# and in a journal, mpipipe/core/logs/logjournal.py). The names are those of the methods
# that wrote them before the log was split into parts, so that a journal left beside a
# log by an earlier version (a resumed run has the same start) still replays.
RECORDS = {"_steps": "steps", "_eval": "eval", "_event": "event", "set_attr": "set_attr",
           "cut_after": "cut_after"}
# The records whose ``time`` keyword is the time the record was made.
TIMED_RECORDS = frozenset({"_eval", "_event"})


def package_versions() -> dict[str, str]:
    """Versions of everything that shapes a result, for the root attributes."""
    out = {"python": platform.python_version()}
    for name in ("numpy", "h5py", "torch", "mpi4py"):
        mod = sys.modules.get(name)
        if mod is None:
            try:
                mod = __import__(name)
            except ImportError:
                continue
        out[name] = getattr(mod, "__version__", "?")
    try:
        from mpi4py import MPI

        out["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
    except Exception:  # noqa: BLE001 - versions are informative only
        pass
    return out


def jsonable(obj: Any) -> Any:
    """What ``json.dumps`` writes for a value it does not know (numpy scalars and arrays,
    else the value's string)."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


def last_step(f: h5py.File) -> int:
    """The step of the last row in ``/steps`` (-1 if none)."""
    steps = f["steps"]
    return int(steps["step"][-1]) if "step" in steps and len(steps["step"]) else -1


def _trim(group: h5py.Group) -> None:
    """Cut the parallel datasets of ``group`` to the rows every one of them has."""
    lengths = [ds.shape[0] for ds in group.values() if isinstance(ds, h5py.Dataset)]
    if lengths and min(lengths) != max(lengths):
        for ds in group.values():
            if isinstance(ds, h5py.Dataset):
                ds.resize((min(lengths),))


@dataclass(frozen=True)
class Clock:
    """The run's time axis: the ``time`` column of every row counts seconds from
    ``start`` (the file's ``start_unix``). One value shared by the log and its parts, so
    that a writer that takes over, and a side file, keep the run's axis."""

    start: float

    def elapsed(self) -> float:
        """Seconds since the log was opened: the ``time`` column of every row."""
        return time.time() - self.start


class _Tables:
    """The open datasets of one log file, by group and column, and the cheap way to add
    rows to them.

    Why not h5py's high-level calls: they look each dataset up by name, and an indexed
    write builds a selection and checks types. That cost about 0.23 ms per column, so a
    ResPipe step row (23 columns over the step and three ranks) took 5.3 ms of the
    writer's CPU, more than its stage's compute. With the handles kept, one extent
    change and one low-level write per column, a row costs about 0.7 ms, and it still
    goes to the file at once (a killed writer loses nothing it was given)."""

    def __init__(self, file: h5py.File) -> None:
        self.file = file
        self._columns: dict[str, dict[str, h5py.Dataset]] = {}

    def columns(self, path: str) -> dict[str, h5py.Dataset]:
        """The datasets of the group at ``path`` (made if missing), by name."""
        cols = self._columns.get(path)
        if cols is None:
            group = self.file.require_group(path)
            cols = {name: ds for name, ds in group.items() if isinstance(ds, h5py.Dataset)}
            self._columns[path] = cols
        return cols

    def append(self, path: str, fields: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> None:
        """Append ``rows`` to the parallel datasets ``fields`` of the group at ``path``.

        A column the group lacks is made with the rows it has so far filled as missing
        (-1 or NaN), so that the columns stay aligned."""
        cols = self.columns(path)
        first = next((cols[name] for name in fields if name in cols), None)
        n = 0 if first is None else first.id.shape[0]
        k = len(rows)
        for name, dtype in fields.items():
            missing = "" if dtype is STR else (-1 if np.issubdtype(dtype, np.integer) else math.nan)
            ds = cols.get(name)
            if ds is None:
                ds = self.file[path].create_dataset(
                    name, shape=(n,), maxshape=(None,), dtype=dtype, chunks=(256,),
                    **({} if dtype is STR else {"fillvalue": missing}))
                cols[name] = ds
            values = [missing if row.get(name) is None else row.get(name) for row in rows]
            ds.id.set_extent((n + k,))
            if dtype is STR:
                ds[n:] = np.asarray(values, dtype=object)
                continue
            space = ds.id.get_space()
            space.select_hyperslab((n,), (k,))
            ds.id.write(h5s.create_simple((k,)), space, np.asarray(values, dtype=dtype))


class LogWriter:
    """The open file of a run log and the writing of its records, until it closes.

    ``written_through``: the last step row the file had when this writer opened it (a
    writer that took over, or a side file): rows of steps up to it are the previous
    writer's and are not written again, so every step keeps one row."""

    def __init__(self, file: h5py.File, path: Path, clock: Clock, written_through: int | None = None) -> None:
        self.file = file
        self.path = path
        self._clock = clock
        self._written_through = written_through
        self._tables = _Tables(file)

    @classmethod
    def create(
        cls,
        path: Path,
        *,
        system: str,
        config: Mapping[str, Any],
        comm_size: int,
        clock: Clock,
        emulation: Mapping[str, Any] | None = None,
        attrs: Mapping[str, Any] | None = None,
        mode: str = "w",
        written_through: int | None = None,
    ) -> LogWriter:
        """Create the log file (``mode`` ``w``: replace a file there, ``x``: refuse one)
        with its root attributes, groups and (empty) event columns.

        Raises:
            OSError: the file cannot be created (``x``: it exists).
        """
        path.parent.mkdir(parents=True, exist_ok=True)
        f = h5py.File(path, mode)
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["system"] = system
        f.attrs["config"] = json.dumps(config, sort_keys=True)
        f.attrs["world_size"] = comm_size
        f.attrs["versions"] = json.dumps(package_versions(), sort_keys=True)
        f.attrs["start_time"] = datetime.now(UTC).isoformat(timespec="seconds")
        f.attrs["start_unix"] = clock.start
        f.attrs["hostname"] = socket.gethostname()
        f.attrs["command"] = " ".join(sys.argv)
        f.attrs["emulation"] = json.dumps(emulation or {}, sort_keys=True)
        f.attrs["status"] = "running"
        for key, value in (attrs or {}).items():
            f.attrs[key] = value if isinstance(value, str | int | float) else json.dumps(value)
        for name in GROUPS:
            f.create_group(name)
        for name, dtype in _EVENT_FIELDS.items():
            f["events"].create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(64,))
        f.flush()
        return cls(f, path, clock, written_through)

    @classmethod
    def reopen(cls, file: h5py.File, path: Path, clock: Clock, *, attrs: Mapping[str, Any] | None = None,
               keep_rows: bool = False) -> LogWriter:
        """Write on into an existing log opened for writing (a resumed run's, or one taken
        over), its columns first cut to the rows all of them have (a writer killed between
        two columns leaves them uneven) and ``attrs`` set. ``keep_rows``: the step rows
        the file has are kept once, the previous writer's, not this one's."""
        for group in (file["steps"], file["eval"], file["events"], *file["ranks"].values()):
            _trim(group)
        if attrs is not None:
            file.attrs.update(attrs)
            file.flush()
        return cls(file, path, clock, last_step(file) if keep_rows else None)

    def record(self, name: str) -> Callable[..., None]:
        """The writing method of a record kept under ``name`` (:data:`RECORDS`).

        Raises:
            KeyError: no record has that name.
        """
        return getattr(self, RECORDS[name])

    def steps(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Append step rows, and the per-rank figures they carry, with one resize and one
        write per dataset for all of them."""
        if self._written_through is not None:
            rows = [r for r in rows if int(r["step"]) > self._written_through]
        if not rows:
            return
        if self._written_through is not None:  # a row replayed twice (journal, rebuilt) once
            self._written_through = max(self._written_through, *(int(r["step"]) for r in rows))
        now = self._clock.elapsed()
        tables = self._tables
        tables.append("steps", _STEP_FIELDS, [
            {**{k: v for k, v in row.items() if k != "ranks"},
             "time": now if row.get("time") is None else row["time"]} for row in rows])
        per_rank: dict[int, list[Mapping[str, Any]]] = {}
        for row in rows:
            for rank, figures in (row.get("ranks") or {}).items():
                per_rank.setdefault(int(rank), []).append({"step": row["step"], **figures})
        for rank, rank_rows in per_rank.items():
            path = f"ranks/{rank}"
            # the base columns, and each declared extra these rows or earlier ones have
            present = {key for figures in rank_rows for key in figures} | set(tables.columns(path))
            fields = {k: d for k, d in _RANK_FIELDS.items() if k in _BASE_RANK_FIELDS or k in present}
            tables.append(path, fields, rank_rows)
        self.file.flush()

    def eval(self, step: int, *, accuracy: float, loss: float = math.nan, time: float | None = None) -> None:
        """Append one evaluation row."""
        t = self._clock.elapsed() if time is None else time
        self._tables.append("eval", _EVAL_FIELDS, [{"step": step, "time": t, "accuracy": accuracy, "loss": loss}])
        self.file.flush()

    def event(self, kind: str, *, step: int, rank: int = -1, time: float | None = None, **detail: Any) -> None:
        """Append one event, ``detail`` as one JSON object."""
        t = self._clock.elapsed() if time is None else time
        self._tables.append("events", _EVENT_FIELDS, [{
            "step": step, "time": t, "kind": kind, "rank": rank,
            "detail": json.dumps(detail, sort_keys=True, default=jsonable),
        }])
        self.file.flush()

    def set_attr(self, key: str, value: Any) -> None:
        """Set a root attribute (e.g. the final summary)."""
        self.file.attrs[key] = value if isinstance(value, str | int | float) else json.dumps(value, default=jsonable)
        self.file.flush()

    def cut_after(self, step: int) -> None:
        """Drop the rows of steps after ``step`` (steps, per-rank figures, evaluations):
        a resumed run runs them again from its checkpoint of ``step``, so that every
        step keeps one row. Events stay (they happened). Records ``rows_dropped``."""
        dropped = 0
        for group in (self.file["steps"], self.file["eval"], *self.file["ranks"].values()):
            if "step" not in group:
                continue
            keep = group["step"][()] <= step
            if keep.all():
                continue
            dropped += int((~keep).sum()) if group.name == "/steps" else 0
            for ds in list(group.values()):
                if isinstance(ds, h5py.Dataset):
                    kept = ds[()][keep]
                    ds.resize((len(kept),))
                    ds[:] = kept
        if dropped:
            self.event(EventKind.ROWS_DROPPED.value, step=step, rows=dropped,
                       why=f"the run resumed from its checkpoint of step {step}")
        self.file.flush()

    def written(self, name: str, group: str = "steps") -> np.ndarray:
        """Column ``/<group>/<name>`` as the file holds it now (rows another writer wrote
        before this one took over too)."""
        if name not in self.file[group]:
            return np.array([])
        return self.file[group][name][()]

    def close(self, status: str, expected: range | None = None) -> str:
        """Mark the run finished with ``status`` and close the file; returns the status
        written. A ``completed`` run whose file lacks a row of a step in ``expected`` is
        ``incomplete: ...`` instead, naming the steps (and one error line says so)."""
        if status == "completed" and expected is not None:
            steps = self.file["steps"]
            have = set(steps["step"][()].tolist()) if "step" in steps else set()
            missing = [s for s in expected if s not in have]
            if missing:
                status = (f"incomplete: no row for {len(missing)} of the {len(expected)} "
                          f"steps run (steps {spans(missing, ', ')})")
                print(f"mpipipe: error: {self.path}: {status}", file=sys.stderr, flush=True)
        self.file.attrs["status"] = status
        self.file.attrs["end_time"] = datetime.now(UTC).isoformat(timespec="seconds")
        self.file.close()
        return status

    def release(self) -> None:
        """Close the file without marking the run finished (another rank writes it now)."""
        self.file.close()
