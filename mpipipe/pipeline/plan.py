"""The pipeline's launch plan: its role kinds (stage, backup, spare) and the plan of a job.

Why here and not in the core: the core launches, logs and stops ranks of any system and
names none of their kinds (:mod:`mpipipe.core.mpi.roles`); this module declares the
pipeline's, ResPipe's backups included, when it is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mpipipe.core.mpi.roles import LaunchPlan, PlanError, Role, RoleKind, register_role_kind

__all__ = ["STAGE", "BACKUP", "SPARE", "PIPELINE_KINDS", "pipeline_plan", "backup_counts"]


STAGE = register_role_kind(RoleKind("stage", "the pipeline", writes_log=True))
BACKUP = register_role_kind(RoleKind("backup", "ResPipe"))
SPARE = register_role_kind(RoleKind("spare", "the pipeline", idle=True))
PIPELINE_KINDS = (STAGE.name, BACKUP.name, SPARE.name)


def pipeline_plan(cfg: Mapping[str, Mapping[str, Any]], world_size: int) -> LaunchPlan:
    """The launch plan of a pipeline (ResPipe) job.

    Without an explicit ``[plan]`` the stages take ranks 0..K-1 and backups
    follow in stage order, as many per stage as ``resilience.backups`` says.
    An explicit plan may end with ``spare K`` ranks, which idle outside the job
    (mpipipe/core/mpi/spare.py): a baseline with the world size of a resilient job.

    Raises:
        PlanError: the world size does not match, a stage has no rank, a backup
            shadows a stage that does not exist, a spare comes before a working
            rank, or a role is not a pipeline role.
    """
    stages = cfg["pipeline"]["stages"]
    if stages < 1:
        raise PlanError(f"pipeline.stages = {stages}: need at least one stage")
    backups = backup_counts(cfg["resilience"].get("backups", {}), stages)
    wanted = stages + sum(backups.values())
    if cfg.get("plan"):
        plan = LaunchPlan.from_table(cfg["plan"], world_size, PIPELINE_KINDS, "a pipeline job has "
                                     "only stages and backups (and spares after them)")
    else:
        if world_size != wanted:
            extra = f" + {wanted - stages} backups" if wanted > stages else ""
            raise PlanError(
                f"the launch plan needs {wanted} ranks ({stages} stages{extra}) but the MPI "
                f"world has {world_size}: run mpirun -n {wanted}, or change pipeline.stages"
            )
        roles = [Role("stage", k) for k in range(stages)]
        for k in sorted(backups):
            roles += [Role("backup", k)] * backups[k]
        plan = LaunchPlan(tuple(roles))
    spares = plan.ranks_of("spare")
    if spares and spares[0] != world_size - len(spares):
        raise PlanError(f"[plan] rank {spares[0]} is '{plan.role_of(spares[0])}' but rank "
                        f"{world_size - 1} is not a spare: give spares the last ranks")
    for r, role in enumerate(plan.roles):
        if role.kind == "spare" and r:
            continue
        if role.kind not in ("stage", "backup"):
            raise PlanError(f"rank {r} is '{role}': a pipeline job has only stages and backups"
                            + (" (and spares after them)" if role.kind == "spare" else ""))
        if role.index >= stages:
            raise PlanError(f"rank {r} is '{role}' but the pipeline has stages 0..{stages - 1}")
    for k in range(stages):
        n = len(plan.ranks_of("stage", k))
        if n == 0:
            raise PlanError(f"stage {k} has no rank; give it one in [plan] or raise the world size")
        if n > 1:
            raise PlanError(f"stage {k} has {n} ranks {plan.ranks_of('stage', k)}; use 'backup {k}' for spares")
    return plan


def backup_counts(table: Any, stages: int) -> dict[int, int]:
    """Read ``resilience.backups``: ``{stage = count}`` or ``"all"`` (one per stage)."""
    if table == "all":
        return dict.fromkeys(range(stages), 1)
    if not isinstance(table, Mapping):
        raise PlanError("resilience.backups must be a table like {1 = 1} or \"all\"")
    out: dict[int, int] = {}
    for key, count in table.items():
        try:
            k = int(key)
        except ValueError:
            raise PlanError(f"resilience.backups: {key!r} is not a stage number") from None
        if not 0 <= k < stages:
            raise PlanError(f"resilience.backups: stage {k} does not exist (stages 0..{stages - 1})")
        if not isinstance(count, int) or count < 0:
            raise PlanError(f"resilience.backups: stage {k} count must be >= 0, got {count!r}")
        if count:
            out[k] = count
    return out
