"""A CSD rank lost: drop it (ULFM revoke, agree, shrink), put the survivors on the host's
state, and re-balance their batches.

A lost host ends the job (:class:`HostLost`): the public data and the model's
reference copy live there.
"""

from __future__ import annotations

import time
from typing import Any

from mpi4py import MPI

from mpipipe.core.logs.logschema import EventKind
from mpipipe.core.mpi import ft

from .figures import StepFigures
from .members import Members
from .step import DataParallelStep
from .tuning import Tuning


class HostLost(RuntimeError):
    """The host rank died: there is no one left to hold the public data and the log.

    ``survivors``: the world ranks left; the lowest says so and closes the log."""

    def __init__(self, message: str, survivors: list[int]) -> None:
        super().__init__(message)
        self.survivors = survivors


class Recovery:
    """Brings the members through an MPI failure: the dead dropped, the rest in step again."""

    def __init__(self, members: Members, stepper: DataParallelStep, figures: StepFigures,
                 tuning: Tuning, records: dict[int, int], is_host: bool, log: Any,
                 progress: Any) -> None:
        self.members = members
        self.stepper = stepper
        self.figures = figures
        self.tuning = tuning
        self.records = records  # world rank -> its private samples, lost with it
        self.is_host = is_host
        self.log = log
        self.progress = progress
        self.dropped_pending: list[int] = []  # dead ranks not yet logged

    def until_stable(self, error: BaseException, attempts: int = 4, *,
                     replan: bool = True, agreed: bool = False) -> None:
        """Recover, and recover again if another rank fails during the recovery.

        ``agreed``: the caller has just taken part in an agreement on this communicator
        (the end of a phase, :func:`mpipipe.core.mpi.ft.agreed_phase`), which stands for the recovery's own.
        """
        for attempt in range(attempts):
            try:
                self._recover(error, replan=replan, agreed=agreed and attempt == 0)
                return
            except MPI.Exception as e:
                if attempt == attempts - 1:
                    raise
                error = e

    def _recover(self, error: BaseException, *, replan: bool = True, agreed: bool = False) -> None:
        """Drop the dead CSDs (ULFM shrink), resync from the host and re-balance.

        Every way into a recovery takes part in exactly one agreement before the shrink:
        here (after the revoke, which makes every other survivor fail out of whatever it
        waits in) or, with ``agreed``, at the end of a phase (:func:`~mpipipe.core.mpi.ft.agreed_phase`). So a
        rank that recovers from an error inside the last step and a rank that finished
        that step and agreed on the end of training meet in the same agreement, then in
        the same shrink, instead of waiting in different collectives for ever.

        ``replan=False`` during the benchmark phase: there are no step models to
        balance with yet; the survivors benchmark again and plan from that.
        """
        t0 = time.perf_counter()
        self._shrink(agreed)
        # The host's state wins: a survivor that already applied this step and one
        # that had not end up identical, momentum included.
        self.stepper.rejoin()
        dead, self.dropped_pending = self.dropped_pending, []
        # The interrupted exchange carried the last step's late figures: that row is
        # written without them.
        self.figures.lose_late()
        if self.is_host and dead:
            self._drop(dead, error, t0, replan)
        elif self.is_host:
            self.log.event(EventKind.MPI_ERROR_RECOVERED, step=self.stepper.done, error=str(error))
        if replan:
            self.tuning.share()

    def _shrink(self, agreed: bool) -> None:
        """Revoke, agree (unless the caller did) and shrink to the survivors.

        Raises:
            HostLost: the host is not among them.
        """
        comm = self.members.comm.comm
        ft.revoke(comm)
        if not agreed:
            ft.agree(comm, 0)
        new = ft.shrink(comm)
        survivors = self.members.world_ranks(new)
        dead = [r for r in self.members.ranks if r not in survivors]
        self.dropped_pending += dead  # logged once the survivors are in step again
        if 0 in dead:
            raise HostLost(f"the host (rank 0) died at step {self.stepper.done + 1}; a Stannis job "
                           "cannot continue without it (the public data and the model's "
                           "reference copy live there)", survivors)
        self.members.adopt(new, survivors)

    def _drop(self, dead: list[int], error: BaseException, t0: float, replan: bool) -> None:
        """Host: log the dropped ranks and what they take with them; plan without them."""
        step = self.stepper.done
        for r in dead:
            self.log.event(EventKind.CSD_DROPPED, step=step, rank=r, error=str(error),
                           samples_lost=self.records.get(r, 0),
                           recovery_s=time.perf_counter() - t0)
            self.progress.message(
                f"step {step}: rank {r} died; dropped, its {self.records.get(r, 0)} "
                "private samples are no longer trained on")
        self.tuning.drop(dead)
        if replan:
            self.tuning.plan(f"ranks {dead} dropped", step)
