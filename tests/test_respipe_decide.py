"""The round's decision, table-driven: reports and the coordinator's view in, a Decision out.

No MPI and no trainer: :func:`mpipipe.respipe.decide.decide` is pure. The job of
most cases: stages 0, 1, 2 on world ranks 0, 1, 2, and rank 3 backing up stage 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from mpipipe.respipe.decide import View, can_go_on, decide, eval_point, round_patience
from mpipipe.respipe.messages import Decision, StateReport
from mpipipe.respipe.settings import Settings

pytestmark = pytest.mark.timeout(60)


def rep(rank: int, done: int = 7, *, backup: bool = False, index: int | None = None,
        latest: int = -1, prev: int = -1, reason: str = "announced", suspect: int = -1,
        t: float = 100.0, dead: Sequence[int] = (), waited: float = 0.0, gen: int = 0,
        after_step: bool = False, records_from: int | None = None,
        resumable: bool = True) -> StateReport:
    """A rank's report; a stage's index defaults to its rank, replicas to none held."""
    return StateReport(
        gen=gen, rank=rank, backup=backup, index=rank if index is None else index, done=done,
        latest=latest, prev=prev, reason=reason, suspect=suspect, t_detect=t,
        dead=tuple(dead), waited_s=waited, after_step=after_step,
        records_from=done - 1 if records_from is None else records_from, resumable=resumable)


def bk(rank: int, stage: int, done: int = 7, latest: int = 7, prev: int = 6,
       **kw: Any) -> StateReport:
    """A backup's report: it holds replicas of steps ``latest`` and ``prev``."""
    return rep(rank, done, backup=True, index=stage, latest=latest, prev=prev, **kw)


def view(*, members: Sequence[int] = (0, 1, 2, 3), route: Sequence[int] = (0, 1, 2),
         backups: Mapping[int, Sequence[int]] | None = None, log: int = 0,
         dead: Sequence[int] = (), silent: Sequence[int] = (),
         homes: Mapping[int, int] | None = None, evaluates: bool = False, total: int = 20,
         eval_every: int = 0) -> View:
    return View(gen=0, members=tuple(members), route=tuple(route),
                backups={1: (3,)} if backups is None else backups, log=log,
                dead=frozenset(dead), silent=tuple(silent), homes=homes or {},
                labels="travel", evaluates=evaluates, total=total, eval_every=eval_every)


@dataclass
class Case:
    name: str
    reports: list[StateReport]
    view: View
    expect: dict[str, Any]
    settings: Settings = field(default_factory=lambda: Settings(backups={1: 1}))


FAILED_1 = rep(0, reason="failed", suspect=1, dead=[1], t=50.0)  # rank 0 saw rank 1 die
LATE_1 = rep(0, reason="late", suspect=1, t=50.0, waited=0.4)  # rank 0 timed out on rank 1

CASES = [
    Case("nobody late: the route, members and step stay",
         [rep(0), rep(1), rep(2), bk(3, 1)], view(),
         dict(gen=1, step=7, go_on=False, lost_stage=-1, merge=-1, shrink=False,
              reason="announced", members=(0, 1, 2, 3), route=(0, 1, 2), choices={},
              silent=(), admit=-1, backups={0: (), 1: (3,), 2: ()}, log=0)),
    Case("a dead stage with a backup: it takes over from the replica of P",
         [FAILED_1, rep(2), bk(3, 1)], view(dead=[1]),
         dict(step=7, lost_stage=-1, shrink=True, reason="failed", suspect=1, t_detect=50.0,
              members=(0, 2, 3), route=(0, 3, 2), choices={1: 7}, backups={0: (), 1: (), 2: ()})),
    Case("the backup's newest replica is a step behind: replay from that step",
         [FAILED_1, rep(2), bk(3, 1, latest=6, prev=5)], view(dead=[1]),
         dict(step=6, choices={1: 6}, route=(0, 3, 2))),
    Case("replicas every R steps: the newest one up to P, updates since are lost",
         [FAILED_1, rep(2), bk(3, 1, latest=5, prev=0)], view(dead=[1]),
         dict(step=7, choices={1: 5})),
    Case("a survivor one step ahead: P is the slowest stage's step",
         [FAILED_1, rep(2, 8), bk(3, 1)], view(dead=[1]),
         dict(step=7, choices={1: 7})),
    Case("a dead stage without a backup: the stage is lost",
         [rep(0, reason="failed", suspect=2, dead=[2]), rep(1), bk(3, 1)], view(dead=[2]),
         dict(lost_stage=2, go_on=False, route=(0, 1, 2), members=(0, 1, 3))),
    Case("late, not dead: left out without a shrink, and told so (silent)",
         [LATE_1, rep(2), bk(3, 1)], view(silent=[1]),
         dict(shrink=False, reason="late", suspect=1, waited_s=0.4, silent=(1,),
              members=(0, 2, 3), route=(0, 3, 2))),
    Case("one dead and one only silent: no shrink (Create_group leaves both out)",
         [FAILED_1, bk(3, 1)], view(dead=[1], silent=[2]),
         dict(shrink=False, lost_stage=2)),
    Case("the earliest detection names the round",
         [rep(0, reason="late", suspect=1, t=60.0), rep(2, reason="failed", suspect=1, t=55.0,
                                                        dead=[1]), bk(3, 1)],
         view(dead=[1]),
         dict(reason="failed", t_detect=55.0, shrink=True)),
    Case("holders: the first backup heard serves, the others stay backups",
         [FAILED_1, rep(2), bk(3, 1), bk(4, 1)],
         view(members=(0, 1, 2, 3, 4), backups={1: (3, 4)}, dead=[1]),
         dict(route=(0, 3, 2), backups={0: (), 1: (4,), 2: ()}, choices={1: 7})),
    Case("holders: a silent first backup is passed over",
         [FAILED_1, rep(2), bk(4, 1)],
         view(members=(0, 1, 2, 3, 4), backups={1: (3, 4)}, dead=[1, 3]),
         dict(route=(0, 4, 2), backups={0: (), 1: (), 2: ()}, shrink=True)),
    Case("the log writer leaves: the lowest surviving stage of the old route writes it",
         [rep(0, reason="failed", suspect=1, dead=[1]), rep(2), bk(3, 1)],
         view(log=1, dead=[1]),
         dict(log=0)),
    Case("neighbour mode: a lost stage merges into its holder",
         [rep(0, reason="failed", suspect=1, dead=[1], latest=7, prev=6), rep(2)],
         view(members=(0, 1, 2), backups={}, dead=[1]),
         dict(merge=1, lost_stage=-1, route=(0, 2), choices={1: 7}, backups={0: (), 1: ()},
              members=(0, 2)),
         Settings(backups={}, mode="neighbour")),
    Case("neighbour mode, R = 3, a stage a step ahead: no going back two steps",
         [rep(1, 4, reason="late", suspect=0, latest=3, prev=0), rep(2, 5)],
         view(members=(0, 1, 2), backups={}, silent=[0]),
         dict(merge=0, step=4, choices={0: 3}, route=(1, 2), members=(1, 2)),
         Settings(backups={}, mode="neighbour")),
    Case("neighbour mode: a holder with no replica yet cannot merge: the stage is lost",
         [rep(0, reason="failed", suspect=1, dead=[1]), rep(2)],
         view(members=(0, 1, 2), backups={}, dead=[1]),
         dict(merge=-1, lost_stage=1, choices={}, route=(0, 1, 2)),
         Settings(backups={}, mode="neighbour")),
    Case("neighbour mode: two lost stages cannot both merge",
         [rep(0, reason="failed", suspect=1, dead=[1, 2])],
         view(members=(0, 1, 2), backups={}, dead=[1, 2]),
         dict(merge=-1, lost_stage=1),
         Settings(backups={}, mode="neighbour")),
    Case("hot: the mirror finishes the step in flight (no replay)",
         [FAILED_1, rep(2), bk(3, 1, latest=7, prev=6)], view(dead=[1]),
         dict(go_on=True, step=7, choices={1: 7}, route=(0, 3, 2)),
         Settings(backups={1: 1}, mode="hot")),
    Case("hot, a survivor one step further on: go on, from the slowest's step",
         [rep(0, 8, reason="failed", suspect=1, dead=[1]), rep(2), bk(3, 1)], view(dead=[1]),
         dict(go_on=True, step=7, choices={1: 7}),
         Settings(backups={1: 1}, mode="hot")),
    Case("hot, a rank in its step's after-work: replay",
         [FAILED_1, rep(2, after_step=True), bk(3, 1)], view(dead=[1]),
         dict(go_on=False, step=7),
         Settings(backups={1: 1}, mode="hot")),
    Case("rejoin: admitted as a backup of the stage furthest below its configured count",
         [rep(0, reason="rejoin", suspect=5, t=70.0, waited=65.0), rep(1), rep(2), bk(3, 1)],
         view(homes={5: 1}),
         dict(admit=5, admit_stage=2, members=(0, 1, 2, 3, 5),
              backups={0: (), 1: (3,), 2: (5,)}, reason="rejoin", waited_s=65.0, go_on=False),
         Settings(backups={1: 1, 2: 1})),
    Case("rejoin: on a tie, the rank's own stage",
         [rep(0, reason="rejoin", suspect=5), rep(1), rep(2), bk(3, 1)],
         view(homes={5: 1}),
         dict(admit=5, admit_stage=0, backups={0: (5,), 1: (3,), 2: ()}),
         Settings(backups={1: 1})),
    Case("rejoin: a failure in the same round comes first, nobody is admitted",
         [rep(0, reason="rejoin", suspect=5, t=10.0), rep(2, reason="failed", suspect=1,
                                                           dead=[1], t=20.0), bk(3, 1)],
         view(dead=[1], homes={5: 1}),
         dict(admit=-1, admit_stage=-1, reason="failed", members=(0, 2, 3))),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_decide(case: Case) -> None:
    d = decide({r.rank: r for r in case.reports}, case.view, case.settings)
    assert {k: getattr(d, k) for k in case.expect} == case.expect
    assert Decision.decode(d.encode()) == d  # what the coordinator decides is what travels


# -- can_go_on (hot mode): stages 0, 2 on ranks 0, 2; rank 3 mirrors stage 1 and serves it

GO_ROUTE, GO_BACKUPS, GO_PROMOTED = [0, 3, 2], {0: [], 1: [], 2: []}, {1: 3}


def heard(**changes: StateReport) -> dict[int, StateReport]:
    h = {0: rep(0), 2: rep(2), 3: bk(3, 1)}
    h.update({int(k[1:]): v for k, v in changes.items()})
    return h


GO_CASES = [
    ("every rank at the step in flight", heard(), "hot", True),
    ("stage 0 finished the step and keeps its messages", heard(r0=rep(0, 8)), "hot", True),
    ("... but kept none of the step its consumer is still in",
     heard(r0=rep(0, 8, records_from=8)), "hot", False),
    ("a rank still at a step's after-work", heard(r2=rep(2, after_step=True)), "hot", False),
    ("an evaluation some ranks have passed and others not",
     heard(r0=rep(0, 10), r2=rep(2, 10), r3=bk(3, 1, 9)), "hot", False),
    ("the promoted backup mirrors another stage", heard(r3=bk(3, 2)), "hot", False),
    ("the promoted backup cannot resume", heard(r3=bk(3, 1, resumable=False)), "hot", False),
    ("cold mode never goes on", heard(), "cold", False),
    ("ranks two steps apart (the mirror behind; others could hold it, the log could not)",
     heard(r0=rep(0, 8, records_from=6), r2=rep(2, 8, records_from=6), r3=bk(3, 1, 6)),
     "hot", False),
]


@pytest.mark.parametrize("reports, mode, expected", [c[1:] for c in GO_CASES],
                         ids=[c[0] for c in GO_CASES])
def test_can_go_on(reports, mode, expected) -> None:
    v = view(evaluates=True, total=20, eval_every=10)
    assert can_go_on(reports, GO_ROUTE, GO_BACKUPS, GO_PROMOTED, v, mode) is expected


@pytest.mark.parametrize("silent, late, expected", [
    ([1], [1], 0.01),  # stage 1 missed its deadline: one more median step, then replaced
    ([1, 4], [1], 0.5),  # a rank nobody found late may only be waiting for a core
    ([4], [], 0.5),
    ([1, 2, 3], [1, 2, 3], 2.0),  # leaving out half the members or more: four times longer
    ([], [], 0.5),
])
def test_patience(silent, late, expected) -> None:
    assert round_patience(silent, late, members=6, grace=0.5, quick=0.01) == expected


ROUTE = (0, 1, 2, 3)  # the world rank of each stage; 4 and 5 are backups


@pytest.mark.parametrize("silent, late, dead, unreplaceable, expected", [
    ([0], [0], [], [], 0.01),  # the plain case: one late stage, nothing else wrong
    # Issue 37: stage 0 delayed and stage 2 still busy with the input that came late:
    # neither answers at once, and stage 2 must not be blamed for stage 0's delay.
    ([0, 2], [0, 2], [], [], 0.5),
    ([2], [2], [1], [], 0.5),  # behind a dead stage: it may be waiting on it
    ([2], [2], [4], [], 0.01),  # a dead backup explains nothing on the route
    ([1], [1], [], [1], 1.0),  # no holder left: leaving it out would end the run
    ([5], [5], [], [1], 0.01),  # a late backup: its stage is not at stake
])
def test_patience_by_cause(silent, late, dead, unreplaceable, expected) -> None:
    assert round_patience(silent, late, members=6, grace=0.5, quick=0.01, route=ROUTE,
                          dead=dead, unreplaceable=unreplaceable) == expected


def test_eval_points() -> None:
    assert eval_point(20, evaluates=True, total=20, eval_every=0)
    assert eval_point(10, evaluates=True, total=20, eval_every=5)
    assert not eval_point(11, evaluates=True, total=20, eval_every=5)
    assert not eval_point(20, evaluates=False, total=20, eval_every=5)
