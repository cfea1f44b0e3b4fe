"""A random fault campaign on the user's own job: draw scenarios, run each under a time
limit with real mpirun and ULFM, and hold its end against what the docs promise.

Why a command and not only tests: a user trusts a fault-tolerant trainer only once it
survived faults nobody planned, on their own model and configuration. Each system
supplies how to draw a scenario and how to judge its end (``mpipipe.respipe.chaos`` for
ResPipe, ``stannis.chaos`` for Stannis); this module runs the campaign: seeds, time
limits, cleanup, the table and the JSON lines.

Every scenario is drawn from its own seed (the campaign's seed and its index), so
``--only i`` reruns scenario i alone, exactly. Every process a run starts lives in a
session of its own and is killed by session id when the run ends or times out
(:func:`mpipipe.tools.launch.kill_job`), never by name.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from mpipipe.tools.emulator import Testbed, TestbedError, load, running
from mpipipe.tools.launch import JobTimeout, run_mpi

__all__ = ["Scenario", "Job", "Verdict", "GOOD", "BAD", "add_chaos_arguments", "parse_budget",
           "ReferenceFailed", "reference_failed",
           "run_job", "campaign", "read_log", "first_verdict", "rows_once", "fault_time", "main",
           "testbed_slots", "node_fault", "hit_ranks"]

# What a run may end as. The good verdicts are those the docs promise; the bad ones are
# defects: HANG (the outer time limit, or the progress watchdog, ended it), CRASH (a
# traceback, an unexpected exit status, a log left open), WRONG (a wrong result: a
# missing, doubled or NaN row, parameters off the reference), UNEXPECTED (a clean end
# the docs do not allow for this fault list).
GOOD = ("exact", "bound", "completed", "refused", "lost-stage", "host-lost")
BAD = ("HANG", "CRASH", "WRONG", "UNEXPECTED")


@dataclass
class Scenario:
    """One drawn run: the overrides and faults added to the user's command."""

    index: int
    world: int
    sets: list[str]
    faults: list[str]
    knobs: dict[str, Any] = field(default_factory=dict)  # what was drawn, for the table
    facts: dict[str, Any] = field(default_factory=dict)  # what the judge needs to know

    def describe(self) -> str:
        knobs = " ".join(f"{k}={v}" for k, v in self.knobs.items())
        return f"{knobs} | {' '.join(self.faults) or 'no fault'}"


@dataclass
class Job:
    """How one mpirun ended."""

    rc: int | None  # None: killed at the time limit
    wall_s: float
    stdout: str
    stderr: str
    log: Path

    @property
    def timed_out(self) -> bool:
        return self.rc is None

    def error_lines(self) -> list[str]:
        """The lines a clean end prints on stderr (``prog: error: ...``)."""
        return [ln for ln in self.stderr.splitlines() if ": error: " in ln]

    def first_error(self) -> str:
        """The one line that says why the job failed: the first ``prog: error:`` line
        (without its prefix), else a traceback's last line, else stderr's first line."""
        errors = self.error_lines()
        if errors:
            return errors[0].split(": error: ", 1)[1].strip()
        trace = self.traceback()
        if trace:
            return trace
        return next((ln.strip() for ln in self.stderr.splitlines() if ln.strip()),
                    "it printed nothing on stderr")

    def traceback(self) -> str | None:
        """The first line of a Python traceback on stderr, if any rank printed one."""
        for ln in self.stderr.splitlines():
            if ln.startswith("Traceback (most recent call last)"):
                tail = self.stderr[self.stderr.index(ln):].splitlines()
                last = next((t for t in tail[1:] if t and not t.startswith(" ")), "")
                return last[:300] or "Traceback"
        return None


@dataclass
class Verdict:
    name: str  # one of GOOD or BAD
    why: str = ""

    @property
    def bad(self) -> bool:
        return self.name in BAD


def parse_budget(text: str | None) -> float | None:
    """``"20m"``, ``"90s"``, ``"1h"`` or plain seconds -> seconds (None: no budget).

    Raises:
        argparse.ArgumentTypeError: anything else, named.
    """
    if text in (None, ""):
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"--budget {text!r}: give a time such as 20m, 90s or 1h")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def add_chaos_arguments(parser: argparse.ArgumentParser, *, runs: int) -> None:
    """The options both systems' chaos commands share."""
    parser.add_argument("--config", metavar="FILE", required=True,
                        help="the job to test: the TOML configuration you train with")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                        help="override a key of every run, as with train (repeatable)")
    parser.add_argument("--runs", type=int, default=runs, metavar="N",
                        help=f"scenarios to draw (default {runs})")
    parser.add_argument("--seed", type=int, default=0, metavar="S",
                        help="the campaign's seed; scenario i is drawn from (S, i) alone")
    parser.add_argument("--only", type=int, metavar="I",
                        help="rerun scenario I of this seed alone (the JSON lines give it)")
    parser.add_argument("--budget", type=parse_budget, metavar="TIME",
                        help="start no new scenario after this much time, e.g. 20m")
    parser.add_argument("--steps", type=int, default=0, metavar="N",
                        help="steps per run (default: drawn, short)")
    parser.add_argument("--out", metavar="DIR",
                        help="keep every run's log and output here (default: a temporary "
                             "folder, removed unless a run went wrong)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON line per scenario instead of the table")
    parser.add_argument("--timeout-factor", type=float, default=4.0, metavar="F",
                        help="a run is HANG after F x its failure-free time + stalls + 60 s "
                             "(default 4)")
    parser.add_argument("--testbed", metavar="FILE",
                        help="run every scenario across the nodes of this emulated cluster "
                             "(docs/testbed.md; root only; brought up and down here unless "
                             "it is up already) and draw whole-node faults too: node-kill "
                             "and partition")


class ReferenceFailed(Exception):
    """The failure-free run that every scenario is measured against did not end well.

    Why an exception of its own: then the user's job itself does not run (a wrong path,
    a bad key), so no scenario can be judged, and the campaign stops with one line
    (:func:`main`) instead of a traceback; its message names the job's first error line
    and the file that holds the rest."""


def reference_failed(job: Job, what: str = "the failure-free reference run") -> ReferenceFailed:
    """The one-line error of a failure-free run that ``job`` ended badly (its output is
    beside the log: ``.err``)."""
    err = job.log.with_suffix(".err")
    if job.timed_out:
        return ReferenceFailed(f"{what} did not end within its time limit; its output is in {err}")
    return ReferenceFailed(f"{what} failed (exit {job.rc}): {job.first_error()}; the rest is in {err}")


def run_job(world: int, argv: Sequence[str], *, log: Path, timeout: float,
            ulfm: bool = True, testbed: Testbed | None = None) -> Job:
    """Run ``python ARGV`` on ``world`` ranks with :func:`mpipipe.tools.launch.run_mpi`
    (on the time limit every rank prints its stack, then the job's whole session is
    killed), across ``testbed``'s nodes if given; its output also goes beside the log
    (``.out``, ``.err``).

    The job runs in this process's directory, the one the user started the campaign
    in: relative paths of the configuration and of ``--set`` (data, checkpoints, a
    factory's file) then resolve as they do for ``train`` started there."""
    start = time.monotonic()
    rc: int | None
    try:
        done = run_mpi(world, list(argv), ulfm=ulfm, timeout=timeout,
                       env={"MPIPIPE_PROGRESS": "lines"}, testbed=testbed, cwd=Path.cwd())
        rc, out, err = done.returncode, done.stdout, done.stderr
    except JobTimeout as e:
        rc, out, err = None, e.stdout or "", e.stderr or ""
    out, err = (t.decode(errors="replace") if isinstance(t, bytes) else t for t in (out, err))
    log.with_suffix(".out").write_text(out)
    log.with_suffix(".err").write_text(err)
    return Job(rc, time.monotonic() - start, out, err, log)


NODE_FAULT_P = 0.4  # on a testbed: how often a drawn fault takes a whole node
PARTITION_S = (2, 4, 7)


def testbed_slots(args: argparse.Namespace, need: int) -> tuple[Testbed | None, list[str]]:
    """``--testbed``: the testbed, and the node of each MPI slot in launch order (ranks
    fill the slots in file order); (None, []) without it.

    Raises:
        ValueError: its nodes have fewer than ``need`` slots (or the file is bad).
    """
    if not getattr(args, "testbed", None):
        return None, []
    bed = load(args.testbed)
    slots = [n.name for n in bed.nodes for _ in range(n.slots)]
    if len(slots) < need:
        raise ValueError(f"--testbed {args.testbed}: its nodes have {len(slots)} MPI slots, "
                         f"fewer than the {need} ranks the smallest scenario needs; give "
                         "the nodes more slots")
    return bed, slots


def node_fault(rng: random.Random, nodes: Sequence[str], steps: int, *,
               partition: bool = True) -> str:
    """A whole-node fault on a testbed: every process of a node killed, or (``partition``:
    the system finds an unreachable rank) its link down."""
    node, step = rng.choice(list(nodes)), rng.randint(2, steps - 3)
    if not partition or rng.random() < 0.5:
        return f"node-kill:node={node}:step={step}"
    return f"partition:node={node}:step={step}:seconds={rng.choice(PARTITION_S)}"


def draw_faults(rng: random.Random, draw: Callable[[int, list[str]], str],
                check: Callable[[list[str]], None]) -> list[str]:
    """A scenario's faults: one to three specs, the i-th ``draw(i, earlier)``, each redrawn
    (up to 20 times) until ``check`` accepts it with the ones before it (it raises
    ``FaultError`` for a list that cannot fire as written); after 20 refusals it is left out.

    Why one place: the order of the draws is what makes a seeded scenario the same
    scenario on every machine, for every system's campaign."""
    from mpipipe.core.mpi.faults import FaultError

    faults: list[str] = []
    for i in range(rng.choice((1, 1, 2, 2, 3))):
        for _attempt in range(20):
            spec = draw(i, faults)
            try:
                check([*faults, spec])
            except FaultError:
                continue
            faults.append(spec)
            break
    return faults


def hit_ranks(faults: Sequence[str], hosts: Sequence[str],
              rank_of: Callable[[Any], int | None]) -> list[int]:
    """Every rank a fault aims at: ``rank_of(fault)`` for a rank's or a stage's, and every
    rank on the node (``hosts``: each rank's host) for a node fault."""
    from mpipipe.core.mpi.faults import parse_all

    hit: set[int] = set()
    for f in parse_all(faults):
        if f.node is None:
            r = rank_of(f)
            hit.update([] if r is None else [r])
        else:
            hit.update(i for i, h in enumerate(hosts) if h == "mpt-" + f.node)
    return sorted(hit)


def fault_time(faults: Sequence[str], steps: int) -> float:
    """Seconds the faults themselves may add to a run, for its time limit: each stall,
    a delay's expected sleeps three times over, 30 s for a slow-down, and, for a fault
    inside a recovery round (``round=1``), the round's wait for the build besides."""
    from mpipipe.core.mpi.faults import parse_all

    total = 0.0
    for f in parse_all(faults):
        if f.round:
            total += 30.0  # ResPipe's BUILD_WAIT_S (15 s) twice: the faulted rank's own
        if f.kind in ("stall", "partition"):
            total += f.seconds
        elif f.kind == "delay":
            total += steps * f.p * f.seconds * 3
        elif f.kind == "slow":
            total += 30.0
    return total


def read_log(path: Path) -> tuple[Any | None, str]:
    """The run's log, or None and why it cannot be read."""
    from mpipipe.core.logs.runlog import LogError, open_log

    try:
        return open_log(path), ""
    except LogError as e:
        return None, str(e)


def first_verdict(job: Job) -> tuple[Any, Verdict | None]:
    """What every system judges alike, before its own rules: (the run's log or None, a
    verdict or None). A time-out or the watchdog is a HANG, a traceback a CRASH; no
    readable log is ``refused`` after one start-up line about a fault, else a CRASH."""
    if job.timed_out:
        return None, Verdict("HANG", "killed at the time limit")
    trace = job.traceback()
    if trace:
        return None, Verdict("CRASH", f"traceback: {trace}")
    run, why = read_log(job.log)
    if run is None:
        errors = job.error_lines()
        if job.rc == 2 and errors and "fault" in errors[0]:
            return None, Verdict("refused", errors[0])
        return None, Verdict("CRASH", f"exit {job.rc}, no readable log: {why}")
    status = str(run.attrs.get("status", ""))
    if "stuck" in status:
        return run, Verdict("HANG", f"the watchdog ended it: {status[:200]}")
    return run, None


def rows_once(run: Any, last: int | None, nan_ok: frozenset[int] = frozenset()) -> str:
    """Why the log's step rows are not 1..last once each with a finite loss ('' if they
    are; ``last`` None: up to the last row written). ``nan_ok``: rows whose loss the
    docs allow to be lost (NaN)."""
    steps = [int(s) for s in run.steps.get("step", [])]
    last = (steps[-1] if steps else 0) if last is None else last
    if steps != list(range(1, last + 1)):
        missing = sorted(set(range(1, last + 1)) - set(steps))
        doubled = sorted({s for s in steps if steps.count(s) > 1})
        return (f"step rows are not 1..{last} once each (missing {missing[:8]}, "
                f"doubled {doubled[:8]})")
    bad = [s for s, v in zip(steps, run.steps.get("loss", []), strict=False)
           if not math.isfinite(float(v)) and s not in nan_ok]
    return f"non-finite loss at steps {bad[:8]}" if bad else ""


def main(args: argparse.Namespace, *, system: str, build: Callable[[argparse.Namespace], Any]
         ) -> int:
    """``python -m SYSTEM chaos``: build the system's campaign (``build(args)``, with
    ``draw`` and ``execute``; a bad option is a ValueError, one line, exit 2) and run it.
    A failure-free run that fails (:class:`ReferenceFailed`) is one line too, exit 2."""
    try:
        camp = build(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"{system} chaos: error: {e}", file=sys.stderr)
        return 2
    bed = getattr(camp, "testbed", None)
    try:
        if bed is None:
            return campaign(args, prog=f"python -m {system} chaos", argv=sys.argv[2:],
                            draw=camp.draw, execute=camp.execute)
        with running(bed):
            return campaign(args, prog=f"python -m {system} chaos", argv=sys.argv[2:],
                            draw=camp.draw, execute=camp.execute)
    except TestbedError as e:
        print(f"{system} chaos: error: --testbed {args.testbed}: {e}", file=sys.stderr)
        return 2
    except ReferenceFailed as e:
        print(f"{system} chaos: error: {e}", file=sys.stderr)
        return 2


def _rerun(prog: str, argv: Sequence[str], seed: int, index: int) -> str:
    """The command line that reruns one scenario alone."""
    keep: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--only", "--runs", "--seed", "--budget"):
            skip = True
            continue
        if a.startswith(("--only=", "--runs=", "--seed=", "--budget=")) or a == "--json":
            continue
        keep.append(a)
    return shlex.join([*prog.split(), *keep, "--seed", str(seed), "--only", str(index)])


def campaign(args: argparse.Namespace, *, prog: str, argv: Sequence[str],
             draw: Callable[[random.Random, int], Scenario],
             execute: Callable[[Scenario, Path], tuple[Job, Verdict]]) -> int:
    """Draw and run the scenarios; print the table (or JSON lines); exit status 0 when no
    run ended HANG, CRASH, WRONG or UNEXPECTED, else 1.

    ``draw(rng, index)`` returns scenario ``index`` from its own generator;
    ``execute(scenario, folder)`` runs it and judges its end.
    """
    if args.runs < 1:
        print(f"{prog}: error: --runs must be at least 1", file=sys.stderr)
        return 2
    if args.only is not None and not 0 <= args.only:
        print(f"{prog}: error: --only must be a scenario index (0 or more)", file=sys.stderr)
        return 2
    keep = args.out is not None
    folder = Path(args.out) if keep else Path(tempfile.mkdtemp(prefix="mpipipe-chaos-"))
    folder.mkdir(parents=True, exist_ok=True)
    jsonl = folder / "chaos.jsonl"
    indices = [args.only] if args.only is not None else list(range(args.runs))
    tally: dict[str, int] = {}
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    if not args.json:
        print(f"{prog}: {len(indices)} scenario(s), seed {args.seed}; logs in {folder}",
              flush=True)
        print(f"{'#':>3}  {'verdict':<10} {'wall s':>7}  scenario", flush=True)
    with open(jsonl, "a") as lines:
        for i in indices:
            if args.budget is not None and time.monotonic() - t0 > args.budget:
                print(f"{prog}: budget of {args.budget:.0f} s spent after {len(rows)} "
                      f"scenario(s); the rest not run", file=sys.stderr, flush=True)
                break
            scenario = draw(random.Random(f"{args.seed}:{i}"), i)
            job, verdict = execute(scenario, folder)
            tally[verdict.name] = tally.get(verdict.name, 0) + 1
            rows.append(_record(lines, args, i, scenario, job, verdict,
                                _rerun(prog, argv, args.seed, i)))
    bad = sum(n for v, n in tally.items() if v in BAD)
    if not args.json:
        _print_tally(tally, rows, time.monotonic() - t0, jsonl)
    if not keep and not bad:
        shutil.rmtree(folder, ignore_errors=True)
    return 1 if bad else 0


def _record(lines: TextIO, args: argparse.Namespace, i: int, scenario: Scenario, job: Job,
            verdict: Verdict, rerun: str) -> dict[str, Any]:
    """Scenario ``i``'s row, written to the JSON lines at once (a campaign cut short
    keeps every row run), then printed as it is (--json) or as a line of the table
    (with the reason of a bad verdict below it)."""
    row = {"index": i, "seed": args.seed, "verdict": verdict.name, "why": verdict.why,
           "wall_s": round(job.wall_s, 2), "rc": job.rc, "world": scenario.world,
           "knobs": scenario.knobs, "faults": scenario.faults, "sets": scenario.sets,
           "log": str(job.log), "rerun": rerun}
    lines.write(json.dumps(row) + "\n")
    lines.flush()
    if args.json:
        print(json.dumps(row), flush=True)
    else:
        print(f"{i:>3}  {verdict.name:<10} {job.wall_s:>7.1f}  {scenario.describe()}"
              + (f"\n{'':>23}{verdict.why}" if verdict.why and verdict.bad else ""),
              flush=True)
    return row


def _print_tally(tally: Mapping[str, int], rows: Sequence[Mapping[str, Any]], elapsed: float,
                 jsonl: Path) -> None:
    """The table's end: the verdicts counted, the JSON lines' file, and the command that
    reruns each bad scenario."""
    walls = sorted(r["wall_s"] for r in rows)
    median = walls[len(walls) // 2] if walls else 0.0
    print("tally: " + ", ".join(f"{v} {tally.get(v, 0)}" for v in (*GOOD, *BAD)
                                if tally.get(v, 0) or v in BAD)
          + f"; {len(rows)} run(s) in {elapsed:.0f} s, median "
            f"{median:.1f} s a run", flush=True)
    print(f"JSON lines: {jsonl}", flush=True)
    for r in rows:
        if r["verdict"] in BAD:
            print(f"rerun #{r['index']}: {r['rerun']}", flush=True)


def python_argv(command: str, *, config: str, sets: Sequence[str], faults: Sequence[str],
                log: Path, extra: Sequence[str] = ()) -> list[str]:
    """``-m <command> train --config C --set ... --inject ... --log L``: a run's argv."""
    argv = ["-m", command, "train", "--quiet", "--config", config, "--log", str(log), "--overwrite"]
    for s in sets:
        argv += ["--set", s]
    for f in faults:
        argv += ["--inject", f]
    return [*argv, *extra]


def config_path(path: str) -> str:
    """The configuration as an absolute path (the campaign's own checks read it too)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--config {path}: no such file")
    return str(p.resolve())

