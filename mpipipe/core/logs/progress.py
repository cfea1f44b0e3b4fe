"""What the printing rank shows: the start-up line, progress, events, evaluations, the summary.

Progress is a `tqdm` bar when the output really is a terminal, and plain lines
every ``run.log_every`` steps otherwise (Slurm output files, CI logs, a pipe).
Both show the elapsed time and an estimate of the time left.

The one throughput figure of the project is defined here (:func:`throughput`):
the summary line, the progress display and ``mpipipe report`` all use it on the
same ``time`` and ``samples`` columns of the run log, so they agree.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

__all__ = ["Progress", "throughput", "THROUGHPUT", "plain_lines", "startup_line", "event_line"]

THROUGHPUT = ("samples/s = samples of steps 2..n / wall seconds from the end of step 1 to the "
              "end of step n (the log's time column: evaluations and checkpoints included; a "
              "resumed run's sessions each leave their first step out, and the time between "
              "them is not counted)")


def throughput(times: Sequence[float], samples: Sequence[float], steps: Sequence[int] | None = None,
               resumed_at: Iterable[int] = ()) -> float:
    """The run's throughput in samples per second of wall time (see :data:`THROUGHPUT`).

    ``times`` and ``samples`` are the ``/steps`` columns ``time`` and ``samples``
    of the log, in row order. Step 1 is left out because it carries start-up
    (first allocations, the pipeline filling). NaN with fewer than two steps.
    A resumed run's log holds sessions (``steps``: the step column; ``resumed_at``:
    the steps of its ``resume`` events): each session's first row is left out as
    step 1 is, and the wall time between sessions (the run was not running) is not
    counted, so the figure is the same in the resumed run's summary and the report.
    Why one definition: a user compares the summary, the progress line and the
    report, and three figures that differ are three figures nobody trusts.
    """
    starts = {0}
    if steps is not None:
        firsts = {int(r) + 1 for r in resumed_at}
        starts |= {i for i, st in enumerate(steps) if int(st) in firsts}
    bounds = [*sorted(starts), len(times)]
    span = done = 0.0
    for a, b in zip(bounds, bounds[1:], strict=False):
        if b - a < 2:
            continue
        span += float(times[b - 1]) - float(times[a])
        done += sum(float(x) for x in list(samples)[a + 1:b] if x is not None and not math.isnan(float(x))
                    and float(x) >= 0)
    return done / span if span > 0 else math.nan


# Launchers whose own stdout tells whether the user watches a terminal.
_LAUNCHERS = frozenset({"mpirun", "mpiexec", "prterun", "orterun", "prte", "srun"})
_MPI_VARS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "SLURM_STEP_ID")


def _parent(pid: int) -> tuple[str, int] | None:
    """(command name, parent pid) of a process from /proc, or None where /proc is not there."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
        return name, int(stat[stat.rindex(")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _launcher_on_terminal() -> bool | None:
    """Whether the mpirun (or srun) that started this process writes to a terminal.

    None when no launcher is among this process's ancestors on this host (a rank
    started by a remote daemon, or no /proc).
    """
    pid = os.getppid()
    for _ in range(8):
        found = _parent(pid)
        if found is None:
            return None
        name, ppid = found
        if name in _LAUNCHERS:
            try:
                target = os.readlink(f"/proc/{pid}/fd/1")
            except OSError:
                return None
            return target.startswith(("/dev/pts/", "/dev/tty"))
        if ppid <= 1:
            return None
        pid = ppid
    return None


def plain_lines(stream: TextIO, environ: Mapping[str, str] | None = None) -> bool:
    """Whether progress must be printed as plain lines rather than a redrawn bar.

    The rule, in order: ``MPIPIPE_PROGRESS=lines`` or ``=bar`` decides (the job
    scripts and CI set ``lines``); a stream that is not a terminal, or
    ``TERM`` unset or ``dumb``, gets lines. Under an MPI launcher ``isatty()`` lies:
    Open MPI gives rank 0 a pseudo-terminal even when mpirun's output goes to a
    file, so the launcher's own standard output decides, and lines are printed
    when the launcher cannot be found on this host (a remote daemon, srun).
    """
    env = os.environ if environ is None else environ
    mode = env.get("MPIPIPE_PROGRESS", "auto")
    if mode in ("lines", "bar"):
        return mode == "lines"
    try:
        if not stream.isatty():
            return True
    except (AttributeError, ValueError):  # a closed or fake stream
        return True
    if env.get("TERM", "dumb") in ("", "dumb"):
        return True
    if any(v in env for v in _MPI_VARS):
        return _launcher_on_terminal() is not True
    return False


def _hosts(hosts: Sequence[str]) -> str:
    """``vm (6 ranks)``, or ``a (ranks 0-3), b (ranks 4-5)``: which ranks run where."""
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    if len(by_host) == 1:
        host, ranks = next(iter(by_host.items()))
        return f"{host} ({len(ranks)} rank{'s' if len(ranks) > 1 else ''})"
    return ", ".join(f"{h} (ranks {spans(r)})" for h, r in by_host.items())


def spans(numbers: Iterable[int], sep: str = ",") -> str:
    """``0-3,6,8-9`` from ranks or steps: what a line names, compressed (any order in)."""
    out: list[str] = []
    for n in sorted(numbers):
        if out and out[-1].split("-")[-1] == str(n - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{n}"
        else:
            out.append(str(n))
    return sep.join(out)


def startup_line(world: int, plan: Sequence[Any], hosts: Sequence[str], log: str | Path | None) -> str:
    """The one line printed when a run starts: world, hosts, plan (roles) and log path.

    ``plan`` is the role of each world rank (anything whose str is ``kind index``),
    ``hosts`` the MPI processor name of each rank (gathered). Why: the first thing
    a user needs to check is that the job they launched is the job that runs.
    """
    by_role: dict[str, list[int]] = {}
    for rank, role in enumerate(plan):
        by_role.setdefault(str(role), []).append(rank)
    roles = ", ".join(f"{role} on {'rank' if len(r) == 1 else 'ranks'} {spans(r)}"
                      for role, r in by_role.items())
    where = f"log {log}" if log else "no log"
    return f"{world} rank{'s' if world != 1 else ''} on {_hosts(hosts)}; plan: {roles}; {where}"


# The console line of each event kind worth one; fields are the event's detail keys
# (seconds printed to the millisecond, a missing key as "?").
_EVENT_LINES = {
    "fault_injected": "fault injected on rank {rank}: {fault}",
    "failure_detected": "rank {rank} ({who}) failed, detected after {detected_after_s} ({how})",
    "takeover": "takeover: stage {stage} (was rank {replaced}) now served by rank {rank}, generation "
                "{generation}, {replay_text}{lost_text}",
    "takeover_recovered": "stage {stage} recovered {recovery_s} after the fault",
    "stage_lost": "stage {stage} lost (rank {rank}, {reason})",
    "rejoined": "rank {rank} rejoined as a backup of stage {stage}, generation {generation}",
    "log_writer_moved": "rank {rank} writes the log now (rank {previous} left the job)",
}


class _Fields(dict):
    def __missing__(self, key: str) -> str:
        return "?"


def event_line(kind: str, step: int, rank: int, detail: Mapping[str, Any]) -> str | None:
    """The console line of a logged event, or None for kinds not worth a line
    (routine ones: replicas, checkpoints, the cost model, ...)."""
    template = _EVENT_LINES.get(kind)
    if template is None:
        return None
    fields = _Fields({k: f"{v:.3f} s" if k.endswith("_s") and isinstance(v, int | float) else v
                      for k, v in detail.items()}, rank=rank)
    # A lost backup has stage -1 and the stage it shadowed in backup_of.
    stage = detail.get("stage")
    fields["who"] = f"backup of stage {detail.get('backup_of', '?')}" if stage == -1 else f"stage {fields['stage']}"
    replay = int(detail.get("replay_step", -1))
    fields["replay_text"] = "finishing the step in flight (no replay)" if replay < 0 else f"replaying step {replay}"
    lost = detail.get("lost_updates")
    fields["lost_text"] = f", {lost} update{'s' if lost != 1 else ''} lost" if isinstance(lost, int) and lost else ""
    return f"step {step}: " + template.format_map(fields)


class Progress:
    """Steps, loss, samples/s, elapsed time and ETA while training, then one summary line.

    Only the printing rank has ``enabled``; the others print nothing. The
    display is a `tqdm` bar or plain lines (:func:`plain_lines`); in lines mode a
    line is printed every ``every`` steps so that an output file stays short.
    :attr:`samples_per_s` is :func:`throughput` over the rows reported so far.
    """

    def __init__(self, total: int, *, enabled: bool = True, every: int = 10, prog: str = "train",
                 stream: TextIO | None = None, quiet: bool = False) -> None:
        self.total = max(int(total), 1)
        self.enabled = enabled  # False on every rank but the printing one
        self.quiet = quiet  # --quiet: only the start-up and summary lines are printed
        self.every = max(int(every), 1)
        self.prog = prog
        self.stream = stream or sys.stdout
        self.tty = enabled and not quiet and not plain_lines(self.stream)
        self._t0 = time.perf_counter()
        self._bar: Any = None
        # the rows seen, for throughput(): the first one, the last one, samples after the first
        self._first: tuple[int, float] | None = None
        self._last: tuple[int, float] | None = None
        self._first_samples = 0.0
        self._after_first = 0.0
        self._clock0 = time.perf_counter()
        self._seen: tuple[int, float] | None = None  # (step, clock) of the first update, for the ETA

    # -- the throughput figure ------------------------------------------------------
    def _record(self, step: int, samples: float, at: float | None) -> None:
        t = (time.perf_counter() - self._clock0) if at is None or math.isnan(at) else float(at)
        s = float(samples) if samples is not None and not math.isnan(float(samples)) else 0.0
        if self._first is None:
            self._first, self._first_samples = (step, t), s
        elif step < self._first[0]:  # a row of an earlier step arrives late (a new log writer)
            self._after_first += self._first_samples
            self._first, self._first_samples = (step, t), s
        else:
            self._after_first += s
        if self._last is None or step >= self._last[0]:
            self._last = (step, t)

    @property
    def samples_per_s(self) -> float:
        """:func:`throughput` of the rows reported so far (NaN before the second)."""
        if self._first is None or self._last is None:
            return math.nan
        span = self._last[1] - self._first[1]
        return self._after_first / span if span > 0 else math.nan

    # -- display ----------------------------------------------------------------------
    def _eta(self, step: int) -> float:
        """Seconds left: the wall time per step since the first update, times the steps left
        (before a second update: the time since start-up per step)."""
        now = time.perf_counter()
        if self._seen is None or step <= self._seen[0]:
            return (now - self._t0) / step * max(self.total - step, 0) if step > 0 else math.nan
        return (now - self._seen[1]) / (step - self._seen[0]) * max(self.total - step, 0)

    def update(self, step: int, *, loss: float = math.nan, samples: float = math.nan,
               time: float | None = None, note: str = "") -> None:
        """Report that ``step`` (1-based count of completed steps) is done.

        ``samples`` and ``time`` are the values of the step's log row (``time``:
        seconds on the log's clock), so that the figure shown is the log's.
        """
        self._record(step, samples, time)
        if self._seen is None:
            self._seen = (step, time_now())
        if not self.enabled or self.quiet:
            return
        sps = self.samples_per_s
        rate = f"{sps:,.1f} samples/s" if not math.isnan(sps) else "- samples/s"
        if self.tty:
            self._draw(step, f"loss {loss:.4f}, {rate}" + (f", {note}" if note else ""))
        elif step % self.every == 0 or step == self.total or note:
            from tqdm import tqdm

            elapsed = tqdm.format_interval(time_now() - self._t0)
            eta = self._eta(step)
            left = tqdm.format_interval(eta) if not math.isnan(eta) else "?"
            print(f"{self.prog}: step {step}/{self.total}  loss {loss:.4f}  {rate}  "
                  f"elapsed {elapsed}  eta {left}" + (f"  {note}" if note else ""),
                  file=self.stream, flush=True)

    def _draw(self, step: int, postfix: str) -> None:
        from tqdm import tqdm

        if self._bar is None:
            self._bar = tqdm(total=self.total, initial=0, file=self.stream, desc=self.prog,
                             # 80x24 where the pty reports 0x0 (tqdm then draws nothing)
                             ncols=shutil.get_terminal_size().columns,
                             nrows=shutil.get_terminal_size().lines,
                             mininterval=0.2, leave=True,
                             bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                                        "[{elapsed}<{remaining}{postfix}]")
        self._bar.set_postfix_str(postfix, refresh=False)
        self._bar.update(step - self._bar.n)

    def message(self, text: str) -> None:
        """Print a line between bar redraws (an event, an evaluation)."""
        if not self.enabled or self.quiet:
            return
        line = f"{self.prog}: {text}"
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
            self.stream.flush()
        else:
            print(line, file=self.stream, flush=True)

    def evaluation(self, step: int, accuracy: float) -> None:
        """Print one evaluation's result (every system prints it the same way)."""
        self.message(f"step {step}: test accuracy {accuracy:.4f}")

    def event(self, kind: str, *, step: int, rank: int, **detail: Any) -> None:
        """Print a logged event worth a line (:func:`event_line`). Call it where the event is
        logged, on the rank that writes the log, so that each is printed once."""
        line = event_line(kind, step, rank, detail)
        if line is not None:
            self.message(line)

    def startup(self, line: str) -> None:
        """Print the start-up line (under ``--quiet`` too, like the summary)."""
        if self.enabled:
            print(f"{self.prog}: {line}", file=self.stream, flush=True)

    def summary(self, **figures: object) -> None:
        """The final line: steps, samples/s, final loss, test accuracy, log path."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        parts = []
        for key, value in figures.items():
            if key == "samples_per_s" and isinstance(value, float):
                value = f"{value:,.1f}"  # as the progress line and the report print it
            elif isinstance(value, float):
                value = f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
            parts.append(f"{key.replace('_', ' ')} {value}")
        print(f"{self.prog}: done: " + ", ".join(parts), file=self.stream, flush=True)


def time_now() -> float:
    """The monotonic clock progress uses (a name, so that ``update``'s ``time`` argument
    does not hide the module)."""
    return time.perf_counter()
