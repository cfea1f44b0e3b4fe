"""A round's decision as a pure function of what the coordinator heard and knows.

Why pure: the verdict (who is left, which backup serves each lost stage, the step
P every rank stands at, whether the step in flight goes on) is the heart of the
protocol. Without MPI and without the trainer's state it can be read in one
place and tested from a table of cases (tests/test_respipe_decide.py). The
trainer gathers the :class:`~mpipipe.respipe.messages.StateReport` of every rank
that answered, describes what it knows in a :class:`View`, and sends the
:class:`~mpipipe.respipe.messages.Decision` this returns.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from mpipipe.respipe.messages import Decision, StateReport
from mpipipe.respipe.mirror import stage_consumers
from mpipipe.respipe.settings import Settings

__all__ = ["View", "decide", "can_go_on", "round_patience", "eval_point", "stage_holders"]


@dataclass(frozen=True)
class View:
    """What the deciding rank knows besides the reports: its generation and the run's facts.

    ``homes`` maps world ranks (at least every rank asking to rejoin) to the index
    of their launch role (the stage each served or backed up at launch): an
    admitted rank prefers its own stage.
    """

    gen: int  # the generation that ends with this round
    members: tuple[int, ...]  # its world ranks
    route: tuple[int, ...]  # the world rank serving each stage
    backups: Mapping[int, Sequence[int]]  # stage -> its backups' world ranks
    log: int  # the world rank writing the log
    dead: frozenset[int]  # world ranks known to have failed (reported, or seen by ULFM)
    silent: tuple[int, ...]  # members neither heard nor known dead
    homes: Mapping[int, int]  # world rank -> its launch role's index
    labels: str = "travel"  # the pipeline's labels ("travel" or "local")
    evaluates: bool = False  # the run evaluates (some steps end with an evaluation)
    total: int = 0  # steps of the run
    eval_every: int = 0  # evaluate every this many steps (0: only at the end)


def round_patience(silent: Sequence[int], late: Iterable[int], members: int, grace: float,
                   quick: float, route: Sequence[int] = (), dead: Iterable[int] = (),
                   unreplaceable: Iterable[int] = ()) -> float:
    """How long a round's coordinator waits for ``silent`` ranks before leaving them out.

    ``quick`` only when the cause is plain: every silent rank was found late by a
    survivor (it has had its deadline), at most one stage of ``route`` is silent and
    none is known ``dead``. Otherwise ``grace``: a stage downstream (or upstream) of a
    delayed, silent or dead stage was late only because it waited on that one, or is
    still busy with the input that came late, and must not be blamed for it (issue 37:
    a healthy stage 2 was replaced behind a delayed stage 0). Twice ``grace`` when a
    silent rank is ``unreplaceable`` (a stage with no live holder: leaving it out ends
    the run, waiting costs at most this); four times ``grace`` before leaving out half
    the members or more, which is more likely this rank's own isolation than theirs.
    """
    if len(silent) >= members / 2:
        return 4 * grace
    if set(silent) & set(unreplaceable):
        return 2 * grace
    late, stages, dead = set(late), set(route), set(dead)
    plain = sum(w in stages for w in silent) <= 1 and not (dead & stages)
    return quick if silent and plain and all(w in late for w in silent) else grace


def eval_point(done: int, *, evaluates: bool, total: int, eval_every: int) -> bool:
    """Is an evaluation due once ``done`` steps are applied?"""
    return evaluates and (done == total or bool(eval_every and done % eval_every == 0))


def stage_holders(stage: int, route: Sequence[int], backups: Mapping[int, Sequence[int]],
                  mode: str) -> list[int]:
    """World ranks that hold a replica of ``stage``: its backups, or (neighbour mode)
    the previous stage (stage 0's: stage 1), as in Bamboo."""
    if mode == "neighbour":
        if len(route) < 2:
            return []
        return [route[stage - 1] if stage > 0 else route[1]]
    return list(backups.get(stage, []))


def decide(reports: Mapping[int, StateReport], view: View, settings: Settings) -> Decision:
    """The coordinator's verdict: members, new route, replay step P and replica choices.

    ``reports``: world rank -> its report, for every rank heard (the coordinator's
    own included). Of ``settings``, ``mode`` and the configured ``backups`` are read.
    """
    mode, heard = settings.mode, reports
    members = sorted(heard)
    lost, route, promoted, lost_stage, merge = _replace_lost(heard, view, mode)
    holders_now = _holders_now(heard, view, promoted, merge, mode)
    P = _replay_step(heard, members, holders_now)
    choices, lost_stage, merge = _replica_choices(heard, holders_now, P, lost_stage, merge)
    shrink = any(w in view.dead for w in view.members if w not in heard) and \
        not any(w not in view.dead for w in view.silent)
    first = min((heard[w] for w in members if heard[w].reason in ("late", "failed")),
                key=lambda r: r.t_detect, default=heard[members[0]])
    if merge >= 0:
        route = [w for i, w in enumerate(route) if i != merge]
    backups = {k: [b for b in view.backups.get(k, []) if b in heard and b not in route]
               for k in range(len(route))}
    admit, admit_stage = -1, -1
    if first.reason == "rejoin" and not lost and merge < 0 and not shrink \
            and not view.silent and first.suspect not in heard:
        admit = first.suspect
        admit_stage = _admit_stage(backups, settings.backups, view.homes[admit])
        backups[admit_stage].append(admit)
        members = sorted([*members, admit])
    go_on = bool(promoted) and lost_stage < 0 and merge < 0 and admit < 0 and \
        can_go_on(heard, route, backups, promoted, view, mode)
    if go_on:
        P = min(heard[w].done for w in route)
        choices = {k: P for k in promoted}
    return Decision(
        gen=view.gen + 1, step=P, go_on=go_on, lost_stage=lost_stage, merge=merge,
        shrink=shrink, reason=first.reason, suspect=first.suspect, t_detect=first.t_detect,
        waited_s=first.waited_s, members=tuple(members), route=tuple(route),
        choices=dict(sorted(choices.items())), silent=tuple(view.silent), admit=admit,
        admit_stage=admit_stage, backups={k: tuple(bs) for k, bs in backups.items()},
        log=_log_writer(view, route, members))


def _replace_lost(heard: Mapping[int, StateReport], view: View, mode: str
                  ) -> tuple[list[int], list[int], dict[int, int], int, int]:
    """The stages whose server was not heard, and how each is replaced.

    Returns (lost, route, promoted, lost_stage, merge): a lost stage's first heard
    backup takes its place in ``route`` (``promoted``); in neighbour mode a single
    lost stage with a live holder is merged into its neighbour (``merge``); the first
    stage that cannot be replaced is ``lost_stage`` (-1: none).
    """
    lost: list[int] = [k for k in range(len(view.route)) if view.route[k] not in heard]
    route = list(view.route)
    promoted: dict[int, int] = {}
    lost_stage, merge = -1, -1
    for k in lost:
        if mode == "neighbour":
            holders = [h for h in stage_holders(k, view.route, view.backups, mode) if h in heard]
            if holders and len(lost) == 1:
                merge = k
                continue
            lost_stage = k
            break
        cands = [b for b in view.backups.get(k, []) if b in heard]
        if not cands:
            lost_stage = k
            break
        promoted[k] = cands[0]
        route[k] = cands[0]
    return lost, route, promoted, lost_stage, merge


def _holders_now(heard: Mapping[int, StateReport], view: View, promoted: Mapping[int, int],
                 merge: int, mode: str) -> dict[int, int]:
    """Stage -> the world rank whose replica restores it: the promoted backups, and
    the merged stage's live neighbour."""
    holders_now = dict(promoted)
    if merge >= 0:
        holders_now[merge] = [h for h in stage_holders(merge, view.route, view.backups, mode)
                              if h in heard][0]
    return holders_now


def _replay_step(heard: Mapping[int, StateReport], members: Sequence[int],
                 holders_now: Mapping[int, int]) -> int:
    """The step P every rank goes back to: the lowest step a serving rank has done."""
    stage_done = [heard[w].done for w in members if not heard[w].backup]
    floor = min(stage_done) if stage_done else 0
    P = floor
    # One step back to a holder's replica (the replica of ``floor`` was still on its way),
    # if every stage can go back with it: a rank rolls back one step at most (it keeps
    # the snapshots of its last two steps), so not when a stage is already a step ahead
    # (seed 5 #16: "cannot roll back from step 5 to 3"); the holder then starts from its
    # newest replica up to P, and the updates since are lost, as with R > 1.
    even = not stage_done or max(stage_done) <= floor
    for b in holders_now.values():
        have = {heard[b].latest, heard[b].prev}
        if floor not in have and floor - 1 in have and even:
            P = floor - 1
    return P


def _replica_choices(heard: Mapping[int, StateReport], holders_now: Mapping[int, int], P: int,
                     lost_stage: int, merge: int) -> tuple[dict[int, int], int, int]:
    """Stage -> the replica step its holder starts from (P, or its newest up to P).

    Returns (choices, lost_stage, merge): a merged stage whose neighbour holds no
    replica of it is lost instead.
    """
    choices = {}
    for k, b in holders_now.items():
        have = sorted(c for c in (heard[b].latest, heard[b].prev) if 0 <= c <= P)
        if not have and k == merge:
            # The neighbour holds no replica of it yet (the pipeline merged a stage
            # since, and no replica step came): the stage is lost, one clean line.
            lost_stage, merge = k, -1
            continue
        choices[k] = P if P in have else (have[-1] if have else 0)
    return choices, lost_stage, merge


def _admit_stage(backups: Mapping[int, Sequence[int]], configured: Mapping[int, int],
                 own: int) -> int:
    """The stage a rejoining rank backs up.

    The replaced rank comes back as a backup of the stage furthest below its
    configured number of backups (then: the fewest, the rank's own stage).
    """
    return min(range(len(backups)), key=lambda k: (
        len(backups[k]) - configured.get(k, 0), len(backups[k]), k != own, k))


def _log_writer(view: View, route: Sequence[int], members: Sequence[int]) -> int:
    """The world rank writing the log after this round.

    The log's writer stays unless it left; then the lowest surviving stage writes it
    (a stage before this round: it has its own figures of the steps before P, and
    reports every step after).
    """
    return view.log if view.log in members else \
        min([w for w in view.route if w in members]
            or [w for w in route if w in members] or members)


def can_go_on(heard: Mapping[int, StateReport], route: Sequence[int],
              backups: Mapping[int, Sequence[int]], promoted: Mapping[int, int], view: View,
              mode: str) -> bool:
    """Can the survivors finish the interrupted step where they stand (hot mode)?

    Yes when every promoted backup is a hot mirror of its stage; every rank keeps
    the messages of each step a consumer of it may still lack (it holds the steps
    from ``records_from``); the ranks are at most one step apart; no rank is
    between applying an update and finishing that step's replica, figures,
    evaluation and checkpoint (``after_step``), and no evaluation would be met
    by some ranks only; and every rank can resume. Otherwise the round replays a step.
    """
    if mode != "hot":
        return False
    ranks = [*route, *(b for bs in backups.values() for b in bs)]
    if any(not heard[w].resumable or heard[w].after_step for w in ranks):
        return False
    if any(not heard[b].backup or heard[b].index != k for k, b in promoted.items()):
        return False
    # Another mirror of a promoted stage must stand where the promoted one does: the
    # new stage's next replica would otherwise go to a mirror that took it already.
    if any(heard[o].done != heard[b].done for k, b in promoted.items()
           for o in backups.get(k, [])):
        return False
    for j, w in enumerate(route):
        consumers = stage_consumers(j, route, backups.get(j, []), view.labels)
        if any(heard[c].done < heard[w].records_from for c in consumers):
            return False
    steps = [heard[w].done for w in route]
    if max(steps) - min(steps) > 1:  # the log rebuilds the rows of the steps from P on
        return False
    return not any(eval_point(s, evaluates=view.evaluates, total=view.total,
                              eval_every=view.eval_every)
                   for s in range(min(steps) + 1, max(steps) + 1))
