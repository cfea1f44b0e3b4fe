"""Where the ranks of a pipeline plan run: a replica must not share a node with what it guards.

Why: a backup (or, in neighbour mode, the stage that holds its neighbour's replica) exists
so that the stage survives the loss of its rank. On one host every rank shares the node
and that is the only choice; once the world spans several nodes (a testbed, a cluster),
a backup on its stage's node dies with it in a node failure, and the run is lost although
the plan looked resilient. The plan check therefore refuses such a placement, naming the
ranks and the node, unless ``resilience.allow_same_node = true`` says it is meant.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mpipipe.core.mpi.roles import LaunchPlan, PlanError

__all__ = ["guards", "check_placement", "check_hosts"]


def guards(plan: LaunchPlan, mode: str) -> list[tuple[int, int, str]]:
    """``(guard rank, guarded rank, why)`` for every replica the plan keeps at start.

    A backup of stage k guards stage k's rank (every mode); in neighbour mode stage k's
    rank also guards stage k-1's (stage 1 guards stage 0), as ResPipe's neighbour mode
    places a stage's replica on the stage before it.
    """
    stage_rank = {plan.roles[r].index: r for r in plan.ranks_of("stage")}
    out = [(b, stage_rank[plan.roles[b].index], f"backup {plan.roles[b].index} shadows stage {plan.roles[b].index}")
           for b in plan.ranks_of("backup") if plan.roles[b].index in stage_rank]
    if mode == "neighbour" and len(stage_rank) >= 2:
        for k, ward in sorted(stage_rank.items()):
            holder_stage = k - 1 if k > 0 else 1
            if holder_stage in stage_rank:
                out.append((stage_rank[holder_stage], ward,
                            f"stage {holder_stage} holds the replica of stage {k} (neighbour mode)"))
    return out


def check_placement(plan: LaunchPlan, hosts: Sequence[str], resilience: Mapping[str, Any]) -> None:
    """Refuse a plan whose guard and guarded ranks share a node, when the world spans nodes.

    ``hosts[r]`` is rank r's hostname. Nothing is checked on one node (there is no other
    choice), nor with ``allow_same_node = true`` in ``resilience``.

    Raises:
        PlanError: one line naming the first two ranks and their node, and the way out.
    """
    if len(set(hosts)) < 2 or resilience.get("allow_same_node", False):
        return
    for guard, guarded, why in guards(plan, str(resilience.get("mode", "cold"))):
        if hosts[guard] == hosts[guarded]:
            raise PlanError(
                f"ranks {guard} and {guarded} are both on node {hosts[guard]} but {why}: a failure of "
                f"that node would lose both. Place them on different nodes (rank order fills the "
                f"hostfile's slots; see [plan]), or set resilience.allow_same_node = true")


def check_hosts(plan: LaunchPlan, hosts: Sequence[str], cfg: Mapping[str, Any]) -> None:
    """:func:`check_placement` with a run's whole configuration (``start_run``'s hook)."""
    check_placement(plan, hosts, cfg.get("resilience", {}))
