"""`python -m mpipipe chaos`: a random fault campaign on the user's own ResPipe job.

Each scenario takes the user's configuration and draws, from its own seed: the number
of stages (``--stages``), the mode (``--modes``), R, ``deadline_factor``, the backups,
a short run, and one to three faults (kill, stall, delay, slow) aimed at stages (the
log writer among them), at backups, at steps and micro-batches, sometimes at the same
step. It runs under ``mpirun --with-ft ulfm`` with a time limit and is judged from its
fault list alone against docs/respipe.md:

- ``exact``: completed, every step's row once, and (cold R = 1, hot mode) the losses
  and final parameters of the failure-free run (the plain pipeline, 1e-5);
- ``bound``: completed, every row once with a finite loss, and no takeover lost more
  than R - 1 updates (cold R > 1, neighbour);
- ``refused``: one line at start-up (a fault that can never fire);
- ``lost-stage``: one clean error line where a stage truly ran out of holders (every
  rank that held it was a fault's target);
- otherwise HANG, CRASH, WRONG or UNEXPECTED (see :mod:`mpipipe.tools.campaign`).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpipipe.tools import campaign
from mpipipe.tools.campaign import Job, Scenario, Verdict

if TYPE_CHECKING:
    from mpipipe.core.mpi.roles import LaunchPlan

__all__ = ["add_parser", "main", "judge"]

PROG = "mpipipe chaos"
MODES = ("cold", "hot", "neighbour")
REPLICATE = (1, 3, 10)
DEADLINE_FACTORS = (2.0, 3.0, 5.0)
STEPS = (60, 90)
STALL_S = (1, 2, 4, 7)
TOLERANCE = 1e-5


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "chaos", help="run a random fault campaign on your job and judge every run",
        description="Draw N seeded fault scenarios on your ResPipe job (kills, stalls, "
                    "delays and slow-downs of stages, backups and the log writer; one to three "
                    "at a time), run each under mpirun --with-ft ulfm with a time limit, and "
                    "judge it against what docs/respipe.md promises. Exit status 1 if any run "
                    "hung, crashed, gave a wrong result or ended in a way the docs do not "
                    "allow.",
        epilog="example:\n  python -m mpipipe chaos --config jobs/configs/respipe-digits.toml "
               "--set data.path=data/digits --runs 12 --seed 1",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    campaign.add_chaos_arguments(parser, runs=20)
    parser.add_argument("--modes", default=",".join(MODES),
                        help="resilience modes to draw from (default: cold,hot,neighbour)")
    parser.add_argument("--stages", default="",
                        help="stage counts to draw from, e.g. 3,4 (default: the config's)")
    parser.set_defaults(func=main)
    return parser


@dataclass
class _Reference:
    """What a failure-free run gives the judge: its losses and final tensors."""

    losses: list[float]
    state: list[Any]


class _Campaign:
    """The user's job, and the failure-free references, cached by what they depend on."""

    def __init__(self, args: argparse.Namespace) -> None:
        from mpipipe.core.run.configfile import load_config
        from mpipipe.pipeline.config import PIPELINE_CHOICES, PIPELINE_DEFAULTS

        self.args = args
        self.config = campaign.config_path(args.config)
        self.cfg = load_config(self.config, args.set, PIPELINE_DEFAULTS, PIPELINE_CHOICES)
        self.modes = _words(args.modes, MODES, "--modes")
        self.stages = [int(s) for s in args.stages.split(",") if s.strip()] if args.stages \
            else [int(self.cfg["pipeline"]["stages"])]
        if any(k < 2 for k in self.stages):
            raise ValueError(f"--stages {args.stages}: a pipeline needs at least 2 stages")
        if args.steps and args.steps < 10:
            raise ValueError(f"--steps {args.steps}: give at least 10")
        self.chunks = int(self.cfg["pipeline"]["chunks"])
        self.refs: dict[tuple[str, ...], tuple[Job, _Reference]] = {}
        # On a testbed: the node of each rank, in launch order.
        self.testbed, self.slots = campaign.testbed_slots(args, max(self.stages))

    def draw(self, rng: random.Random, index: int) -> Scenario:
        """Scenario ``index``: knobs and faults, redrawn until every fault can fire."""
        from mpipipe.core.mpi.faults import target_rank
        from mpipipe.core.run.configfile import load_config
        from mpipipe.pipeline.config import PIPELINE_CHOICES, PIPELINE_DEFAULTS
        from mpipipe.pipeline.plan import pipeline_plan

        k = rng.choice(self.stages)
        mode = rng.choice(self.modes)
        r = rng.choice(REPLICATE)
        df = rng.choice(DEADLINE_FACTORS)
        n = self.args.steps or rng.choice(STEPS)
        backups, table = _draw_backups(rng, k, mode, len(self.slots))
        world = k + sum(backups.values())
        keep_cut = k == int(self.cfg["pipeline"]["stages"])
        sets = [*self.args.set, f"pipeline.stages={k}", *([] if keep_cut else ["pipeline.balance=[]"]),
                f"resilience.mode=\"{mode}\"", f"resilience.replicate_every={r}",
                f"resilience.deadline_factor={df}", f"resilience.backups={table}",
                f"run.steps={n}", f"run.eval_every={n // 2}", f"run.checkpoint_every={n}",
                "run.epochs=0"]
        if self.slots:  # a node fault may take a stage with its backup: that is the point
            sets.append("resilience.allow_same_node=true")
        cfg = load_config(self.config, sets, PIPELINE_DEFAULTS, PIPELINE_CHOICES)
        plan = pipeline_plan(cfg, world)
        backup_ranks = plan.ranks_of("backup")
        stage_ranks = [plan.ranks_of("stage", s)[0] for s in range(k)]
        hosts = ["mpt-" + node for node in self.slots[:world]]
        nodes = sorted(set(self.slots[:world]))
        faults = _draw_faults(rng, cfg, plan, n, hosts, nodes, lambda earlier: _fault(
            rng, stage_ranks, backup_ranks, mode, n, self.chunks, earlier))
        knobs = {"K": k, "mode": mode, "R": r, "DF": df, "N": n, "backups": table,
                 "world": world}
        targets = campaign.hit_ranks(faults, hosts, lambda f: target_rank(f, plan))
        facts = {"targets": targets, "stage_ranks": stage_ranks,
                 "nan_ok": _rows_nan_allowed(faults, hosts, plan),
                 "holders": {s: sorted({*plan.ranks_of("stage", s), *plan.ranks_of("backup", s)})
                             for s in range(k)}}
        return Scenario(index, world, sets, faults, knobs, facts)

    def reference(self, sc: Scenario, folder: Path) -> tuple[Job, _Reference]:
        """The plain pipeline's run of the same model, data, cut and steps (no faults)."""
        sets = [s for s in sc.sets if not s.startswith("resilience.")] + \
            ["resilience.backups={}", 'resilience.mode="cold"']
        key = tuple(sets)
        if key not in self.refs:
            # Named by what it depends on: another campaign in the same --out reuses no
            # file of a different reference.
            name = "ref-" + hashlib.sha1("\0".join(key).encode()).hexdigest()[:10]
            log = folder / f"{name}.h5"
            shutil.rmtree(folder / f"{name}-ckpt", ignore_errors=True)
            argv = campaign.python_argv("mpipipe", config=self.config,
                                     sets=[*sets, f'run.checkpoint_dir="{folder / name}-ckpt"'],
                                     faults=[], log=log)
            job = campaign.run_job(sc.knobs["K"], argv, log=log, ulfm=False, timeout=600,
                                testbed=self.testbed)
            if job.rc != 0:
                raise campaign.reference_failed(job)
            ref, why = campaign.read_log(log)
            if ref is None:
                raise campaign.ReferenceFailed(f"the failure-free reference run's log {log} is "
                                            f"unreadable: {why}")
            self.refs[key] = (job, _Reference([float(x) for x in ref.steps["loss"]],
                                              _final_state(folder / f"{name}-ckpt")))
        return self.refs[key]

    def execute(self, sc: Scenario, folder: Path) -> tuple[Job, Verdict]:
        ref_job, ref = self.reference(sc, folder)
        name = f"run-{sc.index}"
        log = folder / f"{name}.h5"
        ckpt = folder / f"{name}-ckpt"
        shutil.rmtree(ckpt, ignore_errors=True)  # (a rerun's: no stale stage file)
        argv = campaign.python_argv("mpipipe", config=self.config,
                                 sets=[*sc.sets, f'run.checkpoint_dir="{ckpt}"'],
                                 faults=sc.faults, log=log)
        timeout = self.args.timeout_factor * ref_job.wall_s + \
            campaign.fault_time(sc.faults, int(sc.knobs["N"])) + 60.0
        job = campaign.run_job(sc.world, argv, log=log, timeout=timeout, testbed=self.testbed)
        return job, judge(sc, job, ckpt, ref)


def _words(text: str, known: tuple[str, ...], option: str) -> list[str]:
    words = [w.strip() for w in text.split(",") if w.strip()]
    bad = [w for w in words if w not in known]
    if bad or not words:
        raise ValueError(f"{option} {text!r}: choose from {', '.join(known)}")
    return words


def _draw_backups(rng: random.Random, k: int, mode: str, slots: int) -> tuple[dict[int, int], str]:
    """Backups per stage and their ``resilience.backups`` table: none in neighbour mode,
    else one for every stage or a drawn 1 or 2 each; on a testbed (``slots`` > 0) no
    more ranks than its slots."""
    if mode == "neighbour":
        backups: dict[int, int] = {}
        table = "{}"
    elif rng.random() < 0.5:
        backups, table = dict.fromkeys(range(k), 1), '"all"'
    else:
        backups = {s: rng.choice((1, 1, 2)) for s in range(k)}
        table = "{" + ", ".join(f"{s} = {b}" for s, b in backups.items()) + "}"
    if slots and k + sum(backups.values()) > slots:
        # On a testbed the ranks fill its slots: as many backups as there are slots
        # left, taken from the last stages first.
        while k + sum(backups.values()) > slots:
            backups[max(s for s, b in backups.items() if b)] -= 1
        table = "{" + ", ".join(f"{s} = {b}" for s, b in backups.items() if b) + "}"
    return backups, table


def _draw_faults(rng: random.Random, cfg: dict, plan: LaunchPlan, n: int, hosts: list[str],
                 nodes: list[str], fault: Callable[[list[str]], str]) -> list[str]:
    """One to three fault specs that can fire together (:func:`campaign.draw_faults`): a
    node fault now and then on a testbed, else ``fault(earlier)``."""
    from mpipipe.core.mpi.faults import check_nodes, parse_all
    from mpipipe.core.run.cli import check_faults

    def draw(_i: int, earlier: list[str]) -> str:
        if nodes and rng.random() < campaign.NODE_FAULT_P:
            return campaign.node_fault(rng, nodes, n)
        return fault(earlier)

    def check(faults: list[str]) -> None:
        check_faults(cfg, plan, faults, n)
        if hosts:
            check_nodes(parse_all(faults), hosts, plan)

    return campaign.draw_faults(rng, draw, check)


def _rows_nan_allowed(faults: list[str], hosts: list[str], plan: LaunchPlan) -> list[int]:
    """The rows whose loss may be NaN.

    A step's loss lives on three ranks (the last stage, the log's writer, the loss
    keeper); docs/respipe.md allows a NaN loss in a row whose three all went at
    once: rows S and S + 1 of a fault step S at which 3 or more ranks were hit.
    """
    from mpipipe.core.mpi.faults import parse_all, target_rank

    at_once: dict[int, list[int]] = {}
    for f, spec in zip(parse_all(faults), faults, strict=True):
        if f.kind in ("kill", "stall", "node-kill", "partition") and not f.round:
            at_once.setdefault(f.step, []).extend(
                campaign.hit_ranks([spec], hosts, lambda g: target_rank(g, plan)))
    return sorted({row for step, hit in at_once.items() if len(set(hit)) >= 3
                   for row in (step, step + 1)})


def _fault(rng: random.Random, stage_ranks: list[int], backup_ranks: list[int], mode: str,
           n: int, chunks: int, earlier: list[str]) -> str:
    """One fault spec: its kind, target (stage 0 writes the log: drawn twice as often),
    step (now and then the step of an earlier fault) and micro-batch, or (after an
    earlier fault) the recovery round itself."""
    kind = rng.choices(("kill", "stall", "delay", "slow"), weights=(4, 4, 1, 1))[0]
    if backup_ranks and kind in ("kill", "stall") and rng.random() < 0.3:
        target, on_backup = f"rank={rng.choice(backup_ranks)}", True
    else:
        target, on_backup = f"stage={rng.choice([0, *range(len(stage_ranks))])}", False
    steps_before = [int(p.split("=")[1]) for f in earlier for p in f.split(":")
                    if p.startswith("step=")]
    step = rng.choice(steps_before) if steps_before and rng.random() < 0.35 \
        else rng.randint(2, n - 3)
    micro = f":micro={rng.randrange(chunks)}" \
        if kind in ("kill", "stall") and rng.random() < 0.3 and (not on_backup or mode == "hot") \
        else ""
    if kind in ("kill", "stall") and not micro and earlier and rng.random() < 0.2:
        # In a round an earlier fault starts (or the one after it): a fault during
        # recovery, before the member's READY or (build=1) after it, right before its build.
        # Which of those comes from what is drawn already, not from rng: every other draw
        # of a seed stays as it was before these were drawn.
        h = zlib.crc32(f"{target}:{step}".encode())
        micro = f":round={2 if h % 3 == 0 else 1}" + (":build=1" if h % 2 else "")
    if kind == "kill":
        return f"kill:{target}:step={step}{micro}"
    if kind == "stall":
        return f"stall:{target}:step={step}{micro}:seconds={rng.choice(STALL_S)}"
    if kind == "delay":
        return f"delay:{target}:p={rng.choice((0.05, 0.1))}:seconds={rng.choice((0.5, 1.0))}"
    stage = int(target.split("=")[1]) if target.startswith("stage=") else 0
    return f"slow:rank={stage_ranks[stage]}:step={step}:factor={rng.choice((2, 3))}"


def _final_state(ckpt: Path) -> list[Any]:
    """Every tensor of the final checkpoints, stage by stage, in order (a merged stage
    holds its neighbour's layers in the same order, so neighbour runs compare too)."""
    import torch

    files = sorted(ckpt.glob("stage-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    tensors = []
    for p in files:
        blob = torch.load(p, weights_only=False)
        tensors += list(blob["params"].values())
    return tensors


def _nan_ok(sc: Scenario) -> frozenset[int]:
    """Rows whose loss the docs allow to be NaN (see :meth:`_Campaign.draw`)."""
    return frozenset(sc.facts.get("nan_ok", ()))


def _stage_may_be_lost(sc: Scenario) -> bool:
    """Do the faults alone allow a clean 'no backup left'? Every rank launched holding
    some stage (the stage's own and its backups) is a target; in neighbour mode, two
    stages are (a stage and the neighbour holding its replica)."""
    hit = set(sc.facts["targets"])
    if sc.knobs["mode"] == "neighbour":
        return len(hit & set(sc.facts["stage_ranks"])) >= 2
    return any(set(holders) <= hit for holders in sc.facts["holders"].values())


def judge(sc: Scenario, job: Job, ckpt: Path, ref: _Reference) -> Verdict:
    """The verdict of one run, from its exit, output and log and the fault list alone."""
    run, verdict = campaign.first_verdict(job)
    if verdict is not None:
        return verdict
    status = str(run.attrs.get("status", ""))
    n = int(sc.knobs["N"])
    errors = job.error_lines()
    if status.startswith("failed: stage"):
        if job.rc != 2 or not errors:
            return Verdict("CRASH", f"exit {job.rc} after {status[:120]!r} (expected 2 and "
                                    "one error line)")
        written = [int(s) for s in run.steps.get("step", [])]
        gaps = campaign.rows_once(run, written[-1] if written else 0, _nan_ok(sc))
        if gaps:
            return Verdict("WRONG", gaps)
        if not _stage_may_be_lost(sc):
            return Verdict("UNEXPECTED", f"{status[:160]}, but the faults leave every stage "
                                         "a holder")
        return Verdict("lost-stage", status[:160])
    if status != "completed" or job.rc != 0:
        return Verdict("CRASH" if status in ("", "running") or job.rc not in (0, 2)
                       else "UNEXPECTED", f"exit {job.rc}, log status {status[:160]!r}")
    gaps = campaign.rows_once(run, n, _nan_ok(sc))
    if gaps:
        return Verdict("WRONG", gaps)
    replaced = {int(e["rank"]) for e in run.events_of("late") + run.events_of("failure_detected")}
    stage_ranks = set(sc.facts["stage_ranks"])
    only_backups = not set(sc.facts["targets"]) & stage_ranks
    stages_replaced = replaced & stage_ranks
    if only_backups and stages_replaced:
        return Verdict("UNEXPECTED", f"only backups were faulted, yet stage rank(s) "
                                     f"{sorted(stages_replaced)} were replaced")
    r = int(sc.knobs["R"])
    lost = [int(e["detail"].get("lost_updates", 0)) for e in run.events_of("takeover")]
    if any(x > r - 1 for x in lost):
        return Verdict("WRONG", f"a takeover lost {max(lost)} updates, more than R - 1 = {r - 1}")
    if sc.knobs["mode"] == "hot" or (sc.knobs["mode"] == "cold" and r == 1):
        off = _compare(run, ckpt, ref)
        if off:
            return Verdict("WRONG", off)
        return Verdict("exact")
    return Verdict("bound")


def _compare(run: Any, ckpt: Path, ref: _Reference) -> str:
    """'' when the losses and final parameters equal the reference's to 1e-5."""
    ref_state = ref.state
    a = [float(x) for x in run.steps["loss"]]
    b = ref.losses
    worst = max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)
    if worst > TOLERANCE:
        step = next(i + 1 for i, (x, y) in enumerate(zip(a, b, strict=True))
                    if abs(x - y) > TOLERANCE)
        return f"loss off the failure-free run by {worst:.2e} (first at step {step})"
    try:
        state = _final_state(ckpt)
    except (OSError, RuntimeError, KeyError) as e:
        return f"final checkpoints unreadable: {e}"
    if len(state) != len(ref_state):
        return f"final state has {len(state)} tensors, the reference {len(ref_state)}"
    diff = max((float((x.double() - y.double()).abs().max()) if x.numel() else 0.0
                for x, y in zip(state, ref_state, strict=True)), default=0.0)
    if diff > TOLERANCE or any(x.shape != y.shape for x, y in zip(state, ref_state, strict=True)):
        return f"final parameters off the failure-free run by {diff:.2e}"
    return ""


def main(args: argparse.Namespace) -> int:
    return campaign.main(args, system="mpipipe", build=_Campaign)
