"""ResPipe's resilience: backups, replicas every R steps, detection, agreed takeover and replay of a step.

This is our reconstruction of ResPipe (only the paper's abstract is available);
docs/respipe.md describes the mechanism and its knobs. In short:

- Every rank builds the whole model (same seed), so a backup can serve its
  stage after loading the stage's replica: parameters and optimizer state,
  sent every R steps (cold), plus, in hot mode, the stage's inputs and output
  gradients so that the backup mirrors every update; in neighbour mode the
  previous stage holds the replica and merges the lost stage into its own.
- A late stage is found by a receive deadline, a dead one by ULFM's
  MPIX_ERR_PROC_FAILED. Whoever notices starts a *round*: it revokes the data
  communicator (ULFM), announces its state on the control communicator and
  waits a grace period. The lowest live rank decides: who is left, which
  backup serves each lost stage, and the step P to replay; survivors that got
  one step further roll it back from their snapshot. The members build the new
  communicator from their group alone (``Create_from_group``), once each has
  said it is there; a left-out rank, dead or stalled (told it was replaced), is
  not asked, and a member that never comes makes the round run again.
- Every message carries the route's generation in its tag and travels on the
  generation's own communicator, so a demoted rank that wakes up is never
  listened to again. Under ULFM it asks, on a job-wide *lobby* communicator,
  to come back: the lowest member runs a round that admits it as a backup of
  the stage with the fewest, and that stage re-syncs its replica to it.

The parts, one module each; :class:`ResPipe` composes the stateful ones, each built
with the parts it needs and called through a few named methods (docs/internals.md):

- ``membership``: the generation (route, members, holders, communicators, the pipeline
  bound to them and the hot steps composed around it), this rank's role and steps, the deadline, building a generation;
- ``replicas``: the served :class:`~mpipipe.core.state.stagestate.StageState` and the
  held replicas: sending, holding, rollback, promoting, merging, re-syncing;
- ``hot``: the hot mirror; ``rejoin``: the lobby; ``logbook``: figures, rows, events
  and the log's hand-over; ``rounds``: a round's phases, announce, collect, decide, apply;
- pure or stateless: ``messages`` (the typed state report and decision, and their
  versioned codec), ``decide`` (the round's decision as a pure function of the reports),
  ``control`` (the control plane), ``settings`` (the ``[resilience]`` knobs), ``command``
  (the glue for ``python -m mpipipe train``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mpipipe.core.logs.logschema import EventKind
from mpipipe.core.mpi import ft, stop, watchdog
from mpipipe.core.mpi.faults import FaultPlan
from mpipipe.core.mpi.stop import ControlStop, StopRun
from mpipipe.core.mpi.transport import REPLICA, Late, PeerFailed, set_wait_hook
from mpipipe.core.run.batches import DataFault
from mpipipe.core.state.checkpoint import CheckpointError
from mpipipe.core.state.statecodec import pack_state, state_nbytes, unpack_state
from mpipipe.pipeline.engine import Pipeline
from mpipipe.respipe.auto import Retune
from mpipipe.respipe.control import _ANNOUNCE, _DEMOTED, _END, _STOP, _STOP_ASK
from mpipipe.respipe.decide import round_patience
from mpipipe.respipe.hot import HotMirror
from mpipipe.respipe.logbook import Logbook
from mpipipe.respipe.membership import _DEBUG, Demoted, Membership, StageLost
from mpipipe.respipe.messages import Round, RoundStarted
from mpipipe.respipe.mirror import SHADOW_GRAD_MICRO
from mpipipe.respipe.rejoin import Rejoin
from mpipipe.respipe.replicas import Replicas
from mpipipe.respipe.rounds import Rounds
from mpipipe.respipe.settings import Settings

__all__ = [
    "Settings",
    "StageLost",
    "Demoted",
    "ResPipe",
    "pack_state",
    "unpack_state",
    "state_nbytes",
    "SHADOW_GRAD_MICRO",
    "round_patience",
]

# Hot mode: a stage > 0 relays its input of micro-batch i as SHADOW micro i, and a
# stage < K-1 the gradient of its output as SHADOW micro SHADOW_GRAD_MICRO + i.
_BACKUP_POLL_S = 0.02
# A cold backup looks for its next replica this often. Not less often: a replica larger
# than MPI's eager limit leaves its stage only once the backup receives it, and the stage
# waits for that within its deadline, which deadline_factor can make a few milliseconds.
PAUSE_S = 0.001


class ResPipe:
    """Runs the training steps of one rank with backups, takeover and replay.

    Every rank of the job constructs one and calls :meth:`train`; the launch
    plan says whether it starts as a stage or a backup. Callables supplied by
    the training command keep this class free of data sets and models:
    ``batch_of(step) -> (x, y)`` must return the same mini-batch for the same
    step (a replay re-reads it), ``make_optimizer(module)`` builds a stage's
    optimizer, and ``evaluate(pipe) -> (correct, count) | None`` runs a
    forward-only pass on every stage rank.

    It composes the parts (``m``: :class:`Membership`, ``replicas``, ``hot``, ``book``:
    the :class:`Logbook`, ``rejoin``, ``rounds``) and runs the loop: a stage's step, a
    backup's wait, and the round any of them may start.
    """

    def __init__(
        self,
        *,
        cfg: Mapping[str, Any],
        plan: Any,
        pipe: Pipeline,
        make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        batch_of: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        evaluate: Callable[[Pipeline], tuple[int, int] | None] | None = None,
        log: Any = None,
        progress: Any = None,
        comm: Any = None,
        in_shape: Sequence[int] | None = None,
        out: Any = None,
        checkpoint_dir: Any = None,
        resume: tuple[int, Callable[[int], Any]] | None = None,
        schedule: Any = None,
        retune: Retune | None = None,
    ) -> None:
        from mpi4py import MPI

        settings = Settings.from_config(cfg, pipe.k, pipe.chunks)
        shape = tuple(in_shape) if in_shape is not None else tuple(pipe.in_shape)
        if schedule is None:
            from mpipipe.core.run.recipe import Recipe

            schedule = Recipe(cfg).schedule(int(cfg["run"]["steps"]))
        self.schedule = schedule  # the hyperparameters of each step (a replay's too)
        self.loss_fn, self.batch_of = loss_fn, batch_of
        self.checkpoint_every = int(cfg["run"].get("checkpoint_every", 0))
        self.checkpoint_dir = checkpoint_dir
        m = self.m = Membership(world=comm or MPI.COMM_WORLD, plan=plan, settings=settings,
                                pipe=pipe, out=out)
        self.replicas = Replicas(m, make_optimizer, shape)
        self.book = Logbook(m, log=log, progress=progress,
                            batch_size=int(cfg["data"]["batch_size"]), in_shape=shape,
                            make_optimizer=make_optimizer, evaluate=evaluate)
        self.faults = FaultPlan(settings.faults, seed=int(cfg["run"]["seed"]),
                                stage=m.stage, rank=m.wrank, on_fire=self.book.fault_fired,
                                plan=plan)
        self.book.faults = self.faults  # the writer names the faults other ranks' processes fire
        self.hot = HotMirror(m, self.replicas, self.book, batch_of=batch_of, loss_fn=loss_fn,
                             schedule=schedule, in_shape=shape)
        self.rejoin = Rejoin(m, self.replicas, self.faults)
        self.stopper = ControlStop(m, _STOP, _STOP_ASK)
        self.rounds = Rounds(m, self.replicas, self.hot, self.book, self.rejoin,
                             faults=self.faults, stopper=self.stopper,
                             evaluates=evaluate is not None, retune=retune)
        self.finished = False
        self._faults_at = -1  # a backup: the last step its faults were fired for
        pipe.after_forward = self.faults.at_step  # kills and stalls inside a step
        set_wait_hook(self._while_waiting)
        if m.shadowing is not None:
            self.replicas.warm_up(m.shadowing)
        if resume is not None:
            self._resume(*resume)

    # -- what the command reads ------------------------------------------------------------
    @property
    def wrank(self) -> int:
        return self.m.wrank

    @property
    def is_logger(self) -> bool:
        return self.m.is_logger

    def close_lobby(self) -> None:
        """Tell every rank outside the last generation there is nothing to rejoin."""
        self.rejoin.close_lobby()

    def _while_waiting(self) -> None:
        """Every 10 ms of any wait: a stop, a round another rank started, or this rank's
        demotion ends the wait. Why the round too: a revoke does not always wake a send
        to a live rank that has not taken it (a replica to a stalled backup, seen under
        ULFM), and a rank that stays in such a wait is silent in the round and replaced,
        though healthy. Two probes when nothing waits (mpipipe.respipe.control.quiet)."""
        self.stopper.check(boundary=False)
        m = self.m
        if not (m.control.quiet(_ANNOUNCE, seq=m.gen) and m.control.quiet(_DEMOTED, seq=m.gen)):
            self.rounds.check_announcements()

    def _resume(self, step: int, load: Callable[[int], Any]) -> None:
        """Continue from the checkpoints of ``step`` (``load(k)`` reads stage k's).

        A stage loads its own state, and a holder (backup, or neighbour) loads the
        checkpoint of each stage it holds as that stage's replica of ``step``: a
        takeover before the first new replica then continues from the checkpoint,
        not from the initial weights.

        Raises:
            CheckpointError: a checkpoint is missing or unreadable (from ``load``).
        """
        m = self.m
        m.done = step
        owned = [m.stage] if m.stage is not None else []
        held = [m.shadowing] if m.shadowing is not None else list(m.wards)
        for k in owned + held:
            checkpoint = load(k)
            try:
                self.replicas.load_held(k, step, checkpoint.state)
            except CheckpointError as e:  # "does not fit this model and optimizer: ..."
                raise CheckpointError(f"the checkpoint of stage {k} {e}") from None

    def train(self, total_steps: int, eval_every: int = 0) -> dict[str, Any]:
        """Train until ``total_steps`` optimizer steps are applied; returns the summary (rank 0).

        Raises:
            StageLost: a stage failed with no backup left (raised on every survivor).
            Demoted: this rank was replaced (raised on the demoted rank only).
        """
        m = self.m
        self.total = total_steps
        self.rounds.configure(total_steps, eval_every)
        if m.is_logger:
            self.book.log_cost_model()
        # Backups warmed up in the constructor; start together so that no deadline of the
        # first step counts their start-up.
        m.data.Barrier()
        t_start = time.time()
        self.faults.start()  # a poisson process's clock: the run's start, alike on every rank
        rnd: Round | None = None
        while True:
            try:
                try:
                    if rnd is not None:
                        # A failure while a round is applied (a replica re-sync, or what
                        # ranks hold after it) starts the next round on the new route.
                        now, rnd = rnd, None
                        self.rounds.recover(now)
                    elif m.stage is not None:
                        if m.done >= total_steps:
                            break
                        self.stopper.check(boundary=True)
                        self._stage_step()
                    else:
                        if self._backup_wait(total_steps):
                            break
                except (Late, PeerFailed) as e:
                    rnd = self.rounds.round_from(e)
                except RoundStarted as e:
                    rnd = e.round
                except DataFault as e:  # not this rank's failure: every rank stops
                    raise self.stopper.fail(str(e)) from None
            except Demoted as e:
                self._replaced(e)
            except StopRun as e:
                self._stopped(e)
                raise
        self._finish()
        pending = self.stopper.pending
        # A backup, told by its stage that it ended; a stop agreed on for the last step
        # itself leaves nothing to resume: the run completed.
        if pending is not None and (pending.kind == "data" or pending.step < total_steps):
            raise pending
        elapsed = time.time() - t_start
        return {"steps": m.done, "elapsed_s": elapsed, "generation": m.gen,
                "accuracy": self.book.last_eval, "loss": self.book.last_loss,
                "takeovers": self.rounds.takeovers}

    def _replaced(self, e: Demoted) -> None:
        """This rank was replaced: it lets go of the log and asks to rejoin as a backup.

        Raises:
            Demoted: it cannot come back (no ULFM, neighbour mode, or nobody admitted it).
        """
        self.book.leave_log(e.generation)
        if not self.rejoin.rejoin(e):
            raise e
        # Back as a backup: no fault due while it was away fires late, and it writes no
        # row and joins no round it heard of before.
        self._faults_at = max(self._faults_at, self.m.done - 1)
        self.book.forget_pending()
        self.rounds.early = {}

    def _stopped(self, e: StopRun) -> None:
        """A clean stop: on a signal, each stage writes its checkpoint and the run ends as
        at its last step (backups told, rows written); on a data error nothing more."""
        self.m.pipe.transport.discard()
        if e.kind == "signal":
            if self.m.stage is not None and self.checkpoint_dir is not None:
                self._checkpoint()
            self._finish()

    def _stage_step(self) -> None:
        m, book = self.m, self.book
        s = m.done
        pipe, own = m.pipe, self.replicas.own
        assert m.stage is not None and own is not None
        ta = time.perf_counter()
        self.rejoin.poll()
        book.drain_fault_notes()
        if m.wrank == book.loss_keeper():
            book.take_losses()
        slept = self.faults.at_step(s)
        # Only the first stage reads data, and the last one when labels do not travel.
        x, y = self.batch_of(s) if pipe.first or (pipe.last and pipe.labels == "local") \
            else (None, None)
        if _DEBUG and m.gen and s <= m.gen_step + 1:
            m.say(f"step {s} start at {time.time() % 100:.3f}, data {time.perf_counter() - ta:.3f}")
        if m.rollback_possible():
            self.replicas.keep_snapshot()
        pipe.deadline = m.deadline()
        t0 = time.perf_counter()
        pipe.transport.reset_counters()
        loss = m.steps.step(x if pipe.first else None,
                            y if (pipe.first or pipe.last) else None, self.loss_fn, step=s)
        factor = self.faults.slowdown(s)
        if factor > 1:
            time.sleep((factor - 1) * pipe.last_compute_s)
        own.apply_step(self.schedule, s)
        m.done = s + 1
        m.after_step = True
        # The step is applied: its figures leave even when its replica cannot (a holder
        # died or is late), or a round that keeps the step would find its row incomplete.
        failed: Late | PeerFailed | RoundStarted | None = None
        try:
            self.replicas.replicate()
        except (Late, PeerFailed, RoundStarted) as e:
            failed = e
        m.step_times.append(time.perf_counter() - t0 - slept)
        if _DEBUG and m.gen and s <= m.gen_step + 1:
            m.say(f"step {s}: {time.perf_counter() - t0:.3f} s (compute "
                  f"{pipe.last_compute_s:.3f}, wait {pipe.last_wait_s:.3f})")
        book.report(s, book.step_figs(s, loss))
        watchdog.beat(s)
        if failed is not None:
            raise failed
        if self.rounds.eval_point(m.done) or m.done == self.total:
            book.evaluate()
        every = self.checkpoint_every
        if self.checkpoint_dir is not None and (
                m.done == self.total or (every and m.done % every == 0)):
            self._checkpoint()
        m.after_step = False

    def _backup_wait(self, total: int) -> bool:
        """One poll of a backup: take replicas (cold) or mirror a step (hot). True when done."""
        m = self.m
        k = m.shadowing
        assert k is not None
        watchdog.beat()  # a backup that polls is not stuck (its stage's watchdog covers it)
        stage_w = m.route_w[k]
        # The control plane is looked at message by message only when something waits
        # there (or a stop signal came): the dozen probes of a full look cost a backup
        # more CPU than its stage's replicas do, on the cores its stages run on.
        if not m.control.quiet() or stop.requested() is not None:
            if m.control.poll(_END, m.drank(stage_w), seq=0) is not None:
                return True
            self.stopper.check(boundary=True)
            self.rounds.check_announcements()
        self.rejoin.poll()
        # A fault aimed at this backup (rank=R) fires once it knows the stage has begun
        # the step: at each replica (cold), or as it mirrors the step (hot; micro= fires
        # after the mirrored forward).
        while self._faults_at < min(m.done, total - 1):
            self._faults_at += 1
            self.faults.at_step(self._faults_at, by_rank=True)
        R = m.settings.replicate_every
        nxt = (m.done // R + 1) * R
        if m.done >= total or (m.settings.mode != "hot" and nxt > total):
            # Nothing comes after the last step but END. A stage that finished leaves at
            # once: a probe for a next step would find it dead and start a round over a
            # completed run (seed 3 #60); a stage dead after its last step ends this wait.
            if m.ulfm and stage_w in ft.failed_ranks(m.world):
                return True
            time.sleep(_BACKUP_POLL_S)
            return False
        if m.settings.mode == "hot":
            self.hot.mirror_step(k, stage_w)
            return False
        t = m.pipe.transport
        # Probe before receiving: a cancelled receive could lose a replica already matched.
        if self.replicas.probe(stage_w, t.tag(REPLICA, nxt)):
            self.replicas.take(stage_w, k, nxt, t)
            m.done = nxt
        else:
            time.sleep(PAUSE_S)
        return False

    def _checkpoint(self) -> None:
        """This stage writes its own file (atomically); no barrier, so no rank can hang on it."""
        m, own = self.m, self.replicas.own
        assert m.stage is not None and own is not None
        own.save(self.checkpoint_dir, stage=m.stage, balance=m.pipe.balance,
                 eval_count=m.pipe.eval_count)
        if m.is_logger:
            self.book.log_event(EventKind.CHECKPOINT, m.done, m.wrank,
                                directory=str(self.checkpoint_dir))

    def _finish(self) -> None:
        """Tell backups the run is over; write the last row; say which round faults
        never fired (no round ran from their step on)."""
        m = self.m
        for f in self.faults.unfired_round_faults():
            print(f"mpipipe train: rank {m.wrank}: fault {f} did not fire: no recovery "
                  f"round ran on this rank from step {f.step} on", file=sys.stderr, flush=True)
        if m.stage is not None:
            for b in m.backups_w.get(m.stage, []):
                m.control.send(_END, m.drank(b), [m.done], seq=0)
        self.book.write_pending()
        if m.wrank == min(m.members):
            self.rejoin.close_lobby()
        self.finished = True
