"""Each step's figures: what every rank sends the host with its gradients, and what the
host makes of them (the step's log row, written one step late; the run's totals and summary).

Why one step late: a step's wait, joules and bytes are known only after its exchange,
so they travel with the next step's (:data:`LATE_FIGURES`) and complete the row the
host held back (:meth:`StepFigures.record`). After the last step they travel alone
(:meth:`StepFigures.flush`).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from mpipipe.core.logs.logschema import EventKind

from .members import Members

# One row of figures every rank sends to the host per step (float64, buffer API), in
# the same wait as the gradients: this step's, and the previous step's that are known
# only after its exchange (so every step's log row is written one step late).
STEP_FIGURES = ("compute_s", "batch_size", "loss_sum", "busy_s")
LATE_FIGURES = ("wait_s", "joules", "bytes_sent", "bytes_recv", "mpi_bytes", "unaudited_bytes")
FIGURES = STEP_FIGURES + LATE_FIGURES
FIG_BYTES = 8 * len(FIGURES)
STOP_BYTES = 8  # the step's stop code (mpipipe.core.mpi.stop), reduced with the gradients


def _count(x: float) -> int:
    """A byte count carried as float64; -1 where it was lost."""
    return int(x) if math.isfinite(x) else -1


class StepFigures:
    """This rank's figures of each step; on the host, every rank's, logged and totalled."""

    def __init__(self, members: Members, meter: Any, log: Any, progress: Any, is_host: bool) -> None:
        self.members = members
        self.meter = meter
        self.log = log  # the BackgroundLog
        self.progress = progress
        self.is_host = is_host
        self._cycle: float | None = None  # end of the last gradient exchange
        self._post = (math.nan,) * len(LATE_FIGURES)  # last step's late figures, sent next
        self._pending: dict[str, Any] | None = None  # host: the step row held back
        self.history: list[tuple[int, int, float]] = []  # host: (step, samples, end time)
        self.totals = {r: {"samples": 0, "joules": 0.0, "busy_s": 0.0} for r in members.ranks}
        self.last_loss = math.nan  # host: the last step's loss

    # -- every rank -----------------------------------------------------------------------
    def start(self) -> None:
        """A step begins: its joules count from here."""
        self.meter.start()

    def row(self, compute_s: float, b: int, loss_sum: float) -> np.ndarray:
        """This step's figures, and the previous step's that only its end knew (FIGURES)."""
        # Busy time: from the end of the last gradient exchange to the start of this
        # one. It counts what compute_s does not (the optimizer, the host's logging and
        # evaluation), which the step time of the job pays all the same.
        busy_s = compute_s if self._cycle is None else time.perf_counter() - self._cycle
        return np.array([compute_s, b, loss_sum, busy_s, *self._post], dtype=np.float64)

    def table(self) -> np.ndarray | None:
        """Host: the receive buffer of one gather of every member's FIGURES row."""
        return np.zeros((self.members.comm.Get_size(), len(FIGURES))) if self.is_host else None

    def exchanged(self) -> None:
        """The gradient exchange ended: the next step's busy time counts from now."""
        self._cycle = time.perf_counter()

    def restart_clock(self) -> None:
        """The next step's busy time is its compute time (after a recovery or a pause)."""
        self._cycle = None

    def close(self, compute_s: float, wait_s: float) -> None:
        """The step ended: keep its late figures (wait, joules, bytes) for the next exchange."""
        joules = self.meter.stop(compute_s)
        comm = self.members.comm
        sent, recv = comm.take()  # this step's gradients and figures, and any plan
        self._post = (wait_s, joules, sent, recv, *comm.last_mpi)

    def flush(self) -> None:
        """Every rank: send the last step's late figures so its log row can be written.

        Collective; call once training stops (the bytes are not a step's).
        """
        row = np.array([math.nan] * len(STEP_FIGURES) + list(self._post), dtype=np.float64)
        table = self.table()
        comm = self.members.comm
        comm.Gather(row, table, root=0)
        comm.take()
        self._post = (math.nan,) * len(LATE_FIGURES)
        if self.is_host:
            self._write_pending(table[:, len(STEP_FIGURES):])

    def lose_late(self) -> None:
        """The exchange that carried the last step's late figures was interrupted: that
        row is written without them."""
        self._post = (math.nan,) * len(LATE_FIGURES)
        if self.is_host:
            self._write_pending(None)

    # -- the host -------------------------------------------------------------------------
    def record(self, table: np.ndarray, wall: float, step: int) -> list[tuple[int, int, float]]:
        """Host: account step ``step`` from the exchanged table, and log the step before it.

        The table holds this step's figures (what the tuner needs now) and the
        previous step's late ones (wait, joules, bytes), which complete the log row
        held back one step. Returns each member's (rank, batch, busy seconds).
        """
        self._write_pending(table[:, len(STEP_FIGURES):])
        total_b = 0
        loss_sum = 0.0
        now = {}
        busy = []
        for pos, r in enumerate(self.members.ranks):
            fig = dict(zip(STEP_FIGURES, table[pos, :len(STEP_FIGURES)], strict=True))
            b = int(fig["batch_size"])
            total_b += b
            loss_sum += fig["loss_sum"]
            now[r] = {"compute_s": fig["compute_s"], "batch_size": b, "busy_s": fig["busy_s"]}
            busy.append((r, b, fig["busy_s"]))
            t = self.totals.setdefault(r, {"samples": 0, "joules": 0.0, "busy_s": 0.0})
            t["samples"] += b
            t["busy_s"] += fig["compute_s"]
        loss = loss_sum / total_b if total_b else math.nan
        sps = total_b / wall if wall > 0 else math.nan
        self._pending = {"step": step, "time": self.log.elapsed(), "loss": loss,
                         "samples": total_b, "samples_per_s": sps, "ranks": now}
        self.progress.update(step, loss=loss, samples=total_b, time=self._pending["time"])
        self.last_loss = loss
        self.history.append((step, total_b, time.perf_counter()))
        return busy

    def _write_pending(self, late: np.ndarray | None) -> None:
        """Host: write the held-back step row with its late figures (NaN if lost)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        ranks = pending.pop("ranks")
        for pos, (r, fig) in enumerate(ranks.items()):
            values = late[pos] if late is not None else [math.nan] * len(LATE_FIGURES)
            wait_s, joules, sent, recv, mpi, unaudited = (float(v) for v in values)
            fig.update(wait_s=wait_s, joules=joules, bytes_sent=_count(sent),
                       bytes_recv=_count(recv), mpi_bytes=_count(mpi),
                       unaudited_bytes=_count(unaudited))
            if _count(unaudited) > 0:  # MPI counted traffic the audited door did not see
                self.log.event(EventKind.UNAUDITED_TRAFFIC, step=pending["step"], rank=r,
                               bytes=_count(unaudited), mpi_bytes=_count(mpi))
            if math.isfinite(joules):
                self.totals[r]["joules"] += joules
        self.log.step(pending.pop("step"), ranks=ranks, **pending)


def run_summary(totals: dict[int, dict[str, Any]], sources: dict[int, str], *, elapsed: float,
                steps: int, samples_per_s: float, accuracy: float, loss: float,
                final_batches: dict[int, int], grad_bytes: int, buffer_bytes: int) -> dict[str, Any]:
    """The run's summary (the log's ``summary`` attribute) from every rank's totals."""
    per_rank = {}
    for r, t in totals.items():
        per_rank[r] = {
            "samples": t["samples"], "joules": t["joules"],
            "samples_per_joule": t["samples"] / t["joules"] if t["joules"] else 0.0,
            "energy_source": sources.get(r, "?"),
        }
    samples = sum(t["samples"] for t in totals.values())
    # Measured (RAPL: the host's whole package, emulated CSDs' CPU work included)
    # and modelled joules are never added up: with both, there is no total.
    used = sorted({sources.get(r, "?") for r in totals})
    joules = sum(t["joules"] for t in totals.values()) if len(used) == 1 else math.nan
    return {
        "steps": steps, "samples": samples, "seconds": elapsed,
        "samples_per_s": samples_per_s, "energy_sources": used,  # mpipipe.core.logs.progress
        "joules": joules, "samples_per_joule": samples / joules if joules else 0.0,
        "accuracy": accuracy, "loss": loss,
        "final_batches": final_batches,
        "ranks": per_rank, "grad_bytes": grad_bytes,
        "control_bytes": FIG_BYTES + STOP_BYTES,
        "buffer_bytes": buffer_bytes,
    }
