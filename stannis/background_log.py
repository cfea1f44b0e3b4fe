"""Write the run log from a background thread, so the host's steps do not wait for HDF5.

Rank 0 is also the host, the fastest trainer: every millisecond it spends
appending rows to the HDF5 log (about 10-50 ms per step with five ranks on a
busy machine) is a millisecond every CSD waits at the next gradient exchange.
The writes go through the one `mpipipe.core.logs.runlog.RunLog`, in order, from a thread
that runs while torch computes (torch releases the GIL), and consecutive steps
are written together every quarter second (one resize per dataset for all of
them: about 6 ms of CPU per step with five ranks when written one by one).
Every row keeps the time at which it was recorded, not the time it was written.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from mpipipe.core.logs.logschema import check_columns, event_kind
from mpipipe.core.logs.runlog import RunLog


class BackgroundLog:
    """Forwards ``step``, ``eval``, ``event`` and ``set_attr`` to a RunLog from one thread."""

    #: Seconds the writer gathers records before writing them (what a SIGKILL may lose more).
    BATCH_S = 0.25

    def __init__(self, log: RunLog) -> None:
        self.log = log
        self.path = log.path
        self._queue: queue.Queue[tuple[str, tuple, dict] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="runlog-writer", daemon=True)
        if log.active:
            self._thread.start()

    def _run(self) -> None:
        while True:
            items = [self._queue.get()]
            # Steps are written together, at most every BATCH_S: one resize and one
            # write per dataset for all of them instead of one per row.
            time.sleep(self.BATCH_S)
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            steps: list[dict] = []
            for item in items:
                if item is not None and item[0] == "step":
                    name, args, kwargs = item
                    steps.append({"step": args[0], **kwargs})
                    continue
                self._write_steps(steps)  # before the record that followed them
                steps = []
                if item is None:
                    return
                self._write(*item)
            self._write_steps(steps)

    def _write_steps(self, steps: list[dict]) -> None:
        if steps:
            self._write("steps", (steps,), {})

    def _write(self, name: str, args: tuple, kwargs: dict) -> None:
        try:
            getattr(self.log, name)(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - reported by drain()
            self._error = self._error or e

    def _put(self, name: str, *args: Any, **kwargs: Any) -> None:
        # Checked here, where the record is made, not in the thread (whose error would
        # surface only at drain(), far from the line that made it).
        if name == "event":
            args = (event_kind(args[0]).value, *args[1:])
        elif name == "step":
            check_columns("steps", (k for k in kwargs if k != "ranks"), f"(step {args[0]})")
            for rank, figures in (kwargs.get("ranks") or {}).items():
                check_columns("ranks", figures, f"(rank {rank}, step {args[0]})")
        if not self.log.active:
            return
        if name in ("step", "eval", "event") and kwargs.get("time") is None:
            kwargs["time"] = self.log.elapsed()
        self._queue.put((name, args, kwargs))

    def step(self, *args: Any, **kwargs: Any) -> None:
        self._put("step", *args, **kwargs)

    def eval(self, *args: Any, **kwargs: Any) -> None:
        self._put("eval", *args, **kwargs)

    def event(self, *args: Any, **kwargs: Any) -> None:
        self._put("event", *args, **kwargs)

    def set_attr(self, *args: Any, **kwargs: Any) -> None:
        self._put("set_attr", *args, **kwargs)

    def elapsed(self) -> float:
        return self.log.elapsed()

    def drain(self) -> None:
        """Wait until every record is written.

        Raises:
            Exception: the first error the writer met (a full disk, say).
        """
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._error is not None:
            raise self._error
