"""A progress watchdog on every rank: a job that stops making progress ends itself, says
where, and leaves a closed log, instead of waiting for an outside time limit.

Why: a fault-tolerant trainer promises that no wait outlives its deadline, but a
defect can still leave a rank waiting forever (a lost message, a round that never
decides). Like NCCL's watchdog, each rank has a thread that looks, once a second, at
when the rank last made progress: a step done, a message received, a round applied
(:func:`beat`). After ``W`` seconds without any (``run.watchdog_s``; 0: the larger of
60 s and 20 median steps), the rank

1. writes its Python stack, every thread, to ``<log>.stacks/rank-<r>.txt`` with one
   line of what it waited for (the transport names the peer, kind, step and micro-batch
   of the wait; a ResPipe round names the ranks it waits to hear from);
2. if it holds the run log, waits a few seconds for the other stuck ranks' files,
   prints one line (``<prog>: error: stuck: ...``, who waited for whom at which step),
   and closes the log as ``failed: stuck: ...``; every row written before stays;
3. aborts the job (``MPI_Abort``), so mpirun exits non-zero. A rank that does not hold
   the log first gives the writer time to do step 2.

Nothing here imports torch or touches a communicator before it fires.
"""

from __future__ import annotations

import faulthandler
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

__all__ = ["Watchdog", "install", "beat", "waiting", "use_log", "uninstall", "MIN_S", "STEPS"]

MIN_S = 60.0  # the automatic limit is never shorter than this ...
STEPS = 20  # ... nor than this many median steps
LOOK_EVERY_S = 1.0
WRITER_WAIT_S = 5.0  # the log's holder waits this long for the other ranks' stack files
OTHERS_WAIT_S = 15.0  # a rank without the log gives the holder this long before it aborts
EXIT_CODE = 3


class Watchdog:
    """One rank's watchdog thread (see the module's docstring)."""

    def __init__(self, *, rank: int, seconds: float, stacks: Path, prog: str,
                 holds_log: Callable[[], bool], close_log: Callable[[str], None],
                 abort: Callable[[int], None]) -> None:
        if seconds < 0:
            raise ValueError(f"run.watchdog_s = {seconds}: give 0 (automatic) or a time in "
                             "seconds")
        self.rank, self.seconds, self.stacks, self.prog = rank, float(seconds), stacks, prog
        self.holds_log, self.close_log, self.abort = holds_log, close_log, abort
        self.last = time.monotonic()
        self.step = -1
        self.step_times: deque[float] = deque(maxlen=21)
        self._last_step_at: float | None = None
        # what this rank waits for now: '' (nothing), a phrase, or a transport wait
        # (peer, kind, step, micro), formatted only if the watchdog fires
        self.wait: str | tuple[int, str, int, int] = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpipipe-watchdog", daemon=True)
        self.fired = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def limit(self) -> float:
        """W: the configured seconds, or the larger of MIN_S and STEPS median steps."""
        if self.seconds > 0:
            return self.seconds
        median = statistics.median(self.step_times) if self.step_times else 0.0
        return max(MIN_S, STEPS * median)

    def beat(self, step: int | None = None) -> None:
        now = time.monotonic()
        self.last = now
        if step is not None and step != self.step:
            if self._last_step_at is not None:
                self.step_times.append(now - self._last_step_at)
            self._last_step_at, self.step = now, step

    def _run(self) -> None:
        while not self._stop.wait(LOOK_EVERY_S):
            idle = time.monotonic() - self.last
            if idle > self.limit():
                self._fire(idle)
                return

    def _line(self, idle: float) -> str:
        where = f"at step {self.step + 1}" if self.step >= 0 else "before the first step"
        what = _describe(self.wait) or "not in a wait (computing, or outside MPI)"
        return f"rank {self.rank} made no progress for {idle:.0f} s {where}: {what}"

    def _fire(self, idle: float) -> None:
        self.fired = True
        line = self._line(idle)
        try:
            self.stacks.mkdir(parents=True, exist_ok=True)
            path = self.stacks / f"rank-{self.rank}.txt"
            with open(path, "w") as f:
                f.write(line + "\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError:
            pass
        if self.holds_log():
            end = time.monotonic() + WRITER_WAIT_S
            while time.monotonic() < end:
                time.sleep(0.2)
            others = []
            for p in sorted(self.stacks.glob("rank-*.txt")):
                if p.name != f"rank-{self.rank}.txt":
                    try:
                        others.append(p.read_text().splitlines()[0])
                    except (OSError, IndexError):
                        pass
            summary = "; ".join([line, *others])
            print(f"{self.prog}: error: stuck: {summary} (limit {self.limit():.0f} s, "
                  f"run.watchdog_s; every rank's stack in {self.stacks})",
                  file=sys.stderr, flush=True)
            try:
                self.close_log(f"failed: stuck: {summary}")
            except Exception as e:  # noqa: BLE001 - the line above said what happened
                print(f"{self.prog}: error: stuck, and the log could not be closed: {e}",
                      file=sys.stderr, flush=True)
        else:
            print(f"{self.prog}: rank {self.rank}: stuck: {line}", file=sys.stderr, flush=True)
            time.sleep(OTHERS_WAIT_S)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            self.abort(EXIT_CODE)
        finally:
            os._exit(EXIT_CODE)


def _describe(wait: str | tuple[int, str, int, int]) -> str:
    if isinstance(wait, str):
        return wait
    peer, kind, step, micro = wait
    if not kind:
        return f"waiting for rank {peer} to take a message it was sent"
    return f"waiting for rank {peer} ({kind} of step {step + 1}, micro-batch {micro})"


_active: Watchdog | None = None


def install(dog: Watchdog) -> Watchdog:
    """Make ``dog`` this process's watchdog and start it (one per process)."""
    global _active
    if _active is not None:
        _active.stop()
    _active = dog
    dog.start()
    return dog


def uninstall() -> None:
    global _active
    if _active is not None:
        _active.stop()
    _active = None


def use_log(holds_log: Callable[[], bool], close_log: Callable[[str], None]) -> None:
    """The log the watchdog closes, when a system wraps the run's (Stannis's writer thread)."""
    if _active is not None:
        _active.holds_log, _active.close_log = holds_log, close_log


def beat(step: int | None = None) -> None:
    """This rank made progress (``step``: it finished that step). Costs one clock read."""
    if _active is not None:
        _active.beat(step)


def waiting(what: str | tuple[int, str, int, int]) -> None:
    """What this rank waits for now ('' once the wait is over), for the stuck line: a
    phrase, or a transport wait (peer, kind name, step, micro; kind '': a send to peer)."""
    if _active is not None:
        _active.wait = what
