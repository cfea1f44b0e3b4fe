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

The pieces, one module each (ResPipe mixes in the stateful ones):

- ``messages``: the typed state report and decision, and their versioned codec;
- ``decide``: the round's decision as a pure function of the reports;
- ``rounds``: a round's phases, announce, collect, decide, apply;
- ``membership``: generation, route, holders, deadline; ``replicas``: sending,
  holding, promoting; ``hot``: the hot mirror; ``rejoin``: the lobby;
- ``logbook``: figures, rows, events and the log's hand-over; ``control``: the
  control plane; ``settings``: the ``[resilience]`` knobs; ``command``: the glue
  for ``python -m mpipipe train``.
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mpipipe.core.logs.logschema import EventKind
from mpipipe.core.mpi import ft, watchdog
from mpipipe.core.mpi.faults import FaultPlan
from mpipipe.core.mpi.stop import ControlStop, StopRun
from mpipipe.core.mpi.transport import Late, PeerFailed, set_wait_hook
from mpipipe.core.run.batches import DataFault
from mpipipe.core.state.checkpoint import CheckpointError
from mpipipe.core.state.stagestate import StageState
from mpipipe.core.state.statecodec import pack_state, state_nbytes, unpack_state
from mpipipe.respipe.control import _ANNOUNCE, _DEMOTED, _END, _STOP, _STOP_ASK, _Control
from mpipipe.respipe.decide import round_patience
from mpipipe.respipe.hot import HotMirror
from mpipipe.respipe.logbook import FIGS_RESENT, Logbook, _Row
from mpipipe.respipe.membership import _DEBUG, Demoted, Membership, StageLost
from mpipipe.respipe.messages import StateReport
from mpipipe.respipe.mirror import SHADOW_GRAD_MICRO
from mpipipe.respipe.mirror import MirrorPipeline as Pipeline  # ResPipe's: the engine + hot mode
from mpipipe.respipe.rejoin import Rejoin
from mpipipe.respipe.replicas import Replicas, _Slot
from mpipipe.respipe.rounds import Rounds, _Round, _RoundStarted
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


class ResPipe(Rounds, HotMirror, Replicas, Rejoin, Logbook, Membership):
    """Runs the training steps of one rank with backups, takeover and replay.

    Every rank of the job constructs one and calls :meth:`train`; the launch
    plan says whether it starts as a stage or a backup. Callables supplied by
    the training command keep this class free of data sets and models:
    ``batch_of(step) -> (x, y)`` must return the same mini-batch for the same
    step (a replay re-reads it), ``make_optimizer(module)`` builds a stage's
    optimizer, and ``evaluate(pipe) -> (correct, count) | None`` runs a
    forward-only pass on every stage rank.
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
    ) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.world = comm or MPI.COMM_WORLD
        self.wrank = self.world.Get_rank()
        self.cfg = cfg
        self.plan = plan
        self.settings = Settings.from_config(cfg, pipe.k, pipe.chunks)
        self.pipe = pipe
        self.make_optimizer = make_optimizer
        self.loss_fn = loss_fn
        self.batch_of = batch_of
        self.evaluate_fn = evaluate
        self.log = log
        self.progress = progress
        self.out = out or sys.stdout
        self.in_shape = tuple(in_shape) if in_shape is not None else pipe.in_shape
        if schedule is None:
            from mpipipe.core.run.recipe import Recipe

            schedule = Recipe(cfg).schedule(int(cfg["run"]["steps"]))
        self.schedule = schedule  # the hyperparameters of each step (a replay's too)
        self.batch_size = int(cfg["data"]["batch_size"])
        self.ulfm = ft.ulfm_enabled()
        self.gen = 0
        self.log_w = plan.log_rank  # world rank writing the log (it opened it); a round moves it
        self.recent_figs: deque[list[float]] = deque(maxlen=FIGS_RESENT + 1)  # for a new writer
        self._rebuilt: dict[int, list[int]] = {}  # new writer: step -> ranks resending figures
        self.loss_copies: dict[int, float] = {}  # the loss keeper's: step -> loss
        data = self.world.Dup()
        data.Set_errhandler(MPI.ERRORS_RETURN)
        ctl = data.Dup()
        ctl.Set_errhandler(MPI.ERRORS_RETURN)
        self.data, self.control = data, _Control(ctl)
        lobby = self.world.Dup()
        lobby.Set_errhandler(MPI.ERRORS_RETURN)
        self.lobby = _Control(lobby)  # every rank of the job, whatever the generation
        self.members = list(range(self.world.Get_size()))  # world rank of each data rank
        self.route_w = [plan.ranks_of("stage", k)[0] for k in range(pipe.k)]
        self.backups_w: dict[int, list[int]] = {
            k: plan.ranks_of("backup", k) for k in range(pipe.k)}
        self.balance = list(pipe.balance)
        role = plan.role_of(self.wrank)
        self.stage: int | None = role.index if role.kind == "stage" else None
        self.shadowing: int | None = role.index if role.kind == "backup" else None
        self.wards: list[int] = []  # neighbour mode: stages whose replicas this stage holds
        self.ward_slots: dict[int, list[_Slot]] = {}
        self.done = 0
        self.snapshot: _Slot | None = None
        self.slots: list[_Slot] = []  # held replicas (backup or neighbour), newest last
        self._replica_sizes: dict[int, tuple[nn.Module, int]] = {}  # id(stage module) -> bytes
        self.own: StageState | None = None  # the state of the stage this rank serves (hot: mirrors)
        self._mirror_of: int | None = None  # hot: the stage self.own mirrors
        self._mirror_snap: _Slot | None = None  # hot: the mirror's state before its step
        # True from an applied update until the step's replica, figures, evaluation and
        # checkpoint are done: a round then replays (that work is not resumable).
        self._after_step = False
        self.prev_snapshot: _Slot | None = None  # the snapshot before self.snapshot
        self.faults = FaultPlan(self.settings.faults, seed=int(cfg["run"]["seed"]),
                                stage=self.stage, rank=self.wrank, on_fire=self._fault_fired)
        self.step_times: deque[float] = deque(maxlen=21)
        self.pending_rows: dict[int, _Row] = {}
        self.fault_notes: dict[int, tuple[float, str]] = {}  # world rank -> (time, spec)
        self.open_events: list[dict[str, Any]] = []  # takeovers waiting for their recovery_s
        self.events: list[tuple[str, dict[str, Any]]] = []  # what rank 0 logged (for tests)
        self.last_eval: float = math.nan
        self.finished = False
        self.checkpoint_dir = checkpoint_dir
        self.last_loss = math.nan
        self.takeovers = 0
        self._last_row_time: float | None = None
        self._early: dict[int, StateReport] = {}  # announcements that came before the round
        self._rejoin_requests: dict[int, float] = {}  # replaced rank -> when it was told
        self._gen_step = 0  # the step the current generation started at
        self._faults_at = -1  # a backup: the last step its faults were fired for
        self._rebind_pipe()
        pipe.after_forward = self.faults.at_step  # kills and stalls inside a step
        self.stopper = ControlStop(self, _STOP, _STOP_ASK)
        set_wait_hook(self._while_waiting)
        # Every rank built the model from the same seed: before the first replica
        # arrives, a holder's copy of the initial state is the replica of step 0.
        for k in ([self.shadowing] if self.shadowing is not None else self.wards):
            self._hold(_Slot(StageState(self._module(k), self.make_optimizer).pack(), 0), k)
        if self.shadowing is not None:
            self._warm_up(self.shadowing)
        if resume is not None:
            self._resume(*resume)

    def _while_waiting(self) -> None:
        """Every 10 ms of any wait: a stop, a round another rank started, or this rank's
        demotion ends the wait. Why the round too: a revoke does not always wake a send
        to a live rank that has not taken it (a replica to a stalled backup, seen under
        ULFM), and a rank that stays in such a wait is silent in the round and replaced,
        though healthy. Two probes when nothing waits (mpipipe.respipe.control.quiet)."""
        self.stopper.check(boundary=False)
        if not (self.control.quiet(_ANNOUNCE, seq=self.gen)
                and self.control.quiet(_DEMOTED, seq=self.gen)):
            self._check_announcements()

    def _resume(self, step: int, load: Callable[[int], Any]) -> None:
        """Continue from the checkpoints of ``step`` (``load(k)`` reads stage k's).

        A stage loads its own state, and a holder (backup, or neighbour) loads the
        checkpoint of each stage it holds as that stage's replica of ``step``: a
        takeover before the first new replica then continues from the checkpoint,
        not from the initial weights.

        Raises:
            CheckpointError: a checkpoint is missing or unreadable (from ``load``).
        """
        self.done = step
        owned = [self.stage] if self.stage is not None else []
        held = [self.shadowing] if self.shadowing is not None else list(self.wards)
        for k in owned + held:
            checkpoint = load(k)
            state = self.own if k == self.stage and self.own is not None \
                else StageState(self._module(k), self.make_optimizer)
            try:
                state.load_state_dict(checkpoint.state)
            except CheckpointError as e:
                raise CheckpointError(f"the checkpoint of stage {k} {e}") from None
            if k in held:
                slot = _Slot(state.pack(), step)
                if self.stage is not None:
                    self.ward_slots[k] = [slot]
                else:
                    self.slots = [slot]

    def train(self, total_steps: int, eval_every: int = 0) -> dict[str, Any]:
        """Train until ``total_steps`` optimizer steps are applied; returns the summary (rank 0).

        Raises:
            StageLost: a stage failed with no backup left (raised on every survivor).
            Demoted: this rank was replaced (raised on the demoted rank only).
        """
        self.total = total_steps
        if self.is_logger:
            self._log_cost_model()
        # Backups warmed up in the constructor; start together so that no deadline of the
        # first step counts their start-up.
        self.data.Barrier()
        t_start = time.time()
        self.eval_every = eval_every
        rnd: _Round | None = None
        while True:
            try:
                try:
                    if rnd is not None:
                        # A failure while a round is applied (a replica re-sync, or what
                        # ranks hold after it) starts the next round on the new route.
                        now, rnd = rnd, None
                        self._recover(now)
                    elif self.stage is not None:
                        if self.done >= total_steps:
                            break
                        self.stopper.check(boundary=True)
                        self._stage_step()
                    else:
                        if self._backup_wait(total_steps):
                            break
                except (Late, PeerFailed) as e:
                    rnd = self._round_from(e)
                except _RoundStarted as e:
                    rnd = e.round
                except DataFault as e:  # not this rank's failure: every rank stops
                    raise self.stopper.fail(str(e)) from None
            except Demoted as e:
                self._leave_log(e.generation)
                if not self._rejoin(e):
                    raise
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
        return {"steps": self.done, "elapsed_s": elapsed, "generation": self.gen,
                "accuracy": self.last_eval, "loss": self.last_loss,
                "takeovers": self.takeovers}

    def _stopped(self, e: StopRun) -> None:
        """A clean stop: on a signal, each stage writes its checkpoint and the run ends as
        at its last step (backups told, rows written); on a data error nothing more."""
        self.pipe.transport.discard()
        if e.kind == "signal":
            if self.stage is not None and self.checkpoint_dir is not None:
                self._checkpoint()
            self._finish()

    def _stage_step(self) -> None:
        s = self.done
        pipe, own = self.pipe, self.own
        assert self.stage is not None and own is not None
        ta = time.perf_counter()
        self._poll_rejoin()
        self._drain_fault_notes()
        if self.wrank == self._loss_keeper():
            self._take_losses()
        slept = self.faults.at_step(s)
        # Only the first stage reads data, and the last one when labels do not travel.
        x, y = self.batch_of(s) if pipe.first or (pipe.last and pipe.labels == "local") \
            else (None, None)
        if _DEBUG and self.gen and s <= self._gen_step + 1:
            self._say(f"step {s} start at {time.time() % 100:.3f}, data {time.perf_counter() - ta:.3f}")
        if self._rollback_possible():
            # Two kept: after a round that went on, a later one may roll back to the step
            # before (a mirror that was a step behind sets P).
            if self.snapshot is not None and self.snapshot.count != self.done:
                self.prev_snapshot = self.snapshot
            self.snapshot = _Slot(own.pack(), self.done)
        pipe.deadline = self._deadline()
        t0 = time.perf_counter()
        pipe.transport.reset_counters()
        loss = pipe.step(x if pipe.first else None,
                         y if (pipe.first or pipe.last) else None, self.loss_fn, step=s)
        factor = self.faults.slowdown(s)
        if factor > 1:
            time.sleep((factor - 1) * pipe.last_compute_s)
        own.apply_step(self.schedule, s)
        self.done = s + 1
        self._after_step = True
        # The step is applied: its figures leave even when its replica cannot (a holder
        # died or is late), or a round that keeps the step would find its row incomplete.
        failed: Late | PeerFailed | _RoundStarted | None = None
        try:
            self._replicate()
        except (Late, PeerFailed, _RoundStarted) as e:
            failed = e
        self.step_times.append(time.perf_counter() - t0 - slept)
        if _DEBUG and self.gen and s <= self._gen_step + 1:
            self._say(f"step {s}: {time.perf_counter() - t0:.3f} s (compute "
                      f"{pipe.last_compute_s:.3f}, wait {pipe.last_wait_s:.3f})")
        self._report(s, self._step_figs(s, loss))
        watchdog.beat(s)
        if failed is not None:
            raise failed
        if self._eval_point(self.done) or self.done == self.total:
            self._evaluate()
        every = int(self.cfg["run"].get("checkpoint_every", 0))
        if self.checkpoint_dir is not None and (
                self.done == self.total or (every and self.done % every == 0)):
            self._checkpoint()
        self._after_step = False

    def _checkpoint(self) -> None:
        """This stage writes its own file (atomically); no barrier, so no rank can hang on it."""
        assert self.stage is not None and self.own is not None
        self.own.save(self.checkpoint_dir, stage=self.stage, balance=self.pipe.balance,
                      eval_count=self.pipe.eval_count)
        if self.is_logger:
            self._log_event(EventKind.CHECKPOINT, self.done, self.wrank,
                            directory=str(self.checkpoint_dir))

    def _finish(self) -> None:
        """Tell backups the run is over; write the last row; say which round faults
        never fired (no round ran from their step on)."""
        for f in self.faults.unfired_round_faults():
            print(f"mpipipe train: rank {self.wrank}: fault {f} did not fire: no recovery "
                  f"round ran on this rank from step {f.step} on", file=sys.stderr, flush=True)
        if self.stage is not None:
            for k, bs in self.backups_w.items():
                if k == self.stage:
                    for b in bs:
                        self.control.send(_END, self._drank(b), [self.done], seq=0)
        if self.is_logger:
            for s in sorted(self.pending_rows):
                self._write_row(s)
        if self.wrank == min(self.members):
            self.close_lobby()
        self.finished = True
