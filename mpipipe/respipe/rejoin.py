"""Rejoining: a replaced rank asks, on the job-wide lobby, to come back as a backup; the
lowest member turns the request into a round that admits it.

The :class:`Rejoin` part of :class:`mpipipe.respipe.trainer.ResPipe`.
"""

from __future__ import annotations

import sys
import time

from mpipipe.core.mpi import ft, watchdog
from mpipipe.core.mpi.faults import FaultPlan
from mpipipe.respipe.control import _ADMIT, _CLOSED, _REJOIN, _Control
from mpipipe.respipe.membership import BuildAgain, Demoted, Membership
from mpipipe.respipe.messages import Decision, Round, RoundStarted
from mpipipe.respipe.replicas import Replicas

REJOIN_WAIT_S = 300.0  # how long a replaced rank waits to be admitted or told the job ended


class Rejoin:
    """The lobby's side of a round: requests, admission, and the end of the job.

    Built with the membership (the lobby, who is a member), the replicas (an admitted
    rank re-syncs its stage's) and the fault plan (a fault may fire in the build).
    """

    def __init__(self, m: Membership, replicas: Replicas, faults: FaultPlan) -> None:
        self.m, self.replicas, self.faults = m, replicas, faults
        self.requests: dict[int, float] = {}  # replaced rank -> when it was told
        self._closed = False  # the last generation said the run is over (closed)

    def enabled(self) -> bool:
        """Replaced ranks may rejoin only under ULFM (a round must be able to wake every
        member at once, which revoking the data communicator does) and with backup
        ranks (not in neighbour mode)."""
        return self.m.ulfm and self.m.settings.mode != "neighbour"

    def poll(self) -> None:
        """At a step boundary: the coordinator turns a rejoin request into a round."""
        if not self.enabled():
            return
        msg = self.m.lobby.poll(_REJOIN, self.m.MPI.ANY_SOURCE)
        while msg is not None:
            # Every member keeps the requests: if the coordinator dies, the next one has them.
            self.requests[int(msg[0])] = float(msg[1])
            msg = self.m.lobby.poll(_REJOIN, self.m.MPI.ANY_SOURCE)
        for w in [w for w in self.requests if w in self.m.members]:
            del self.requests[w]  # already back
        if self.requests and self.m.wrank == min(self.m.members):
            w = min(self.requests)
            since = self.requests.pop(w)
            # The round's "waited" slot carries when the rank was told it was replaced.
            raise RoundStarted(Round("rejoin", w, time.time(), since))

    def answer(self, rnd: Round, decision: Decision) -> None:
        """Coordinator, after deciding a rejoin round: admit the rank, or send it away."""
        if rnd.reason != "rejoin":
            return
        if decision.admit == rnd.suspect:
            self.m.lobby.send(_ADMIT, rnd.suspect, decision.encode())
        else:  # a failure came in between: the round had other business
            self.m.lobby.send(_CLOSED, rnd.suspect, [self.m.gen])

    def close_lobby(self) -> None:
        """Tell every rank outside the job's last generation that there is nothing to rejoin.

        Called by the lowest member at the end (or on a lost stage); waits up to a
        second for the notices to leave, as the process exits right after.
        """
        if not self.enabled():
            return
        for w in range(self.m.world.Get_size()):
            if w not in self.m.members:
                self.m.lobby.send(_CLOSED, w, [self.m.gen])
        self.m.lobby.drain(1.0)

    def closed(self) -> bool:
        """Has the job's last generation said that there is nothing to rejoin (the run is
        over)? Kept once heard."""
        if not self._closed and self.m.lobby.poll(_CLOSED, self.m.MPI.ANY_SOURCE) is not None:
            self._closed = True
        return self._closed

    def rejoin(self, demoted: Demoted) -> bool:
        """A replaced rank asks to come back as a backup. True once it is one again.

        False (the rank then leaves, as without ULFM) when rejoining is not possible,
        the job ended first, or nobody answered within REJOIN_WAIT_S. A replaced log
        writer has let go of the log by now: the round gave it to a survivor.
        """
        if not self.enabled():
            return False
        print(f"mpipipe train: rank {self.m.wrank} was late and has been replaced ({demoted}); "
              "it asks to rejoin as a backup", file=sys.stderr, flush=True)
        since = time.time()
        self._ask(since)
        give_up = time.perf_counter() + REJOIN_WAIT_S
        while time.perf_counter() < give_up:
            if self.closed():
                return False
            msg = self.m.lobby.poll(_ADMIT, self.m.MPI.ANY_SOURCE)
            if msg is not None:
                if self._admitted(Decision.decode(msg)):
                    return True
                # The generation that admitted it was not built (a member died or never
                # came): the members run their round again without it; ask once more.
                self._ask(since)
            watchdog.beat()  # a bounded wait of its own (REJOIN_WAIT_S), not stuck
            time.sleep(0.005)
        return False

    def _ask(self, since: float) -> None:
        """Ask every other rank of the job (the lowest member answers)."""
        for w in range(self.m.world.Get_size()):
            if w != self.m.wrank:
                self.m.lobby.send(_REJOIN, w, [self.m.wrank, since])

    def _admitted(self, d: Decision) -> bool:
        """Join the new generation's communicators and take the replica of the assigned stage.

        False when the communicator could not be built (then the rank leaves)."""
        m = self.m
        MPI = m.MPI
        try:
            new = m.build(d, lambda step, **at: self.faults.in_round(d.step, **at))
            ctl = new.Dup()
            ctl.Set_errhandler(MPI.ERRORS_RETURN)
            ft.agree(new, 1)
        except (MPI.Exception, BuildAgain):
            return False  # a member died or never came: the members go on without this rank
        k, P = d.admit_stage, d.step
        m.adopt(d, new, _Control(ctl), d.members)
        m.back_up(k, P)
        self.replicas.forget()
        m.steps.abandon()
        m.serve(d)
        self.replicas.resync(P)
        if k != m.launch_stage(m.wrank):
            self.replicas.warm_up(k)  # a first optimizer step would otherwise come at the takeover
        m.say(f"rejoined as a backup of stage {k} at generation {m.gen}")
        return True
