"""The logbook: per-step figures become the log's rows on the writer, fault notes and
events, evaluations, and the hand-over of the log when its writer leaves.

The :class:`Logbook` part of :class:`mpipipe.respipe.trainer.ResPipe`: the only one that
writes the run log (on the rank that holds it) and its progress lines.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mpipipe.core.logs.logschema import EventKind
from mpipipe.core.logs.runlog import LogError
from mpipipe.core.mpi import ft
from mpipipe.core.mpi.faults import Fault, FaultPlan
from mpipipe.respipe.control import _EVAL, _FAULT, _FIGS, _LOSS, _RELEASED
from mpipipe.respipe.costmodel import predict, stage_shapes
from mpipipe.respipe.membership import Membership
from mpipipe.respipe.messages import Decision

# A new writer rebuilds the rows of the last FIGS_RESENT steps before a round's step P
# (the old writer wrote the rows before those: it is at most a step behind the others and
# writes a row one step late). Every rank keeps one step more (a step it completed beyond
# P, rolled back, may still sit in its window), so that every sender still has each of
# those steps: with one window of three, a last stage a step ahead had already dropped
# step P-3, which the writer still had and then waited 0.5 s for, in its own step, until
# its downstream stage found it late (issue 37).
FIGS_RESENT = 3


@dataclass
class _Row:
    """One step's row of the log, completed on rank 0 from every stage's figures."""

    step: int
    time: float
    loss: float
    samples: int
    ranks: dict[int, dict[str, float]] = field(default_factory=dict)


class Logbook:
    """Figures, rows, events and the log writer's hand-over.

    Built with the :class:`Membership` (who writes the log, the route, the control plane),
    the run log and progress printer (None on ranks that never write), and what the
    figures and the evaluation need. Public results: ``last_loss``, ``last_eval``, and
    ``events`` (what this rank logged, for tests).
    """

    def __init__(self, m: Membership, *, log: Any, progress: Any, batch_size: int,
                 in_shape: tuple[int, ...], make_optimizer: Callable[[Any], Any],
                 evaluate: Callable[[Any], tuple[int, int] | None] | None) -> None:
        self.m = m
        self.log, self.progress = log, progress
        self.batch_size, self.in_shape = batch_size, in_shape
        self.make_optimizer = make_optimizer  # the cost model's replica sizes
        self.evaluate_fn = evaluate
        self.recent_figs: deque[list[float]] = deque(maxlen=FIGS_RESENT + 1)  # for a new writer
        self.rebuilt: dict[int, list[int]] = {}  # new writer: step -> ranks resending figures
        self.loss_copies: dict[int, float] = {}  # the loss keeper's: step -> loss
        self.pending_rows: dict[int, _Row] = {}
        self.fault_notes: dict[int, tuple[float, str]] = {}  # world rank -> (time, spec)
        self.faults: FaultPlan | None = None  # names a fault a process drew (the trainer sets it)
        self.open_events: list[dict[str, Any]] = []  # takeovers waiting for their recovery_s
        self.events: list[tuple[str, dict[str, Any]]] = []  # what this rank logged (for tests)
        self.last_eval = math.nan
        self.last_loss = math.nan
        self._last_row_time: float | None = None

    def fault_fired(self, fault: Fault, step: int, detail: Mapping[str, float]) -> None:
        now = time.time()
        # A process's event: which one, for the writer to name it (FaultPlan.drawn_fault).
        drawn = [detail["process"], detail["event"]] if "event" in detail else []
        if self.m.is_logger:
            self.log_event(EventKind.FAULT_INJECTED, step, self.m.wrank, fault=str(fault), at=now)
            if fault.how.silences:
                # The log passes to a survivor, which needs the fault's time for its
                # detected_after_s and recovery_s: every member hears it (logged: 1).
                for w in self.m.members:
                    if w != self.m.wrank:
                        self.m.control.send(_FAULT, self.m.drank(w),
                                            [now, step, self.m.wrank, 1, *drawn], seq=self.m.wrank)
        else:
            self.m.control.send(_FAULT, self.m.drank(self.m.log_w),
                                [now, step, self.m.wrank, 0, *drawn], seq=self.m.wrank)
        if fault.how.ends_process:
            time.sleep(0.01)  # let the note leave before the process dies (or the link goes)

    def drain_fault_notes(self, new_writer: bool = False) -> None:
        """The log writer (or the rank about to become it) reads the fault notes."""
        if not (self.m.is_logger or new_writer) or not self.m.settings.faults:
            return  # (without injected faults there are none to read)
        for w in self.m.members:
            if w == self.m.wrank:
                continue
            msg = self.m.control.poll(_FAULT, self.m.drank(w), seq=w)
            while msg is not None:
                t, step = float(msg[0]), int(msg[1])
                if len(msg) >= 6 and self.faults is not None:
                    spec = str(self.faults.drawn_fault(int(msg[4]), int(msg[5]), step))
                else:
                    spec = next((str(f) for f in self.m.settings.faults
                                 if f.targets(stage=self.m.launch_stage(w), rank=w)
                                 and (f.how.repeats or f.step == step)), "?")
                # A new writer skips older faults of the old one (a stall it survived).
                if not (new_writer and step < self.m.done - 1):
                    self.fault_notes[w] = (t, spec)
                    if len(msg) < 4 or not msg[3]:  # the old writer logged its own
                        self.log_event(EventKind.FAULT_INJECTED, step, w, fault=spec, at=t)
                msg = self.m.control.poll(_FAULT, self.m.drank(w), seq=w)

    def rel(self, t_abs: float) -> float | None:
        """A wall-clock time as seconds since the log opened (the log's time column)."""
        if self.log is None or not self.log.active:
            return None
        return self.log.elapsed() - (time.time() - t_abs)

    def log_event(self, kind: EventKind, step: int, rank: int, **detail: Any) -> None:
        self.events.append((kind, dict(detail, step=step, rank=rank)))
        if self.log is not None:
            t = detail.pop("at", None)
            self.log.event(kind, step=step, rank=rank, time=None if t is None else self.rel(t),
                           **detail)
            if self.progress is not None and self.log.active:  # once: by the log writer
                self.progress.event(kind, step=step, rank=rank, **detail)

    def loss_keeper(self) -> int | None:
        """The stage that keeps copies of the last stage's losses: the one that writes the
        log if the writer leaves (the lowest stage of the route but the writer, the rule
        of :func:`mpipipe.respipe.decide.decide`), or if that is the last stage itself,
        the one after it."""
        others = [w for w in self.m.route_w if w not in (self.m.log_w, self.m.route_w[-1])]
        return min(others) if others else None

    def report(self, s: int, figs: list[float]) -> None:
        self.keep_figs(figs)
        # The loss exists on the last stage and the writer only: a copy goes to a third
        # stage (_loss_keeper), so that the row keeps its loss when the writer and the
        # last stage are lost together (a new writer rebuilds the row, move_log).
        keeper = self.loss_keeper()
        if not math.isnan(figs[2]) and keeper is not None:
            self.m.control.send(_LOSS, self.m.drank(keeper), [s, figs[2]], seq=s)
        if not self.m.is_logger:
            self.m.control.send(_FIGS, self.m.drank(self.m.log_w), figs, seq=s)
            return
        row = self.pending_rows.get(s) or _Row(s, figs[1], figs[2], self.batch_size)
        row.ranks[self.m.wrank] = self._fig_dict(figs)
        self.pending_rows[s] = row
        # Rows are written one step late: a step can only be rolled back while it is the
        # newest, so a written row is never undone and samples are never counted twice.
        for old in sorted(k for k in self.pending_rows if k < s):
            self.write_row(old)
        self.close_open_events(figs[1])

    def step_figs(self, s: int, loss: float | None) -> list[float]:
        """Step ``s``'s figures as they travel: step, time, loss, compute_s, wait_s, bytes
        sent and received, world rank, control bytes sent since the last step's figures."""
        t = self.m.pipe.transport
        return [s, time.time(), math.nan if loss is None else loss, self.m.pipe.last_compute_s,
                t.wait_s, t.total_sent, t.total_recv, self.m.wrank, self.m.control.take_sent()]

    def keep_figs(self, figs: list[float]) -> None:
        # a replayed step's figures replace those of its rolled-back run
        while self.recent_figs and int(self.recent_figs[-1][0]) >= int(figs[0]):
            self.recent_figs.pop()
        self.recent_figs.append(figs)

    @staticmethod
    def _fig_dict(figs: Sequence[float]) -> dict[str, float]:
        return {"compute_s": float(figs[3]), "wait_s": float(figs[4]),
                "bytes_sent": int(figs[5]), "bytes_recv": int(figs[6]),
                "ctrl_bytes_sent": int(figs[8])}

    def collect_figs(self, s: int, wait_s: float, alive: Sequence[int] | None = None) -> None:
        row = self.pending_rows[s]
        rebuilt = self.rebuilt.get(s)  # a new writer's row of a step before its round
        if s < self.m.gen_step and rebuilt is None:
            return  # collected before the route changed (figures travel per generation)
        # Figures of a rank that has just died may still be waiting: take them, but do
        # not wait for them (``alive``: the ranks worth waiting for).
        want = rebuilt if rebuilt is not None else [w for w in self.m.route_w if w != self.m.wrank]
        end = time.perf_counter() + wait_s
        passes = 0
        while True:
            passes += 1
            for w in want:
                if w in row.ranks or w not in self.m.members:
                    continue
                msg = self.m.control.poll(_FIGS, self.m.drank(w), seq=s)
                if msg is not None:
                    row.ranks[w] = self._fig_dict(msg)
                    if not math.isnan(msg[2]):
                        row.loss = float(msg[2])
                    row.time = max(row.time, float(msg[1]))
            # A rank that died after sending is not waited for, but looked at more than
            # once: a probe finds a message only once MPI has progressed it (seen here:
            # the first probe after a quiet spell misses a message the second one finds),
            # and the last stage's figures carry the row's loss.
            if all(w in row.ranks for w in want
                   if w in self.m.members and (alive is None or w in alive or passes < 4)) or \
                    time.perf_counter() > end:
                return
            time.sleep(0.0005)

    def write_row(self, s: int) -> None:
        self.collect_figs(s, 0.5)
        row = self.pending_rows.pop(s)
        self.rebuilt.pop(s, None)
        prev, self._last_row_time = self._last_row_time, row.time
        dt = row.time - prev if prev is not None else (
            statistics.median(self.m.step_times) if self.m.step_times else math.nan)
        rate = row.samples / dt if dt > 0 else math.nan
        self.last_loss = row.loss
        at = self.rel(row.time)
        if self.log is not None:
            self.log.step(s + 1, time=at, loss=row.loss, samples=row.samples,
                          samples_per_s=rate, ranks=row.ranks)
        if self.progress is not None:
            self.progress.update(s + 1, loss=row.loss, samples=row.samples, time=at)

    def close_open_events(self, t_done: float) -> None:
        for ev in self.open_events:
            rec = t_done - ev["t0"]
            self.log_event(EventKind(ev["kind"] + "_recovered"), ev["step"], ev["rank"],
                            recovery_s=rec, detected_after_s=ev["detected_after_s"],
                            stage=ev["stage"], generation=ev["generation"])
        self.open_events = []

    def evaluate(self) -> None:
        if self.evaluate_fn is None:
            return
        self.m.pipe.deadline = max(self.m.settings.deadline_s, self.m.deadline())
        # Every stage starts an evaluation with the same sequence number, even after a
        # replay made some of them evaluate at this step once before.
        self.m.pipe.eval_count = (self.m.done * 64) % 4096
        result = self.evaluate_fn(self.m.pipe)
        if result is not None:
            correct, count = result
            acc = correct / max(count, 1)
            if self.m.is_logger:
                self.log_eval(self.m.done, acc)
            else:
                self.m.control.send(_EVAL, self.m.drank(self.m.log_w),
                                  [self.m.done, acc, time.time()], seq=self.m.done)
        if self.m.is_logger and result is None:
            msg = None
            src = self.m.drank(self.m.route_w[-1])
            end = time.perf_counter() + 5.0
            while msg is None and time.perf_counter() < end:
                msg = self.m.control.poll(_EVAL, src, seq=self.m.done)
                if msg is None:
                    time.sleep(0.0005)
            if msg is not None:
                self.log_eval(int(msg[0]), float(msg[1]), float(msg[2]))

    def log_eval(self, step: int, acc: float, at: float | None = None) -> None:
        self.last_eval = acc
        if self.log is not None and self.log.active:
            self.log.eval(step, time=self.rel(at or time.time()), accuracy=acc)
            if self.progress is not None:
                self.progress.evaluation(step, acc)

    def log_cost_model(self) -> None:
        try:
            shapes, in_bytes = stage_shapes(self.m.pipe.partitions, self.in_shape,
                                            self.make_optimizer)
        except Exception:  # noqa: BLE001 - shapes unknown: the log just lacks the prediction
            return
        s = self.m.settings
        label = 8 if self.m.pipe.labels == "travel" and self.m.pipe.k > 1 else 0
        protected = dict.fromkeys(range(self.m.pipe.k), 1) if s.mode == "neighbour" \
            else dict(s.backups)
        c = predict(shapes, batch_size=self.batch_size, backups=protected,
                    replicate_every=s.replicate_every, mode=s.mode, label_bytes=label,
                    input_bytes=in_bytes)
        self.log_event(EventKind.COST_MODEL, 0, -1, bytes_per_step=c.total, plain=c.plain,
                        replica=c.replica, shadow=c.shadow, lost_updates=c.lost_updates,
                        mode=s.mode, replicate_every=s.replicate_every)

    def take_losses(self, passes: int = 1, back: int = 1) -> None:
        """The loss keeper keeps the last stage's recent losses (see _report): the steps
        from ``back`` before its own to its own, each looked at ``passes`` times (a probe
        finds a message only once MPI progressed it, see collect_figs). At each step it
        looks at two (a copy is sent at the end of the last stage's step, so it may come
        a step late: two probes a step); a round looks at the last five, four times."""
        last = self.m.route_w[-1]
        if last == self.m.wrank or last not in self.m.members:
            return
        for _ in range(passes):
            for s in range(max(0, self.m.done - back), self.m.done + 1):
                if s in self.loss_copies:
                    continue
                msg = self.m.control.poll(_LOSS, self.m.drank(last), seq=s)
                if msg is not None:
                    self.loss_copies[int(msg[0])] = float(msg[1])
        for old in [s for s in self.loss_copies if s < self.m.done - 4]:
            del self.loss_copies[old]

    def figs_again(self, wanted: Callable[[int], bool]) -> list[int]:
        """This rank's kept figures of the ``wanted`` steps go to the writer again; the
        writer starts those rows from its own. Returns the steps of the rows started."""
        mine = [f for f in self.recent_figs if wanted(int(f[0]))]
        if not self.m.is_logger:
            for figs in mine:
                self.m.control.send(_FIGS, self.m.drank(self.m.log_w), figs, seq=int(figs[0]))
            return []
        for figs in mine:
            loss = figs[2] if not math.isnan(figs[2]) else \
                self.loss_copies.get(int(figs[0]), math.nan)
            row = _Row(int(figs[0]), figs[1], loss, self.batch_size)
            row.ranks[self.m.wrank] = self._fig_dict(figs)
            self.pending_rows[row.step] = row
        return [int(f[0]) for f in mine]

    def move_log(self, d: Decision, P: int, old: int, old_writer_dead: bool) -> None:
        """Hand the log to the writer the round named, if it changed.

        The rows of the steps before P that the old writer had not written are
        rebuilt by the new one: every stage of the old route sends it its figures of
        those steps again (the loss comes from the last stage's). Rows the old writer
        did write are kept once (RunLog.take_over). The new writer opens the file only
        once the old one is dead (``old_writer_dead``: the round shrank it away) or has
        let go.
        """
        if self.m.log_w == old:
            return
        senders = [w for w in self.m.route_w if w in self.m.members and w != self.m.log_w]
        before = lambda s: P - FIGS_RESENT <= s < P  # noqa: E731 - the steps rebuilt
        if self.m.log_w != self.m.wrank:
            if self.m.wrank in senders:
                self.figs_again(before)
            return
        if self.log is not None:
            def let_go() -> bool:  # asked until it says yes (RunLog keeps the answer)
                # Replaced alive: it says so once it closed the file. Found late but in
                # fact dead (a deadline fired before ULFM reported it): ULFM knows later.
                return self.m.lobby.poll(_RELEASED, old, seq=d.gen) is not None or \
                    (self.m.ulfm and old in ft.failed_ranks(self.m.lobby.comm))

            try:
                self.log.take_over(None if old_writer_dead else let_go, order=d.gen)
            except LogError as e:  # the file was replaced or lost: train on, and say so
                print(f"mpipipe train: error: rank {self.m.wrank} cannot take the run log over: "
                      f"{e}; training goes on without a log", file=sys.stderr, flush=True)
        if self.progress is not None:
            self.progress.enabled = True
        self.pending_rows, self.rebuilt = {}, {}
        for s in self.figs_again(before):
            self.rebuilt[s] = senders
        self.log_event(EventKind.LOG_WRITER_MOVED, P, self.m.wrank, previous=old,
                        why="the previous writer left the job (failed or replaced)")

    def leave_log(self, generation: int) -> None:
        """A writer replaced at ``generation`` lets go of the file and tells the job (the
        new writer waits for that: HDF5's own lock may be off)."""
        if self.log is None or not self.log.active:
            return
        self.log.release()
        for w in range(self.m.world.Get_size()):
            if w != self.m.wrank:
                self.m.lobby.send(_RELEASED, w, [generation], seq=generation)
        self.m.lobby.drain(1.0)
        if self.progress is not None:
            self.progress.enabled = False

    def flush_rows_until(self, P: int) -> None:
        if self.m.is_logger:
            for s in sorted(self.pending_rows):
                if s < P:
                    self.write_row(s)

    def write_pending(self) -> None:
        """The run's end: the writer writes every row it still holds."""
        if self.m.is_logger:
            for s in sorted(self.pending_rows):
                self.write_row(s)

    def collect_pending(self, alive: Sequence[int]) -> None:
        """The round's writer, before leaving the old control communicator: the figures
        of the rows it still holds travel on it."""
        for s in sorted(self.pending_rows):
            self.collect_figs(s, 0.2, alive=alive)

    def drop_rows_from(self, P: int) -> None:
        """A round replays from P: rows of P on start again."""
        self.pending_rows = {s: r for s, r in self.pending_rows.items() if s < P}

    def forget_pending(self) -> None:
        """A replaced rank that rejoins writes no row it held before."""
        self.pending_rows = {}

    def log_round(self, d: Decision, P: int, *, gone: Sequence[int],
                  stage_before: Mapping[int, int], backups_before: Mapping[int, Sequence[int]],
                  lost_stages: Sequence[int], t_comm: float) -> None:
        """The writer logs what a round did: each rank found failed or late (and, for a
        backup, how many its stage has left), each takeover (its recovery time follows
        with the next step's figures), and an admitted rank."""
        t_fault = min((self.fault_notes.get(w, (math.nan,))[0] for w in gone), default=math.nan)
        detected_after = d.t_detect - t_fault if not math.isnan(t_fault) else d.waited_s
        if not self.m.is_logger:
            return
        kind = EventKind.FAILURE_DETECTED if d.reason == "failed" or d.shrink else EventKind.LATE
        for w in gone:
            backup_of = next((k for k, bs in backups_before.items() if w in bs), -1)
            self.log_event(kind, P, w, detected_after_s=detected_after,
                           how="ulfm" if d.shrink else "deadline",
                           stage=next((k for k, x in stage_before.items() if x == w), -1),
                           backup_of=backup_of)
            if backup_of >= 0 and self.progress is not None:
                left = len(self.m.backups_w.get(backup_of, []))
                self.progress.message(f"backup rank {w} of stage {backup_of} lost "
                                      f"({kind}); stage {backup_of} has {left} "
                                      f"backup{'' if left == 1 else 's'} left")
        go_on = bool(d.go_on)
        for k in lost_stages:
            w_new = self.m.route_w[k] if d.merge < 0 else self.m.route_w[max(k - 1, 0)]
            ev = {"kind": EventKind.TAKEOVER, "step": P, "rank": w_new, "stage": k,
                  "generation": self.m.gen, "detected_after_s": detected_after,
                  "t0": t_fault if not math.isnan(t_fault) else d.t_detect}
            self.log_event(EventKind.TAKEOVER, P, w_new, stage=k, replaced=stage_before[k],
                           generation=self.m.gen, replay_step=-1 if go_on else P + 1,
                           lost_updates=P - d.choices.get(k, P),
                           detected_after_s=detected_after,
                           agreement_s=t_comm - d.t_detect, mode=self.m.settings.mode)
            self.open_events.append(ev)
        if d.admit >= 0:
            self.log_event(EventKind.REJOINED, P, d.admit, stage=d.admit_stage,
                           generation=self.m.gen, after_s=t_comm - d.waited_s)
