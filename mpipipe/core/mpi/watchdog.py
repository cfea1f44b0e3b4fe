"""A progress watchdog on every rank: a job that stops making progress ends itself, says
where, and leaves a closed log, instead of waiting for an outside time limit.

Why: a fault-tolerant trainer promises that no wait outlives its deadline, but a
defect can still leave a rank waiting forever (a lost message, a round that never
decides). Like NCCL's watchdog, each rank has a thread that looks, once a second, at
when the rank last made progress: a step done, a message received, a round applied
(:func:`beat`). After ``W`` seconds without any (``run.watchdog_s``; 0: the larger of
60 s and 20 median steps; before the rank's first step at least STARTUP_S, for torch's
import, the data's checks and a backup's warm-up), the rank writes its Python stack,
every thread, to ``<log>.stacks/rank-<r>.txt`` after one line of what it waited for
(the transport names the peer, kind, step and micro-batch of the wait; a ResPipe round
names the ranks it waits to hear from). Then:

- the rank that holds the run log waits a few seconds for the other stuck ranks'
  files, prints one line (``<prog>: error: stuck: ...``, who waited for whom at which
  step), closes the log as ``failed: stuck: ...`` (every row written before stays) and
  aborts the job (``MPI_Abort``), so mpirun exits non-zero;
- any other rank says so in one line and waits: its wait may be the writer's long
  work (a Stannis CSD waits in a collective while the host evaluates). If it makes
  progress again it goes on; if not for another ``W``, it aborts the job itself (the
  writer is then gone or stuck where it cannot see it).

An abort must not outlive itself: under ULFM, ``MPI_Abort`` was seen to leave the other
ranks of a stuck job running until an outside time limit. So the writer also leaves a
mark beside the stacks (``abort-<job>``, named for the job's PMIx namespace, so a later
job in the same place is not misled), which every other rank's watchdog looks for each
second and then ends its own process; and a rank whose ``MPI_Abort`` has not ended it
within ABORT_GRACE_S ends itself.

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

__all__ = ["Watchdog", "install", "beat", "waiting", "use_log", "uninstall", "MIN_S", "STEPS",
           "STARTUP_S"]

MIN_S = 60.0  # the automatic limit is never shorter than this ...
STEPS = 20  # ... nor than this many median steps
STARTUP_S = 300.0  # ... nor, before the rank's first step, than this
LOOK_EVERY_S = 1.0
WRITER_WAIT_S = 5.0  # the log's holder waits this long for the other ranks' stack files
ABORT_GRACE_S = 10.0  # a rank still alive this long after its MPI_Abort ends itself
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

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop watching, and wait for the thread to end: a thread woken here but run only
        during the interpreter's exit (a script returning from ``mpipipe.train`` on a busy
        host) was seen to run a weakref callback into torch there, and abort the process."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)

    def limit(self) -> float:
        """W: the configured seconds, or the larger of MIN_S and STEPS median steps (and
        of STARTUP_S before the first step)."""
        if self.seconds > 0:
            return self.seconds
        median = statistics.median(self.step_times) if self.step_times else 0.0
        return max(MIN_S if self.step >= 0 else STARTUP_S, STEPS * median)

    def beat(self, step: int | None = None) -> None:
        now = time.monotonic()
        self.last = now
        if step is not None and step != self.step:
            if self._last_step_at is not None:
                self.step_times.append(now - self._last_step_at)
            self._last_step_at, self.step = now, step

    def _mark(self) -> Path | None:
        """The file that tells every rank of this job that the job is being aborted
        (None outside an MPI job launched by a PMIx runtime)."""
        job = os.environ.get("PMIX_NAMESPACE", "")
        if not job:
            return None
        return self.stacks / ("abort-" + "".join(c if c.isalnum() else "-" for c in job))

    def _run(self) -> None:
        warned_at = None  # a rank without the log: when it last said it was stuck
        mark = self._mark()
        while not self._stop.wait(LOOK_EVERY_S):
            if mark is not None and mark.exists():
                # The writer found the job stuck and aborts it: end this rank too.
                self._dump(self._line(time.monotonic() - self.last))
                self._abort()
                return
            idle = time.monotonic() - self.last
            if warned_at is not None and self.last > warned_at:
                warned_at = None  # progress again: it was only waiting for slow work
            if idle <= self.limit():
                continue
            if self.holds_log():
                self._fire(idle)
                return
            if warned_at is None:
                self._dump(self._line(idle))
                print(f"{self.prog}: rank {self.rank}: no progress for {idle:.0f} s: "
                      f"{_describe(self.wait) or 'not in a wait'}; it aborts the job after "
                      f"{2 * self.limit():.0f} s (stack in {self.stacks})",
                      file=sys.stderr, flush=True)
                warned_at = time.monotonic()
            elif idle > 2 * self.limit():
                self._abort()
                return

    def _line(self, idle: float) -> str:
        where = f"at step {self.step + 1}" if self.step >= 0 else "before the first step"
        what = _describe(self.wait) or "not in a wait (computing, or outside MPI)"
        return f"rank {self.rank} made no progress for {idle:.0f} s {where}: {what}"

    def _dump(self, line: str) -> None:
        """This rank's line and stack, every thread, into its file beside the log."""
        try:
            self.stacks.mkdir(parents=True, exist_ok=True)
            with open(self.stacks / f"rank-{self.rank}.txt", "w") as f:
                f.write(line + "\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError:
            pass

    def _fire(self, idle: float) -> None:
        """The log's holder is stuck: one line naming every stuck rank's wait, the log
        closed as stuck, the job aborted."""
        line = self._line(idle)
        self._dump(line)
        time.sleep(WRITER_WAIT_S)  # the other stuck ranks write their files meanwhile
        others = []
        for p in sorted(self.stacks.glob("rank-*.txt")):
            if p.name != f"rank-{self.rank}.txt":
                try:
                    others.append(p.read_text().splitlines()[0])
                except (OSError, IndexError):
                    pass
        summary = "; ".join([line, *others])
        print(f"{self.prog}: error: stuck: {summary} (limit {self.limit():.0f} s, "
              f"run.watchdog_s; every rank's stack in {self.stacks})", file=sys.stderr, flush=True)
        try:
            self.close_log(f"failed: stuck: {summary}")
        except Exception as e:  # noqa: BLE001 - the line above said what happened
            print(f"{self.prog}: error: stuck, and the log could not be closed: {e}",
                  file=sys.stderr, flush=True)
        mark = self._mark()
        if mark is not None:
            try:
                mark.write_text(summary + "\n")
            except OSError:
                pass
        self._abort()

    def _abort(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        last = threading.Timer(ABORT_GRACE_S, os._exit, args=(EXIT_CODE,))
        last.daemon = True
        last.start()  # MPI_Abort may block, or return without ending this process
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
