"""A clean collective stop: a fatal data error or a stop signal ends every rank, with a reason.

Why one mechanism: a damaged record (or a label outside the model's classes)
and a SIGINT/SIGTERM both mean "every rank stops now, in agreement, and says
why" -- not "a rank is late", which the pipeline's deadlines and ResPipe's
takeovers would make of it. Each training loop reaches a :class:`StopRun` at a
step boundary (the plain pipeline and Stannis agree on it in a collective, see
:func:`agree`; ResPipe sends it on its control plane), then the log writer
prints one line and closes the log with :attr:`StopRun.status`.

Signals: SIGINT, SIGTERM and SIGUSR1 ask for a stop (:func:`install`). Open MPI 5's
``mpirun`` forwards SIGUSR1 to every rank and goes on; on SIGINT or SIGTERM it
sends its ranks SIGCONT, SIGTERM a quarter second later and SIGKILL a quarter
second after that, too soon for a step boundary. So a clean stop is
``kill -USR1 <mpirun pid>`` (the job scripts turn Slurm's SIGTERM into that);
see docs/pipeline.md, "Stopping a run".
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

__all__ = ["StopRun", "install", "requested", "agree", "agree_code", "stop_from",
           "resume_command", "announce", "ControlStop", "all_reach",
           "flush_and_exit"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
NONE, SIGNAL, DATA = 0, 1, 2  # stop codes, the larger wins when ranks disagree
_requested: str | None = None
_hosts: tuple[str, ...] = ()  # every rank's host, recorded by install()


class StopRun(Exception):  # noqa: N818 - it is a request to stop, not an error of the caller
    """Every rank stops: ``kind`` is ``"data"`` (a fatal data error) or ``"signal"``."""

    def __init__(self, kind: str, message: str, step: int = -1) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.step = step

    @property
    def status(self) -> str:
        """The run log's final status: ``failed: data: ...`` or ``interrupted at step S``."""
        return f"failed: data: {self.message}" if self.kind == "data" \
            else f"interrupted at step {self.step}"

    @property
    def exit_code(self) -> int:
        """2 for a data error (a bad input); 128 + the signal's number for a stop request
        (130 for SIGINT, 143 for SIGTERM and for SIGUSR1, which stands in for SIGTERM)."""
        if self.kind == "data":
            return 2
        return 128 + (signal.SIGINT if self.message == "SIGINT" else signal.SIGTERM)


def _handler(signum: int, frame: Any) -> None:
    global _requested
    if _requested is not None and signum == signal.SIGINT:
        raise KeyboardInterrupt  # a second Ctrl-C: stop now, without agreement
    if _requested is None:
        _requested = signal.Signals(signum).name


def install(hosts: tuple[str, ...] | list[str] = ()) -> None:
    """Turn SIGINT, SIGTERM and SIGUSR1 into a stop request at the next step boundary.

    Why not the default: the default kills the rank in the middle of a step, so the
    others wait for it until a deadline, the log says ``running`` and nothing
    since the last checkpoint is kept. Only the main thread may install handlers.
    """
    global _hosts, _previous
    _hosts = tuple(hosts)  # for resume_command: one host with more ranks than cores?
    for s in STOP_SIGNALS:
        _previous.setdefault(s, signal.signal(s, _handler))


_previous: dict[int, Any] = {}  # the handlers before install: uninstall puts them back


def uninstall() -> None:
    """The handlers as they were before :func:`install`, and no stop request pending: a
    script that called ``mpipipe.train`` goes on with its own Ctrl-C."""
    global _requested
    for s, handler in _previous.items():
        signal.signal(s, handler)
    _previous.clear()
    _requested = None


def requested() -> str | None:
    """The name of the first stop signal this rank received, or None."""
    return _requested


def agree_code(comm: Any, error: str | None) -> int:
    """This rank's stop code (a data error, a signal, or none) as an int for a MAX reduction."""
    return DATA if error else (SIGNAL if _requested else NONE)


def stop_from(comm: Any, worst: int, error: str | None, step: int) -> StopRun | None:
    """After every rank learned the largest stop code ``worst``: the StopRun they all raise.

    Collective when ``worst`` is not NONE (one allgather of small strings, once per run),
    so that every rank knows the failing rank's message and the signal's name.
    """
    if worst == NONE:
        return None
    if worst == DATA:
        first = next(e for e in comm.allgather(error) if e)
        return StopRun("data", first, step)
    names = [n for n in comm.allgather(_requested) if n]
    return StopRun("signal", names[0] if names else "SIGTERM", step)


def agree(comm: Any, error: str | None, step: int) -> StopRun | None:
    """Collective at a step boundary: None to go on, or the StopRun every rank raises.

    ``error`` is this rank's fatal data error (one line naming shard, record and fix),
    or None. A data error anywhere wins over a signal.
    """
    from mpi4py import MPI

    worst = comm.allreduce(agree_code(comm, error), op=MPI.MAX)
    return stop_from(comm, worst, error, step)


def resume_command(directory: str | Path, argv: list[str] | None = None, *,
                   size: int | None = None) -> str:
    """The command that continues this run from the checkpoints in ``directory``.

    The run's own arguments, with ``--resume`` replaced and ``--overwrite`` left out
    (it would replace the log the resumed run continues), under ``mpirun -n SIZE``
    (plus ``--with-ft ulfm`` when this run has it, and ``--oversubscribe`` when its
    ranks all ran on one host with fewer cores than ranks: mpirun refuses that
    without it). SIZE is the whole MPI world, spare ranks included, unless given:
    the command relaunches the whole job.
    """
    from mpipipe.core.mpi import ft

    if size is None:
        from mpi4py import MPI

        size = MPI.COMM_WORLD.Get_size()

    argv = list(sys.argv if argv is None else argv)
    main = Path(argv[0])
    module = main.parent.name if main.name == "__main__.py" else main.name
    rest, skip = [], False
    for a in argv[1:]:
        if skip:
            skip = False
        elif a == "--resume":
            skip = True
        elif a != "--overwrite" and not a.startswith("--resume="):
            rest.append(a)
    crowded = len(set(_hosts)) == 1 and size > (os.cpu_count() or 1)
    mpirun = ["mpirun"] + (["--with-ft", "ulfm"] if ft.ulfm_enabled() else []) + \
        (["--oversubscribe"] if crowded else []) + ["-n", str(size)]
    return shlex.join([*mpirun, "python", "-m", module, *rest, "--resume", str(directory)])


def announce(prog: str, stop: StopRun, *, checkpoint_dir: str | Path | None,
             unresumable: str = "set run.checkpoint_dir to make an interrupted run resumable"
             ) -> None:
    """The one line the log writer prints when the run stops (stderr)."""
    if stop.kind == "data":
        line = f"{prog}: error: data: {stop.message}"
    elif checkpoint_dir is not None:
        line = (f"{prog}: interrupted by {stop.message} at step {stop.step}; checkpoint in "
                f"{checkpoint_dir}; resume with: {resume_command(checkpoint_dir)}")
    else:
        line = (f"{prog}: interrupted by {stop.message} at step {stop.step}; no checkpoint was "
                f"written ({unresumable})")
    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()


class ControlStop:
    """ResPipe's clean stop, on its control plane (its ranks share no collective per step).

    Why not a collective: ranks of a resilient pipeline may be dead, replaced, or a
    step apart, and backups are not in the step at all. Instead:

    - a rank that meets a fatal data error sends STOP(data, message) to every member
      and stops; the others stop as soon as they see it: at a step boundary, in a
      backup's poll, in a round, or while blocked on a peer (the transport's wait
      hook), long before any deadline, so no rank is taken for late or dead;
    - a rank that got a stop signal asks the *decider* (the rank of stage 0); at its
      next step boundary the decider sends STOP(signal, S) with S = its steps done
      + 1. No stage can finish step S + 1 without stage 0, so every stage stops
      with exactly S steps done (one blocked inside step S leaves it: a step
      changes no parameter before its end), writes its checkpoint and tells its
      backups the run is over.

    ``rp`` is ResPipe's membership (``members``, ``route_w``, ``stage``, ``done``,
    ``control``, ``drank``: mpipipe.respipe.membership.Membership); its ``control`` has
    ``send``, ``poll`` and ``quiet`` (mpipipe.respipe.control._Control).
    """

    def __init__(self, rp: Any, code: int, ask_code: int) -> None:
        self.rp = rp
        self.code, self.ask_code = code, ask_code
        self.pending: StopRun | None = None
        self.asked = False

    def _others(self) -> list[int]:
        return [w for w in self.rp.members if w != self.rp.wrank]

    def _send(self, kind: int, step: int, text: str) -> None:
        import numpy as np

        raw = np.frombuffer(text.encode()[:4000], dtype=np.uint8).astype(np.float64)
        vec = [kind, step, *raw.tolist()]
        for w in self._others():
            self.rp.control.send(self.code, self.rp.drank(w), vec, seq=0)

    def poll(self) -> None:
        """Read any STOP waiting from another member (a data error wins over a signal)."""
        if self.rp.control.quiet(self.code):
            return
        for w in self._others():
            msg = self.rp.control.poll(self.code, self.rp.drank(w), seq=0)
            if msg is None:
                continue
            text = bytes(msg[2:].astype("uint8")).decode(errors="replace")
            got = StopRun("data" if int(msg[0]) == DATA else "signal", text, int(msg[1]))
            if self.pending is None or got.kind == "data":
                self.pending = got

    def check(self, boundary: bool) -> None:
        """Raise the StopRun that is due on this rank (``boundary``: between two steps)."""
        rp = self.rp
        self.poll()
        decider = rp.route_w[0] == rp.wrank
        if self.pending is None and _requested is not None and not decider and not self.asked:
            rp.control.send(self.ask_code, rp.drank(rp.route_w[0]), [1], seq=0)
            self.asked = True
        if self.pending is None and decider and boundary:
            asked = _requested is not None or (not rp.control.quiet(self.ask_code) and any(
                rp.control.poll(self.ask_code, rp.drank(w), seq=0) is not None
                for w in self._others()))
            if asked:
                self.pending = StopRun("signal", _requested or "SIGTERM", rp.done + 1)
                self._send(SIGNAL, rp.done + 1, self.pending.message)
        p = self.pending
        if p is not None and (p.kind == "data" or (rp.stage is not None and rp.done >= p.step)):
            raise p

    def fail(self, message: str) -> StopRun:
        """This rank met a fatal data error: tell every member, return the StopRun to raise."""
        self._send(DATA, self.rp.done, message)
        self.rp.control.drain(2.0)
        self.pending = StopRun("data", message, self.rp.done)
        return self.pending


def all_reach(comm: Any, seconds: float) -> bool:
    """Wait (at most ``seconds``) until every rank of ``comm`` got here; False if not all did.

    Why: mpirun ends the whole job, silently, as soon as one rank exits with a non-zero
    status, so a rank that left first took the log writer's stop line (and the log's
    final status) with it. Bounded, and failures swallowed, because a rank that already
    left (or died) must not keep the others from leaving.
    """
    import time

    try:
        request = comm.Ibarrier()
        give_up = time.monotonic() + seconds
        while not request.Test():
            if time.monotonic() > give_up:
                return False
            time.sleep(0.002)
        return True
    except Exception:  # noqa: BLE001 - a failed peer under ULFM: leave anyway
        return False


def exit_at_end(code: int) -> None:
    """Leave without MPI_Finalize once the script ends (the Python API after a takeover):
    registered after mpi4py's own exit hook, so it runs first."""
    import atexit

    atexit.register(flush_and_exit, code)


def flush_and_exit(code: int) -> None:
    """Leave without MPI_Finalize (ResPipe: requests to peers that stopped may be pending)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
