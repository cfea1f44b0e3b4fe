"""One data-parallel step of a Stannis rank: forward and backward on its local batch, the
batch-weighted gradient allreduce, and the optimizer step that every rank then takes alike.

The rank's model, optimizer, loss and rate schedule live here, with the exchange that
keeps them equal on every rank (:class:`~stannis.allreduce.WeightedAllreduce`, the
buffers' average, the host's state after a start or a recovery).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from mpipipe.core.mpi import stop
from mpipipe.core.run.batches import DataFault
from mpipipe.core.run.lr import decay
from mpipipe.core.state.stagestate import StageState

from .allreduce import BufferAverage, WeightedAllreduce, broadcast_state
from .device import Device
from .hypertune import scaled_lr
from .members import Members


class DataParallelStep:
    """This rank's model and the steps that train it with the others'.

    ``state``: the rank's model, optimizer and optimizer steps applied (``done``: the
    host's, shared in :meth:`sync_from_host` and after a recovery in :meth:`rejoin`).
    """

    def __init__(self, members: Members, state: StageState, loss_fn: Any, schedule: Any,
                 device: Device, cfg: dict) -> None:
        self.members = members
        self.state, self.loss_fn, self.schedule = state, loss_fn, schedule
        model = state.module
        self.stream, self.stretch, self.turns = device.stream, device.stretch, device.turns
        self.optim = cfg["optim"]
        s = cfg["stannis"]
        averaged = None if s["local_buffers"] else BufferAverage(members.comm, model)
        self.buffers = averaged if averaged is not None and averaged.nbytes else None
        self.reducer = WeightedAllreduce(members.comm, model.parameters(),
                                         s["bucket_bytes"], exchange=s["exchange"],
                                         root=0)  # the host: rank 0, before and after a shrink

    @property
    def model(self) -> torch.nn.Module:
        return self.state.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.state.optimizer

    @property
    def done(self) -> int:
        """Optimizer steps applied."""
        return self.state.step

    # -- the host's state -----------------------------------------------------------------
    def sync_from_host(self) -> None:
        """Every rank starts (and restarts after a failure) from the host's parameters
        and optimizer state."""
        broadcast_state(self.members.comm, self.state)

    def rejoin(self) -> None:
        """After a shrink: exchange over the new communicator, from the host's step count
        and state. A survivor that already applied this step and one that had not end up
        identical, momentum included.
        """
        self.reducer.comm = self.members.comm
        if self.buffers is not None:
            self.buffers.comm = self.members.comm
        step = np.array([self.done], dtype=np.int64)
        self.members.comm.Bcast(step, root=0)
        self.state.step = int(step[0])
        self.sync_from_host()

    # -- one step's pieces ----------------------------------------------------------------
    def compute(self, b: int) -> tuple[float, float]:
        """Forward and backward on ``b`` local samples; returns (device seconds, loss sum).

        Device seconds: wall time, and at least CPU time times the emulated slow-down
        (see csd.py).
        """
        t0 = time.perf_counter()
        c0 = time.thread_time()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        if b > 0:
            with self.turns:  # CSDs that share a core take turns (see csd.CoreTurns)
                x, y = self.stream.next(b)
                loss = self.loss_fn(self.model(x), y)
                loss.backward()
            loss_sum = float(loss.item()) * b
        return self.stretch.apply(time.thread_time() - c0, time.perf_counter() - t0, b), loss_sum

    def clear_grads(self) -> None:
        """Drop the gradients of computes that no step applies (the benchmark's)."""
        self.optimizer.zero_grad(set_to_none=True)

    def local(self, b: int, slowdown: float) -> tuple[int, float, float, str | None]:
        """This rank's share of a step at an emulated ``slowdown`` (a ``slow`` fault):
        (batch, device seconds, loss sum, data error). A data error empties the batch."""
        self.stretch.extra = slowdown
        if b > 0 and self.stretch.factor == 1.0:
            # Gradients go up while backward still runs (WeightedAllreduce's Overlap). Not
            # on an emulated CSD: its backward runs at the host's pace and then sleeps off
            # the slow-down, so its gradients would be ready far earlier than a real slow
            # device's and the overlap would hide more than it could.
            self.reducer.arm(b)
        try:
            compute_s, loss_sum = self.compute(b)
        except DataFault as e:  # every rank learns it in this step's exchange, and stops
            return 0, 0.0, 0.0, str(e)
        return b, compute_s, loss_sum, None

    def exchange(self, b: int, error: str | None, index: int, row: np.ndarray,
                 table: np.ndarray | None) -> float:
        """The weighted gradient allreduce of step ``index``; returns the global batch.

        The step's figures ``row`` (gathered into the host's ``table``), the buffers'
        average and the stop code travel in the same wait as the gradients.

        Raises:
            stop.StopRun: a data error or a stop signal on some rank, before this step's
                update: the run ends with ``index`` steps done.
        """
        comm = self.members.comm
        self.reducer.reset_counters()
        # A data error or a stop signal on any rank travels with the gradients (one float64).
        code = np.array([stop.agree_code(comm, error)], dtype=np.float64)
        worst = np.zeros(1)
        buffers = self.buffers.requests(b) if self.buffers is not None else []
        total = self.reducer.reduce(b, alongside=[comm.Igather(row, table, root=0),
                                                  comm.Iallreduce(code, worst, op=MPI.MAX),
                                                  *buffers])
        if self.buffers is not None:
            self.buffers.apply()
        halt = stop.stop_from(comm, int(worst[0]), error, index)
        if halt is not None:
            raise halt  # before this step's update: the run ends with `index` steps done
        return total

    def update(self, index: int, total: float, steps: int) -> None:
        """Step ``index``'s optimizer step at the rate for a global batch of ``total``
        (rates decay over ``steps``)."""
        if self.schedule.scheduled:  # the user's scheduler (config or script) owns the rate
            self.schedule.apply(self.optimizer, index)
        else:
            o = self.optim
            # optim.lr, or a given optimizer's own rate, scaled (Schedule.base_rate)
            self.schedule.set_rates(self.optimizer, lambda base: scaled_lr(
                base, o["base_batch"], int(total), index, o["warmup_steps"]) * decay(index, steps, o["schedule"]))
        self.optimizer.step()
        self.state.step = index + 1

    # -- figures --------------------------------------------------------------------------
    @property
    def wait_s(self) -> float:
        """How long the last exchange waited for the others."""
        return self.reducer.wait_s

    @property
    def grad_bytes(self) -> int:
        """The gradients' bytes per exchange."""
        return self.reducer.payload_bytes

    @property
    def buffer_bytes(self) -> int:
        """The averaged buffers' bytes per exchange (0 if kept per rank, or none)."""
        return self.buffers.nbytes if self.buffers is not None else 0
