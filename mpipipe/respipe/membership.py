"""Who is who in the current generation, and where this rank stands: the route, the
holders of each stage's replica, the communicators, the pipeline bound to them (and the
hot steps composed around it), this rank's role and steps, the receive deadline;
building a generation's communicator; and the two ways a rank leaves
(:class:`StageLost`, :class:`Demoted`).

Every other part of ResPipe is built with the :class:`Membership` and asks it, through
its methods and its public fields; only a round changes it (:meth:`Membership.adopt`,
:meth:`Membership.serve`, :meth:`Membership.build`).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from torch import nn

from mpipipe.core.mpi import ft, watchdog
from mpipipe.pipeline.engine import Pipeline, Route
from mpipipe.respipe.control import _DEMOTED, _GO, _READY, _Control
from mpipipe.respipe.decide import stage_holders
from mpipipe.respipe.messages import Decision
from mpipipe.respipe.mirror import HotSteps
from mpipipe.respipe.settings import Settings

MIN_DEADLINE_S = 0.008  # floor of a deadline set in median step times
_DEBUG = bool(os.environ.get("MPIPIPE_DEBUG_ROUNDS"))  # (stacks: kill -USR2 mpirun, see cli.start_run)
# How long a member waits for the others to build a generation's communicator before the
# round runs again without the missing ones (ft.from_group). Members reach the build as
# soon as they read the decision, which they poll for; under 10 ranks on 2 cores a
# poller can lose the CPU for seconds, so this is generous, and far below the watchdog.
BUILD_WAIT_S = 15.0


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


class BuildAgain(Exception):
    """The members that came could not build the decided generation; the round runs
    again (raised on each of them alike, see :meth:`Membership.build`)."""


class Membership:
    """The generation's route, members and communicators, and this rank's place in it.

    Public fields, read by every part: ``wrank``, ``world``, ``plan``, ``settings``,
    ``ulfm``, ``gen`` and ``gen_step`` (the step the generation started at), ``members``
    (the world rank of each data-communicator rank), ``route_w`` (the world rank serving
    each stage), ``backups_w``, ``log_w`` (the log's writer), ``stage`` / ``shadowing``
    (the stage this rank serves, or backs up), ``wards`` (neighbour mode: the stages whose
    replicas it holds), ``data`` / ``control`` / ``lobby``, ``steps`` (the
    :class:`~mpipipe.respipe.mirror.HotSteps` a stage's or mirror's training step goes
    through, with what hot mode keeps of a step) and ``pipe`` (the engine it holds,
    bound to the route), ``done`` (optimizer steps applied; a backup's: the step it stands at),
    ``after_step`` (an update is applied but its step's work is not finished: a round
    then replays) and ``step_times`` (for the deadline).
    """

    def __init__(self, *, world: Any, plan: Any, settings: Settings, pipe: Any,
                 out: TextIO | None = None) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.world = world
        self.wrank = world.Get_rank()
        self.plan = plan
        self.settings = settings
        self.steps = HotSteps(pipe)
        self.out = out or sys.stdout
        self.ulfm = ft.ulfm_enabled()
        self.gen = 0
        self.gen_step = 0
        self.done = 0
        self.after_step = False
        self.step_times: deque[float] = deque(maxlen=21)
        self.log_w = plan.log_rank  # world rank writing the log (it opened it); a round moves it
        data = world.Dup()
        data.Set_errhandler(MPI.ERRORS_RETURN)
        ctl = data.Dup()
        ctl.Set_errhandler(MPI.ERRORS_RETURN)
        self.data, self.control = data, _Control(ctl)
        lobby = world.Dup()
        lobby.Set_errhandler(MPI.ERRORS_RETURN)
        self.lobby = _Control(lobby)  # every rank of the job, whatever the generation
        self.members = list(range(world.Get_size()))  # world rank of each data rank
        self.route_w = [plan.ranks_of("stage", k)[0] for k in range(pipe.k)]
        self.backups_w: dict[int, list[int]] = {
            k: plan.ranks_of("backup", k) for k in range(pipe.k)}
        role = plan.role_of(self.wrank)
        self.stage: int | None = role.index if role.kind == "stage" else None
        self.shadowing: int | None = role.index if role.kind == "backup" else None
        self.wards: list[int] = []
        self.rebind()

    # -- questions -----------------------------------------------------------------------
    @property
    def pipe(self) -> Pipeline:
        """The engine (:class:`~mpipipe.pipeline.engine.Pipeline`), bound to the route:
        the one ``steps`` holds, so that the two never part."""
        return self.steps.engine

    @property
    def is_logger(self) -> bool:
        return self.wrank == self.log_w

    def drank(self, world_rank: int) -> int:
        """The data (and control) communicator's rank of ``world_rank``."""
        return self.members.index(world_rank)

    def module(self, stage: int) -> nn.Module:
        """Stage ``stage``'s module: its state (parameters and buffers) is a replica's."""
        return self.pipe.partitions[stage]

    def holders_of(self, stage: int) -> list[int]:
        """World ranks that hold a replica of ``stage``."""
        return stage_holders(stage, self.route_w, self.backups_w, self.settings.mode)

    def launch_stage(self, w: int) -> int | None:
        """The stage world rank ``w`` served at launch (None: it started as a backup)."""
        role = self.plan.role_of(w)
        return role.index if role.kind == "stage" else None

    def rollback_possible(self) -> bool:
        """A takeover can roll this stage back one step only if some stage has a replica."""
        return any(self.holders_of(k) for k in range(self.pipe.k))

    def demoted(self) -> bool:
        """True if a round of this generation left this rank out (it was late)."""
        return any(self.control.poll(_DEMOTED, self.drank(w), seq=self.gen) is not None
                   for w in self.members if w != self.wrank)

    def median_step(self) -> float:
        """The running median step time (0 before any step)."""
        return statistics.median(self.step_times) if self.step_times else 0.0

    def deadline(self) -> float:
        """How long a receive waits before its sender is late: ``deadline_s``, or once 5
        steps are timed, ``deadline_factor`` median steps, except in the first step of a
        generation. Why: after a round every rank restarts at once, but some still do the
        round's own work (the log's writer collects figures, a promoted backup loads its
        replica); counted against the tight deadline, that made healthy ranks late."""
        s = self.settings
        if s.deadline_factor > 0 and len(self.step_times) >= 5 and \
                (self.gen == 0 or self.done > self.gen_step):
            return max(s.deadline_factor * self.median_step(), MIN_DEADLINE_S)
        return s.deadline_s

    def say(self, text: str) -> None:
        """A rank's own note, for debugging rounds (MPIPIPE_DEBUG_ROUNDS=1); what users see
        is printed once, by the log writer, from the events (mpipipe.core.logs.progress.event_line)."""
        if _DEBUG:
            print(f"mpipipe: rank {self.wrank}: {text}", file=self.out, flush=True)

    # -- changes -------------------------------------------------------------------------
    def rebind(self) -> None:
        """Point the pipeline at the current route, communicator and shadows."""
        hot = self.settings.mode == "hot"
        shadows = tuple((k, self.drank(b)) for k, bs in self.backups_w.items() for b in bs) \
            if hot else ()
        route = Route(tuple(self.drank(w) for w in self.route_w), self.gen, shadows)
        self.steps.rebind(route, self.data)
        self.steps.relay_grads = hot
        # Bits of one int64 say which micro-batches a rank holds (Have).
        self.steps.resumable = hot and self.pipe.chunks <= 62
        self.wards = [k for k in range(self.pipe.k) if self.wrank in self.holders_of(k)] \
            if self.stage is not None and self.settings.mode == "neighbour" else []

    def adopt(self, d: Decision, data: Any, control: _Control, members: Sequence[int]) -> int:
        """Enter generation ``d.gen`` on its new communicators, with its log writer; returns
        the previous writer. The route and roles follow in :meth:`serve`, once the old
        route has been read."""
        self.data, self.control, self.members = data, control, list(members)
        self.gen, self.gen_step = d.gen, d.step
        old, self.log_w = self.log_w, d.log
        return old

    def back_up(self, k: int, step: int) -> None:
        """This rank is a backup of stage k now, standing at ``step`` (a rejoin)."""
        self.stage, self.shadowing = None, k
        self.done = step

    def serve(self, d: Decision, pipe: Any = None) -> None:
        """Take the decided route and holders (``pipe``: a neighbour merge's new pipeline),
        this rank's stage in it, and rebind the pipeline."""
        if pipe is not None:
            self.steps = HotSteps(pipe)
            self.stage = d.route.index(self.wrank) if self.wrank in d.route else None
        self.route_w = list(d.route)
        self.backups_w = {k: list(bs) for k, bs in d.backups.items()}
        self.rebind()

    def new_generation_again(self) -> None:
        """A decided generation was not built: the retry counts as one of its own, on
        the old control communicator, so that no message of the failed attempt matches."""
        self.gen += 1

    def build(self, d: Decision, in_round: Callable[..., float]) -> Any:
        """The new generation's communicator, built by its members alone (a member's and an
        admitted rank's side alike).

        From their world ranks (ft.from_group): a left-out rank, dead or stalled, and an
        admitted rank (not on this generation's communicator) need nothing else. Not
        Shrink, even when every rank left out is dead: it waits for every live rank, and
        a member may stall or die in between. The lobby's ranks are world ranks. First
        every member says it is there (:meth:`_ready`), so that the build itself only
        starts among members that all came.

        Raises:
            BuildAgain: a member did not come (every member that came gets it alike).
        """
        since = time.perf_counter()
        in_round(max(self.done, d.step))  # kill/stall ...:round=N
        watchdog.waiting(f"building generation {d.gen} with ranks {list(d.members)}")
        if not self._ready(d, since):
            raise BuildAgain("a member did not say it was there in time")
        in_round(max(self.done, d.step), at_build=True)  # ...:round=N:build=1
        try:
            new = ft.from_group(self.lobby.comm, sorted(d.members), d.comm_tag,
                                wait_s=BUILD_WAIT_S)
        except ft.BuildFailed as e:
            raise BuildAgain(str(e)) from None
        watchdog.waiting("")
        return new

    def _ready(self, d: Decision, since: float) -> bool:
        """Every member says, on the lobby, that it is there to build generation ``d.gen``;
        the round's coordinator (the lowest member heard: the lowest but an admitted
        rank) answers all of them: build (True) or run the round again (False).

        Why: Open MPI 5.0's ``Create_from_group`` waits for ever for a member that does
        not come, and one blocked with a member that dies was seen to crash the process
        (a segmentation fault in ``ompi_comm_revoke_local``, under ULFM, when the death
        is processed). So it is only started once every member is known to be there.

        One verdict for all: the coordinator says "build" only within BUILD_WAIT_S of
        reading its own decision (``since``), while every other member waits for the
        verdict twice as long from a later moment (it read the decision after it was
        sent); a member that hears nothing (the coordinator died or stalled) runs the
        round again, as all the others then do.
        """
        leader = min(w for w in d.members if w != d.admit)
        others = [w for w in d.members if w != leader]
        if self.wrank != leader:
            self.lobby.send(_READY, leader, [d.gen], seq=d.gen)
            end = since + 2 * BUILD_WAIT_S
            while time.perf_counter() < end:
                msg = self.lobby.poll(_GO, leader, seq=d.gen)
                if msg is not None:
                    return bool(msg[1])
                time.sleep(0.001)
            return False
        ready: set[int] = set()
        while time.perf_counter() < since + BUILD_WAIT_S and len(ready) < len(others):
            ready.update(w for w in others if w not in ready
                         and self.lobby.poll(_READY, w, seq=d.gen) is not None)
            time.sleep(0.0005)
        go = len(ready) == len(others) and time.perf_counter() < since + BUILD_WAIT_S
        for w in others:
            self.lobby.send(_GO, w, [d.gen, float(go)], seq=d.gen)
        return go
