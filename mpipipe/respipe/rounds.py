"""A round, in four paired phases: announce, collect, decide, apply.

Whoever notices a late or failed rank starts a round: it revokes the data
communicator, *announces* its :class:`~mpipipe.respipe.messages.StateReport` to
every member, and *collects* the others' until every member answered or the
patience ran out. The lowest rank heard *decides* (:func:`mpipipe.respipe.decide.decide`,
a pure function) and sends the :class:`~mpipipe.respipe.messages.Decision`; every
member *applies* it: new communicators, route, roles, and the state of step P.

The :class:`Rounds` mixin of :class:`mpipipe.respipe.trainer.ResPipe`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mpipipe.core.logs.logschema import EventKind
from mpipipe.core.mpi import ft, watchdog
from mpipipe.core.mpi.transport import Late, PeerFailed, pause
from mpipipe.respipe.control import _ANNOUNCE, _DECISION, _DEMOTED, _GO, _READY, _Control
from mpipipe.respipe.decide import View, decide, eval_point, round_patience, stage_holders
from mpipipe.respipe.membership import _DEBUG, Demoted, StageLost
from mpipipe.respipe.messages import Decision, StateReport

QUICK_GRACE_S = 0.003  # floor of the wait for an answer from a rank already found late
# How long a member waits for the others to build a generation's communicator before the
# round runs again without the missing ones (ft.from_group). Members reach the build as
# soon as they read the decision, which they poll for; under 10 ranks on 2 cores a
# poller can lose the CPU for seconds, so this is generous, and far below the watchdog.
BUILD_WAIT_S = 15.0


@dataclass
class _Round:
    reason: str
    suspect: int
    t_detect: float
    waited_s: float = math.nan


class _RoundStarted(Exception):
    """Another rank started a round; this one joins it."""

    def __init__(self, rnd: _Round) -> None:
        super().__init__(rnd.reason)
        self.round = rnd


class Rounds:
    """Detection to agreement to takeover: the round's phases."""

    def _round_from(self, e: Exception) -> _Round:
        now = time.time()
        if isinstance(e, Late):
            return _Round("late", self.members[e.source] if 0 <= e.source < len(self.members)
                          else -1, now, e.waited_s)
        assert isinstance(e, PeerFailed)
        revoked = e.error_class == self.MPI.ERR_REVOKED
        src = self.members[e.peer] if 0 <= e.peer < len(self.members) else -1
        return _Round("revoked" if revoked else "failed", -1 if revoked else src, now)

    def _check_announcements(self) -> None:
        """Join a round another rank started (its announcement is waiting)."""
        for w in self.members:
            if w == self.wrank:
                continue
            msg = self.control.poll(_ANNOUNCE, self._drank(w), seq=self.gen)
            if msg is not None:
                self._early[w] = StateReport.decode(msg)  # the round reads it from here
                raise _RoundStarted(_Round("announced", -1, time.time()))
        if self._demoted():
            raise Demoted(self.gen + 1)

    # -- announce ----------------------------------------------------------------
    def _state_report(self, rnd: _Round) -> StateReport:
        """Where this rank stands and what it holds, as the round's coordinator needs it."""
        index = self.stage if self.stage is not None else (self.shadowing or 0)
        held = sorted(self.slots if self.stage is None else
                      next(iter(self.ward_slots.values()), []), key=lambda s: s.count)
        latest = held[-1].count if held else -1
        prev = held[-2].count if len(held) > 1 else -1
        dead = {self.members[w] for w in (ft.failed_ranks(self.data) if self.ulfm else [])}
        if rnd.reason == "failed" and rnd.suspect >= 0:
            dead.add(rnd.suspect)
        last = self.pipe.last_state
        records_from = last.step if last is not None and last.step == self.done - 1 \
            else self.done  # the oldest step whose messages this rank can send again
        return StateReport(
            gen=self.gen, rank=self.wrank, backup=self.stage is None, index=index,
            done=self.done, latest=latest, prev=prev, reason=rnd.reason, suspect=rnd.suspect,
            t_detect=rnd.t_detect, dead=tuple(sorted(dead)), waited_s=rnd.waited_s,
            after_step=bool(self._after_step), records_from=records_from,
            resumable=bool(self.pipe.resumable))

    def _announce(self, rnd: _Round) -> StateReport:
        """Wake every survivor (ULFM: revoke the data communicator) and send them this
        rank's report; returns it. Paired with :meth:`_collect` on every other member."""
        if self.ulfm:
            ft.revoke(self.data)  # wake every survivor blocked on the data communicator
        self.pipe.transport.discard()
        mine = self._state_report(rnd)
        vector = mine.encode()
        for w in self.members:
            if w != self.wrank:
                self.control.send(_ANNOUNCE, self._drank(w), vector, seq=self.gen)
        return mine

    # -- collect -------------------------------------------------------------------
    def _collect(self, heard: dict[int, StateReport], dead: set[int]) -> list[int]:
        """One pass over the members' announcements of this generation: adds what arrived
        to ``heard`` and the ranks they (or ULFM) know dead to ``dead``; returns the
        members still silent (neither heard nor known dead)."""
        for w in self.members:
            if w == self.wrank or w in heard:
                continue
            msg = self.control.poll(_ANNOUNCE, self._drank(w), seq=self.gen)
            if msg is not None:
                report = StateReport.decode(msg)
                if report.gen == self.gen:
                    heard[w] = report
                    dead.update(report.dead)
        if self.ulfm:
            for d in ft.failed_ranks(self.control.comm):
                dead.add(self.members[d])
        return [w for w in self.members if w not in heard and w not in dead]

    def _unreplaceable(self, heard: Mapping[int, StateReport]) -> list[int]:
        """The stages (world ranks) that no rank heard in this round holds a replica of:
        leaving one of them out would end the run."""
        return [w for k, w in enumerate(self.route_w)
                if not any(h in heard for h in stage_holders(k, self.route_w, self.backups_w,
                                                             self.settings.mode))]

    # -- decide (the coordinator) ----------------------------------------------------
    def _view(self, heard: Mapping[int, StateReport], dead: set[int],
              silent: Sequence[int]) -> View:
        """What this rank knows besides the reports, for :func:`decide`."""
        asking = {m.suspect for m in heard.values() if m.reason == "rejoin" and m.suspect >= 0}
        return View(gen=self.gen, members=tuple(self.members), route=tuple(self.route_w),
                    backups={k: tuple(bs) for k, bs in self.backups_w.items()},
                    log=self.log_w, dead=frozenset(dead), silent=tuple(silent),
                    homes={w: self.plan.role_of(w).index for w in asking},
                    labels=self.pipe.labels, evaluates=self.evaluate_fn is not None,
                    total=self.total, eval_every=self.eval_every)

    def _decide(self, heard: Mapping[int, StateReport], dead: set[int],
                silent: Sequence[int]) -> Decision:
        """The coordinator's verdict (the pure :func:`decide` on what it heard and knows)."""
        return decide(heard, self._view(heard, dead, silent), self.settings)

    def _send_decision(self, rnd: _Round, decision: Decision, silent: Sequence[int]) -> None:
        """The coordinator sends the decision to every member (and the lobby's answer to a
        rank asking to rejoin), and tells the silent ranks they were left out.
        Paired with :meth:`_receive_decision` on every other member."""
        vector = decision.encode()
        for w in decision.members:
            if w != self.wrank and w in self.members:
                self.control.send(_DECISION, self._drank(w), vector, seq=self.gen)
        self._answer_rejoin(rnd, decision)
        for w in silent:
            self.control.send(_DEMOTED, self._drank(w), [self.gen + 1], seq=self.gen)

    def _receive_decision(self, heard: Mapping[int, StateReport]) -> Decision | None:
        """A decision from any rank heard in this round, if one is waiting."""
        for w in sorted(heard):
            if w == self.wrank:
                continue
            msg = self.control.poll(_DECISION, self._drank(w), seq=self.gen)
            if msg is not None:
                return Decision.decode(msg)
        return None

    # -- the round -------------------------------------------------------------------
    def _recover(self, rnd: _Round) -> None:
        """Run one round: announce, collect (until everyone answered or the patience ran
        out), decide (the lowest rank heard) or receive the decision, apply it."""
        mine = self._announce(rnd)
        heard: dict[int, StateReport] = {self.wrank: mine}
        heard.update((w, m) for w, m in self._early.items() if m.gen == self.gen)
        self._early = {}
        dead = set(mine.dead)
        start = time.perf_counter()
        # How long a round waits for silent ranks before it leaves them out: a deadline,
        # at least half a second, so that ranks that merely wait for a core (many ranks
        # on few cores) are not taken for stalled ones. A rank some survivor already
        # found late has had its deadline: it gets half a median step more to answer
        # (a slow rank that answers stays in; one that does not is replaced).
        grace = min(max(self._deadline(), 0.5), 5.0)
        quick = min(grace, max(self._median_step() / 2, QUICK_GRACE_S))
        decision = None
        told: list[int] | None = None  # the silent ranks the watchdog was last told of
        while decision is None:
            self.stopper.check(boundary=False)  # a data error is no member's failure
            if self._demoted():
                raise Demoted(self.gen + 1)
            silent = self._collect(heard, dead)
            if silent != told:
                told = silent
                watchdog.waiting(f"in a round of generation {self.gen} (step {self.done + 1}), "
                                 f"waiting to hear from ranks {silent or 'none'} and for a "
                                 "decision")
            waited = time.perf_counter() - start
            coordinator = min(heard)
            late = {m.suspect for m in heard.values() if m.reason == "late"}
            patience = round_patience(silent, late, len(self.members), grace, quick,
                                      route=self.route_w, dead=dead,
                                      unreplaceable=self._unreplaceable(heard))
            if coordinator == self.wrank and (not silent or waited > patience):
                decision = self._decide(heard, dead, silent)
                self._send_decision(rnd, decision, silent)
                break
            decision = self._receive_decision(heard)
            if decision is None and waited > 8 * grace + 2.0:
                # The coordinator we expected went silent too: leave it out and go on.
                heard.pop(coordinator, None)
                if coordinator == self.wrank:
                    raise RuntimeError("round failed: no decision reached")
            pause(waited)
        watchdog.waiting("")
        if _DEBUG:
            self._say(f"round gen {self.gen}: {rnd.reason} suspect {rnd.suspect} -> "
                      f"members {list(decision.members)} route {list(decision.route)} "
                      f"P {decision.step}")
        self._apply(decision, rnd)

    def _eval_point(self, done: int) -> bool:
        """Is an evaluation due once ``done`` steps are applied?"""
        return eval_point(done, evaluates=self.evaluate_fn is not None, total=self.total,
                          eval_every=self.eval_every)

    def _rebuild(self, d: Decision, why: Exception) -> None:
        """The members that came could not build the decided generation (a member died,
        or never came, between the decision and the build): every one of them gets this
        alike (:func:`mpipipe.core.mpi.ft.from_group`), nothing is applied yet, and they run
        the round again without the missing one.

        The retry counts as a generation of its own, on the old control communicator:
        no message of the failed attempt (announcements, the decision) matches it, and
        its decision's communicator tag differs. An admitted rank that came gives up
        its admission and asks again (:meth:`Rejoin._rejoin`).

        Raises:
            _RoundStarted: always (the round to run now).
        """
        self._say(f"generation {d.gen} not built ({why}): the round runs again")
        self.gen += 1
        raise _RoundStarted(_Round("rebuild", -1, time.time()))

    def _build(self, d: Decision, in_round: Callable[..., float]) -> Any:
        """The new generation's communicator, built by its members alone (a member's and an
        admitted rank's side alike); runs the round again (:meth:`_rebuild`) if a member
        did not come.

        From their world ranks (ft.from_group): a left-out rank, dead or stalled, and an
        admitted rank (not on this generation's communicator) need nothing else. Not
        Shrink, even when every rank left out is dead: it waits for every live rank, and
        a member may stall or die in between. The lobby's ranks are world ranks. First
        every member says it is there (:meth:`_ready`), so that the build itself only
        starts among members that all came.
        """
        since = time.perf_counter()
        in_round(max(self.done, d.step))  # kill/stall ...:round=N
        watchdog.waiting(f"building generation {d.gen} with ranks {list(d.members)}")
        if not self._ready(d, since):
            self._rebuild(d, ft.BuildFailed("a member did not say it was there in time"))
        in_round(max(self.done, d.step), at_build=True)  # ...:round=N:build=1
        try:
            new = ft.from_group(self.lobby.comm, sorted(d.members), d.comm_tag,
                                wait_s=BUILD_WAIT_S)
        except ft.BuildFailed as e:
            self._rebuild(d, e)
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

    # -- apply -----------------------------------------------------------------------
    def _apply(self, d: Decision, rnd: _Round) -> None:
        """Build the new communicators, then adopt the route, roles and state of step P."""
        MPI = self.MPI
        old_data = self.data
        gone = [w for w in self.members if w not in d.members]
        shrunk = bool(d.shrink)  # every rank left out had failed
        new = self._build(d, self.faults.in_round)
        ctl = new.Dup()
        ctl.Set_errhandler(MPI.ERRORS_RETURN)
        lobby = self.lobby.comm.Get_group()
        members_new = new.Get_group().Translate_ranks(list(range(new.Get_size())), lobby)
        lobby.Free()
        if sorted(members_new) != sorted(d.members):
            raise RuntimeError(f"round disagreement: communicator has {members_new}, decision "
                               f"says {list(d.members)}")
        if self.ulfm:
            ft.agree(new, 1)
        t_comm = time.time()
        del old_data  # never freed: a demoted rank may still post to it
        if self.wrank == d.log:
            # Fault notes, figures and loss copies of steps before the round travel on the
            # old control communicator: read them before leaving it.
            self._drain_fault_notes(new_writer=d.log != self.log_w)
            if d.log != self.log_w:
                self._take_losses(passes=4, back=4)
            for s in sorted(self.pending_rows):
                self._collect_figs(s, 0.2, alive=d.members)
        self.data, self.control, self.members = new, _Control(ctl), members_new
        self.gen = d.gen
        P = d.step
        self._gen_step = P
        self._move_log(d, P, old_writer_dead=shrunk)
        stage_before = {k: w for k, w in enumerate(self.route_w)}
        if d.lost_stage >= 0:
            k = d.lost_stage
            self._log_event(EventKind.STAGE_LOST, P, stage_before[k], stage=k, reason=d.reason)
            self._flush_rows_until(P)
            raise StageLost(k, stage_before[k], "failed" if d.reason == "failed"
                            else "stopped responding", had=len(self.plan.ranks_of("backup", k)))
        go_on = bool(d.go_on)
        if not go_on:  # the step is replayed from its start
            self.pipe.abandon()
            self.pipe.zero_grad()
            self._after_step = False
        # Roll back a step this rank completed beyond P (its snapshot holds step P).
        if not go_on and self.stage is not None and self.done > P:
            snap = next((x for x in (self.snapshot, self.prev_snapshot)
                         if x is not None and x.count == P), None)
            if snap is None:
                raise RuntimeError(f"cannot roll back from step {self.done} to {P}")
            assert self.own is not None
            self.own.unpack(snap.flat, P)
            self.done = P
        elif not go_on and self.stage is not None and self.snapshot is not None \
                and self.snapshot.count == P == self.done:
            # Cut mid-step: the forwards it ran moved BatchNorm's running statistics; the
            # replay must not count those micro-batches twice (the snapshot has step P's).
            assert self.own is not None
            self.own.unpack(self.snapshot.flat, P)
        if d.merge >= 0:
            self._merge(d, P)
        for k, w in enumerate(d.route):
            if d.merge < 0 and w == self.wrank and self.stage != k:
                if go_on:
                    self._promote_mirror(k)
                else:
                    self._promote(k, d.choices[k], P)
        lost_stages = [k for k, w in stage_before.items() if w not in d.members]
        backups_before = self.backups_w
        self.route_w = list(d.route)
        self.backups_w = {k: list(bs) for k, bs in d.backups.items()}
        if self.stage is None and self.shadowing is not None and not go_on:
            self.slots = []
            self.done = P
        self.pending_rows = {s: r for s, r in self.pending_rows.items() if s < P}
        self._rebind_pipe()
        if go_on and self.stage is not None:
            # Nothing is replayed: the rows of the steps from P on are rebuilt in the new
            # generation from the figures every stage sends again.
            self._figs_again(lambda s: s >= P)
        t_fault = min((self.fault_notes.get(w, (math.nan,))[0] for w in gone),
                      default=math.nan)
        detected_after = d.t_detect - t_fault if not math.isnan(t_fault) else d.waited_s
        if self.is_logger:
            kind = EventKind.FAILURE_DETECTED if d.reason == "failed" or d.shrink else EventKind.LATE
            for w in gone:
                backup_of = next((k for k, bs in backups_before.items() if w in bs), -1)
                self._log_event(kind, P, w, detected_after_s=detected_after,
                                how="ulfm" if d.shrink else "deadline",
                                stage=next((k for k, x in stage_before.items() if x == w), -1),
                                backup_of=backup_of)
                if backup_of >= 0 and self.progress is not None:
                    left = len(self.backups_w.get(backup_of, []))
                    self.progress.message(f"backup rank {w} of stage {backup_of} lost "
                                          f"({kind}); stage {backup_of} has {left} "
                                          f"backup{'' if left == 1 else 's'} left")
            for k in lost_stages:
                w_new = self.route_w[k] if d.merge < 0 else self.route_w[max(k - 1, 0)]
                ev = {"kind": EventKind.TAKEOVER, "step": P, "rank": w_new, "stage": k,
                      "generation": self.gen, "detected_after_s": detected_after,
                      "t0": t_fault if not math.isnan(t_fault) else d.t_detect}
                self._log_event(EventKind.TAKEOVER, P, w_new, stage=k, replaced=stage_before[k],
                                generation=self.gen, replay_step=-1 if go_on else P + 1,
                                lost_updates=P - d.choices.get(k, P),
                                detected_after_s=detected_after,
                                agreement_s=t_comm - d.t_detect, mode=self.settings.mode)
                self.open_events.append(ev)
        self.takeovers += len(lost_stages)
        if d.admit >= 0 and self.is_logger:
            self._log_event(EventKind.REJOINED, P, d.admit, stage=d.admit_stage,
                            generation=self.gen, after_s=t_comm - d.waited_s)
        if go_on:
            self._go_on()
        else:
            self._resync(P)
        watchdog.beat()
        if _DEBUG:
            self._say(f"applied at {time.time() % 100:.3f}")
