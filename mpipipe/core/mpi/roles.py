"""The launch plan: which role every MPI rank plays, checked before any work starts.

Every rank evaluates the same configuration, so every rank reaches the same
verdict without exchanging a message: a bad plan stops all ranks at once with
one error line and exit status 2, and nothing can hang waiting for a peer.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

__all__ = [
    "RoleKind",
    "register_role_kind",
    "role_kinds",
    "Role",
    "LaunchPlan",
    "PlanError",
    "fail_fast",
    "TrainingFailed",
    "report_failure",
    "check_world_size",
]


class PlanError(ValueError):
    """The launch plan does not fit the configuration or the MPI world."""


@dataclass(frozen=True)
class RoleKind:
    """A kind of role a system's ranks play, and what the shared core needs to know of it.

    Why registered, not listed here: the core launches, logs and stops ranks of both
    systems and must know none of them by name; each system declares its own kinds
    (the pipeline: ``stage``, ``backup``, ``spare``; Stannis: ``host``, ``csd``).
    """

    name: str
    system: str  # who registered it, for error messages
    indexed: bool = True  # "stage 1" (an index) or "host" (none)
    writes_log: bool = False  # may open the run log: the lowest such rank does (LaunchPlan.log_rank)
    idle: bool = False  # in the MPI world but not in the job (LaunchPlan.without_spares)
    example: str = ""  # what a user writes, for error messages ("stage K")

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z_]*", self.name):
            raise ValueError(f"role kind {self.name!r}: use a lower-case word")


_KINDS: dict[str, RoleKind] = {}


def register_role_kind(kind: RoleKind) -> RoleKind:
    """Declare a kind of role; registering the same declaration again is harmless.

    Raises:
        ValueError: another system declared a different kind of that name.
    """
    known = _KINDS.setdefault(kind.name, kind)
    if known != kind:
        raise ValueError(f"role kind {kind.name!r} is declared twice, differently: by {known.system} "
                         f"({known}) and by {kind.system} ({kind})")
    return kind


def role_kinds() -> dict[str, RoleKind]:
    """The kinds declared so far, by name (a copy)."""
    return dict(_KINDS)


def _examples(kinds: Iterable[str]) -> str:
    names = [k.example or (f"{k.name} K" if k.indexed else k.name) for k in map(_KINDS.__getitem__, kinds)]
    return " or ".join(", ".join(f"'{n}'" for n in names).rsplit(", ", 1)) if names else "(none declared)"


_ROLE_RE = re.compile(r"^\s*([a-z][a-z_]*)\s*(\d+)?\s*$")


@dataclass(frozen=True, order=True)
class Role:
    """What one rank does: a declared kind (:func:`register_role_kind`) and, for an indexed
    kind, which one (``stage 1``, ``csd 3``; ``host`` has none)."""

    kind: str
    index: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise PlanError(f"unknown role kind {self.kind!r} (known: {', '.join(_KINDS) or 'none'}; "
                            f"a system declares its kinds with mpipipe.core.mpi.roles.register_role_kind)")

    @property
    def spec(self) -> RoleKind:
        """The declaration of this role's kind."""
        return _KINDS[self.kind]

    def __str__(self) -> str:
        return f"{self.kind} {self.index}" if self.spec.indexed else self.kind

    @classmethod
    def parse(cls, text: str, kinds: Iterable[str] | None = None, job: str = "") -> Role:
        """Read a role as a user writes it: ``"stage 1"``, ``"host"``, ``"csd 3"``, ...

        ``kinds``: the kinds the caller's system accepts (default: every declared one), and
        ``job`` what the error says of them ("a Stannis job has only a host and CSDs"). Why a
        system names its own: which other systems happen to be imported in the process must
        not change what a plan means, or the error a wrong one gets.

        Raises:
            PlanError: not one of ``kinds``, or an index missing where the kind needs one.
        """
        accepted = list(_KINDS) if kinds is None else [k for k in kinds if k in _KINDS]
        m = _ROLE_RE.match(text)
        if not m or m.group(1) not in accepted:
            raise PlanError(f"unknown role {text!r}: {job} (write {_examples(accepted)})" if job
                            else f"unknown role {text!r}: expected {_examples(accepted)}")
        kind, index = m.group(1), m.group(2)
        if _KINDS[kind].indexed and index is None:
            raise PlanError(f"role {text!r} needs an index, e.g. '{kind} 1'")
        return cls(kind, int(index or 0))


@dataclass(frozen=True)
class LaunchPlan:
    """One role per world rank, in rank order."""

    roles: tuple[Role, ...]

    @property
    def world_size(self) -> int:
        return len(self.roles)

    def role_of(self, rank: int) -> Role:
        return self.roles[rank]

    def ranks_of(self, kind: str, index: int | None = None) -> list[int]:
        """Ranks whose role has this kind (and index, if given), in rank order."""
        return [
            r for r, role in enumerate(self.roles)
            if role.kind == kind and (index is None or role.index == index)
        ]

    def describe(self) -> str:
        return ", ".join(f"{r}={role}" for r, role in enumerate(self.roles))

    @property
    def log_rank(self) -> int:
        """The world rank that opens and writes the run log: the lowest rank of a kind that
        ``writes_log`` (a stage; the host in Stannis). Why not rank 0: any rank may be a
        backup, and a backup has no figures of its own to log and learns of steps only
        through its replicas."""
        return min((r for r, role in enumerate(self.roles) if role.spec.writes_log), default=0)

    def without_spares(self) -> LaunchPlan:
        """The plan of the ranks that work, without the ``idle`` kinds (spares are the last
        ranks, so none is renumbered)."""
        return LaunchPlan(tuple(r for r in self.roles if not r.spec.idle))

    @classmethod
    def from_table(cls, table: Mapping[str, Any], world_size: int,
                   kinds: Iterable[str] | None = None, job: str = "") -> LaunchPlan:
        """Build a plan from an explicit ``role name -> rank`` table (config ``[plan]``), of
        roles of ``kinds`` (default: any declared; ``job``: see :meth:`Role.parse`).

        Raises:
            PlanError: a rank outside the world, a rank with two roles, a rank
                with none, or an unknown role name.
        """
        by_rank: dict[int, Role] = {}
        for name, rank in table.items():
            role = Role.parse(name, kinds, job)
            if not isinstance(rank, int) or isinstance(rank, bool):
                raise PlanError(f"[plan] '{name}' must be a rank number, got {rank!r}")
            if not 0 <= rank < world_size:
                raise PlanError(
                    f"[plan] '{name}' = {rank}: no such rank (the MPI world has ranks 0..{world_size - 1})"
                )
            if rank in by_rank:
                raise PlanError(f"[plan] rank {rank} has two roles: '{by_rank[rank]}' and '{role}'")
            by_rank[rank] = role
        missing = [r for r in range(world_size) if r not in by_rank]
        if missing:
            raise PlanError(f"[plan] ranks {missing} have no role; give every rank one role")
        return cls(tuple(by_rank[r] for r in range(world_size)))


def launcher_world_size(env: Mapping[str, str] | None = None) -> tuple[int, str] | None:
    """The world size the launcher promised, and which variable said so.

    Open MPI's own count comes before Slurm's: under mpirun in a multi-node allocation the
    ranks on the other nodes descend from the srun that started Open MPI's daemons, and
    inherit that step's SLURM_NTASKS (one per node), not the job's.
    """
    env = os.environ if env is None else env
    for var in ("MPIPIPE_EXPECT_NP", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        if env.get(var, "").isdigit():
            return int(env[var]), var
    return None


def check_world_size(size: int, env: Mapping[str, str] | None = None) -> None:
    """Fail if MPI's world is not what the launcher promised.

    A launch without PMI (``srun`` with no MPI plugin, or N copies of
    ``python``) starts N singletons that each believe they are rank 0 of 1;
    training them would write N logs and learn N times the same thing.

    Raises:
        PlanError: the sizes differ.
    """
    promised = launcher_world_size(env)
    if promised and promised[0] != size:
        n, var = promised
        raise PlanError(
            f"{var}={n} but the MPI world has {size} rank(s): the processes did not join one "
            f"MPI job (launched without PMI?). Start with mpirun -n {n} inside the allocation"
        )


class TrainingFailed(RuntimeError):
    """The run stopped with one error line, on every rank alike (a bad configuration, plan,
    fault or log path; a lost stage; a run that did not complete).

    Why an exception and not an exit: ``mpipipe.train(...)`` runs inside the user's script,
    which may catch it and go on; the commands print :attr:`line` on rank 0 and exit with
    :attr:`status` (2), as they always did.
    """

    def __init__(self, message: str, prog: str = "", rank: int = 0, status: int = 2) -> None:
        super().__init__(message)
        self.prog, self.rank, self.status = prog, rank, status

    @property
    def line(self) -> str:
        """What the command prints: ``prog: error: message``."""
        return f"{self.prog}: error: {self}" if self.prog else str(self)


def fail_fast(comm: Any, error: BaseException | str, prog: str, rank: int | None = None) -> NoReturn:
    """Stop this rank with one error line (:class:`TrainingFailed`); every rank must reach
    the same verdict, and the command prints it once (rank 0)."""
    rank = comm.Get_rank() if rank is None and comm is not None else (rank or 0)
    sys.stdout.flush()
    raise TrainingFailed(str(error), prog, rank)


def report_failure(failure: TrainingFailed) -> int:
    """A command's end after :class:`TrainingFailed`: its line on rank 0; the exit status."""
    if failure.rank == 0:
        print(failure.line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    return failure.status


def describe_roles(roles: Iterable[Role]) -> str:
    return ", ".join(str(r) for r in roles)
