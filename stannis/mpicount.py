"""Bytes this process hands to MPI, as Open MPI's own monitoring counts them.

Why: :class:`stannis.audit.AuditedComm` counts what goes through it, so a send
that bypasses it (a raw ``MPI.COMM_WORLD.Send``, a collective on a communicator
of its own) would be invisible to the privacy audit. Open MPI's monitoring
components sit under every communicator of the process: the PML one counts each
point-to-point message the application sends (tag >= 0, any communicator; the
messages collectives make internally are kept apart), the COLL one the payload
of each collective per peer. Read through the MPI_T performance variables they
give a figure that no Python code path can avoid. The audit predicts the same
figure from the operations it forwarded; any difference is traffic it did not see.

Open MPI's convention for collectives, which the prediction follows: an
allreduce of n bytes counts n for every other member, on every member; a rooted
collective (gather, bcast) counts n per other member at the root and nothing
elsewhere.

Limits: the counters exist only under Open MPI, only when monitoring was asked
for before ``MPI_Init`` (:func:`enable`), and not with ``--with-ft ulfm`` (Open
MPI 5 leaves the monitoring components out when fault tolerance is on); then
:func:`counters` returns None and the log says so (``mpi_bytes`` = -1).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from functools import cache
from typing import Any

__all__ = ["ENV", "enable", "counters", "MpiCounters"]

ENV = "OMPI_MCA_pml_monitoring_enable"
_PVARS = (b"pml_monitoring_messages_size", b"coll_monitoring_messages_size")
_CLASS_SIZE = 2   # MPI_T_PVAR_CLASS_SIZE in Open MPI's mpi.h
_THREAD_SINGLE = 0


def enable() -> None:
    """Ask Open MPI for its monitoring counters; call before mpi4py initialises MPI.

    Level 2 keeps the application's point-to-point messages apart from those that
    collectives make internally (which the COLL counter accounts for by payload).
    A value already in the environment (e.g. ``mpirun -x``) is left as it is.
    """
    if "mpi4py.MPI" not in sys.modules:
        os.environ.setdefault(ENV, "2")


class MpiCounters:
    """The process's MPI_T session on the monitoring counters, bound to ``MPI_COMM_WORLD``."""

    def __init__(self, lib: Any, session: ctypes.c_void_p,
                 handles: list[tuple[ctypes.c_void_p, Any]]) -> None:
        self._lib, self._session, self._handles = lib, session, handles

    def read(self) -> int:
        """Bytes counted so far: point-to-point sent plus collective payload, all peers."""
        total = 0
        for handle, buf in self._handles:
            if self._lib.MPI_T_pvar_read(self._session, handle, buf) != 0:
                raise RuntimeError("MPI_T_pvar_read failed on a monitoring counter")
            total += sum(buf)
        return int(total)


def _libmpi() -> Any:
    """The MPI library mpi4py loaded (already in the process: no second copy)."""
    for name in ("libmpi.so.40", ctypes.util.find_library("mpi")):
        if name:
            try:
                return ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
    return None


@cache
def counters() -> MpiCounters | None:
    """The process-wide counters, or None where this MPI cannot give them (see the module)."""
    from mpi4py import MPI

    if not MPI.Get_library_version().startswith("Open MPI") or \
            os.environ.get(ENV, "0") in ("", "0"):
        return None
    lib = _libmpi()
    if lib is None:
        return None
    provided = ctypes.c_int()
    if lib.MPI_T_init_thread(_THREAD_SINGLE, ctypes.byref(provided)) != 0:
        return None
    session = ctypes.c_void_p()
    if lib.MPI_T_pvar_session_create(ctypes.byref(session)) != 0:
        return None
    world = ctypes.c_void_p(MPI.COMM_WORLD.handle)
    handles = []
    for name in _PVARS:
        index, handle, count = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_int()
        if lib.MPI_T_pvar_get_index(name, _CLASS_SIZE, ctypes.byref(index)) != 0:
            return None  # monitoring components absent (e.g. under ULFM)
        if lib.MPI_T_pvar_handle_alloc(session, index, ctypes.byref(world), ctypes.byref(handle),
                                       ctypes.byref(count)) != 0:
            return None
        lib.MPI_T_pvar_start(session, handle)  # continuous variables: already running
        handles.append((handle, (ctypes.c_ulong * count.value)()))
    return MpiCounters(lib, session, handles)
