"""The control plane: small float64 messages on a second communicator, and their codes.

Announcements (typed state reports), decisions, figures, fault notes and the clean
stop travel here; rejoin requests on a job-wide lobby built the same way.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

# Control messages (float64 arrays on the generation's control communicator).
_ANNOUNCE, _DECISION, _DEMOTED, _END, _FIGS, _FAULT, _EVAL = range(1, 8)
# On the lobby (the whole job's communicator): a replaced rank asks to come back; the
# coordinator admits it (the round's decision) or tells it the job is over.
_REJOIN, _ADMIT, _CLOSED = range(8, 11)
_RELEASED = 11  # on the lobby: a replaced log writer has closed the file
_STOP, _STOP_ASK = 12, 13  # the clean stop (mpipipe.core.mpi.stop.ControlStop), on the control plane
_LOSS = 14  # the last stage's loss of a step, to the writer's successor (Logbook.report)
# On the lobby, before a generation is built: a member is there to build it (to the round's
# coordinator), and the coordinator's verdict, build or run the round again (Membership._ready).
_READY, _GO = 15, 16
_CTL_LEN = 256


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

    def quiet(self, code: int | None = None, seq: int = 0) -> bool:
        """True when no message waits here (of this ``code`` and ``seq``, or of any kind):
        one probe instead of one per peer. False also when that cannot be known (under
        ULFM an any-source probe fails once a rank has died), so that the caller then
        looks peer by peer. Why: each probe costs tens of microseconds of CPU, and a rank
        that looks at every peer for every code each step spends a slow node's share on it."""
        tag = self.MPI.ANY_TAG if code is None else _ctl_tag(code, seq)
        try:
            return not self.comm.Iprobe(self.MPI.ANY_SOURCE, tag)
        except Exception:  # noqa: BLE001 - a failed rank: look at each message
            return False

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
