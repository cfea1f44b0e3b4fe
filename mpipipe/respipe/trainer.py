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
  one step further roll it back from their snapshot. The new communicator
  comes from ``Shrink`` (dead ranks) or ``Create_group`` (a stalled rank,
  which stays alive and is told it was replaced).
- Every message carries the route's generation in its tag and travels on the
  generation's own communicator, so a demoted rank that wakes up is never
  listened to again. Under ULFM it asks, on a job-wide *lobby* communicator,
  to come back: the lowest member runs a round that admits it as a backup of
  the stage with the fewest, and that stage re-syncs its replica to it.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from mpipipe.core import ft
from mpipipe.core.checkpoint import CheckpointError
from mpipipe.core.data import DataFault
from mpipipe.core.faults import Fault, FaultPlan
from mpipipe.core.lr import set_rate_for_step
from mpipipe.core.runlog import LogError
from mpipipe.core.statecodec import pack_state, replica_numel, unpack_state
from mpipipe.core.stop import ControlStop, StopRun
from mpipipe.core.transport import CTRL, REPLICA, SHADOW, Late, PeerFailed, pause, set_wait_hook
from mpipipe.respipe.costmodel import predict, stage_shapes
from mpipipe.respipe.mirror import SHADOW_GRAD_MICRO, Have, Route, stage_consumers
from mpipipe.respipe.mirror import MirrorPipeline as Pipeline  # ResPipe's: the engine + hot mode

__all__ = [
    "Settings",
    "StageLost",
    "Demoted",
    "ResPipe",
    "pack_state",
    "unpack_state",
    "replica_numel",
    "SHADOW_GRAD_MICRO",
    "BatchCache",
    "round_patience",
    "train",
]

# Hot mode: a stage > 0 relays its input of micro-batch i as SHADOW micro i, and a
# stage < K-1 the gradient of its output as SHADOW micro SHADOW_GRAD_MICRO + i.

# Control messages (float64 arrays on the generation's control communicator).
_ANNOUNCE, _DECISION, _DEMOTED, _END, _FIGS, _FAULT, _EVAL = range(1, 8)
# On the lobby (the whole job's communicator): a replaced rank asks to come back; the
# coordinator admits it (the round's decision) or tells it the job is over.
_REJOIN, _ADMIT, _CLOSED = range(8, 11)
_RELEASED = 11  # on the lobby: a replaced log writer has closed the file
_STOP, _STOP_ASK = 12, 13  # the clean stop (mpipipe.core.stop.ControlStop), on the control plane
_CTL_LEN = 256
_REASONS = {0: "none", 1: "late", 2: "failed", 3: "revoked", 4: "announced", 5: "rejoin"}
REJOIN_WAIT_S = 300.0  # how long a replaced rank waits to be admitted or told the job ended
_BACKUP_POLL_S = 0.02
MIN_DEADLINE_S = 0.008  # floor of a deadline set in median step times
QUICK_GRACE_S = 0.003  # floor of the wait for an answer from a rank already found late
_DEBUG = bool(os.environ.get("MPIPIPE_DEBUG_ROUNDS"))
if _DEBUG:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid> prints every thread's stack


def round_patience(silent: Sequence[int], late: Iterable[int], members: int, grace: float,
                   quick: float) -> float:
    """How long a round's coordinator waits for ``silent`` ranks before leaving them out.

    ``quick`` if every silent rank was already found late by a survivor (it has
    had its deadline); ``grace`` otherwise; four times ``grace`` before leaving
    out half the members or more, which is more likely this rank's own isolation
    than theirs.
    """
    if len(silent) >= members / 2:
        return 4 * grace
    late = set(late)
    return quick if silent and all(w in late for w in silent) else grace


class StageLost(RuntimeError):
    """A stage failed and no backup (or neighbour) is left to serve it."""

    def __init__(self, stage: int, rank: int, reason: str, had: int = 0) -> None:
        self.stage, self.rank, self.reason = stage, rank, reason
        hint = "" if ft.ulfm_enabled() else " and run under mpirun --with-ft ulfm to survive dead ranks"
        more = "one" if had == 0 else f"{had + 1} (it had {had})"
        super().__init__(
            f"stage {stage} (world rank {rank}) {reason} and has no backup left: the pipeline "
            f"cannot continue. Give it {more} with resilience.backups = "
            f"{{{stage} = {had + 1}}}{hint}")


class Demoted(RuntimeError):
    """This rank was late and has been replaced; it must not send anything more."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        super().__init__(f"this rank was replaced at generation {generation}")


@dataclass(frozen=True)
class Settings:
    """The ``[resilience]`` knobs, checked."""

    backups: Mapping[int, int]
    replicate_every: int = 1
    mode: str = "cold"
    deadline_s: float = 30.0
    deadline_factor: float = 0.0
    faults: tuple[Fault, ...] = ()

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], stages: int, chunks: int = 1) -> Settings:
        """Read and check ``cfg["resilience"]``.

        Raises:
            ValueError: R < 1, a deadline <= 0, or a bad fault spec (names the key).
        """
        from mpipipe.core.faults import parse_all
        from mpipipe.core.roles import _backup_counts

        sec = cfg["resilience"]
        r = int(sec["replicate_every"])
        if r < 1:
            raise ValueError(f"resilience.replicate_every = {r}: must be >= 1")
        if float(sec["deadline_s"]) <= 0:
            raise ValueError(f"resilience.deadline_s = {sec['deadline_s']}: must be > 0")
        if float(sec["deadline_factor"]) < 0:
            raise ValueError("resilience.deadline_factor must be >= 0 (0: fixed deadline only)")
        if sec["mode"] == "neighbour" and _backup_counts(sec.get("backups", {}), stages):
            raise ValueError("resilience.mode = \"neighbour\" needs no backup ranks (each "
                             "stage's neighbour holds its replica): set resilience.backups = {}")
        if sec["mode"] != "cold" and (sched := cfg.get("pipeline", {}).get("schedule")) == "interleaved-1f1b":
            raise ValueError(f'resilience.mode = "{sec["mode"]}" runs one chunk per rank: '
                             f'schedule "{sched}" needs resilience.mode = "cold"')
        # Whether each fault can fire was checked at start-up (cli.check_faults).
        faults = tuple(parse_all(sec.get("inject", [])))
        return cls(_backup_counts(sec.get("backups", {}), stages), r, sec["mode"],
                   float(sec["deadline_s"]), float(sec["deadline_factor"]), faults)



# -- the control plane -----------------------------------------------------------------------

def _ctl_tag(code: int, seq: int = 0) -> int:
    return (code << 24) | (seq % (1 << 24))


class _Control:
    """Small float64 messages on a control communicator: announcements, decisions, figures.

    Why a second communicator: revoking the data communicator (to wake every
    survivor at once) must not take the control messages with it, and control
    traffic must not count as pipeline bytes.
    """

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI

        self.comm = comm
        self.MPI = MPI
        self._sends: list[tuple[Any, np.ndarray]] = []
        self.bytes_sent = 0  # payload handed to MPI since the last take_sent()

    def take_sent(self) -> int:
        """Control bytes sent since the last call (a step's ``ctrl_bytes_sent``)."""
        n, self.bytes_sent = self.bytes_sent, 0
        return n

    def send(self, code: int, dest: int, values: Sequence[float], seq: int = 0) -> None:
        buf = np.asarray(values, dtype=np.float64)
        try:
            req = self.comm.Isend(buf, dest, _ctl_tag(code, seq))
            self._sends.append((req, buf))
            self.bytes_sent += buf.nbytes
        except Exception:  # noqa: BLE001 - a dead or gone peer: nothing to tell it
            pass
        self._reap()

    def drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the started sends to complete."""
        end = time.perf_counter() + timeout_s
        self._reap()
        while self._sends and time.perf_counter() < end:
            time.sleep(0.001)
            self._reap()

    def _reap(self) -> None:
        still = []
        for req, buf in self._sends:
            try:
                if not req.Test():
                    still.append((req, buf))
            except Exception:  # noqa: BLE001 - peer died: drop the message
                pass
        self._sends = still

    def poll(self, code: int, source: int, seq: int = 0) -> np.ndarray | None:
        """One waiting message with this code from ``source``, or None (never blocks)."""
        status = self.MPI.Status()
        try:
            # A matched probe receives exactly the probed message, even from a rank that
            # has died since (under ULFM a plain Recv from it fails).
            message = self.comm.Improbe(source, _ctl_tag(code, seq), status)
            if message is None:
                return None
            buf = np.empty(status.Get_count(self.MPI.DOUBLE), dtype=np.float64)
            message.Recv(buf)
            return buf
        except Exception:  # noqa: BLE001 - source died: treat as silent
            return None


def encode_decision(d: Mapping[str, Any]) -> np.ndarray:
    """A round's decision as the float64 vector the coordinator sends (see read_decision).

    Why one flat vector: it travels as a single control message to every member
    and, on the lobby, to a rank being admitted.
    """
    code = {v: k for k, v in _REASONS.items()}[d["reason"]]
    route = list(d["route"])
    vec = [d["gen"], d["P"], d["lost_stage"], d["merge"], d["shrink"], code, d["suspect"],
           d["t_detect"], d["waited_s"], len(d["members"]), *d["members"], len(route), *route,
           len(d["choices"]), *[x for k, c in sorted(d["choices"].items()) for x in (k, c)],
           len(d["silent"]), *d["silent"], d["admit"], d["admit_stage"],
           *[x for k in range(len(route)) for x in (len(d["backups"][k]), *d["backups"][k])],
           d["log"], d["go_on"]]
    return np.asarray(vec, dtype=np.float64)


def read_decision(v: np.ndarray) -> dict[str, Any]:
    """The decision a vector from encode_decision carries (plus the vector itself)."""
    it = iter(v.tolist())
    d: dict[str, Any] = {"vector": v}
    d["gen"], d["P"], d["lost_stage"], d["merge"], d["shrink"] = (int(next(it)) for _ in range(5))
    d["reason"] = _REASONS.get(int(next(it)), "late")
    d["suspect"], d["t_detect"], d["waited_s"] = int(next(it)), next(it), next(it)
    d["members"] = [int(next(it)) for _ in range(int(next(it)))]
    d["route"] = [int(next(it)) for _ in range(int(next(it)))]
    n = int(next(it))
    d["choices"] = {int(next(it)): int(next(it)) for _ in range(n)}
    d["silent"] = [int(next(it)) for _ in range(int(next(it)))]
    d["admit"], d["admit_stage"] = int(next(it)), int(next(it))
    d["backups"] = {k: [int(next(it)) for _ in range(int(next(it)))]
                    for k in range(len(d["route"]))}
    d["log"] = int(next(it))
    d["go_on"] = int(next(it))
    return d


# -- the resilient trainer -------------------------------------------------------------------

@dataclass
class _Slot:
    """One held copy of a stage's state: the flat replica and its step count."""

    flat: torch.Tensor
    count: int


@dataclass
class _Round:
    reason: str
    suspect: int
    t_detect: float
    waited_s: float = math.nan


@dataclass
class _Row:
    """One step's row of the log, completed on rank 0 from every stage's figures."""

    step: int
    time: float
    loss: float
    samples: int
    ranks: dict[int, dict[str, float]] = field(default_factory=dict)


class ResPipe:
    """Runs the training steps of one rank with backups, takeover and replay.

    Every rank of the job constructs one and calls :meth:`train`; the launch
    plan says whether it starts as a stage or a backup. Callables supplied by
    the training command keep this class free of data sets and models:
    ``batch_of(step) -> (x, y)`` must return the same mini-batch for the same
    step (a replay re-reads it), ``make_optimizer(params)`` builds a stage's
    optimizer, and ``evaluate(pipe) -> (correct, count) | None`` runs a
    forward-only pass on every stage rank.
    """

    def __init__(
        self,
        *,
        cfg: Mapping[str, Any],
        plan: Any,
        pipe: Pipeline,
        make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
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
        self.optim = cfg["optim"]["name"]
        self.momentum = float(cfg["optim"].get("momentum", 0.0)) if self.optim == "sgd" else 0.0
        self.batch_size = int(cfg["data"]["batch_size"])
        self.ulfm = ft.ulfm_enabled()
        self.gen = 0
        self.log_w = plan.log_rank  # world rank writing the log (it opened it); a round moves it
        self.recent_figs: deque[list[float]] = deque(maxlen=3)  # this rank's, for a new writer
        self._rebuilt: dict[int, list[int]] = {}  # new writer: step -> ranks resending figures
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
        self.optimizer: torch.optim.Optimizer | None = None
        self._mirror_of: int | None = None  # hot: the stage whose optimizer self.optimizer is
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
        self._early: dict[int, np.ndarray] = {}
        self._rejoin_requests: dict[int, float] = {}  # replaced rank -> when it was told
        self._gen_step = 0  # the step the current generation started at
        self._faults_at = -1  # a backup: the last step its faults were fired for
        self._rebind_pipe()
        pipe.after_forward = self.faults.at_step  # kills and stalls inside a step
        self.stopper = ControlStop(self, _STOP, _STOP_ASK)
        set_wait_hook(lambda: self.stopper.check(boundary=False))
        # Every rank built the model from the same seed: before the first replica
        # arrives, a holder's copy of the initial state is the replica of step 0.
        for k in ([self.shadowing] if self.shadowing is not None else self.wards):
            params = self._params(k)
            self._hold(_Slot(pack_state(params, self.make_optimizer(params), self.optim,
                                        self.momentum), 0), k)
        if self.shadowing is not None:
            self._warm_up(self.shadowing)
        if resume is not None:
            self._resume(*resume)

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
            state = load(k)
            params = self._params(k)
            opt = self.optimizer if k == self.stage else self.make_optimizer(params)
            try:
                self.pipe.partitions[k].load_state_dict(state.params)
                if state.optimizer and isinstance(opt, torch.optim.Optimizer):
                    opt.load_state_dict(state.optimizer)
            except (RuntimeError, ValueError, KeyError) as e:
                raise CheckpointError(f"the checkpoint of stage {k} does not fit this model "
                                      f"and optimizer: {e}") from None
            if k in held:
                slot = _Slot(pack_state(params, opt, self.optim, self.momentum), step)
                if self.stage is not None:
                    self.ward_slots[k] = [slot]
                else:
                    self.slots = [slot]

    def _warm_up(self, stage: int) -> None:
        """Run the stage's layers and its optimizer once on throwaway copies.

        Why: the first optimizer step of a process imports parts of torch that take
        seconds; a backup that paid this only at takeover would miss its deadline.
        """
        import copy

        shapes, pipe = self.pipe.boundary_shapes(self.in_shape), self.pipe
        for c in range(stage, len(pipe.chunk_modules), pipe.k):  # the stage's chunks
            part = copy.deepcopy(pipe.chunk_modules[c])
            shape, dtype = shapes[c]
            x = torch.zeros((2, *shape), dtype=dtype, requires_grad=dtype.is_floating_point)
            out = part(x)
            out.float().sum().backward()
            opt = self.make_optimizer(part.parameters())
            opt.step()

    # -- small helpers ---------------------------------------------------------------
    @property
    def is_logger(self) -> bool:
        return self.wrank == self.log_w

    def _drank(self, world_rank: int) -> int:
        return self.members.index(world_rank)

    def _median_step(self) -> float:
        """The running median step time (0 before any step)."""
        return statistics.median(self.step_times) if self.step_times else 0.0

    def _deadline(self) -> float:
        s = self.settings
        if s.deadline_factor > 0 and len(self.step_times) >= 5:
            return max(s.deadline_factor * self._median_step(), MIN_DEADLINE_S)
        return s.deadline_s

    def _say(self, text: str) -> None:
        """A rank's own note, for debugging rounds (MPIPIPE_DEBUG_ROUNDS=1); what users see
        is printed once, by the log writer, from the events (mpipipe.core.progress.event_line)."""
        if _DEBUG:
            print(f"mpipipe: rank {self.wrank}: {text}", file=self.out, flush=True)

    def _params(self, stage: int) -> list[nn.Parameter]:
        return list(self.pipe.partitions[stage].parameters())

    def _holders_of(self, stage: int) -> list[int]:
        """World ranks that hold a replica of ``stage``."""
        if self.settings.mode == "neighbour":
            # Every stage is held by the previous one (stage 0 by stage 1), as in Bamboo.
            if self.pipe.k < 2:
                return []
            return [self.route_w[stage - 1] if stage > 0 else self.route_w[1]]
        return list(self.backups_w.get(stage, []))

    def _wards_of(self, world_rank: int) -> list[int]:
        if self.settings.mode != "neighbour":
            return []
        return [k for k in range(self.pipe.k) if world_rank in self._holders_of(k)]

    def _rebind_pipe(self) -> None:
        """Point the pipeline at the current route, communicator and shadows."""
        hot = self.settings.mode == "hot"
        shadows = tuple((k, self._drank(b)) for k, bs in self.backups_w.items() for b in bs) \
            if hot else ()
        route = Route(tuple(self._drank(w) for w in self.route_w), self.gen, shadows)
        self.pipe.rebind(route, self.data)
        self.pipe.relay_grads = hot
        # Bits of one int64 say which micro-batches a rank holds (Have).
        self.pipe.resumable = hot and self.pipe.chunks <= 62
        self.wards = self._wards_of(self.wrank) if self.stage is not None else []
        if self.stage is not None and self.optimizer is None:
            self.optimizer = self.make_optimizer(self._params(self.stage))

    # -- fault notes -----------------------------------------------------------------
    def _fault_fired(self, fault: Fault, step: int, detail: Mapping[str, float]) -> None:
        now = time.time()
        if self.is_logger:
            self._log_event("fault_injected", step, self.wrank, fault=str(fault), at=now)
            if fault.kind in ("kill", "stall", "node-kill", "partition"):
                # The log passes to a survivor, which needs the fault's time for its
                # detected_after_s and recovery_s: every member hears it (logged: 1).
                for w in self.members:
                    if w != self.wrank:
                        self.control.send(_FAULT, self._drank(w), [now, step, self.wrank, 1],
                                          seq=self.wrank)
        else:
            self.control.send(_FAULT, self._drank(self.log_w), [now, step, self.wrank, 0],
                              seq=self.wrank)
        if fault.kind in ("kill", "node-kill", "partition"):
            time.sleep(0.01)  # let the note leave before the process dies (or the link goes)

    def _drain_fault_notes(self, new_writer: bool = False) -> None:
        """The log writer (or the rank about to become it) reads the fault notes."""
        if not (self.is_logger or new_writer):
            return
        for w in self.members:
            if w == self.wrank:
                continue
            msg = self.control.poll(_FAULT, self._drank(w), seq=w)
            while msg is not None:
                t, step = float(msg[0]), int(msg[1])
                spec = next((str(f) for f in self.settings.faults
                             if f.targets(stage=self._launch_stage(w), rank=w)
                             and (f.kind == "delay" or f.step == step)), "?")
                # A new writer skips older faults of the old one (a stall it survived).
                if not (new_writer and step < self.done - 1):
                    self.fault_notes[w] = (t, spec)
                    if len(msg) < 4 or not msg[3]:  # the old writer logged its own
                        self._log_event("fault_injected", step, w, fault=spec, at=t)
                msg = self.control.poll(_FAULT, self._drank(w), seq=w)

    def _rel(self, t_abs: float) -> float | None:
        """A wall-clock time as seconds since the log opened (the log's time column)."""
        if self.log is None or not self.log.active:
            return None
        return self.log.elapsed() - (time.time() - t_abs)

    def _launch_stage(self, w: int) -> int | None:
        role = self.plan.role_of(w)
        return role.index if role.kind == "stage" else None

    def _log_event(self, kind: str, step: int, rank: int, **detail: Any) -> None:
        self.events.append((kind, dict(detail, step=step, rank=rank)))
        if self.log is not None:
            t = detail.pop("at", None)
            self.log.event(kind, step=step, rank=rank, time=None if t is None else self._rel(t),
                           **detail)
            if self.progress is not None and self.log.active:  # once: by the log writer
                self.progress.event(kind, step=step, rank=rank, **detail)

    # -- the training loop -----------------------------------------------------------
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
                self._early[w] = msg  # the round reads it from here
                raise _RoundStarted(_Round("announced", -1, time.time()))
        if self._demoted():
            raise Demoted(self.gen + 1)

    # -- rejoining: a replaced rank comes back as a backup ----------------------------
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

    def _answer_rejoin(self, rnd: _Round, decision: Mapping[str, Any]) -> None:
        """Coordinator, after deciding a rejoin round: admit the rank, or send it away."""
        if rnd.reason != "rejoin":
            return
        if decision["admit"] == rnd.suspect:
            self.lobby.send(_ADMIT, rnd.suspect, decision["vector"])
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
        for w in range(self.world.Get_size()):
            if w != self.wrank:
                self.lobby.send(_REJOIN, w, [self.wrank, since])
        give_up = time.perf_counter() + REJOIN_WAIT_S
        while time.perf_counter() < give_up:
            if self.lobby.poll(_CLOSED, self.MPI.ANY_SOURCE) is not None:
                return False
            msg = self.lobby.poll(_ADMIT, self.MPI.ANY_SOURCE)
            if msg is not None:
                return self._admitted(read_decision(msg))
            time.sleep(0.005)
        return False

    def _admitted(self, d: Mapping[str, Any]) -> bool:
        """Join the new generation's communicators and take the replica of the assigned stage.

        False when the communicator could not be built (then the rank leaves)."""
        MPI = self.MPI
        group = self.lobby.comm.Get_group().Incl(d["members"])
        try:
            new = self.lobby.comm.Create_group(group, tag=100 + d["gen"] % 1000)
            new.Set_errhandler(MPI.ERRORS_RETURN)
            ctl = new.Dup()
            ctl.Set_errhandler(MPI.ERRORS_RETURN)
            ft.agree(new, 1)
        except MPI.Exception:
            return False  # a member died meanwhile: the survivors shrink without this rank
        finally:
            group.Free()
        k, P = d["admit_stage"], d["P"]
        self.data, self.control, self.members = new, _Control(ctl), list(d["members"])
        self.gen, self._gen_step = d["gen"], P
        self.log_w = d["log"]
        self.route_w = list(d["route"])
        self.backups_w = {j: list(bs) for j, bs in d["backups"].items()}
        self.stage, self.shadowing = None, k
        self.optimizer, self.snapshot, self.slots = None, None, []
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

    def _rollback_possible(self) -> bool:
        """A takeover can roll this stage back one step only if some stage has a replica."""
        return any(self._holders_of(k) for k in range(self.pipe.k))

    def _demoted(self) -> bool:
        """True if a round of this generation left this rank out (it was late)."""
        return any(self.control.poll(_DEMOTED, self._drank(w), seq=self.gen) is not None
                   for w in self.members if w != self.wrank)

    def _stage_step(self) -> None:
        s = self.done
        pipe, opt = self.pipe, self.optimizer
        assert self.stage is not None and opt is not None
        ta = time.perf_counter()
        self._poll_rejoin()
        self._drain_fault_notes()
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
            self.snapshot = _Slot(pack_state(self._params(self.stage), opt, self.optim,
                                             self.momentum), self.done)
        pipe.deadline = self._deadline()
        t0 = time.perf_counter()
        pipe.transport.reset_counters()
        loss = pipe.step(x if pipe.first else None,
                         y if (pipe.first or pipe.last) else None, self.loss_fn, step=s)
        factor = self.faults.slowdown(s)
        if factor > 1:
            time.sleep((factor - 1) * pipe.last_compute_s)
        set_rate_for_step(opt, self.cfg["optim"], s, self.total)
        opt.step()
        self.done = s + 1
        self._after_step = True
        self._replicate()
        self.step_times.append(time.perf_counter() - t0 - slept)
        if _DEBUG and self.gen and s <= self._gen_step + 1:
            self._say(f"step {s}: {time.perf_counter() - t0:.3f} s (compute "
                      f"{pipe.last_compute_s:.3f}, wait {pipe.last_wait_s:.3f})")
        self._report(s, self._step_figs(s, loss))
        if self._eval_point(self.done) or self.done == self.total:
            self._evaluate()
        every = int(self.cfg["run"].get("checkpoint_every", 0))
        if self.checkpoint_dir is not None and (
                self.done == self.total or (every and self.done % every == 0)):
            self._checkpoint()
        self._after_step = False

    def _checkpoint(self) -> None:
        """This stage writes its own file (atomically); no barrier, so no rank can hang on it."""
        from mpipipe.core import checkpoint

        assert self.stage is not None
        checkpoint.save_stage(self.checkpoint_dir, step=self.done, stage=self.stage,
                              balance=self.pipe.balance, module=self.pipe.partitions[self.stage],
                              optimizer=self.optimizer if isinstance(
                                  self.optimizer, torch.optim.Optimizer) else None,
                              eval_count=self.pipe.eval_count)
        if self.is_logger:
            self._log_event("checkpoint", self.done, self.wrank,
                            directory=str(self.checkpoint_dir))

    def _replicate(self) -> None:
        """Send this stage's replica to its holders every R steps (and take the ward's)."""
        assert self.stage is not None and self.optimizer is not None
        R = self.settings.replicate_every
        if self.done % R:
            return
        t = self.pipe.transport
        holders = self._holders_of(self.stage)
        if holders:
            flat = pack_state(self._params(self.stage), self.optimizer, self.optim, self.momentum)
            for h in holders:
                t.send(flat, self._drank(h), kind=REPLICA, step=self.done)
        for ward in self.wards:
            self._take_replica(self.route_w[ward], ward, self.done, t)
        t.flush(self._deadline())

    def _take_replica(self, source_w: int, stage: int, count: int, t: Any,
                      deadline: float | None = None) -> None:
        n = replica_numel(self._params(stage), self.optim, self.momentum)
        buf = torch.empty(n, dtype=torch.float32)
        t.recv(buf, self._drank(source_w), kind=REPLICA, step=count,
               deadline=self._deadline() if deadline is None else deadline)
        self._hold(_Slot(buf, count), stage)

    def _hold(self, slot: _Slot, stage: int) -> None:
        """Keep the two newest replicas of ``stage``."""
        if self.stage is not None:  # a neighbour holding its ward's replica
            held = self.ward_slots.get(stage, [])
            self.ward_slots[stage] = [s for s in held if s.count != slot.count][-1:] + [slot]
        else:
            self.slots = [s for s in self.slots if s.count != slot.count][-1:] + [slot]

    # -- per-step figures and the log ------------------------------------------------
    def _report(self, s: int, figs: list[float]) -> None:
        self._keep_figs(figs)
        if not self.is_logger:
            self.control.send(_FIGS, self._drank(self.log_w), figs, seq=s)
            return
        row = self.pending_rows.get(s) or _Row(s, figs[1], figs[2], self.batch_size)
        row.ranks[self.wrank] = self._fig_dict(figs)
        self.pending_rows[s] = row
        # Rows are written one step late: a step can only be rolled back while it is the
        # newest, so a written row is never undone and samples are never counted twice.
        for old in sorted(k for k in self.pending_rows if k < s):
            self._write_row(old)
        self._close_open_events(figs[1])

    def _step_figs(self, s: int, loss: float | None) -> list[float]:
        """Step ``s``'s figures as they travel: step, time, loss, compute_s, wait_s, bytes
        sent and received, world rank, control bytes sent since the last step's figures."""
        t = self.pipe.transport
        return [s, time.time(), math.nan if loss is None else loss, self.pipe.last_compute_s,
                t.wait_s, t.total_sent, t.total_recv, self.wrank, self.control.take_sent()]

    def _keep_figs(self, figs: list[float]) -> None:
        # a replayed step's figures replace those of its rolled-back run
        while self.recent_figs and int(self.recent_figs[-1][0]) >= int(figs[0]):
            self.recent_figs.pop()
        self.recent_figs.append(figs)

    @staticmethod
    def _fig_dict(figs: Sequence[float]) -> dict[str, float]:
        return {"compute_s": float(figs[3]), "wait_s": float(figs[4]),
                "bytes_sent": int(figs[5]), "bytes_recv": int(figs[6]),
                "ctrl_bytes_sent": int(figs[8])}

    def _collect_figs(self, s: int, wait_s: float, alive: Sequence[int] | None = None) -> None:
        row = self.pending_rows[s]
        rebuilt = self._rebuilt.get(s)  # a new writer's row of a step before its round
        if s < self._gen_step and rebuilt is None:
            return  # collected before the route changed (figures travel per generation)
        # Figures of a rank that has just died may still be waiting: take them, but do
        # not wait for them (``alive``: the ranks worth waiting for).
        want = rebuilt if rebuilt is not None else [w for w in self.route_w if w != self.wrank]
        end = time.perf_counter() + wait_s
        while True:
            for w in want:
                if w in row.ranks or w not in self.members:
                    continue
                msg = self.control.poll(_FIGS, self._drank(w), seq=s)
                if msg is not None:
                    row.ranks[w] = self._fig_dict(msg)
                    if not math.isnan(msg[2]):
                        row.loss = float(msg[2])
                    row.time = max(row.time, float(msg[1]))
            if all(w in row.ranks for w in want
                   if w in self.members and (alive is None or w in alive)) or \
                    time.perf_counter() > end:
                return
            time.sleep(0.0005)

    def _write_row(self, s: int) -> None:
        self._collect_figs(s, 0.5)
        row = self.pending_rows.pop(s)
        self._rebuilt.pop(s, None)
        prev, self._last_row_time = self._last_row_time, row.time
        dt = row.time - prev if prev is not None else (
            statistics.median(self.step_times) if self.step_times else math.nan)
        rate = row.samples / dt if dt > 0 else math.nan
        self.last_loss = row.loss
        at = self._rel(row.time)
        if self.log is not None:
            self.log.step(s + 1, time=at, loss=row.loss, samples=row.samples,
                          samples_per_s=rate, ranks=row.ranks)
        if self.progress is not None:
            self.progress.update(s + 1, loss=row.loss, samples=row.samples, time=at)

    def _close_open_events(self, t_done: float) -> None:
        for ev in self.open_events:
            rec = t_done - ev["t0"]
            self._log_event(ev["kind"] + "_recovered", ev["step"], ev["rank"],
                            recovery_s=rec, detected_after_s=ev["detected_after_s"],
                            stage=ev["stage"], generation=ev["generation"])
        self.open_events = []

    def _evaluate(self) -> None:
        if self.evaluate_fn is None:
            return
        self.pipe.deadline = max(self.settings.deadline_s, self._deadline())
        # Every stage starts an evaluation with the same sequence number, even after a
        # replay made some of them evaluate at this step once before.
        self.pipe.eval_count = (self.done * 64) % 4096
        result = self.evaluate_fn(self.pipe)
        if result is not None:
            correct, count = result
            acc = correct / max(count, 1)
            if self.is_logger:
                self._log_eval(self.done, acc)
            else:
                self.control.send(_EVAL, self._drank(self.log_w),
                                  [self.done, acc, time.time()], seq=self.done)
        if self.is_logger and result is None:
            msg = None
            src = self._drank(self.route_w[-1])
            end = time.perf_counter() + 5.0
            while msg is None and time.perf_counter() < end:
                msg = self.control.poll(_EVAL, src, seq=self.done)
                if msg is None:
                    time.sleep(0.0005)
            if msg is not None:
                self._log_eval(int(msg[0]), float(msg[1]), float(msg[2]))

    def _log_eval(self, step: int, acc: float, at: float | None = None) -> None:
        self.last_eval = acc
        if self.log is not None and self.log.active:
            self.log.eval(step, time=self._rel(at or time.time()), accuracy=acc)
            if self.progress is not None:
                self.progress.evaluation(step, acc)

    def _log_cost_model(self) -> None:
        try:
            shapes, in_bytes = stage_shapes(self.pipe.partitions, self.in_shape, self.optim,
                                            self.momentum)
        except Exception:  # noqa: BLE001 - shapes unknown: the log just lacks the prediction
            return
        s = self.settings
        label = 8 if self.pipe.labels == "travel" and self.pipe.k > 1 else 0
        protected = dict.fromkeys(range(self.pipe.k), 1) if s.mode == "neighbour" \
            else dict(s.backups)
        c = predict(shapes, batch_size=self.batch_size, backups=protected,
                    replicate_every=s.replicate_every, mode=s.mode, label_bytes=label,
                    input_bytes=in_bytes)
        self._log_event("cost_model", 0, -1, bytes_per_step=c.total, plain=c.plain,
                        replica=c.replica, shadow=c.shadow, lost_updates=c.lost_updates,
                        mode=s.mode, replicate_every=s.replicate_every)

    def _finish(self) -> None:
        """Tell backups the run is over; write the last row."""
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

    # -- backups ---------------------------------------------------------------------
    def _backup_wait(self, total: int) -> bool:
        """One poll of a backup: take replicas (cold) or mirror a step (hot). True when done."""
        k = self.shadowing
        assert k is not None
        stage_w = self.route_w[k]
        if self.control.poll(_END, self._drank(stage_w), seq=0) is not None:
            return True
        self.stopper.check(boundary=True)
        self._poll_rejoin()
        self._check_announcements()
        # A fault aimed at this backup (rank=R) fires once it knows the stage has begun
        # the step: at each replica (cold), or as it mirrors the step (hot; micro= fires
        # after the mirrored forward).
        while self._faults_at < min(self.done, total - 1):
            self._faults_at += 1
            self.faults.at_step(self._faults_at, by_rank=True)
        if self.settings.mode == "hot":
            self._mirror_step(k, stage_w)
            return False
        R = self.settings.replicate_every
        nxt = (self.done // R + 1) * R
        if nxt > total:
            nxt = total  # no replica comes after the last step
            time.sleep(_BACKUP_POLL_S)
            return False
        t = self.pipe.transport
        # Probe before receiving: a cancelled receive could lose a replica already matched.
        if self._probe(stage_w, t.tag(REPLICA, nxt)):
            self._take_replica(stage_w, k, nxt, t)
            self.done = nxt
        else:
            time.sleep(0.001)
        return False

    def _probe(self, source_w: int, tag: int) -> bool:
        """Is a data message from ``source_w`` waiting? A dead source raises PeerFailed."""
        src = self._drank(source_w)
        try:
            return bool(self.pipe.transport.comm.Iprobe(src, tag))
        except self.MPI.Exception as e:
            raise PeerFailed(src, ft.error_class(e)) from e

    def _mirror_step(self, k: int, stage_w: int) -> None:
        """Hot mode: run stage k's actions on the tensors it relays, then step.

        The stage relays its inputs and its output gradients (stages < K-1); the last
        stage's mirror reads y itself, so the mirror applies exactly the stage's update,
        in the same order. The pipeline keeps the step's progress, so that a takeover
        in the middle of it finishes the step where the mirror stands (no replay).
        """
        pipe, t = self.pipe, self.pipe.transport
        s = self.done
        params = self._params(k)
        self._start_mirror(k)
        assert self.optimizer is not None
        st = pipe.inflight
        if st is None or st.step != s or st.stage != k:
            # Wait (briefly, so END and announcements are seen) for the step's first
            # relayed tensor (every schedule starts with the forward of micro-batch 0).
            if not self._probe(stage_w, t.tag(SHADOW, s, 0)):
                time.sleep(0.0005)
                return
            self._mirror_snap = _Slot(pack_state(params, self.optimizer, self.optim,
                                                 self.momentum), s)
        pipe.deadline = self._deadline()
        pipe.boundary_shapes(self.in_shape)
        t.reset_counters()
        y = self.batch_of(s)[1] if k == pipe.k - 1 else None
        loss = pipe.step(None, y, self.loss_fn, step=s, mirror=(k, self._drank(stage_w)))
        set_rate_for_step(self.optimizer, self.cfg["optim"], s, self.total)
        self.optimizer.step()
        snap = self._mirror_snap
        self.snapshot = snap
        self.done = s + 1
        self.slots = [snap, _Slot(pack_state(params, self.optimizer, self.optim,
                                             self.momentum), self.done)]
        # Kept in case this mirror takes over before the stage's figures reach the log.
        self._keep_figs(self._step_figs(s, loss))
        if self.done % self.settings.replicate_every == 0:
            # The periodic replica guards the mirror against drift; it replaces the state.
            self._after_step = True
            self._take_replica(stage_w, k, self.done, t)
            unpack_state(self.slots[-1].flat, params, self.optimizer, self.optim, self.momentum,
                         self.done)
            self._after_step = False

    def _start_mirror(self, k: int) -> None:
        """A new mirror of stage k starts from the replica it holds (of step 0, or of a
        resumed run's checkpoint), optimizer state included."""
        if self.optimizer is not None and self._mirror_of == k:
            return
        params = self._params(k)
        self.optimizer = self.make_optimizer(params)
        self._mirror_of = k
        self.pipe.abandon()
        if self.slots:
            unpack_state(self.slots[-1].flat, params, self.optimizer, self.optim,
                         self.momentum, self.slots[-1].count)

    # -- rounds: detection, agreement, takeover ----------------------------------------
    def _state_vector(self, rnd: _Round) -> list[float]:
        kind = 0 if self.stage is not None else 1
        index = self.stage if self.stage is not None else (self.shadowing or 0)
        held = sorted(self.slots if self.stage is None else
                      next(iter(self.ward_slots.values()), []), key=lambda s: s.count)
        latest = held[-1].count if held else -1
        prev = held[-2].count if len(held) > 1 else -1
        dead = 0
        for w in ft.failed_ranks(self.data) if self.ulfm else []:
            dead |= 1 << self.members[w]
        if rnd.reason == "failed" and rnd.suspect >= 0:
            dead |= 1 << rnd.suspect
        last = self.pipe.last_state
        records_from = last.step if last is not None and last.step == self.done - 1 \
            else self.done  # the oldest step whose messages this rank can send again
        return [self.gen, self.wrank, kind, index, self.done, latest, prev,
                {v: k for k, v in _REASONS.items()}[rnd.reason], rnd.suspect, rnd.t_detect,
                float(dead), rnd.waited_s, float(self._after_step), records_from,
                float(self.pipe.resumable)]

    def _recover(self, rnd: _Round) -> None:
        """Run one round: announce, wait, decide (lowest live rank), apply the decision."""
        if self.ulfm:
            ft.revoke(self.data)  # wake every survivor blocked on the data communicator
        self.pipe.transport.discard()
        mine = self._state_vector(rnd)
        for w in self.members:
            if w != self.wrank:
                self.control.send(_ANNOUNCE, self._drank(w), mine, seq=self.gen)
        heard: dict[int, np.ndarray] = {self.wrank: np.asarray(mine)}
        heard.update((w, m) for w, m in self._early.items() if int(m[0]) == self.gen)
        self._early = {}
        dead = int(mine[10])
        start = time.perf_counter()
        # How long a round waits for silent ranks before it leaves them out: a deadline,
        # at least half a second, so that ranks that merely wait for a core (many ranks
        # on few cores) are not taken for stalled ones. A rank some survivor already
        # found late has had its deadline: it gets half a median step more to answer
        # (a slow rank that answers stays in; one that does not is replaced).
        grace = min(max(self._deadline(), 0.5), 5.0)
        quick = min(grace, max(self._median_step() / 2, QUICK_GRACE_S))
        decision = None
        while decision is None:
            self.stopper.check(boundary=False)  # a data error is no member's failure
            if self._demoted():
                raise Demoted(self.gen + 1)
            for w in self.members:
                if w == self.wrank or w in heard:
                    continue
                msg = self.control.poll(_ANNOUNCE, self._drank(w), seq=self.gen)
                if msg is not None and int(msg[0]) == self.gen:
                    heard[w] = msg
                    dead |= int(msg[10])
            if self.ulfm:
                for d in ft.failed_ranks(self.control.comm):
                    dead |= 1 << self.members[d]
            silent = [w for w in self.members if w not in heard and not (dead >> w) & 1]
            waited = time.perf_counter() - start
            coordinator = min(heard)
            late = {int(m[8]) for m in heard.values() if _REASONS[int(m[7])] == "late"}
            patience = round_patience(silent, late, len(self.members), grace, quick)
            if coordinator == self.wrank and (not silent or waited > patience):
                decision = self._decide(heard, dead, silent)
                for w in decision["members"]:
                    if w != self.wrank and w in self.members:
                        self.control.send(_DECISION, self._drank(w), decision["vector"],
                                          seq=self.gen)
                self._answer_rejoin(rnd, decision)
                for w in silent:
                    self.control.send(_DEMOTED, self._drank(w), [self.gen + 1], seq=self.gen)
                break
            for w in sorted(heard):
                if w == self.wrank:
                    continue
                msg = self.control.poll(_DECISION, self._drank(w), seq=self.gen)
                if msg is not None:
                    decision = read_decision(msg)
                    break
            if decision is None and waited > 8 * grace + 2.0:
                # The coordinator we expected went silent too: leave it out and go on.
                heard.pop(coordinator, None)
                if coordinator == self.wrank:
                    raise RuntimeError("round failed: no decision reached")
            pause(waited)
        if _DEBUG:
            self._say(f"round gen {self.gen}: {rnd.reason} suspect {rnd.suspect} -> "
                      f"members {decision['members']} route {decision['route']} P {decision['P']}")
        self._apply(decision, heard, rnd)

    def _decide(self, heard: Mapping[int, np.ndarray], dead: int,
                silent: Sequence[int]) -> dict[str, Any]:
        """The coordinator's verdict: members, new route, replay step P and replica choices."""
        members = sorted(heard)
        k_count = self.pipe.k
        lost: list[int] = [k for k in range(k_count) if self.route_w[k] not in heard]
        route = list(self.route_w)
        promoted: dict[int, int] = {}
        lost_stage, merge = -1, -1
        for k in lost:
            if self.settings.mode == "neighbour":
                holders = [h for h in self._holders_of(k) if h in heard]
                if holders and len(lost) == 1:
                    merge = k
                    continue
                lost_stage = k
                break
            cands = [b for b in self.backups_w.get(k, []) if b in heard]
            if not cands:
                lost_stage = k
                break
            promoted[k] = cands[0]
            route[k] = cands[0]
        stage_done = [int(heard[w][4]) for w in members if int(heard[w][2]) == 0]
        floor = min(stage_done) if stage_done else 0
        P = floor
        holders_now = dict(promoted)
        if merge >= 0:
            holders_now[merge] = [h for h in self._holders_of(merge) if h in heard][0]
        for b in holders_now.values():
            have = {int(heard[b][5]), int(heard[b][6])}
            if floor not in have and floor - 1 in have:
                P = floor - 1
        choices = {}
        for k, b in holders_now.items():
            have = sorted(c for c in (int(heard[b][5]), int(heard[b][6])) if 0 <= c <= P)
            choices[k] = P if P in have else (have[-1] if have else 0)
        shrink = 1 if any((dead >> w) & 1 for w in self.members if w not in heard) and \
            not any(not (dead >> w) & 1 for w in silent) else 0
        first = min((heard[w] for w in members if int(heard[w][7]) in (1, 2)),
                    key=lambda v: v[9], default=heard[members[0]])
        if merge >= 0:
            route = [w for i, w in enumerate(route) if i != merge]
        backups = {k: [b for b in self.backups_w.get(k, []) if b in heard and b not in route]
                   for k in range(len(route))}
        reason = _REASONS.get(int(first[7]), "late")
        admit, admit_stage = -1, -1
        if reason == "rejoin" and not lost and merge < 0 and not shrink \
                and not silent and int(first[8]) not in heard:
            # The replaced rank comes back as a backup of the stage furthest below its
            # configured number of backups (then: the fewest, the rank's own stage).
            admit = int(first[8])
            own = self.plan.role_of(admit).index
            admit_stage = min(range(len(route)), key=lambda k: (
                len(backups[k]) - self.settings.backups.get(k, 0), len(backups[k]), k != own, k))
            backups[admit_stage].append(admit)
            members = sorted([*members, admit])
        # The log's writer stays unless it left; then the lowest surviving stage writes it
        # (a stage before this round: it has its own figures of the steps before P, and
        # reports every step after).
        log_w = self.log_w if self.log_w in members else \
            min([w for w in self.route_w if w in members]
                or [w for w in route if w in members] or members)
        go_on = promoted and lost_stage < 0 and merge < 0 and admit < 0 and \
            self._can_go_on(heard, route, backups, promoted)
        if go_on:
            P = min(int(heard[w][4]) for w in route)
            choices = {k: P for k in promoted}
        return read_decision(encode_decision({
            "gen": self.gen + 1, "P": P, "go_on": int(bool(go_on)), "lost_stage": lost_stage, "merge": merge,
            "shrink": shrink, "reason": reason,
            "suspect": int(first[8]), "t_detect": float(first[9]), "waited_s": float(first[11]),
            "members": members, "route": route, "choices": choices, "silent": list(silent),
            "admit": admit, "admit_stage": admit_stage, "backups": backups, "log": log_w}))

    def _can_go_on(self, heard: Mapping[int, np.ndarray], route: Sequence[int],
                   backups: Mapping[int, Sequence[int]], promoted: Mapping[int, int]) -> bool:
        """Can the survivors finish the interrupted step where they stand (hot mode)?

        Yes when every promoted backup is a hot mirror of its stage; every rank keeps
        the messages of each step a consumer of it may still lack (it holds the steps
        from ``records_from``); the ranks are at most one step apart; no rank is
        between applying an update and finishing that step's replica, figures,
        evaluation and checkpoint (``_after_step``), and no evaluation would be met
        by some ranks only; and every rank can resume. Otherwise the round replays a step.
        """
        if self.settings.mode != "hot":
            return False
        ranks = [*route, *(b for bs in backups.values() for b in bs)]
        if any(len(heard[w]) < 15 or not heard[w][14] or heard[w][12] for w in ranks):
            return False
        if any(int(heard[b][2]) != 1 or int(heard[b][3]) != k for k, b in promoted.items()):
            return False
        # Another mirror of a promoted stage must stand where the promoted one does: the
        # new stage's next replica would otherwise go to a mirror that took it already.
        if any(int(heard[o][4]) != int(heard[b][4]) for k, b in promoted.items()
               for o in backups.get(k, [])):
            return False
        for j, w in enumerate(route):
            consumers = stage_consumers(j, route, backups.get(j, []), self.pipe.labels)
            if any(int(heard[c][4]) < int(heard[w][13]) for c in consumers):
                return False
        steps = [int(heard[w][4]) for w in route]
        if max(steps) - min(steps) > 1:  # the log rebuilds the rows of the steps from P on
            return False
        return not any(self._eval_point(s) for s in range(min(steps) + 1, max(steps) + 1))

    def _eval_point(self, done: int) -> bool:
        """Is an evaluation due once ``done`` steps are applied?"""
        return self.evaluate_fn is not None and (
            done == self.total or bool(self.eval_every and done % self.eval_every == 0))

    def _apply(self, d: Mapping[str, Any], heard: Mapping[int, np.ndarray], rnd: _Round) -> None:
        """Build the new communicators, then adopt the route, roles and state of step P."""
        MPI = self.MPI
        old_data, old_ctl = self.data, self.control.comm
        gone = [w for w in self.members if w not in d["members"]]
        new = None
        shrunk = bool(d["shrink"])  # the ranks a shrink leaves out had failed
        # An admitted rank is not on this generation's communicator: build from the lobby.
        parent = made_from = self.lobby.comm if d["admit"] >= 0 else old_ctl
        if not d["shrink"]:
            group = parent.Get_group().Incl([w if d["admit"] >= 0 else self._drank(w)
                                             for w in d["members"]])
            try:
                new = parent.Create_group(group, tag=100 + d["gen"] % 1000)
                new.Set_errhandler(MPI.ERRORS_RETURN)
            except MPI.Exception as e:
                # A left-out rank was dead after all: ULFM refuses; every member gets the
                # same error and shrinks instead.
                if not (self.ulfm and ft.is_proc_failed(e)):
                    raise
            group.Free()
        if new is None:
            new, made_from = ft.shrink(old_ctl), old_ctl
            shrunk = True
        ctl = new.Dup()
        ctl.Set_errhandler(MPI.ERRORS_RETURN)
        old_group = made_from.Get_group()
        translated = new.Get_group().Translate_ranks(list(range(new.Get_size())), old_group)
        members_new = translated if made_from is self.lobby.comm else \
            [self.members[i] for i in translated]
        old_group.Free()
        if d["admit"] >= 0 and made_from is old_ctl:
            # Building from the lobby failed (a member died): shrink has left the admitted
            # rank out, which then leaves; this round goes on without it.
            d = dict(d, members=[w for w in d["members"] if w != d["admit"]], admit=-1,
                     backups={k: [b for b in bs if b != d["admit"]]
                              for k, bs in d["backups"].items()})
        if sorted(members_new) != sorted(d["members"]):
            raise RuntimeError(f"round disagreement: communicator has {members_new}, decision "
                               f"says {d['members']}")
        if self.ulfm:
            ft.agree(new, 1)
        t_comm = time.time()
        del old_data  # never freed: a demoted rank may still post to it
        if self.wrank == d["log"]:
            # Fault notes and figures of steps before the round travel on the old control
            # communicator: read them before leaving it.
            self._drain_fault_notes(new_writer=d["log"] != self.log_w)
            for s in sorted(self.pending_rows):
                self._collect_figs(s, 0.2, alive=d["members"])
        self.data, self.control, self.members = new, _Control(ctl), members_new
        self.gen = d["gen"]
        P = d["P"]
        self._gen_step = P
        self._move_log(d, P, old_writer_dead=shrunk)
        stage_before = {k: w for k, w in enumerate(self.route_w)}
        if d["lost_stage"] >= 0:
            k = d["lost_stage"]
            self._log_event("stage_lost", P, stage_before[k], stage=k, reason=d["reason"])
            self._flush_rows_until(P)
            raise StageLost(k, stage_before[k], "failed" if d["reason"] == "failed"
                            else "stopped responding", had=len(self.plan.ranks_of("backup", k)))
        go_on = bool(d["go_on"])
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
            assert self.optimizer is not None
            unpack_state(snap.flat, self._params(self.stage), self.optimizer,
                         self.optim, self.momentum, P)
            self.done = P
        if d["merge"] >= 0:
            self._merge(d, P)
        for k, w in enumerate(d["route"]):
            if d["merge"] < 0 and w == self.wrank and self.stage != k:
                if go_on:
                    self._promote_mirror(k)
                else:
                    self._promote(k, d["choices"][k], P)
        lost_stages = [k for k, w in stage_before.items() if w not in d["members"]]
        backups_before = self.backups_w
        self.route_w = list(d["route"])
        self.backups_w = {k: list(bs) for k, bs in d["backups"].items()}
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
        detected_after = d["t_detect"] - t_fault if not math.isnan(t_fault) else d["waited_s"]
        if self.is_logger:
            kind = "failure_detected" if d["reason"] == "failed" or d["shrink"] else "late"
            for w in gone:
                backup_of = next((k for k, bs in backups_before.items() if w in bs), -1)
                self._log_event(kind, P, w, detected_after_s=detected_after,
                                how="ulfm" if d["shrink"] else "deadline",
                                stage=next((k for k, x in stage_before.items() if x == w), -1),
                                backup_of=backup_of)
                if backup_of >= 0 and self.progress is not None:
                    left = len(self.backups_w.get(backup_of, []))
                    self.progress.message(f"backup rank {w} of stage {backup_of} lost "
                                          f"({kind}); stage {backup_of} has {left} "
                                          f"backup{'' if left == 1 else 's'} left")
            for k in lost_stages:
                w_new = self.route_w[k] if d["merge"] < 0 else self.route_w[max(k - 1, 0)]
                ev = {"kind": "takeover", "step": P, "rank": w_new, "stage": k,
                      "generation": self.gen, "detected_after_s": detected_after,
                      "t0": t_fault if not math.isnan(t_fault) else d["t_detect"]}
                self._log_event("takeover", P, w_new, stage=k, replaced=stage_before[k],
                                generation=self.gen, replay_step=-1 if go_on else P + 1,
                                lost_updates=P - d["choices"].get(k, P),
                                detected_after_s=detected_after,
                                agreement_s=t_comm - d["t_detect"], mode=self.settings.mode)
                self.open_events.append(ev)
        self.takeovers += len(lost_stages)
        if d["admit"] >= 0 and self.is_logger:
            self._log_event("rejoined", P, d["admit"], stage=d["admit_stage"],
                            generation=self.gen, after_s=t_comm - d["waited_s"])
        if go_on:
            self._go_on()
        else:
            self._resync(P)
        if _DEBUG:
            self._say(f"applied at {time.time() % 100:.3f}")

    def _move_log(self, d: Mapping[str, Any], P: int, old_writer_dead: bool) -> None:
        """Hand the log to the writer the round named, if it changed.

        The rows of the steps before P that the old writer had not written are
        rebuilt by the new one: every stage of the old route sends it its figures of
        those steps again (the loss comes from the last stage's). Rows the old writer
        did write are kept once (RunLog.take_over). The new writer opens the file only
        once the old one is dead (``old_writer_dead``: the round shrank it away) or has
        let go.
        """
        old, self.log_w = self.log_w, d["log"]
        if self.log_w == old:
            return
        senders = [w for w in self.route_w if w in self.members and w != self.log_w]
        if self.log_w != self.wrank:
            if self.wrank in senders:
                self._figs_again(lambda s: s < P)
            return
        if self.log is not None:
            def let_go() -> bool:  # asked until it says yes (RunLog keeps the answer)
                # Replaced alive: it says so once it closed the file. Found late but in
                # fact dead (a deadline fired before ULFM reported it): ULFM knows later.
                return self.lobby.poll(_RELEASED, old, seq=d["gen"]) is not None or \
                    (self.ulfm and old in ft.failed_ranks(self.lobby.comm))

            try:
                self.log.take_over(None if old_writer_dead else let_go)
            except LogError as e:  # the file was replaced or lost: train on, and say so
                print(f"mpipipe train: error: rank {self.wrank} cannot take the run log over: "
                      f"{e}; training goes on without a log", file=sys.stderr, flush=True)
        if self.progress is not None:
            self.progress.enabled = True
        self.pending_rows, self._rebuilt = {}, {}
        for s in self._figs_again(lambda s: s < P):
            self._rebuilt[s] = senders
        self._log_event("log_writer_moved", P, self.wrank, previous=old,
                        why="the previous writer left the job (failed or replaced)")

    def _leave_log(self, generation: int) -> None:
        """A writer replaced at ``generation`` lets go of the file and tells the job (the
        new writer waits for that: HDF5's own lock may be off)."""
        if self.log is None or not self.log.active:
            return
        self.log.release()
        for w in range(self.world.Get_size()):
            if w != self.wrank:
                self.lobby.send(_RELEASED, w, [generation], seq=generation)
        self.lobby.drain(1.0)
        if self.progress is not None:
            self.progress.enabled = False

    def _flush_rows_until(self, P: int) -> None:
        if self.is_logger:
            for s in sorted(self.pending_rows):
                if s < P:
                    self._write_row(s)

    def _promote(self, k: int, count: int, P: int) -> None:
        """This backup now serves stage k from its replica of step ``count``."""
        slot = next((s for s in self.slots if s.count == count), None)
        params = self._params(k)
        if self.optimizer is None or self._mirror_of != k:
            self.optimizer = self.make_optimizer(params)
        if slot is None:
            raise RuntimeError(f"backup of stage {k} lacks the replica of step {count}")
        unpack_state(slot.flat, params, self.optimizer, self.optim, self.momentum, count)
        self.stage, self.shadowing = k, None
        self.done = P
        self.slots = []
        self.snapshot = self.prev_snapshot = None
        self._say(f"took over stage {k} at step {P + 1} (replica of step {count})")

    def _promote_mirror(self, k: int) -> None:
        """This hot mirror now serves stage k from where it stands, its step in flight too."""
        self._start_mirror(k)  # a backup that has not mirrored a step yet starts now
        self.stage, self.shadowing = k, None
        self.slots = []
        self.snapshot = self.prev_snapshot = None
        self._say(f"took over stage {k} in step {self.done + 1} (hot, no replay)")

    def _go_on(self) -> None:
        """After a round that keeps the step in flight: each rank tells the ranks it takes
        messages from what it holds, then sends its own consumers what they lack."""
        pipe, t = self.pipe, self.pipe.transport
        deadline = max(self.settings.deadline_s, 1.0)
        source = None if self.shadowing is None or self.stage is not None \
            else self._drank(self.route_w[self.shadowing])
        mine = pipe.have(self.done).encode()
        for r in pipe.suppliers(source):
            t.send(mine, r, kind=CTRL, step=0)
        theirs = {r: Have.decode(t.recv(torch.empty(4, dtype=torch.int64), r, kind=CTRL,
                                        step=0, deadline=deadline))
                  for r in pipe.consumers()}
        sent = pipe.resume(theirs)
        if _DEBUG:
            self._say(f"go on at step {self.done}: holds {pipe.have(self.done)}, "
                      f"resent {sent} messages")

    def _figs_again(self, wanted: Callable[[int], bool]) -> list[int]:
        """This rank's kept figures of the ``wanted`` steps go to the writer again; the
        writer starts those rows from its own. Returns the steps of the rows started."""
        mine = [f for f in self.recent_figs if wanted(int(f[0]))]
        if not self.is_logger:
            for figs in mine:
                self.control.send(_FIGS, self._drank(self.log_w), figs, seq=int(figs[0]))
            return []
        for figs in mine:
            row = _Row(int(figs[0]), figs[1], figs[2], self.batch_size)
            row.ranks[self.wrank] = self._fig_dict(figs)
            self.pending_rows[row.step] = row
        return [int(f[0]) for f in mine]

    def _merge(self, d: Mapping[str, Any], P: int) -> None:
        """Neighbour takeover: the pipeline loses stage k, whose layers join its holder's.

        Every survivor rebuilds the pipeline with one stage fewer (the module's layers
        are shared, so optimizers keep their parameters); the holder loads its replica
        of stage k into those layers and gets one optimizer over both slices.
        """
        k = d["merge"]
        old = self.pipe
        into = k - 1 if k > 0 else 0  # index of the merged stage in the new pipeline
        balance = list(old.balance)
        if k > 0:
            balance[k - 1:k + 1] = [balance[k - 1] + balance[k]]
        else:
            balance[0:2] = [balance[0] + balance[1]]
        route = Route(tuple(self.members.index(w) for w in d["route"]), d["gen"])
        new = Pipeline(old.module, balance, old.chunks, old.schedule, self.data, route,
                       in_shape=self.in_shape, labels=old.labels, deadline=old.deadline,
                       label_dtype=old.label_dtype)
        new.after_forward = old.after_forward
        holder = self.route_w[k - 1] if k > 0 else self.route_w[1]
        if self.wrank == holder:
            count = d["choices"][k]
            slot = next((s for s in self.ward_slots.get(k, []) if s.count == count), None)
            if slot is None:
                raise RuntimeError(f"neighbour of stage {k} lacks its replica of step {count}")
            own = self._params(self.stage) if self.stage is not None else []
            ward = self._params(k)
            merged = self.make_optimizer(new.partitions[into].parameters())
            old_opt = self.optimizer
            if old_opt is not None:
                for p in own:
                    if p in old_opt.state:
                        merged.state[p] = old_opt.state[p]
            unpack_state(slot.flat, ward, merged, self.optim, self.momentum, count)
            self.optimizer = merged
            self._say(f"took over stage {k} into its own (replica of step {count})")
        self.pipe = new
        self.stage = d["route"].index(self.wrank) if self.wrank in d["route"] else None
        self.snapshot = self.prev_snapshot = None
        self.ward_slots = {}

    def _resync(self, P: int) -> None:
        """After a takeover every stage refreshes its backups, so all replicas are of step P."""
        t = self.pipe.transport
        deadline = max(self.settings.deadline_s, 1.0)
        if self.stage is not None:
            assert self.optimizer is not None
            holders = self._holders_of(self.stage)
            if holders:
                flat = pack_state(self._params(self.stage), self.optimizer, self.optim,
                                  self.momentum)
                for h in holders:
                    t.send(flat, self._drank(h), kind=REPLICA, step=P, micro=1)
            for ward in self.wards:
                self._take_resync(self.route_w[ward], ward, P, t, deadline)
            t.flush(deadline)
        elif self.shadowing is not None:
            self._take_resync(self.route_w[self.shadowing], self.shadowing, P, t, deadline)
            if self.settings.mode == "hot":
                params = self._params(self.shadowing)
                if self.optimizer is None or self._mirror_of != self.shadowing:
                    self.optimizer = self.make_optimizer(params)
                    self._mirror_of = self.shadowing
                unpack_state(self.slots[-1].flat, params, self.optimizer, self.optim,
                             self.momentum, P)
            self.done = P

    def _take_resync(self, source_w: int, stage: int, P: int, t: Any, deadline: float) -> None:
        n = replica_numel(self._params(stage), self.optim, self.momentum)
        buf = torch.empty(n, dtype=torch.float32)
        t.recv(buf, self._drank(source_w), kind=REPLICA, step=P, micro=1, deadline=deadline)
        if self.stage is not None:
            self.ward_slots[stage] = [_Slot(buf, P)]
        else:
            self.slots = [_Slot(buf, P)]


class _RoundStarted(Exception):
    """Another rank started a round; this one joins it."""

    def __init__(self, rnd: _Round) -> None:
        super().__init__(rnd.reason)
        self.round = rnd


# -- glue for the training command -------------------------------------------------------------

class BatchCache:
    """``batch_of(step)`` over a sequential reader: keeps the last few batches for replays.

    Why copies: the reader reuses its output buffers, and a replay after a takeover
    re-reads the mini-batch of a step the reader has already moved past.
    """

    def __init__(self, next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                 keep: int = 3, first_step: int = 0,
                 seek: Callable[[int], None] | None = None) -> None:
        self.next_batch = next_batch
        self.keep = keep
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.next_step = first_step
        self.seek = seek

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step in self.cache:
            return self.cache[step]
        if step < self.next_step:
            raise RuntimeError(f"step {step} is older than the {self.keep} batches kept")
        if self.seek is not None and step - self.next_step >= self.keep:
            # Far behind (a backup that just took over): jump instead of reading every
            # batch in between, and read the last `keep` so that replays still find them.
            self.cache.clear()
            self.next_step = step - self.keep + 1
            self.seek(self.next_step)
        while self.next_step <= step:
            x, y = self.next_batch()
            self.cache[self.next_step] = (x.clone(), y.clone())
            self.next_step += 1
        for old in [s for s in self.cache if s < step - self.keep + 1]:
            del self.cache[old]
        return self.cache[step]


class _NoParams:
    """The optimizer of a stage without parameters (only ReLU or pooling layers)."""

    state: dict = {}

    def step(self) -> None:
        return None


def _eval_fn(cfg: Mapping[str, Any], eval_batches: int
             ) -> Callable[[Pipeline], tuple[int, int] | None]:
    """A forward-only pass over the test split; (correct, count) on the last stage."""
    from mpipipe.core import data

    path, bs = cfg["data"]["path"], cfg["data"]["batch_size"]

    def evaluate(pipe: Pipeline) -> tuple[int, int] | None:
        correct = count = 0
        result = None
        if pipe.first:
            batches: Iterable[tuple[Any, Any]] = data.test_batches(path, bs)
        else:
            batches = ((None, None) for _ in range(eval_batches))
        for x, y in batches:
            r = pipe.evaluate(x, y if (pipe.first or pipe.last) else None)
            if r is not None:
                correct, count = correct + r[0], count + r[1]
                result = (correct, count)
        return result

    return evaluate


def _close_log(run: Any, status: str) -> bool:
    """Close the log if this rank writes it; False (and one error line) if it could not,
    or if it holds less than it should (the status written is then ``incomplete: ...``)."""
    try:
        return run.log.close(status) == status
    except LogError as e:
        print(f"{run.prog}: error: {e}", file=sys.stderr, flush=True)
        return False


def train(run: Any) -> int:
    """`python -m mpipipe train` with ResPipe: the resilient loop on every rank; exit status.

    Builds the same model, pipeline and data as the plain loop (mpipipe.pipeline.train.setup),
    then hands the steps to :class:`ResPipe`. A stage lost with no backup stops every
    survivor with one error line naming the stage (exit 2) and a closed, readable log.
    """
    from mpipipe.core import checkpoint, data, stop
    from mpipipe.pipeline import train as plain

    s = plain.setup(run, Pipeline)
    cfg, log, progress = run.cfg, run.log, run.progress
    try:
        Settings.from_config(cfg, s.pipe.k, s.pipe.chunks)
    except ValueError as e:
        run.fail(e)
    if run.rank == 0:
        print(f"{run.prog}: {ft.startup_note()}", flush=True)  # even under --quiet
    reader: list[Any] = []

    def open_reader() -> Any:
        # Opened on first use: only the ranks that read data ever open it.
        if not reader:
            reader.append(data.TrainBatches(cfg["data"]["path"], cfg["data"]["batch_size"],
                                            seed=cfg["run"]["seed"],
                                            shuffle=cfg["data"]["shuffle"],
                                            drop_last=cfg["data"]["drop_last"],
                                            num_classes=cfg["model"]["num_classes"]))
        return reader[0]

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        return open_reader().next()

    def seek(step: int) -> None:
        open_reader().seek_batch(step)

    def make_opt(params: Iterable[nn.Parameter]) -> Any:
        return plain.make_optimizer(cfg, list(params)) or _NoParams()

    resume = None
    if run.args.resume:
        directory = run.args.resume
        resume = (s.start_step, lambda k: checkpoint.load_stage(directory, k))
    error = None
    try:
        rp = ResPipe(cfg=cfg, plan=run.plan, pipe=s.pipe, make_optimizer=make_opt,
                     loss_fn=s.loss_fn, batch_of=BatchCache(next_batch, seek=seek),
                     evaluate=_eval_fn(cfg, s.eval_batches), log=log,
                     progress=progress, comm=run.comm,
                     in_shape=s.in_shape, checkpoint_dir=s.checkpoint_dir, resume=resume)
    except checkpoint.CheckpointError as e:  # a backup's (a stage's failed in setup)
        error = str(e)
    plain.agree(run, error)
    try:
        result = rp.train(s.total_steps, cfg["run"]["eval_every"])
    except StageLost as e:
        _close_log(run, f"failed: {e}")
        if rp.members and rp.wrank == rp.members[0]:
            print(f"{run.prog}: error: {e}", file=sys.stderr, flush=True)
            rp.close_lobby()  # a replaced rank waiting to rejoin leaves too
        try:
            rp.data.Barrier()  # the log is closed before any survivor exits
        except Exception:  # noqa: BLE001 - a further failure: exit anyway
            pass
        # Leave without MPI_Finalize: under ULFM it runs an agreement over the world,
        # which we saw hang now and then with a dead rank in it. The log and the
        # checkpoints are closed files by now; mpirun reports the exit status.
        stop.flush_and_exit(2)
    except StopRun as e:  # a data error or a stop signal: every rank leaves, none takes over
        if rp.is_logger:
            stop.announce(run.prog, e, checkpoint_dir=s.checkpoint_dir
                          if e.kind == "signal" else None)
            _close_log(run, e.status)
        stop.all_reach(rp.data, 30.0)  # the writer's line and log before anyone's exit
        stop.flush_and_exit(e.exit_code)
    except Demoted as e:
        print(f"{run.prog}: rank {run.rank} was late and has been replaced ({e}); it leaves "
              f"the job without sending anything", file=sys.stderr, flush=True)
        # (a replaced log writer let go of the log: a survivor writes it now)
        # Leave without MPI_Finalize, whose world-wide agreement would wait for ranks
        # that have moved on (or, after a lost stage, exited with an error).
        stop.flush_and_exit(0)
    code = 0
    if log.active:
        summary = {
            "steps": result["steps"],
            # the file's rows: a writer that took over has not seen the first ones itself
            # (its own rows only if the file is not open yet: the old writer holds it)
            "samples_per_s": log.throughput() if len(log.written("time")) else progress.samples_per_s,
            "final_loss": result["loss"],
            "test_accuracy": result["accuracy"],
            "takeovers": result["takeovers"],
            "log": str(log.path),
        }
        log.set_attr("summary", summary)
        progress.summary(**summary)  # printed under --quiet too
        code = 0 if _close_log(run, "completed") else 1
    if result["takeovers"] or result["generation"]:
        # A replaced rank leaves without MPI_Finalize (see Demoted above), and a killed
        # one never reaches it; the world-wide agreement inside Finalize was seen to wait
        # for such a rank now and then. Everything is written and closed: leave as well.
        stop.flush_and_exit(code)
    return code
