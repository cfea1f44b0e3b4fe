"""Who is who in the current generation: the route, the holders of each stage's replica,
communicator ranks, and the receive deadline; and the two ways a rank leaves it.

The :class:`Membership` mixin of :class:`mpipipe.respipe.trainer.ResPipe` reads the
trainer's ``members``, ``route_w``, ``backups_w``, ``gen``, ``settings`` and ``pipe``.
"""

from __future__ import annotations

import os
import statistics

from torch import nn

from mpipipe.core.mpi import ft
from mpipipe.core.state.stagestate import StageState
from mpipipe.pipeline.engine import Route
from mpipipe.respipe.control import _DEMOTED
from mpipipe.respipe.decide import stage_holders

MIN_DEADLINE_S = 0.008  # floor of a deadline set in median step times
_DEBUG = bool(os.environ.get("MPIPIPE_DEBUG_ROUNDS"))  # (stacks: kill -USR2 mpirun, see cli.start_run)


class StageLost(RuntimeError):
    """A stage failed and no backup (or neighbour) is left to serve it."""

    def __init__(self, stage: int, rank: int, reason: str, had: int = 0) -> None:
        self.stage, self.rank, self.reason = stage, rank, reason
        hint = "" if ft.ulfm_enabled() else " and run under mpirun --with-ft ulfm to survive dead ranks"
        more = "one" if had == 0 else f"{had + 1} (it had {had})"
        super().__init__(
            f"stage {stage} (world rank {rank}) {reason} and has no backup left: the pipeline "
            f"cannot continue. Give it {more} with resilience.backups = "
            f"{{{stage} = {had + 1}}}{hint}")


class Demoted(RuntimeError):
    """This rank was late and has been replaced; it must not send anything more."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        super().__init__(f"this rank was replaced at generation {generation}")


class Membership:
    """The generation's route and members, as the rest of ResPipe asks about them."""

    @property
    def is_logger(self) -> bool:
        return self.wrank == self.log_w

    def _drank(self, world_rank: int) -> int:
        return self.members.index(world_rank)

    def _median_step(self) -> float:
        """The running median step time (0 before any step)."""
        return statistics.median(self.step_times) if self.step_times else 0.0

    def _deadline(self) -> float:
        """How long a receive waits before its sender is late: ``deadline_s``, or once 5
        steps are timed, ``deadline_factor`` median steps, except in the first step of a
        generation. Why: after a round every rank restarts at once, but some still do the
        round's own work (the log's writer collects figures, a promoted backup loads its
        replica); counted against the tight deadline, that made healthy ranks late."""
        s = self.settings
        if s.deadline_factor > 0 and len(self.step_times) >= 5 and \
                (self.gen == 0 or self.done > self._gen_step):
            return max(s.deadline_factor * self._median_step(), MIN_DEADLINE_S)
        return s.deadline_s

    def _say(self, text: str) -> None:
        """A rank's own note, for debugging rounds (MPIPIPE_DEBUG_ROUNDS=1); what users see
        is printed once, by the log writer, from the events (mpipipe.core.logs.progress.event_line)."""
        if _DEBUG:
            print(f"mpipipe: rank {self.wrank}: {text}", file=self.out, flush=True)

    def _module(self, stage: int) -> nn.Module:
        """Stage ``stage``'s module: its state (parameters and buffers) is a replica's."""
        return self.pipe.partitions[stage]

    def _holders_of(self, stage: int) -> list[int]:
        """World ranks that hold a replica of ``stage``."""
        return stage_holders(stage, self.route_w, self.backups_w, self.settings.mode)

    def _wards_of(self, world_rank: int) -> list[int]:
        if self.settings.mode != "neighbour":
            return []
        return [k for k in range(self.pipe.k) if world_rank in self._holders_of(k)]

    def _rebind_pipe(self) -> None:
        """Point the pipeline at the current route, communicator and shadows."""
        hot = self.settings.mode == "hot"
        shadows = tuple((k, self._drank(b)) for k, bs in self.backups_w.items() for b in bs) \
            if hot else ()
        route = Route(tuple(self._drank(w) for w in self.route_w), self.gen, shadows)
        self.pipe.rebind(route, self.data)
        self.pipe.relay_grads = hot
        # Bits of one int64 say which micro-batches a rank holds (Have).
        self.pipe.resumable = hot and self.pipe.chunks <= 62
        self.wards = self._wards_of(self.wrank) if self.stage is not None else []
        if self.stage is not None and self.own is None:
            self.own = StageState(self._module(self.stage), self.make_optimizer, step=self.done)

    def _launch_stage(self, w: int) -> int | None:
        role = self.plan.role_of(w)
        return role.index if role.kind == "stage" else None

    def _rollback_possible(self) -> bool:
        """A takeover can roll this stage back one step only if some stage has a replica."""
        return any(self._holders_of(k) for k in range(self.pipe.k))

    def _demoted(self) -> bool:
        """True if a round of this generation left this rank out (it was late)."""
        return any(self.control.poll(_DEMOTED, self._drank(w), seq=self.gen) is not None
                   for w in self.members if w != self.wrank)
