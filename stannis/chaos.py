"""`python -m stannis chaos`: a random fault campaign on the user's own Stannis job.

Each scenario takes the user's configuration and draws, from its own seed, a short run
and one to three faults: kills, stalls and slow-downs of CSDs (several at once, some at
a re-tune step, where the plan changes) and, now and then, a kill of the host. It runs
under ``mpirun --with-ft ulfm`` with a time limit and is judged from its fault list
alone against docs/stannis.md:

- ``completed``: every step's row once with a finite loss, and no CSD dropped that no
  fault hit (a dropped CSD's records are counted as lost, as documented);
- ``host-lost``: the host was killed; the survivors end with one error line and the
  rows the host wrote stay readable (the host writes the log, so it cannot close it);
- ``refused``: one line at start-up;
- otherwise HANG, CRASH, WRONG or UNEXPECTED (see :mod:`mpipipe.tools.campaign`).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from mpipipe.tools import campaign
from mpipipe.tools.campaign import Job, Scenario, Verdict

__all__ = ["main", "add_arguments", "judge"]

PROG = "stannis chaos"
STEPS = (40, 60)
STALL_S = (1, 2, 4, 8)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    campaign.add_chaos_arguments(parser, runs=12)
    parser.add_argument("--host-kills", type=float, default=0.1, metavar="P",
                        help="share of scenarios that kill the host too (default 0.1)")


class _Campaign:
    def __init__(self, args: argparse.Namespace) -> None:
        from mpipipe.core.run.configfile import load_config

        from .config import STANNIS_CHOICES, STANNIS_DEFAULTS

        self.args = args
        self.config = campaign.config_path(args.config)
        self.cfg = load_config(self.config, args.set, STANNIS_DEFAULTS, STANNIS_CHOICES)
        self.csds = int(self.cfg["stannis"]["csds"])
        if self.csds < 1:
            raise ValueError("stannis.csds must be at least 1 for a fault campaign")
        if args.steps and args.steps < 10:
            raise ValueError(f"--steps {args.steps}: give at least 10")
        if not 0 <= args.host_kills <= 1:
            raise ValueError(f"--host-kills {args.host_kills}: give a share between 0 and 1")
        self.retune = int(self.cfg["stannis"]["retune_every"])
        # On a testbed: the node of each rank, in launch order.
        self.testbed, self.slots = campaign.testbed_slots(args, 1 + self.csds)

    def draw(self, rng: random.Random, index: int) -> Scenario:
        from mpipipe.core.mpi.faults import check_nodes, check_reachable, parse_all
        from mpipipe.core.run.configfile import load_config

        from .config import STANNIS_CHOICES, STANNIS_DEFAULTS, stannis_plan

        n = self.args.steps or rng.choice(STEPS)
        world = 1 + self.csds
        sets = [*self.args.set, f"run.steps={n}", f"run.eval_every={n // 2}"]
        cfg = load_config(self.config, sets, STANNIS_DEFAULTS, STANNIS_CHOICES)
        plan = stannis_plan(cfg, world)
        kill_host = rng.random() < self.args.host_kills
        hosts = ["mpt-" + node for node in self.slots[:world]]
        # the host's node never: no run survives losing the host (check_nodes refuses it)
        nodes = sorted(set(self.slots[1:world]) - set(self.slots[:1]))

        def draw(i: int, earlier: list[str]) -> str:
            if nodes and not (kill_host and i == 0) and rng.random() < campaign.NODE_FAULT_P:
                # no partition: Stannis finds a lost CSD by ULFM only (docs/stannis.md)
                return campaign.node_fault(rng, nodes, n, partition=False)
            return self._fault(rng, n, earlier, host=kill_host and i == 0)

        def check(specs: list[str]) -> None:
            check_reachable(parse_all(specs), plan, steps=n)
            if hosts:
                check_nodes(parse_all(specs), hosts, plan)

        faults = campaign.draw_faults(rng, draw, check)
        targets = campaign.hit_ranks(faults, hosts, lambda f: f.rank)
        knobs = {"CSDs": self.csds, "N": n, "retune_every": self.retune, "world": world}
        return Scenario(index, world, sets, faults, knobs,
                        {"targets": targets, "host_killed": any(
                            f.kind == "kill" and f.rank == 0 for f in parse_all(faults))})

    def _fault(self, rng: random.Random, n: int, earlier: list[str], host: bool) -> str:
        kind = "kill" if host else rng.choices(("kill", "stall", "slow"), weights=(3, 3, 2))[0]
        rank = 0 if host else rng.randint(1, self.csds)
        steps_before = [int(p.split("=")[1]) for f in earlier for p in f.split(":")
                        if p.startswith("step=")]
        roll = rng.random()
        if steps_before and roll < 0.3:
            step = rng.choice(steps_before)  # several at once
        elif roll < 0.6 and self.retune > 0:  # at a re-tune, or right after it
            step = min(n - 3, max(2, self.retune * rng.randint(1, max(1, n // self.retune - 1))
                                  + rng.choice((0, 1))))
        else:
            step = rng.randint(2, n - 3)
        if kind == "kill":
            return f"kill:rank={rank}:step={step}"
        if kind == "stall":
            return f"stall:rank={rank}:step={step}:seconds={rng.choice(STALL_S)}"
        return f"slow:rank={rank}:step={step}:factor={rng.choice((2, 3, 4))}"

    def execute(self, sc: Scenario, folder: Path) -> tuple[Job, Verdict]:
        if not hasattr(self, "clean_s"):
            # The failure-free run's time sets every run's limit.
            log = folder / "clean.h5"
            argv = campaign.python_argv("stannis", config=self.config, sets=sc.sets, faults=[],
                                     log=log)
            job = campaign.run_job(sc.world, argv, log=log, timeout=900, testbed=self.testbed)
            if job.rc != 0:
                raise campaign.reference_failed(job, "the failure-free run")
            self.clean_s = job.wall_s
        log = folder / f"run-{sc.index}.h5"
        argv = campaign.python_argv("stannis", config=self.config, sets=sc.sets, faults=sc.faults,
                                 log=log)
        timeout = self.args.timeout_factor * self.clean_s + \
            campaign.fault_time(sc.faults, int(sc.knobs["N"])) + 60.0
        job = campaign.run_job(sc.world, argv, log=log, timeout=timeout, testbed=self.testbed)
        return job, judge(sc, job)


def judge(sc: Scenario, job: Job) -> Verdict:
    """The verdict of one Stannis run from its exit, output and log and its fault list."""
    run, verdict = campaign.first_verdict(job)
    if verdict is not None:
        return verdict
    status = str(run.attrs.get("status", ""))
    if sc.facts["host_killed"]:
        lines = [ln for ln in job.error_lines() if "host (rank 0) died" in ln]
        if job.rc == 0 or len(lines) != 1:
            return Verdict("UNEXPECTED", f"the host was killed, yet exit {job.rc} and "
                                         f"{len(lines)} line(s) naming it")
        if not status.startswith("failed: the host"):
            return Verdict("CRASH", f"the host was killed and the log says {status[:120]!r}")
        gaps = campaign.rows_once(run, None)
        return Verdict("WRONG", gaps) if gaps else Verdict("host-lost", status[:120])
    if status != "completed" or job.rc != 0:
        return Verdict("CRASH" if status in ("", "running") else "UNEXPECTED",
                       f"exit {job.rc}, log status {status[:160]!r}")
    gaps = campaign.rows_once(run, int(sc.knobs["N"]))
    if gaps:
        return Verdict("WRONG", gaps)
    dropped = {int(e["rank"]) for e in run.events_of("csd_dropped")}
    healthy = dropped - set(sc.facts["targets"])
    if healthy:
        return Verdict("UNEXPECTED", f"CSD rank(s) {sorted(healthy)} dropped, though no fault "
                                     "hit them")
    return Verdict("completed")


def main(args: argparse.Namespace) -> int:
    return campaign.main(args, system="stannis", build=_Campaign)
