"""Rejoining: a replaced rank asks, on the job-wide lobby, to come back as a backup; the
lowest member turns the request into a round that admits it.

The :class:`Rejoin` mixin of :class:`mpipipe.respipe.trainer.ResPipe`.
"""

from __future__ import annotations

import sys
import time

from mpipipe.core.mpi import ft, watchdog
from mpipipe.respipe.control import _ADMIT, _CLOSED, _REJOIN, _Control
from mpipipe.respipe.membership import Demoted
from mpipipe.respipe.messages import Decision
from mpipipe.respipe.rounds import _Round, _RoundStarted

REJOIN_WAIT_S = 300.0  # how long a replaced rank waits to be admitted or told the job ended


class Rejoin:
    """The lobby's side of a round: requests, admission, and the end of the job."""

    def _rejoin_enabled(self) -> bool:
        """Replaced ranks may rejoin only under ULFM (a round must be able to wake every
        member at once, which revoking the data communicator does) and with backup
        ranks (not in neighbour mode)."""
        return self.ulfm and self.settings.mode != "neighbour"

    def _poll_rejoin(self) -> None:
        """At a step boundary: the coordinator turns a rejoin request into a round."""
        if not self._rejoin_enabled():
            return
        msg = self.lobby.poll(_REJOIN, self.MPI.ANY_SOURCE)
        while msg is not None:
            # Every member keeps the requests: if the coordinator dies, the next one has them.
            self._rejoin_requests[int(msg[0])] = float(msg[1])
            msg = self.lobby.poll(_REJOIN, self.MPI.ANY_SOURCE)
        for w in [w for w in self._rejoin_requests if w in self.members]:
            del self._rejoin_requests[w]  # already back
        if self._rejoin_requests and self.wrank == min(self.members):
            w = min(self._rejoin_requests)
            since = self._rejoin_requests.pop(w)
            # The round's "waited" slot carries when the rank was told it was replaced.
            raise _RoundStarted(_Round("rejoin", w, time.time(), since))

    def _answer_rejoin(self, rnd: _Round, decision: Decision) -> None:
        """Coordinator, after deciding a rejoin round: admit the rank, or send it away."""
        if rnd.reason != "rejoin":
            return
        if decision.admit == rnd.suspect:
            self.lobby.send(_ADMIT, rnd.suspect, decision.encode())
        else:  # a failure came in between: the round had other business
            self.lobby.send(_CLOSED, rnd.suspect, [self.gen])

    def close_lobby(self) -> None:
        """Tell every rank outside the job's last generation that there is nothing to rejoin.

        Called by the lowest member at the end (or on a lost stage); waits up to a
        second for the notices to leave, as the process exits right after.
        """
        if not self._rejoin_enabled():
            return
        for w in range(self.world.Get_size()):
            if w not in self.members:
                self.lobby.send(_CLOSED, w, [self.gen])
        self.lobby.drain(1.0)

    def _rejoin(self, demoted: Demoted) -> bool:
        """A replaced rank asks to come back as a backup. True once it is one again.

        False (the rank then leaves, as without ULFM) when rejoining is not possible,
        the job ended first, or nobody answered within REJOIN_WAIT_S. A replaced log
        writer has let go of the log by now: the round gave it to a survivor.
        """
        if not self._rejoin_enabled():
            return False
        print(f"mpipipe train: rank {self.wrank} was late and has been replaced ({demoted}); "
              "it asks to rejoin as a backup", file=sys.stderr, flush=True)
        since = time.time()
        self._ask_to_rejoin(since)
        give_up = time.perf_counter() + REJOIN_WAIT_S
        while time.perf_counter() < give_up:
            if self.lobby.poll(_CLOSED, self.MPI.ANY_SOURCE) is not None:
                return False
            msg = self.lobby.poll(_ADMIT, self.MPI.ANY_SOURCE)
            if msg is not None:
                if self._admitted(Decision.decode(msg)):
                    return True
                # The generation that admitted it was not built (a member died or never
                # came): the members run their round again without it; ask once more.
                self._ask_to_rejoin(since)
            watchdog.beat()  # a bounded wait of its own (REJOIN_WAIT_S), not stuck
            time.sleep(0.005)
        return False

    def _ask_to_rejoin(self, since: float) -> None:
        """Ask every other rank of the job (the lowest member answers)."""
        for w in range(self.world.Get_size()):
            if w != self.wrank:
                self.lobby.send(_REJOIN, w, [self.wrank, since])

    def _admitted(self, d: Decision) -> bool:
        """Join the new generation's communicators and take the replica of the assigned stage.

        False when the communicator could not be built (then the rank leaves)."""
        MPI = self.MPI
        try:
            new = self._build(d, lambda step, **at: self.faults.in_round(d.step, **at))
            ctl = new.Dup()
            ctl.Set_errhandler(MPI.ERRORS_RETURN)
            ft.agree(new, 1)
        except (MPI.Exception, _RoundStarted):
            return False  # a member died or never came: the members go on without this rank
        k, P = d.admit_stage, d.step
        self.data, self.control, self.members = new, _Control(ctl), list(d.members)
        self.gen, self._gen_step = d.gen, P
        self.log_w = d.log
        self.route_w = list(d.route)
        self.backups_w = {j: list(bs) for j, bs in d.backups.items()}
        self.stage, self.shadowing = None, k
        self.own, self.snapshot, self.slots = None, None, []
        self.prev_snapshot = None
        self.done = P
        self._faults_at = max(self._faults_at, P - 1)  # none due while it was away fires late
        self.pending_rows, self._early = {}, {}
        self.pipe.abandon()
        self._rebind_pipe()
        self._resync(P)
        if k != self._launch_stage(self.wrank):
            self._warm_up(k)  # a first optimizer step would otherwise come at the takeover
        self._say(f"rejoined as a backup of stage {k} at generation {self.gen}")
        return True
