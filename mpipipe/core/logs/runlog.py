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

:class:`RunLog` is the one object the trainers hold; it composes the parts that do the
work, each in its module beside this one: the writer of the open file
(:mod:`~mpipipe.core.logs.logwriter`), the take-over that waits for it
(:mod:`~mpipipe.core.logs.logtakeover`) with its journal
(:mod:`~mpipipe.core.logs.logjournal`), and the reader (:mod:`~mpipipe.core.logs.logreader`).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mpipipe.core.logs.logformat import FORMAT, FORMAT_VERSION, LogError
from mpipipe.core.logs.logreader import RunData, open_for_reading, open_log
from mpipipe.core.logs.logschema import EventKind, SchemaError, check_columns, event_kind
from mpipipe.core.logs.logtakeover import Takeover
from mpipipe.core.logs.logwriter import Clock, LogWriter, package_versions

# The journal order of a last rank closing an abandoned log: after every hand-over's.
_LAST_ORDER = 999_999

__all__ = ["FORMAT", "FORMAT_VERSION", "RunLog", "LogError", "RunData", "open_log", "open_for_reading",
           "package_versions", "EventKind", "SchemaError"]


class RunLog:
    """Writer of one run's HDF5 log. Create it on rank 0; other ranks use :meth:`null`.

    At any moment a log is one of: open (its :attr:`writer`), taken over and waiting for
    the file (a :class:`~mpipipe.core.logs.logtakeover.Takeover`), a resumed run's log not
    opened yet, or null (this rank writes nothing)."""

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
        path = Path(path)
        if mode == "a":
            path.parent.mkdir(parents=True, exist_ok=True)
            self._setup(path, _continued_start(path, system), system)
            self._continued = {"config": json.dumps(config, sort_keys=True),
                               "world_size": comm_size, "command": " ".join(sys.argv),
                               "status": "running"}
            return
        self._setup(path, time.time(), system)
        self._writer = LogWriter.create(path, system=system, config=config, comm_size=comm_size,
                                        clock=self._clock, emulation=emulation, attrs=attrs, mode=mode)

    def _setup(self, path: Path | None, start: float, system: str) -> None:
        """A log that writes nothing (yet): its file, time axis and system."""
        self.path = path
        self._clock = Clock(start)
        self._system = system
        self._writer: LogWriter | None = None
        self._takeover: Takeover | None = None
        # A resumed run's log, not opened yet: the root attributes this run sets in it.
        self._continued: dict[str, Any] | None = None
        self._expected: range | None = None  # the step rows close() checks for

    @classmethod
    def null(cls, path: str | Path | None = None, start: float | None = None,
             system: str = "mpipipe") -> RunLog:
        """A log that writes nothing: what ranks other than 0 hold.

        Given the file and the writer's start time (``start_unix``), the rank can
        :meth:`take_over` the log later with the same time column.
        """
        obj = cls.__new__(cls)
        obj._setup(None if path is None else Path(path), time.time() if start is None else start, system)
        return obj

    @property
    def writer(self) -> LogWriter | None:
        """The writer of the file open now (None while this rank's records wait for it,
        or where it writes nothing)."""
        return self._writer

    @property
    def active(self) -> bool:
        """Whether this rank is the writer (its records reach the file, now or later)."""
        return self._writer is not None or self._takeover is not None or self._continued is not None

    @property
    def start(self) -> float:
        """The Unix time the ``time`` column counts from (the file's ``start_unix``)."""
        return self._clock.start

    def elapsed(self) -> float:
        """Seconds since the log was opened: the ``time`` column of every row."""
        return self._clock.elapsed()

    def expect_steps(self, first: int, last: int) -> None:
        """The step rows this run must leave (1-based, both ends included); :meth:`close`
        checks them. Set on every rank: a rank that takes the log over checks too."""
        self._expected = range(first, last + 1)

    # ------------------------------------------------------------ records

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
        self._record("_steps", rows)

    def eval(self, step: int, *, accuracy: float, loss: float = math.nan, time: float | None = None) -> None:
        """Record one evaluation on the held-out split."""
        self._record("_eval", step, accuracy=accuracy, loss=loss, time=time)

    def event(self, kind: EventKind | str, *, step: int, rank: int = -1, time: float | None = None,
              **detail: Any) -> None:
        """Record one event (fault injected, failure detected, takeover, re-tune, ...).

        ``kind`` is an :class:`EventKind` (or its string); ``detail`` goes to the
        ``detail`` column as one JSON object.

        Raises:
            SchemaError: ``kind`` is not an EventKind (checked on every rank).
        """
        self._record("_event", event_kind(kind).value, step=step, rank=rank, time=time, **detail)

    def set_attr(self, key: str, value: Any) -> None:
        """Set a root attribute (e.g. the final summary)."""
        self._record("set_attr", key, value)

    def cut_after(self, step: int) -> None:
        """Drop the rows of steps after ``step`` (steps, per-rank figures, evaluations):
        a resumed run runs them again from its checkpoint of ``step``, so that every
        step keeps one row. Events stay (they happened). Records ``rows_dropped``."""
        self._record("cut_after", step)

    def _record(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Write one record (:data:`~mpipipe.core.logs.logwriter.RECORDS`) to the open
        file, or hold it while a taken-over file is still locked; nothing on a null log."""
        writer = self._open_writer()
        if writer is not None:
            writer.record(name)(*args, **kwargs)
        elif self._takeover is not None:
            self._takeover.hold(name, args, kwargs)

    def _open_writer(self) -> LogWriter | None:
        """The writer, opening the file first where it is due: a resumed run's log at its
        first record, a taken-over one once the previous writer has let go."""
        if self._writer is None and self._continued is not None:
            self._continue()
        if self._writer is None and self._takeover is not None:
            try:
                self._try_open()
            except LogError as e:  # a late open failed: say so once, train on
                print(f"mpipipe: error: {e}", file=sys.stderr, flush=True)
        return self._writer

    def _continue(self) -> None:
        """Open the continued log for writing and mark it as this run's (the file opens
        only now, so a run that fails before it has recorded anything leaves the old log
        exactly as it was)."""
        assert self.path is not None and self._continued is not None
        self._writer = LogWriter.reopen(h5py.File(self.path, "r+"), self.path, self._clock,
                                        attrs=self._continued)
        self._continued = None

    # ------------------------------------------------------------ reading back

    def written(self, name: str, group: str = "steps") -> np.ndarray:
        """Column ``/<group>/<name>`` as this writer's file holds it now (empty where this
        rank's file is not open): rows another writer wrote before this one took over too."""
        return np.array([]) if self._writer is None else self._writer.written(name, group)

    def throughput(self) -> float:
        """:func:`mpipipe.core.logs.progress.throughput` of this writer's file as it holds it now, its
        ``resume`` events included (NaN where this rank's file is not open): the figure the
        report will give, so that a resumed run's summary says the same."""
        from mpipipe.core.logs.progress import throughput

        kinds = [k.decode() if isinstance(k, bytes) else str(k) for k in self.written("kind", "events")]
        resumed = [int(st) for k, st in zip(kinds, self.written("step", "events"), strict=True)
                   if k == EventKind.RESUME]
        return throughput(self.written("time"), self.written("samples"), self.written("step"), resumed)

    # ------------------------------------------------------------ hand-over

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
        self._takeover = Takeover(self.path, self._clock, self._system, ready, order)
        self._try_open()

    def status_on_disk(self) -> str | None:
        """The run status the log's file holds now (``running``, ``completed``, ...); None
        while another process holds it open for writing, or where it cannot be read.

        Why: a rank outside the job (a replaced one) learns from the file whether the run
        is over, without a message from ranks that may all be gone.
        """
        if self.path is None or not self.path.is_file():
            return None
        try:
            with h5py.File(self.path, "r") as f:
                return str(f.attrs.get("status", "")) if f.attrs.get("format") == FORMAT else None
        except (OSError, BlockingIOError):
            return None

    def close_abandoned(self, status: str) -> bool:
        """Close a log that no live rank writes any more: the last rank alive of a run
        whose writers all left (ResPipe: a replaced writer that woke to find every other
        rank dead). The journals the dead writers left are written first; then ``status``.

        A log whose run is already over (its status is not ``running``), or whose file
        another process still holds, is left exactly as it is. Returns True if this
        rank closed it with ``status``.
        """
        if self.active or self.path is None or not self.path.is_file():
            return False
        try:
            with h5py.File(self.path, "r") as f:
                if f.attrs.get("format") != FORMAT or str(f.attrs.get("status", "")) != "running":
                    return False
        except (OSError, BlockingIOError):  # held by a live writer, or not a log
            return False
        try:
            self.take_over(None, order=_LAST_ORDER)
            return self.close(status, wait_s=5.0) == status
        except LogError as e:
            print(f"mpipipe: error: {e}", file=sys.stderr, flush=True)
            return False

    def _try_open(self, wait_s: float = 0.0) -> bool:
        """Open a taken-over log (retrying for ``wait_s``) and write what waited.

        Raises:
            LogError: the file is gone, damaged or not a run log (the records waiting
                are written to a side file first).
        """
        takeover = self._takeover
        assert takeover is not None and self.path is not None
        try:
            f = takeover.open(wait_s)
        except LogError:
            self._takeover = None
            raise
        if f is None:
            return False
        # Rows of steps the previous writer got to write are kept once (its, not ours).
        self._writer = LogWriter.reopen(f, self.path, self._clock, keep_rows=True)
        self._takeover = None
        takeover.hand_to(self._writer)
        return True

    def release(self) -> None:
        """Close the file without marking the run finished: another rank writes it now.

        Records still waiting for the file (it never opened) stay in this writer's
        journal, which the next writer writes first (a side file if there is none)."""
        if self._writer is not None:
            self._writer.release()
        elif self._takeover is not None:
            self._takeover.release()
        self._writer, self._takeover, self._continued = None, None, None

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
        if self._writer is None and self._takeover is not None and not self._try_open(wait_s):
            takeover, self._takeover = self._takeover, None
            raise takeover.cannot(f"still held by the run's previous log writer after "
                                  f"{wait_s:.0f} s", status=status)
        if self._writer is None and self._continued is not None and status == "completed":
            self._continue()  # (a run that recorded nothing, yet completed)
        if self._writer is None:
            return status
        writer, self._writer = self._writer, None
        return writer.close(status, self._expected)

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close("completed" if exc_type is None else f"failed: {exc}")


def _continued_start(path: Path, system: str) -> float:
    """The start (``start_unix``) of an existing run log that a resumed run continues,
    checked without writing to it.

    Raises:
        LogError: the file is not a run log of ``system``.
    """
    with h5py.File(path, "r") as f:
        found = (f.attrs.get("format"), f.attrs.get("system"))
        if found != (FORMAT, system):
            raise LogError(f"{path} is not a {system} run log (format "
                           f"{found[0]!r}, system {found[1]!r}); will not write into it")
        return float(f.attrs["start_unix"])  # one time axis
