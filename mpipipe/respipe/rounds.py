"""A round, in four paired phases: announce, collect, decide, apply.

Whoever notices a late or failed rank starts a round: it revokes the data
communicator, *announces* its :class:`~mpipipe.respipe.messages.StateReport` to
every member, and *collects* the others' until every member answered or the
patience ran out. The lowest rank heard *decides* (:func:`mpipipe.respipe.decide.decide`,
a pure function) and sends the :class:`~mpipipe.respipe.messages.Decision`; every
member *applies* it: new communicators, route, roles, and the state of step P.

The :class:`Rounds` part of :class:`mpipipe.respipe.trainer.ResPipe`: it drives the
other parts through their methods (the membership builds and adopts the generation,
the replicas roll back, promote, merge and re-sync, the hot mirror goes on, the logbook
moves the log and logs the round, the rejoin part answers the lobby).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from mpipipe.core.logs.logschema import EventKind
from mpipipe.core.mpi import ft, watchdog
from mpipipe.core.mpi.faults import FaultPlan
from mpipipe.core.mpi.stop import ControlStop
from mpipipe.core.mpi.transport import Late, PeerFailed, pause
from mpipipe.respipe.auto import Retune
from mpipipe.respipe.control import _ANNOUNCE, _DECISION, _DEMOTED, _Control
from mpipipe.respipe.decide import View, decide, eval_point, round_patience, stage_holders
from mpipipe.respipe.hot import HotMirror
from mpipipe.respipe.logbook import Logbook
from mpipipe.respipe.membership import _DEBUG, BuildAgain, Demoted, Membership, StageLost
from mpipipe.respipe.messages import Decision, Round, RoundStarted, StateReport
from mpipipe.respipe.rejoin import Rejoin
from mpipipe.respipe.replicas import Replicas

QUICK_GRACE_S = 0.003  # floor of the wait for an answer from a rank already found late


class Rounds:
    """Detection to agreement to takeover: the round's phases.

    Built with the parts a round drives and the run's stop and fault plan; ``configure``
    gives it the run's length and evaluation period (decide needs them). ``takeovers``
    counts the stages taken over on this rank's view.
    """

    def __init__(self, m: Membership, replicas: Replicas, hot: HotMirror, book: Logbook,
                 rejoin: Rejoin, *, faults: FaultPlan, stopper: ControlStop,
                 evaluates: bool, retune: Retune | None = None) -> None:
        self.m, self.replicas, self.hot, self.book, self.rejoin = m, replicas, hot, book, rejoin
        self.retune = retune  # replicate_every = "auto": R chosen again at rounds
        self.faults, self.stopper = faults, stopper
        self.evaluates = evaluates
        self.total, self.eval_every = 0, 0
        self.takeovers = 0
        self.early: dict[int, StateReport] = {}  # announcements that came before the round

    def configure(self, total: int, eval_every: int) -> None:
        """The run's length and evaluation period (a round's decision needs both)."""
        self.total, self.eval_every = total, eval_every

    def round_from(self, e: Exception) -> Round:
        now = time.time()
        if isinstance(e, Late):
            return Round("late", self.m.members[e.source] if 0 <= e.source < len(self.m.members)
                          else -1, now, e.waited_s)
        assert isinstance(e, PeerFailed)
        revoked = e.error_class == self.m.MPI.ERR_REVOKED
        src = self.m.members[e.peer] if 0 <= e.peer < len(self.m.members) else -1
        return Round("revoked" if revoked else "failed", -1 if revoked else src, now)

    def check_announcements(self) -> None:
        """Join a round another rank started (its announcement is waiting)."""
        for w in self.m.members:
            if w == self.m.wrank:
                continue
            msg = self.m.control.poll(_ANNOUNCE, self.m.drank(w), seq=self.m.gen)
            if msg is not None:
                self.early[w] = StateReport.decode(msg)  # the round reads it from here
                raise RoundStarted(Round("announced", -1, time.time()))
        if self.m.demoted():
            raise Demoted(self.m.gen + 1)

    # -- announce ----------------------------------------------------------------
    def _state_report(self, rnd: Round) -> StateReport:
        """Where this rank stands and what it holds, as the round's coordinator needs it."""
        index = self.m.stage if self.m.stage is not None else (self.m.shadowing or 0)
        held = self.replicas.newest()
        latest = held[-1].count if held else -1
        prev = held[-2].count if len(held) > 1 else -1
        dead = {self.m.members[w] for w in (ft.failed_ranks(self.m.data) if self.m.ulfm else [])}
        if rnd.reason == "failed" and rnd.suspect >= 0:
            dead.add(rnd.suspect)
        last = self.m.steps.last_state
        records_from = last.step if last is not None and last.step == self.m.done - 1 \
            else self.m.done  # the oldest step whose messages this rank can send again
        return StateReport(
            gen=self.m.gen, rank=self.m.wrank, backup=self.m.stage is None, index=index,
            done=self.m.done, latest=latest, prev=prev, reason=rnd.reason, suspect=rnd.suspect,
            t_detect=rnd.t_detect, dead=tuple(sorted(dead)), waited_s=rnd.waited_s,
            after_step=bool(self.m.after_step), records_from=records_from,
            resumable=bool(self.m.steps.resumable))

    def _announce(self, rnd: Round) -> StateReport:
        """Wake every survivor (ULFM: revoke the data communicator) and send them this
        rank's report; returns it. Paired with :meth:`_collect` on every other member."""
        if self.m.ulfm:
            ft.revoke(self.m.data)  # wake every survivor blocked on the data communicator
        self.m.pipe.transport.discard()
        mine = self._state_report(rnd)
        vector = mine.encode()
        for w in self.m.members:
            if w != self.m.wrank:
                self.m.control.send(_ANNOUNCE, self.m.drank(w), vector, seq=self.m.gen)
        return mine

    # -- collect -------------------------------------------------------------------
    def _collect(self, heard: dict[int, StateReport], dead: set[int]) -> list[int]:
        """One pass over the members' announcements of this generation: adds what arrived
        to ``heard`` and the ranks they (or ULFM) know dead to ``dead``; returns the
        members still silent (neither heard nor known dead)."""
        for w in self.m.members:
            if w == self.m.wrank or w in heard:
                continue
            msg = self.m.control.poll(_ANNOUNCE, self.m.drank(w), seq=self.m.gen)
            if msg is not None:
                report = StateReport.decode(msg)
                if report.gen == self.m.gen:
                    heard[w] = report
                    dead.update(report.dead)
        if self.m.ulfm:
            for d in ft.failed_ranks(self.m.control.comm):
                dead.add(self.m.members[d])
        return [w for w in self.m.members if w not in heard and w not in dead]

    def _unreplaceable(self, heard: Mapping[int, StateReport]) -> list[int]:
        """The stages (world ranks) that no rank heard in this round holds a replica of:
        leaving one of them out would end the run."""
        return [w for k, w in enumerate(self.m.route_w)
                if not any(h in heard for h in stage_holders(k, self.m.route_w, self.m.backups_w,
                                                             self.m.settings.mode))]

    # -- decide (the coordinator) ----------------------------------------------------
    def _view(self, heard: Mapping[int, StateReport], dead: set[int],
              silent: Sequence[int]) -> View:
        """What this rank knows besides the reports, for :func:`decide`."""
        asking = {m.suspect for m in heard.values() if m.reason == "rejoin" and m.suspect >= 0}
        return View(gen=self.m.gen, members=tuple(self.m.members), route=tuple(self.m.route_w),
                    backups={k: tuple(bs) for k, bs in self.m.backups_w.items()},
                    log=self.m.log_w, dead=frozenset(dead), silent=tuple(silent),
                    homes={w: self.m.plan.role_of(w).index for w in asking},
                    labels=self.m.pipe.labels, evaluates=self.evaluates,
                    total=self.total, eval_every=self.eval_every)

    def _decide(self, heard: Mapping[int, StateReport], dead: set[int],
                silent: Sequence[int]) -> Decision:
        """The coordinator's verdict (the pure :func:`decide` on what it heard and knows),
        with R chosen again where ``"auto"`` finds the run drifted from its model."""
        d = decide(heard, self._view(heard, dead, silent), self.m.settings)
        return d if self.retune is None else self.retune.propose(d, self.m)

    def _send_decision(self, rnd: Round, decision: Decision, silent: Sequence[int]) -> None:
        """The coordinator sends the decision to every member (and the lobby's answer to a
        rank asking to rejoin), and tells the silent ranks they were left out.
        Paired with :meth:`_receive_decision` on every other member."""
        vector = decision.encode()
        for w in decision.members:
            if w != self.m.wrank and w in self.m.members:
                self.m.control.send(_DECISION, self.m.drank(w), vector, seq=self.m.gen)
        self.rejoin.answer(rnd, decision)
        for w in silent:
            self.m.control.send(_DEMOTED, self.m.drank(w), [self.m.gen + 1], seq=self.m.gen)

    def _receive_decision(self, heard: Mapping[int, StateReport]) -> Decision | None:
        """A decision from any rank heard in this round, if one is waiting."""
        for w in sorted(heard):
            if w == self.m.wrank:
                continue
            msg = self.m.control.poll(_DECISION, self.m.drank(w), seq=self.m.gen)
            if msg is not None:
                return Decision.decode(msg)
        return None

    # -- the round -------------------------------------------------------------------
    def recover(self, rnd: Round) -> None:
        """Run one round: announce, collect (until everyone answered or the patience ran
        out), decide (the lowest rank heard) or receive the decision, apply it."""
        mine = self._announce(rnd)
        heard: dict[int, StateReport] = {self.m.wrank: mine}
        heard.update((w, m) for w, m in self.early.items() if m.gen == self.m.gen)
        self.early = {}
        dead = set(mine.dead)
        start = time.perf_counter()
        # How long a round waits for silent ranks before it leaves them out: a deadline,
        # at least half a second, so that ranks that merely wait for a core (many ranks
        # on few cores) are not taken for stalled ones. A rank some survivor already
        # found late has had its deadline: it gets half a median step more to answer
        # (a slow rank that answers stays in; one that does not is replaced).
        grace = min(max(self.m.deadline(), 0.5), 5.0)
        quick = min(grace, max(self.m.median_step() / 2, QUICK_GRACE_S))
        decision = None
        told: list[int] | None = None  # the silent ranks the watchdog was last told of
        while decision is None:
            self.stopper.check(boundary=False)  # a data error is no member's failure
            if self.m.demoted():
                raise Demoted(self.m.gen + 1)
            silent = self._collect(heard, dead)
            if silent != told:
                told = silent
                watchdog.waiting(f"in a round of generation {self.m.gen} (step {self.m.done + 1}), "
                                 f"waiting to hear from ranks {silent or 'none'} and for a "
                                 "decision")
            waited = time.perf_counter() - start
            coordinator = min(heard)
            late = {m.suspect for m in heard.values() if m.reason == "late"}
            patience = round_patience(silent, late, len(self.m.members), grace, quick,
                                      route=self.m.route_w, dead=dead,
                                      unreplaceable=self._unreplaceable(heard))
            if coordinator == self.m.wrank and (not silent or waited > patience):
                decision = self._decide(heard, dead, silent)
                self._send_decision(rnd, decision, silent)
                break
            decision = self._receive_decision(heard)
            if decision is None and waited > 8 * grace + 2.0:
                # The coordinator we expected went silent too: leave it out and go on.
                heard.pop(coordinator, None)
                if coordinator == self.m.wrank:
                    raise RuntimeError("round failed: no decision reached")
            pause(waited)
        watchdog.waiting("")
        if _DEBUG:
            self.m.say(f"round gen {self.m.gen}: {rnd.reason} suspect {rnd.suspect} -> "
                      f"members {list(decision.members)} route {list(decision.route)} "
                      f"P {decision.step}")
        self._apply(decision, rnd)

    def eval_point(self, done: int) -> bool:
        """Is an evaluation due once ``done`` steps are applied?"""
        return eval_point(done, evaluates=self.evaluates, total=self.total,
                          eval_every=self.eval_every)

    # -- apply -----------------------------------------------------------------------
    def _apply(self, d: Decision, rnd: Round) -> None:
        """Build the new communicators, then adopt the route, roles and state of step P."""
        m = self.m
        try:
            t_comm, before = self._enter(d)
        except BuildAgain as why:
            # The members that came could not build the decided generation (a member died,
            # or never came, between the decision and the build): every one of them gets
            # this alike, nothing is applied yet, and they run the round again without the
            # missing one. An admitted rank that came gives up its admission and asks
            # again (Rejoin.rejoin).
            m.say(f"generation {d.gen} not built ({why}): the round runs again")
            m.new_generation_again()
            raise RoundStarted(Round("rebuild", -1, time.time())) from None
        P = d.step
        gone = [w for w in before if w not in d.members]
        stage_before = dict(enumerate(m.route_w))
        if d.lost_stage >= 0:
            k = d.lost_stage
            self.book.log_event(EventKind.STAGE_LOST, P, stage_before[k], stage=k, reason=d.reason)
            self.book.flush_rows_until(P)
            raise StageLost(k, stage_before[k], "failed" if d.reason == "failed"
                            else "stopped responding", had=len(m.plan.ranks_of("backup", k)))
        go_on = bool(d.go_on)
        if not go_on:  # the step is replayed from its start
            m.steps.abandon()
            m.pipe.zero_grad()
            m.after_step = False
            self.replicas.rollback(P)  # a step this rank completed beyond P, or cut inside P
        merged = self.replicas.merge(d, P) if d.merge >= 0 else None
        for k, w in enumerate(d.route):
            if d.merge < 0 and w == m.wrank and m.stage != k:
                if go_on:
                    self.hot.promote(k)
                else:
                    self.replicas.promote(k, d.choices[k], P)
        lost_stages = [k for k, w in stage_before.items() if w not in d.members]
        backups_before = m.backups_w
        if m.stage is None and m.shadowing is not None and not go_on:
            self.replicas.restart_backup(P)
        self.book.drop_rows_from(P)
        m.serve(d, merged)
        if go_on and m.stage is not None:
            # Nothing is replayed: the rows of the steps from P on are rebuilt in the new
            # generation from the figures every stage sends again.
            self.book.figs_again(lambda s: s >= P)
        self.book.log_round(d, P, gone=gone, stage_before=stage_before,
                            backups_before=backups_before, lost_stages=lost_stages,
                            t_comm=t_comm)
        self.takeovers += len(lost_stages)
        if self.retune is not None:
            self.retune.applied(d, gone, m, self.book.log_event)
        if go_on:
            self.hot.go_on()
        else:
            self.replicas.resync(P)
        watchdog.beat()
        if _DEBUG:
            m.say(f"applied at {time.time() % 100:.3f}")

    def _enter(self, d: Decision) -> tuple[float, list[int]]:
        """Build generation ``d.gen``'s communicators and enter it; the writer first reads
        what still travels on the old control communicator, and the log moves if the
        writer changed. Returns when the communicator was agreed on, and the members before.

        Raises:
            BuildAgain: a member did not come (from :meth:`Membership.build`).
        """
        m = self.m
        old_data = m.data
        before = list(m.members)
        shrunk = bool(d.shrink)  # every rank left out had failed
        new = m.build(d, self.faults.in_round)
        ctl = new.Dup()
        ctl.Set_errhandler(m.MPI.ERRORS_RETURN)
        lobby = m.lobby.comm.Get_group()
        members_new = new.Get_group().Translate_ranks(list(range(new.Get_size())), lobby)
        lobby.Free()
        if sorted(members_new) != sorted(d.members):
            raise RuntimeError(f"round disagreement: communicator has {members_new}, decision "
                               f"says {list(d.members)}")
        if m.ulfm:
            ft.agree(new, 1)
        t_comm = time.time()
        del old_data  # never freed: a demoted rank may still post to it
        if m.wrank == d.log:
            # Fault notes, figures and loss copies of steps before the round travel on the
            # old control communicator: read them before leaving it.
            self.book.drain_fault_notes(new_writer=d.log != m.log_w)
            if d.log != m.log_w:
                self.book.take_losses(passes=4, back=4)
            self.book.collect_pending(alive=d.members)
        old_writer = m.adopt(d, new, _Control(ctl), members_new)
        self.book.move_log(d, d.step, old_writer, old_writer_dead=shrunk)
        return t_comm, before
