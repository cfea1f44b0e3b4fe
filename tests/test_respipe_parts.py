"""ResPipe's parts, each built alone: the membership on a one-rank communicator, the
others with fakes of their neighbours (a fake membership, transport, log and lobby).
The protocol as a whole runs under mpirun in tests/test_respipe_runs.py."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from mpipipe.core.logs.logschema import EventKind
from mpipipe.core.mpi.transport import REPLICA, Late
from mpipipe.respipe.control import _ADMIT, _CLOSED, _REJOIN
from mpipipe.respipe.logbook import Logbook
from mpipipe.respipe.membership import MIN_DEADLINE_S, Membership
from mpipipe.respipe.messages import Decision, Round, RoundStarted
from mpipipe.respipe.mirror import Have
from mpipipe.respipe.rejoin import Rejoin
from mpipipe.respipe.replicas import Replicas, _Slot
from mpipipe.respipe.rounds import Rounds
from mpipipe.respipe.settings import Settings


def _sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


class _Plan:
    """Three stages on ranks 0..2 (rank 0 writes the log), a backup of stage 1 on rank 3."""

    log_rank = 0

    def ranks_of(self, kind: str, k: int) -> list[int]:
        return [k] if kind == "stage" else ([3] if k == 1 else [])

    def role_of(self, w: int) -> Any:
        return SimpleNamespace(kind="stage", index=w) if w < 3 else \
            SimpleNamespace(kind="backup", index=1)


class _Pipe:
    """What the membership asks of the engine: its stages and a route to bind."""

    k, chunks = 3, 1

    def __init__(self) -> None:
        self.partitions = [nn.Linear(3, 3) for _ in range(3)]
        self.route: Any = None

    def rebind(self, route: Any, comm: Any) -> None:
        self.route = route


class _Transport:
    def __init__(self) -> None:
        self.sent: list[tuple[int, int, int, int]] = []  # (dest, kind, step, bytes)
        self.flushed = 0

    def send(self, flat: torch.Tensor, dest: int, *, kind: int, step: int, micro: int = 0) -> None:
        self.sent.append((dest, kind, step, flat.numel()))

    def flush(self, deadline: float) -> None:
        self.flushed += 1


class _FakeMembership:
    """The membership as the other parts see it: fields and a few questions."""

    def __init__(self, *, stage: int | None, shadowing: int | None = None, wrank: int = 0,
                 holders: dict[int, list[int]] | None = None, R: int = 1,
                 log_w: int = 0) -> None:
        self.stage, self.shadowing, self.wrank, self.log_w = stage, shadowing, wrank, log_w
        self.members = [0, 1, 2, 3]
        self.route_w = [0, 1, 2]
        self.backups_w = {0: [], 1: [3], 2: []}
        self.wards: list[int] = []
        self.done, self.gen, self.gen_step, self.after_step = 0, 0, 0, False
        self.step_times: list[float] = []
        self.settings = Settings(backups={1: 1}, replicate_every=R)
        self.pipe = SimpleNamespace(transport=_Transport(),
                                    partitions=[nn.Linear(3, 3) for _ in range(3)])
        self._holders = holders or {1: [3]}
        self.control = _Lobby()
        self.said: list[str] = []

    @property
    def is_logger(self) -> bool:
        return self.wrank == self.log_w

    def module(self, k: int) -> nn.Module:
        return self.pipe.partitions[k]

    def holders_of(self, k: int) -> list[int]:
        return self._holders.get(k, [])

    def drank(self, w: int) -> int:
        return self.members.index(w)

    def deadline(self) -> float:
        return 1.0

    def say(self, text: str) -> None:
        self.said.append(text)


class _Lobby:
    """A control plane that keeps what is sent and hands out what a test puts in."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int, list[float]]] = []
        self.inbox: list[tuple[int, list[float]]] = []

    def send(self, code: int, dest: int, values: Any, seq: int = 0) -> None:
        self.sent.append((code, dest, list(values)))

    def poll(self, code: int, source: int, seq: int = 0) -> Any:
        for i, (c, values) in enumerate(self.inbox):
            if c == code:
                del self.inbox[i]
                return values
        return None


# -- Membership (a real one, on this process alone) ---------------------------------------

class _World:
    """A job of four ranks as rank 0 sees it (no message is sent in these tests)."""

    def Get_rank(self) -> int:  # noqa: N802 - MPI's names
        return 0

    def Get_size(self) -> int:  # noqa: N802
        return 4

    def Dup(self) -> _World:  # noqa: N802
        return self

    def Set_errhandler(self, handler: Any) -> None:  # noqa: N802
        pass


@pytest.fixture
def membership() -> Membership:
    return Membership(world=_World(), plan=_Plan(), pipe=_Pipe(),
                      settings=Settings(backups={1: 1}, deadline_s=2.0, deadline_factor=3.0))


def test_membership_knows_the_route_holders_and_binds_the_pipe(membership: Membership) -> None:
    m = membership
    assert (m.route_w, m.backups_w, m.stage, m.shadowing) == ([0, 1, 2], {0: [], 1: [3], 2: []}, 0, None)
    assert m.holders_of(1) == [3] and m.holders_of(0) == []
    assert m.rollback_possible() and m.is_logger and m.drank(3) == 3
    assert m.pipe.route.generation == 0 and m.module(2) is m.pipe.partitions[2]
    assert m.steps.engine is m.pipe and not (m.steps.resumable or m.steps.relay_grads)  # cold


def test_the_hot_steps_around_the_engine_forget_what_peers_held_on_a_new_route() -> None:
    m = Membership(world=_World(), plan=_Plan(), pipe=_Pipe(),
                   settings=Settings(backups={1: 1}, mode="hot"))
    assert m.steps.resumable and m.steps.relay_grads
    assert m.pipe.route.shadows == ((1, 3),)  # the backup of stage 1 gets its relays
    m.steps.peer_have = {1: Have(0, 1, 0, False)}
    m.rebind()
    assert m.steps.peer_have == {} and m.steps.engine is m.pipe


def test_the_deadline_follows_the_median_step_but_not_in_a_generations_first_step(
        membership: Membership) -> None:
    m = membership
    assert m.deadline() == 2.0  # fewer than 5 steps timed
    m.step_times.extend([0.1, 0.2, 0.3, 0.2, 0.2])
    assert m.deadline() == pytest.approx(0.6)
    m.gen, m.gen_step, m.done = 1, 7, 7  # a round just ended: its first step
    assert m.deadline() == 2.0
    m.done = 8
    assert m.deadline() == pytest.approx(0.6)
    m.step_times.clear()
    m.step_times.extend([0.0001] * 5)
    assert m.deadline() == MIN_DEADLINE_S


def test_adopt_and_serve_enter_the_decided_generation(membership: Membership) -> None:
    m = membership
    d = Decision(gen=1, step=4, members=(0, 1, 3), route=(0, 3, 1), backups={0: (), 1: (), 2: ()},
                 log=1, choices={1: 4}, lost_stage=-1, merge=-1, shrink=True, go_on=False,
                 admit=-1, admit_stage=-1, silent=(), reason="failed", suspect=2, t_detect=0.0,
                 waited_s=0.0)
    old = m.adopt(d, m.data, m.control, d.members)
    assert old == 0 and m.log_w == 1 and not m.is_logger and (m.gen, m.gen_step) == (1, 4)
    m.serve(d)
    assert m.route_w == [0, 3, 1] and m.backups_w[1] == []
    assert m.pipe.route.generation == 1 and m.pipe.route.ranks == (0, 2, 1)  # data ranks
    m.back_up(2, 4)
    assert (m.stage, m.shadowing, m.done) == (None, 2, 4)


# -- Replicas (with a fake membership) --------------------------------------------------------

def test_a_stage_replicates_every_r_steps_the_exact_state_to_its_holders() -> None:
    m = _FakeMembership(stage=1, wrank=1, R=2)
    r = Replicas(m, _sgd, (3,))
    assert r.own is not None and r.own.module is m.module(1)
    for done in (1, 2, 3, 4):
        m.done = done
        r.replicate()
    t = m.pipe.transport
    assert [(dest, kind, step) for dest, kind, step, _ in t.sent] == [(3, REPLICA, 2), (3, REPLICA, 4)]
    assert all(n == r.own.nbytes for *_, n in t.sent)


def test_rollback_restores_the_snapshot_of_the_replayed_step_exactly() -> None:
    m = _FakeMembership(stage=1, wrank=1)
    r = Replicas(m, _sgd, (3,))
    own = r.own
    before = {k: v.clone() for k, v in own.module.state_dict().items()}
    r.keep_snapshot()  # step 0
    own.module(torch.ones(2, 3)).sum().backward()
    own.apply_step(SimpleNamespace(apply=lambda opt, s: None), 0)
    m.done = 1
    r.rollback(0)
    assert m.done == 0 and own.step == 0 and not own.optimizer.state
    assert all(torch.equal(before[k], v) for k, v in own.module.state_dict().items())
    with pytest.raises(RuntimeError, match="cannot roll back from step 3 to 1"):
        m.done = 3
        r.rollback(1)


def test_a_backup_holds_the_two_newest_replicas_and_is_promoted_from_the_chosen_one() -> None:
    m = _FakeMembership(stage=None, shadowing=1, wrank=3)
    r = Replicas(m, _sgd, (3,))
    assert [s.count for s in r.slots] == [0]  # the initial state is the replica of step 0
    src = Replicas(_FakeMembership(stage=1, wrank=1), _sgd, (3,)).own
    with torch.no_grad():
        src.module.weight.fill_(0.5)
    for count in (1, 2, 3):
        r.hold(_Slot(src.pack(), count), 1)
    assert [s.count for s in r.slots] == [2, 3]
    r.promote(1, 2, P=2)
    assert (m.stage, m.shadowing, m.done, r.slots) == (1, None, 2, [])
    assert torch.equal(r.own.module.weight, torch.full((3, 3), 0.5)) and r.own.step == 2
    with pytest.raises(RuntimeError, match="lacks the replica of step 5"):
        Replicas(_FakeMembership(stage=None, shadowing=1, wrank=3), _sgd, (3,)).promote(1, 5, 5)


# -- Logbook (with a fake membership and log) ----------------------------------------------

class _Log:
    active = True

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.events: list[tuple[str, dict[str, Any]]] = []

    def elapsed(self) -> float:
        return 0.0

    def step(self, step: int, **row: Any) -> None:
        self.rows.append(step)

    def event(self, kind: str, **detail: Any) -> None:
        self.events.append((kind, detail))


def _book(m: _FakeMembership, log: _Log | None = None) -> Logbook:
    return Logbook(m, log=log, progress=None, batch_size=8, in_shape=(3,),
                   make_optimizer=_sgd, evaluate=None)


def test_the_writer_writes_a_row_one_step_late_and_closes_a_takeover_with_its_recovery() -> None:
    m = _FakeMembership(stage=0, wrank=0, log_w=0)
    m.route_w = [0]  # a one-stage route: the writer waits for nobody's figures
    log = _Log()
    book = _book(m, log)
    figs = [0, 100.0, 1.5, 0.1, 0.0, 10, 10, 0, 0]
    book.report(0, figs)
    assert log.rows == [] and 0 in book.pending_rows
    book.open_events.append({"kind": EventKind.TAKEOVER, "step": 0, "rank": 0, "stage": 1,
                             "generation": 1, "detected_after_s": 0.1, "t0": 100.5})
    book.report(1, [1, 101.0, 1.2, 0.1, 0.0, 10, 10, 0, 0])
    assert log.rows == [1] and book.last_loss == 1.5
    assert [k for k, _ in log.events] == [EventKind.TAKEOVER + "_recovered"]
    assert log.events[0][1]["recovery_s"] == pytest.approx(0.5)
    book.write_pending()
    assert log.rows == [1, 2]


def test_a_non_writer_sends_its_figures_and_a_loss_copy_to_the_keeper() -> None:
    m = _FakeMembership(stage=2, wrank=2, log_w=0)
    book = _book(m)
    assert book.loss_keeper() == 1  # the lowest stage but the writer and the last one
    book.report(4, [4, 1.0, 0.7, 0.1, 0.0, 1, 1, 2, 0])
    codes = [(code, dest) for code, dest, _ in m.control.sent]
    from mpipipe.respipe.control import _FIGS, _LOSS
    assert codes == [(_LOSS, 1), (_FIGS, 0)]


def test_a_round_is_logged_once_by_the_writer_with_its_takeover() -> None:
    m = _FakeMembership(stage=0, wrank=0, log_w=0)
    m.route_w, m.gen = [0, 3, 2], 1
    log = _Log()
    book = _book(m, log)
    book.fault_notes[1] = (10.0, "kill:stage=1:step=3")
    d = Decision(gen=1, step=3, members=(0, 2, 3), route=(0, 3, 2), backups={0: (), 1: (), 2: ()},
                 log=0, choices={1: 3}, lost_stage=-1, merge=-1, shrink=True, go_on=False, admit=-1,
                 admit_stage=-1, silent=(), reason="failed", suspect=1, t_detect=10.25,
                 waited_s=0.0)
    book.log_round(d, 3, gone=[1], stage_before={0: 0, 1: 1, 2: 2},
                   backups_before={1: [3]}, lost_stages=[1], t_comm=10.5)
    kinds = [k for k, _ in log.events]
    assert kinds == [EventKind.FAILURE_DETECTED, EventKind.TAKEOVER]
    take = log.events[1][1]
    assert (take["rank"], take["replaced"], take["replay_step"], take["lost_updates"]) == (3, 1, 4, 0)
    assert take["detected_after_s"] == pytest.approx(0.25) and len(book.open_events) == 1
    other = _book(_FakeMembership(stage=2, wrank=2, log_w=0), _Log())
    other.log_round(d, 3, gone=[1], stage_before={0: 0, 1: 1, 2: 2},
                    backups_before={1: [3]}, lost_stages=[1], t_comm=10.5)
    assert other.log.events == [] and other.open_events == []


# -- Rejoin (with a fake membership and lobby) ---------------------------------------------

def _rejoin(m: _FakeMembership) -> Rejoin:
    return Rejoin(m, replicas=None, faults=None)  # type: ignore[arg-type]


def test_rejoin_needs_ulfm_and_backup_ranks() -> None:
    m = _FakeMembership(stage=0)
    m.ulfm, m.lobby, m.MPI = False, _Lobby(), SimpleNamespace(ANY_SOURCE=-1)
    assert not _rejoin(m).enabled()
    m.ulfm = True
    assert _rejoin(m).enabled()
    m.settings = Settings(backups={}, mode="neighbour")
    assert not _rejoin(m).enabled()


def test_the_coordinator_turns_a_rejoin_request_into_a_round_and_answers_it() -> None:
    m = _FakeMembership(stage=0, wrank=0)
    m.members = [0, 1, 2]  # rank 3 was replaced
    m.ulfm, m.lobby, m.MPI = True, _Lobby(), SimpleNamespace(ANY_SOURCE=-1)
    part = _rejoin(m)
    m.lobby.inbox.append((_REJOIN, [3, 42.0]))
    with pytest.raises(RoundStarted) as e:
        part.poll()
    assert (e.value.round.reason, e.value.round.suspect, e.value.round.waited_s) == ("rejoin", 3, 42.0)
    admit = SimpleNamespace(admit=3, encode=lambda: [1.0])
    part.answer(e.value.round, admit)  # type: ignore[arg-type]
    part.answer(e.value.round, SimpleNamespace(admit=-1))  # type: ignore[arg-type]
    assert [(code, dest) for code, dest, _ in m.lobby.sent] == [(_ADMIT, 3), (_CLOSED, 3)]


# -- Rounds (with fakes) -----------------------------------------------------------------------

def test_a_round_names_the_late_rank_by_its_world_rank_and_reports_what_it_holds() -> None:
    m = _FakeMembership(stage=None, shadowing=1, wrank=3)
    m.members = [0, 1, 3, 2]  # data rank 2 is world rank 3
    m.ulfm, m.MPI = False, SimpleNamespace(ERR_REVOKED=-7)
    m.steps = SimpleNamespace(last_state=None, resumable=False)  # the hot steps, idle
    replicas = Replicas(m, _sgd, (3,))
    rounds = Rounds(m, replicas, hot=None, book=None, rejoin=None,  # type: ignore[arg-type]
                    faults=None, stopper=None, evaluates=False)  # type: ignore[arg-type]
    rnd = rounds.round_from(Late(3, 0.25))
    assert (rnd.reason, rnd.suspect, rnd.waited_s) == ("late", 2, 0.25)
    m.done = 5
    replicas.hold(_Slot(replicas.slots[0].flat, 5), 1)
    report = rounds._state_report(Round("late", 2, 1.0, 0.25))
    assert (report.backup, report.index, report.done, report.latest, report.prev) == (True, 1, 5, 5, 0)
    assert report.records_from == 5 and not report.after_step and math.isclose(report.waited_s, 0.25)
