"""Taking a run log over from its writer: the records of a rank that became the writer
wait, in order and with the times they were made, until the file can be opened, and
what cannot be written there goes to a side file.

Why wait: HDF5's file lock keeps two writers apart, but it is off on many parallel file
systems (HDF5_USE_FILE_LOCKING=FALSE), and a replaced writer still holding the file open
would overwrite our rows when it closes; so the file opens only once the previous writer
has let go (``ready``) and the lock is free. The waiting records also go to a journal
(mpipipe/core/logs/logjournal.py), so that a new writer killed before the file freed up
does not take them along.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import h5py

from mpipipe.core.logs.logformat import FORMAT, LogError
from mpipipe.core.logs.logjournal import Journal, replay
from mpipipe.core.logs.logwriter import TIMED_RECORDS, Clock, LogWriter, last_step

__all__ = ["Takeover", "RETRY_OPEN_S"]

RETRY_OPEN_S = 0.25  # how often a new writer tries again to open a file still locked

_Waiting = list[tuple[str, tuple, dict]]


class Takeover:
    """A writer that took the log over and waits for its file: the records held until it
    opens, and this writer's journal."""

    def __init__(self, path: Path, clock: Clock, system: str, ready: Callable[[], bool] | None,
                 order: int) -> None:
        self._path = path
        self._clock = clock
        self._system = system
        self._ready = ready  # has the previous writer let go? (None: it is dead)
        self._queue: _Waiting | None = []
        self._next_open = 0.0
        self._journal = Journal.start(path, order, clock.start)

    def hold(self, name: str, args: tuple, kwargs: dict) -> None:
        """Keep one record until the file opens (in memory and in the journal), stamped
        with the time it was made, not when the file opened."""
        now = self._clock.elapsed()
        if name == "_steps":
            args = ([{**r, "time": now if r.get("time") is None else r["time"]} for r in args[0]],)
        elif name in TIMED_RECORDS and kwargs.get("time") is None:
            kwargs = {**kwargs, "time": now}
        if self._queue is not None:
            self._queue.append((name, args, kwargs))
        if self._journal is not None and not self._journal.add(name, args, kwargs):
            self._journal = None

    def open(self, wait_s: float = 0.0) -> h5py.File | None:
        """The log file, opened for writing once the previous writer has let go (retrying
        for ``wait_s``); None while it still holds it.

        Raises:
            LogError: the file is gone, damaged or not a run log (the records waiting
                are written to a side file first).
        """
        give_up = time.monotonic() + wait_s
        while True:
            now = time.monotonic()
            if now >= self._next_open:
                self._next_open = now + RETRY_OPEN_S
                if self._ready is None or self._ready():
                    self._ready = None  # once let go, always
                    f = self._open_file()
                    if f is not None:
                        return f
            if now >= give_up:
                return None
            time.sleep(min(RETRY_OPEN_S, max(give_up - now, 0.0)))

    def _open_file(self) -> h5py.File | None:
        """The file opened for writing; None while HDF5's lock is held."""
        try:
            f = h5py.File(self._path, "r+")  # never create: a missing file is an error
        except BlockingIOError:  # the previous writer still holds the lock
            return None
        except OSError as e:
            raise self.cannot(f"cannot open it ({e})") from None
        if f.attrs.get("format") != FORMAT:
            f.close()
            raise self.cannot("not an mpipipe run log; will not write into it")
        return f

    def hand_to(self, writer: LogWriter) -> None:
        """Write what waited into the file just opened: the journals of earlier writers
        first (in the order of their hand-overs), then this writer's records; then remove
        this writer's journal."""
        queue, self._queue = self._queue or [], None
        replay(self._path, self._clock.start, None if self._journal is None else self._journal.path,
               writer.record)
        for name, args, kwargs in queue:
            writer.record(name)(*args, **kwargs)
        self._drop_journal()

    def release(self) -> None:
        """Stop waiting: another rank writes the log now. The records still waiting stay
        in this writer's journal, which the next writer writes first (a side file if
        there is none)."""
        if self._queue and self._journal is None:
            self._spill("released: another rank writes the run log now", "running")
        self._drop_journal(keep=bool(self._queue))  # the next writer writes its records

    def cannot(self, why: str, status: str = "running") -> LogError:
        """Give up on the file: spill what waited, stop writing, and say where it went."""
        waiting = bool(self._queue)
        spilled = self._spill(why, status) if waiting or status != "running" else None
        self._queue = None
        self._drop_journal(keep=waiting and spilled is None)
        where = f"; {len(spilled[1])} waiting records are in {spilled[0]}" if spilled else ""
        return LogError(f"{self._path}: {why}{where}")

    def _drop_journal(self, keep: bool = False) -> None:
        """Close this writer's journal; remove it unless ``keep`` (left for the next writer)."""
        journal, self._journal = self._journal, None
        if journal is not None:
            journal.close(keep)

    def _spill(self, why: str, status: str) -> tuple[Path, _Waiting] | None:
        """Write the waiting records to ``<log>.tail.h5``, a run log of its own (same time
        axis, run ``status``), so that nothing this rank recorded is lost. None if that
        failed too."""
        queue = self._queue or []
        tail = self._path.with_name(self._path.stem + ".tail.h5")
        n = 2
        while tail.exists():  # an earlier spill of this run stays as it is
            tail = self._path.with_name(f"{self._path.stem}.tail-{n}.h5")
            n += 1
        through = None
        try:  # rows the main file has already (best effort: it may be locked)
            with h5py.File(self._path, "r") as f:
                through = last_step(f)
        except (OSError, KeyError):
            pass
        try:
            # a row goes to one of the two files only (written_through)
            side = LogWriter.create(tail, system=self._system, config={}, comm_size=0, clock=self._clock,
                                    attrs={"continues": str(self._path), "why": why}, written_through=through)
            for name, args, kwargs in queue:
                side.record(name)(*args, **kwargs)
            side.close(status)
        except (OSError, LogError) as e:
            print(f"mpipipe: error: {len(queue)} log records lost: cannot write {tail}: {e}",
                  file=sys.stderr, flush=True)
            return None
        return tail, queue
