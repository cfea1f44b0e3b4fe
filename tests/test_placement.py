"""Placement of a pipeline plan across nodes: a replica never on the node of what it guards."""

from __future__ import annotations

import pytest

from mpipipe.core.mpi.roles import PlanError
from mpipipe.core.run.configfile import load_config
from mpipipe.pipeline.config import PIPELINE_DEFAULTS
from mpipipe.pipeline.plan import pipeline_plan
from mpipipe.respipe.placement import check_placement, guards


def plan_of(*settings: str, world: int):
    cfg = load_config(None, list(settings), PIPELINE_DEFAULTS)
    return pipeline_plan(cfg, world), cfg["resilience"]


def test_guards_of_backups_and_neighbours() -> None:
    plan, _ = plan_of("resilience.backups={0=1, 2=1}", world=5)  # stages 0..2, backups 0 and 2
    assert [(g, w) for g, w, _ in guards(plan, "cold")] == [(3, 0), (4, 2)]
    plan, _ = plan_of(world=3)
    assert [(g, w) for g, w, _ in guards(plan, "neighbour")] == [(1, 0), (0, 1), (1, 2)]
    assert guards(plan, "hot") == []


def test_backup_on_its_stage_node_is_refused_naming_ranks_and_node() -> None:
    plan, res = plan_of("resilience.backups={1=1}", world=4)  # backup 1 is rank 3
    with pytest.raises(PlanError, match=r"ranks 3 and 1 are both on node n2 but backup 1 shadows stage 1"
                                        r".*allow_same_node = true"):
        check_placement(plan, ["n1", "n2", "n3", "n2"], res)
    check_placement(plan, ["n1", "n2", "n3", "n1"], res)  # another node: fine
    check_placement(plan, ["h"] * 4, res)  # one host: no other choice, not checked
    _, allowed = plan_of("resilience.backups={1=1}", "resilience.allow_same_node=true", world=4)
    check_placement(plan, ["n1", "n2", "n3", "n2"], allowed)


def test_neighbour_holder_on_its_ward_node_is_refused() -> None:
    plan, res = plan_of("resilience.mode=neighbour", world=3)
    with pytest.raises(PlanError, match=r"ranks 1 and 2 are both on node b but stage 1 holds the replica of stage 2"):
        check_placement(plan, ["a", "b", "b"], res)
    check_placement(plan, ["a", "b", "c"], res)
    cold, res_cold = plan_of(world=3)
    check_placement(cold, ["a", "b", "b"], res_cold)  # cold without backups guards nothing
