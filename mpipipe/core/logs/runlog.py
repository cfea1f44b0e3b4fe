"""The HDF5 run log: one file per run, written by one rank, flushed after every record.

Both systems write the same schema, declared once in :mod:`mpipipe.core.logs.logschema`
(and described in docs/hdf5-log.md), so one report command reads every run; every
record is checked against it, and one with an unknown column or event kind is refused
(:class:`~mpipipe.core.logs.logschema.SchemaError`). Rows are appended to extendable datasets and the file is
flushed after each call, so a run killed at any moment leaves a file that
reads up to its last completed step.

Rank 0 creates the file; every other rank holds a :meth:`RunLog.null` log that
knows the file and the run's start, so that a survivor can :meth:`RunLog.take_over`
when the writer dies or is replaced (ResPipe). HDF5's file lock keeps the
two from writing at once: a replaced writer that is still alive keeps the lock
until it releases it (:meth:`RunLog.release`) or exits, and the new one holds its
records until then. Those records also go, one JSON line each, to a journal beside the
log (``<log>.queue-*.jsonl``), so that a new writer killed before the file freed up does
not take them along: the next one that opens the file writes them first.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import platform
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import h5py
import numpy as np
from h5py import h5s

from mpipipe.core.logs.logschema import (
    EVAL_COLUMNS,
    EVENT_COLUMNS,
    GROUPS,
    RANK_COLUMNS,
    STEP_COLUMNS,
    STR,
    EventKind,
    SchemaError,
    check_columns,
    dtypes,
    event_kind,
)
from mpipipe.core.logs.progress import spans

__all__ = ["FORMAT", "FORMAT_VERSION", "RunLog", "LogError", "RunData", "open_log", "open_for_reading",
           "package_versions", "EventKind", "SchemaError"]

FORMAT = "mpipipe-runlog"
FORMAT_VERSION = 1

# The columns of each group (mpipipe/core/logs/logschema.py declares them, with their meanings).
_STEP_FIELDS = dtypes(STEP_COLUMNS)
_EVAL_FIELDS = dtypes(EVAL_COLUMNS)
_RANK_FIELDS = dtypes(RANK_COLUMNS)
_BASE_RANK_FIELDS = dtypes(c for c in RANK_COLUMNS if c.required)
_EVENT_FIELDS = dtypes(EVENT_COLUMNS)


class LogError(ValueError):
    """A file is not a readable run log; the message names what is missing."""


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


_Method = TypeVar("_Method", bound=Callable[..., None])
RETRY_OPEN_S = 0.25  # how often a new writer tries again to open a file still locked


def _record(method: _Method) -> _Method:
    """A writing method: runs on the open file, waits in the queue of a writer whose
    file is still locked, and does nothing on a null log."""
    takes_time = "time" in inspect.signature(method).parameters

    @wraps(method)
    def write(self: RunLog, *args: Any, **kwargs: Any) -> None:
        if self._file is None and self._continued is not None:
            self._continue()
        if self._file is None and self._queue is not None:
            try:
                self._try_open()
            except LogError as e:  # a late open failed: say so once, train on
                print(f"mpipipe: error: {e}", file=sys.stderr, flush=True)
                return
        if self._file is not None:
            method(self, *args, **kwargs)
        elif self._queue is not None:
            # A record's time is when it was made, not when the file opened.
            now = self.elapsed()
            if method.__name__ == "_steps":
                args = ([{**r, "time": now if r.get("time") is None else r["time"]}
                         for r in args[0]],)
            elif takes_time and kwargs.get("time") is None:
                kwargs = {**kwargs, "time": now}
            self._queue.append((method, args, kwargs))
            self._journal_add(method.__name__, args, kwargs)

    return write  # type: ignore[return-value]


def _last_step(f: h5py.File) -> int:
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


class RunLog:
    """Writer of one run's HDF5 log. Create it on rank 0; other ranks use :meth:`null`."""

    _queue: list[tuple[Callable[..., None], tuple, dict]] | None = None  # taken over, not open
    _written_through: int | None = None  # taken over: the last step row the file had
    _ready: Callable[[], bool] | None = None  # taken over: has the previous writer let go?
    _expected: range | None = None  # the step rows close() checks for
    _continued: dict[str, Any] | None = None  # a resumed run's log, not opened yet
    _open_tables: _Tables | None = None  # the datasets of the file open now
    _journal: Any = None  # taken over, not open: the waiting records' file (a text file)

    def __init__(
        self,
        path: str | Path,
        *,
        system: str,
        config: Mapping[str, Any],
        comm_size: int,
        emulation: Mapping[str, Any] | None = None,
        attrs: Mapping[str, Any] | None = None,
        mode: str = "w",
    ) -> None:
        """Create the log (``mode`` ``w``: replace a file there, ``x``: refuse one), or
        continue an existing run log (``a``: a resumed run; see :meth:`cut_after`).

        Raises:
            LogError: ``a`` on a file that is not a run log of ``system``.
            OSError: the file cannot be created (``x``: it exists) or opened.
        """
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._system = system
        self._t0 = time.time()
        if mode == "a":
            self._file = None
            self._check_continued(config, comm_size)
            return
        self._file: h5py.File | None = h5py.File(self.path, mode)
        f = self._file
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["system"] = system
        f.attrs["config"] = json.dumps(config, sort_keys=True)
        f.attrs["world_size"] = comm_size
        f.attrs["versions"] = json.dumps(package_versions(), sort_keys=True)
        f.attrs["start_time"] = datetime.now(UTC).isoformat(timespec="seconds")
        f.attrs["start_unix"] = self._t0
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

    def _check_continued(self, config: Mapping[str, Any], comm_size: int) -> None:
        """Check an existing run log that a resumed run continues, without writing to it:
        the file opens for writing at the first record (:meth:`_continue`), so a run that
        fails before it has recorded anything leaves the old log exactly as it was."""
        with h5py.File(self.path, "r") as f:
            found = (f.attrs.get("format"), f.attrs.get("system"))
            if found != (FORMAT, self._system):
                raise LogError(f"{self.path} is not a {self._system} run log (format "
                               f"{found[0]!r}, system {found[1]!r}); will not write into it")
            self._t0 = float(f.attrs["start_unix"])  # one time axis
        self._continued = {"config": json.dumps(config, sort_keys=True),
                           "world_size": comm_size, "command": " ".join(sys.argv),
                           "status": "running"}

    def _continue(self) -> None:
        """Open the continued log for writing and mark it as this run's."""
        assert self._continued is not None
        f = h5py.File(self.path, "r+")
        for group in (f["steps"], f["eval"], f["events"], *f["ranks"].values()):
            _trim(group)  # a run killed between two columns leaves them uneven
        f.attrs.update(self._continued)
        f.flush()
        self._file, self._continued = f, None

    @_record
    def cut_after(self, step: int) -> None:
        """Drop the rows of steps after ``step`` (steps, per-rank figures, evaluations):
        a resumed run runs them again from its checkpoint of ``step``, so that every
        step keeps one row. Events stay (they happened). Records ``rows_dropped``."""
        assert self._file is not None
        dropped = 0
        for group in (self._file["steps"], self._file["eval"], *self._file["ranks"].values()):
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
            self.event(EventKind.ROWS_DROPPED, step=step, rows=dropped,
                       why=f"the run resumed from its checkpoint of step {step}")
        self._file.flush()

    def expect_steps(self, first: int, last: int) -> None:
        """The step rows this run must leave (1-based, both ends included); :meth:`close`
        checks them. Set on every rank: a rank that takes the log over checks too."""
        self._expected = range(first, last + 1)

    @classmethod
    def null(cls, path: str | Path | None = None, start: float | None = None,
             system: str = "mpipipe") -> RunLog:
        """A log that writes nothing: what ranks other than 0 hold.

        Given the file and the writer's start time (``start_unix``), the rank can
        :meth:`take_over` the log later with the same time column.
        """
        obj = cls.__new__(cls)
        obj._file = None
        obj._t0 = time.time() if start is None else start
        obj.path = None if path is None else Path(path)  # type: ignore[assignment]
        obj._system = system
        return obj

    @property
    def active(self) -> bool:
        """Whether this rank is the writer (its records reach the file, now or later)."""
        return self._file is not None or self._queue is not None or self._continued is not None

    def take_over(self, ready: Callable[[], bool] | None = None, order: int = 0) -> None:
        """Make this rank the writer of the log that rank 0 created.

        Opens the file for appending once ``ready()`` says the previous writer has let
        go (``None``: it is dead) and HDF5's lock is free, at the first record after
        that; records wait in order, with their own times, until then. Why both: HDF5's
        lock is off on many parallel file systems (HDF5_USE_FILE_LOCKING=FALSE), and a
        replaced writer still holding the file open would overwrite our rows when it
        closes. ``order`` ranks this hand-over among the run's others (ResPipe: the
        generation): journals of earlier writers are written in that order.

        Raises:
            LogError: this log does not know its file, or the file is not a run log.
        """
        if self.active:
            return
        if self.path is None:
            raise LogError("this rank's log does not know the run's file; cannot take it over")
        self._queue, self._ready = [], ready
        self._next_open = 0.0
        self._journal = self._open_journal(order)
        self._try_open()

    def _journals(self) -> list[Path]:
        """The journals of this log's earlier waiting writers, oldest hand-over first."""
        return sorted(self.path.parent.glob(f"{self.path.stem}.queue-*.jsonl"))

    def _open_journal(self, order: int) -> Any:
        """Start this writer's journal (None, with one warning, where it cannot be made)."""
        name = f"{self.path.stem}.queue-{order:06d}-{socket.gethostname()}-{os.getpid()}.jsonl"
        try:
            journal = open(self.path.with_name(name), "w", encoding="utf-8")  # noqa: SIM115
            journal.write(json.dumps({"start_unix": self._t0}) + "\n")
            journal.flush()
        except OSError as e:
            print(f"mpipipe: warning: {self.path}: records waiting for the file are kept in "
                  f"memory only ({e})", file=sys.stderr, flush=True)
            return None
        return journal

    def _journal_add(self, name: str, args: tuple, kwargs: dict) -> None:
        """One waiting record, written through to the journal (a kill loses none)."""
        if self._journal is None:
            return
        try:
            self._journal.write(json.dumps({"m": name, "a": args, "k": kwargs},
                                           default=_jsonable) + "\n")
            self._journal.flush()
        except OSError as e:
            print(f"mpipipe: warning: {self._journal.name}: cannot write ({e}); records "
                  f"waiting for the log are kept in memory only", file=sys.stderr, flush=True)
            self._drop_journal(keep=True)

    def _drop_journal(self, keep: bool = False) -> None:
        """Close this writer's journal; remove it unless ``keep`` (left for the next writer)."""
        journal, self._journal = self._journal, None
        if journal is not None:
            journal.close()
            if not keep:
                Path(journal.name).unlink(missing_ok=True)

    def _replay_journals(self) -> None:
        """Write the records of earlier writers that waited for the file and left the job
        before it freed up (killed, or replaced and let go), then remove their journals.
        A journal of another run (its start differs) is left alone; a line cut by a kill
        ends its journal."""
        own = None if self._journal is None else Path(self._journal.name)
        for path in self._journals():
            if path == own:
                continue
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
                if not lines or json.loads(lines[0]).get("start_unix") != self._t0:
                    continue
            except (OSError, ValueError, AttributeError):
                continue
            for line in lines[1:]:
                try:
                    rec = json.loads(line)
                    method = getattr(RunLog, rec["m"])
                except (ValueError, KeyError, TypeError, AttributeError):
                    break
                method(self, *rec["a"], **rec["k"])
            path.unlink(missing_ok=True)

    def release(self) -> None:
        """Close the file without marking the run finished: another rank writes it now.

        Records still waiting for the file (it never opened) stay in this writer's
        journal, which the next writer writes first (a side file if there is none)."""
        if self._file is not None:
            self._file.close()
        elif self._queue and self._journal is None:
            self._spill("released: another rank writes the run log now", "running")
        self._drop_journal(keep=bool(self._queue))  # the next writer writes its records
        self._file, self._queue, self._continued = None, None, None

    def _try_open(self, wait_s: float = 0.0) -> bool:
        """Open a taken-over log (retrying for ``wait_s``) and write what waited.

        Raises:
            LogError: the file is gone, damaged or not a run log (the records waiting
                are written to a side file first).
        """
        give_up = time.monotonic() + wait_s
        while self._file is None:
            now = time.monotonic()
            if now >= self._next_open:
                self._next_open = now + RETRY_OPEN_S
                if self._ready is None or self._ready():
                    self._ready = None  # once let go, always
                    try:
                        f = h5py.File(self.path, "r+")  # never create: a missing file is an error
                    except BlockingIOError:  # the previous writer still holds the lock
                        f = None
                    except OSError as e:
                        raise self._cannot(f"cannot open it ({e})") from None
                    if f is not None:
                        if f.attrs.get("format") != FORMAT:
                            f.close()
                            raise self._cannot("not an mpipipe run log; will not write into it")
                        self._file = f
                        break
            if now >= give_up:
                return False
            time.sleep(min(RETRY_OPEN_S, max(give_up - now, 0.0)))
        for group in (self._file["steps"], self._file["eval"], self._file["events"],
                      *self._file["ranks"].values()):
            _trim(group)  # a writer killed between two columns leaves them uneven
        # Rows of steps the previous writer got to write are kept once (its, not ours).
        self._written_through = _last_step(self._file)
        queue, self._queue = self._queue or [], None
        self._replay_journals()
        for method, args, kwargs in queue:
            method(self, *args, **kwargs)
        self._drop_journal()
        return True

    def _cannot(self, why: str, status: str = "running") -> LogError:
        """Give up on the file: spill what waited, stop writing, and say where it went."""
        waiting = bool(self._queue)
        spilled = self._spill(why, status) if waiting or status != "running" else None
        self._queue = None
        self._drop_journal(keep=waiting and spilled is None)
        where = f"; {len(spilled[1])} waiting records are in {spilled[0]}" if spilled else ""
        return LogError(f"{self.path}: {why}{where}")

    def _spill(self, why: str, status: str) -> tuple[Path, list] | None:
        """Write the waiting records to ``<log>.tail.h5``, a run log of its own (same time
        axis, run ``status``), so that nothing this rank recorded is lost. None if that
        failed too."""
        queue = self._queue or []
        tail = self.path.with_name(self.path.stem + ".tail.h5")
        n = 2
        while tail.exists():  # an earlier spill of this run stays as it is
            tail = self.path.with_name(f"{self.path.stem}.tail-{n}.h5")
            n += 1
        through = None
        try:  # rows the main file has already (best effort: it may be locked)
            with h5py.File(self.path, "r") as f:
                through = _last_step(f)
        except (OSError, KeyError):
            pass
        try:
            side = RunLog(tail, system=self._system, config={},
                          comm_size=0, attrs={"continues": str(self.path), "why": why})
            side._t0 = self._t0
            side._written_through = through  # a row goes to one of the two files only
            assert side._file is not None
            side._file.attrs["start_unix"] = self._t0
            for method, args, kwargs in queue:
                method(side, *args, **kwargs)
            side.close(status)
        except (OSError, LogError) as e:
            print(f"mpipipe: error: {len(queue)} log records lost: cannot write {tail}: {e}",
                  file=sys.stderr, flush=True)
            return None
        return tail, queue

    @property
    def start(self) -> float:
        """The Unix time the ``time`` column counts from (the file's ``start_unix``)."""
        return self._t0

    def elapsed(self) -> float:
        """Seconds since the log was opened: the ``time`` column of every row."""
        return time.time() - self._t0

    def step(
        self,
        step: int,
        *,
        time: float | None = None,
        loss: float,
        samples: int,
        samples_per_s: float,
        ranks: Mapping[int, Mapping[str, float]] | None = None,
    ) -> None:
        """Record one optimizer step and the per-rank figures gathered for it.

        Raises:
            SchemaError: a rank's figures name a column the schema does not declare.
        """
        self.steps([{"step": step, "time": time, "loss": loss, "samples": samples,
                     "samples_per_s": samples_per_s, "ranks": ranks}])

    def steps(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Record several steps at once (keyword arguments of :meth:`step` per row).

        One resize and one write per dataset for all of them: what a writer that
        has fallen behind uses to catch up. Every row is checked against the schema
        first, on every rank (a null log too), so a misspelt figure fails where it is
        made, not on the one rank that writes.

        Raises:
            SchemaError: a row or a rank's figures name a column the schema does not declare.
        """
        for row in rows:
            check_columns("steps", (k for k in row if k != "ranks"), f"(step {row.get('step')})")
            for rank, figures in (row.get("ranks") or {}).items():
                check_columns("ranks", figures, f"(rank {rank}, step {row.get('step')})")
        self._steps(rows)

    @_record
    def _steps(self, rows: Sequence[Mapping[str, Any]]) -> None:
        if self._written_through is not None:
            rows = [r for r in rows if int(r["step"]) > self._written_through]
        if not rows:
            return
        if self._written_through is not None:  # a row replayed twice (journal, rebuilt) once
            self._written_through = max(self._written_through, *(int(r["step"]) for r in rows))
        assert self._file is not None
        now = self.elapsed()
        tables = self._tables()
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
        self._file.flush()

    def _tables(self) -> _Tables:
        """The datasets of the file open now (found again after the file changed)."""
        assert self._file is not None
        if self._open_tables is None or self._open_tables.file is not self._file:
            self._open_tables = _Tables(self._file)
        return self._open_tables

    def eval(self, step: int, *, accuracy: float, loss: float = math.nan, time: float | None = None) -> None:
        """Record one evaluation on the held-out split."""
        self._eval(step, accuracy=accuracy, loss=loss, time=time)

    @_record
    def _eval(self, step: int, *, accuracy: float, loss: float = math.nan, time: float | None = None) -> None:
        assert self._file is not None
        t = self.elapsed() if time is None else time
        self._tables().append("eval", _EVAL_FIELDS, [{"step": step, "time": t, "accuracy": accuracy, "loss": loss}])
        self._file.flush()

    def event(self, kind: EventKind | str, *, step: int, rank: int = -1, time: float | None = None,
              **detail: Any) -> None:
        """Record one event (fault injected, failure detected, takeover, re-tune, ...).

        ``kind`` is an :class:`EventKind` (or its string); ``detail`` goes to the
        ``detail`` column as one JSON object.

        Raises:
            SchemaError: ``kind`` is not an EventKind (checked on every rank).
        """
        self._event(event_kind(kind).value, step=step, rank=rank, time=time, **detail)

    @_record
    def _event(self, kind: str, *, step: int, rank: int = -1, time: float | None = None, **detail: Any) -> None:
        assert self._file is not None
        t = self.elapsed() if time is None else time
        self._tables().append("events", _EVENT_FIELDS, [{
            "step": step, "time": t, "kind": kind, "rank": rank,
            "detail": json.dumps(detail, sort_keys=True, default=_jsonable),
        }])
        self._file.flush()

    @_record
    def set_attr(self, key: str, value: Any) -> None:
        """Set a root attribute (e.g. the final summary)."""
        assert self._file is not None
        self._file.attrs[key] = value if isinstance(value, str | int | float) else json.dumps(value, default=_jsonable)
        self._file.flush()

    def written(self, name: str, group: str = "steps") -> np.ndarray:
        """Column ``/<group>/<name>`` as this writer's file holds it now (empty where this
        rank's file is not open): rows another writer wrote before this one took over too."""
        if self._file is None or name not in self._file[group]:
            return np.array([])
        return self._file[group][name][()]

    def throughput(self) -> float:
        """:func:`mpipipe.core.logs.progress.throughput` of this writer's file as it holds it now, its
        ``resume`` events included (NaN where this rank's file is not open): the figure the
        report will give, so that a resumed run's summary says the same."""
        from mpipipe.core.logs.progress import throughput

        kinds = [k.decode() if isinstance(k, bytes) else str(k) for k in self.written("kind", "events")]
        resumed = [int(st) for k, st in zip(kinds, self.written("step", "events"), strict=True)
                   if k == EventKind.RESUME]
        return throughput(self.written("time"), self.written("samples"), self.written("step"), resumed)

    def close(self, status: str = "completed", wait_s: float = 30.0) -> str:
        """Mark the run finished (``completed`` or ``failed: why``) and close the file.

        A writer that took over waits up to ``wait_s`` for the previous one to let go.
        A run whose file lacks a row of a step it ran (:meth:`expect_steps`) is not
        ``completed`` but ``incomplete: ...``, naming the steps (and one error line
        says so): a log must not claim what it does not hold. Returns the status written.

        Raises:
            LogError: the previous writer never let go, or the file could not be opened;
                the records that waited, and the status, are in ``<log>.tail.h5``.
        """
        if self._file is None and self._queue is not None and not self._try_open(wait_s):
            raise self._cannot(f"still held by the run's previous log writer after "
                               f"{wait_s:.0f} s", status=status)
        if self._file is None and self._continued is not None and status == "completed":
            self._continue()  # (a run that recorded nothing, yet completed)
        if self._file is None:
            return status
        if status == "completed" and self._expected is not None:
            steps = self._file["steps"]
            have = set(steps["step"][()].tolist()) if "step" in steps else set()
            missing = [s for s in self._expected if s not in have]
            if missing:
                status = (f"incomplete: no row for {len(missing)} of the {len(self._expected)} "
                          f"steps run (steps {spans(missing, ', ')})")
                print(f"mpipipe: error: {self.path}: {status}", file=sys.stderr, flush=True)
        self._file.attrs["status"] = status
        self._file.attrs["end_time"] = datetime.now(UTC).isoformat(timespec="seconds")
        self._file.close()
        self._file = None
        return status

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close("completed" if exc_type is None else f"failed: {exc}")


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


# ---------------------------------------------------------------- reading


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
    """Read a run log written by :class:`RunLog`.

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
        ev = _columns(f["events"], "/events")
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
    return RunData(p, attrs, config, steps, evals, dict(sorted(ranks.items())), events)
