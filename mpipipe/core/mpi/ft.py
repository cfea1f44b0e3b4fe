"""ULFM helpers: is fault tolerance on, which peers failed, and revoke/shrink/agree that never raise on their own."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

__all__ = [
    "ulfm_enabled",
    "startup_note",
    "is_proc_failed",
    "is_revoked",
    "error_class",
    "revoke",
    "shrink",
    "agree",
    "agreed_phase",
    "PhaseFailed",
    "BuildFailed",
    "from_group",
    "failed_ranks",
    "lost_ranks",
]


def ulfm_enabled(env: dict[str, str] | None = None) -> bool:
    """True when the job runs under ``mpirun --with-ft ulfm``.

    Why the environment: Open MPI exports ``OMPI_MCA_mpi_ft_enable=1`` to every
    rank it launches with ULFM, and nothing in the MPI API says so portably.
    Without ULFM a dead rank makes ``mpirun`` abort the job, and ``Comm.Agree``
    hangs, so resilience must know before it relies on them.
    """
    env = os.environ if env is None else env
    return env.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() in ("1", "true", "yes", "on")


def startup_note(enabled: bool | None = None) -> str:
    """The one line printed at start-up about which failures can be handled."""
    if ulfm_enabled() if enabled is None else enabled:
        return ("resilience: ULFM on (mpirun --with-ft ulfm): dead ranks are detected by MPI, "
                "late ranks by deadline")
    return ("resilience: ULFM off: only late (stalled) ranks are detected, by deadline; a dead rank "
            "stops the job (run mpirun --with-ft ulfm to survive it)")


def error_class(exc: BaseException) -> int | None:
    """The MPI error class of an ``MPI.Exception``, or None for anything else."""
    get = getattr(exc, "Get_error_class", None)
    if get is None:
        return None
    try:
        return int(get())
    except Exception:  # noqa: BLE001 - a broken exception object is simply not an MPI error
        return None


def is_proc_failed(exc: BaseException) -> bool:
    """True if ``exc`` reports a failed peer (MPIX_ERR_PROC_FAILED or ..._PENDING)."""
    from mpi4py import MPI

    cls = error_class(exc)
    return cls is not None and cls in (
        getattr(MPI, "ERR_PROC_FAILED", -1), getattr(MPI, "ERR_PROC_FAILED_PENDING", -1))


def is_revoked(exc: BaseException) -> bool:
    """True if ``exc`` says the communicator was revoked by another survivor."""
    from mpi4py import MPI

    cls = error_class(exc)
    return cls is not None and cls == getattr(MPI, "ERR_REVOKED", -2)


def revoke(comm: Any) -> None:
    """Revoke ``comm`` so that every survivor's pending operation on it fails at once.

    Revoking twice, or a communicator some other rank already revoked, is fine.
    """
    try:
        comm.Revoke()
    except Exception:  # noqa: BLE001 - already revoked or ULFM off: nothing more to do
        pass


def shrink(comm: Any) -> Any:
    """A new communicator of the survivors of ``comm`` (collective over survivors).

    The result returns errors instead of aborting, like every communicator here.
    """
    from mpi4py import MPI

    new = comm.Shrink()
    new.Set_errhandler(MPI.ERRORS_RETURN)
    return new


class BuildFailed(RuntimeError):
    """A new communicator was not built: a member never came, or gave up waiting for one.

    Every member that came gets it alike (see :func:`from_group`), so they can all
    recover together."""


def from_group(world: Any, ranks: list[int], tag: str, wait_s: float | None = None) -> Any:
    """A new communicator of exactly ``ranks`` (ranks of ``world``), made by them alone.

    Why not ``Create_group`` on the old communicator, or ``Shrink``: ``Shrink`` waits
    for every live rank, a stalled one included, and a parent with a dead member may
    refuse ``Create_group``; MPI-4's ``Create_from_group`` needs no parent, so a dead
    rank and a stalled one left out at once are both simply not asked. ``tag`` must be
    unique to this set of ranks and this attempt. The result returns errors, like every
    communicator here.

    ``wait_s`` (under ULFM): how long to wait for the other members. Open MPI 5.0's
    ``Create_from_group`` waits for every rank of the group for ever, even for one that
    has died (seen here: a member killed before its call left the others blocked for
    good), and it cannot be cancelled. So the call runs in a thread, and a member that
    waited ``wait_s`` gives up and raises :class:`BuildFailed`. To keep every member's
    verdict the same when the last one comes just after another gave up, each member,
    once the call returns, agrees on the new communicator whether it still wanted it:
    one "no" and all of them raise :class:`BuildFailed` (a member that gave up says its
    "no" from the thread, whenever the call completes). A build that never completes
    leaves its thread blocked; the process leaves without ``MPI_Finalize`` anyway after
    a round. A caveat no thread can help: when Open MPI processes the death of a member
    while such a call waits (here or in a thread left blocked), it was seen to crash
    the process (a segmentation fault in ``ompi_comm_revoke_local``). So callers first
    make sure every member is there (ResPipe: ``Membership._ready``), and this time limit
    is the last line, for a member that dies in between.

    A build left blocked may also harm a later build of the same members (one failed
    everywhere in 1 of 8 runs here), never one of other members (every run): callers
    must not build the members of a blocked build again, and ResPipe never does (the
    missing member is dead, or, stalled, completes the blocked build itself when it
    comes back, and is then left out). docs/respipe.md has the measurements.

    What is returned is a duplicate of the communicator made from the group: Open MPI
    5.0's agreement (``Agree``) on a communicator made from a group keys its history on
    an identifier that all such communicators share ("removing old agreement (0.0).1
    from history, due to cycling of identifiers"), and a second one's ``Agree`` then
    failed or hung; on a duplicate it works (seen here, 5 generations in a row).

    Raises:
        BuildFailed: a member did not come within ``wait_s``, another member gave up, or
            MPI refused the call (Open MPI does once it knows a member dead).
    """
    if wait_s is None or not ulfm_enabled():
        return _build(world, ranks, tag)
    return _Build(world, ranks, tag).result(wait_s)


def _build(world: Any, ranks: list[int], tag: str) -> Any:
    from mpi4py import MPI

    parent = world.Get_group()
    group = parent.Incl(list(ranks))
    parent.Free()
    try:
        made = MPI.Intracomm.Create_from_group(group, stringtag=tag,
                                               errhandler=MPI.ERRORS_RETURN)
    finally:
        group.Free()
    comm = made.Dup()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    return comm


class _Build:
    """One bounded :func:`from_group`: the blocking call in a thread, and the members'
    agreement on whether all of them still wanted its result."""

    def __init__(self, world: Any, ranks: list[int], tag: str) -> None:
        self._lock = threading.Lock()
        self._gave_up = False  # the caller stopped waiting (set under the lock)
        self._wanted = False  # the thread found the caller still waiting (under the lock)
        self._done = threading.Event()
        self._comm: Any = None
        self._error: BaseException | None = None
        threading.Thread(target=self._run, args=(world, list(ranks), tag), daemon=True,
                         name="mpipipe-build").start()

    def _run(self, world: Any, ranks: list[int], tag: str) -> None:
        try:
            comm = _build(world, ranks, tag)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            # Open MPI refuses the call ("operation not supported") once it knows a
            # member dead: like a member that never comes, a build to recover from.
            self._error = BuildFailed(f"the build failed: {e}") if error_class(e) is not None \
                else e
            self._done.set()
            return
        with self._lock:
            self._wanted = not self._gave_up
        try:
            everyone, uniform = agree(comm, int(self._wanted))
            if self._wanted and everyone and uniform:
                self._comm = comm
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self._error = e
        self._done.set()

    def result(self, wait_s: float) -> Any:
        if not self._done.wait(wait_s):
            with self._lock:
                if not self._wanted:
                    self._gave_up = True
                    raise BuildFailed(f"a member did not come within {wait_s:.0f} s")
            self._done.wait()  # every member came: the agreement is under way
        if self._error is not None:
            raise self._error
        if self._comm is None:
            raise BuildFailed("another member gave up waiting for the rest")
        return self._comm


def agree(comm: Any, flag: int = 1) -> tuple[int, bool]:
    """Fault-tolerant agreement: the bitwise AND of ``flag`` over survivors, and whether all agreed.

    ``Comm.Agree`` completes with the same outcome on every survivor, which is
    what makes it safe to branch on: if a process failed and was not yet
    acknowledged, every survivor sees the error (returned here as False) and
    may acknowledge it and agree again.
    """
    try:
        return int(comm.Agree(int(flag))), True
    except Exception as e:  # noqa: BLE001
        if is_proc_failed(e):
            try:
                comm.Ack_failed()
            except Exception:  # noqa: BLE001
                pass
            return int(flag), False
        raise


class PhaseFailed(RuntimeError):
    """A phase (:func:`agreed_phase`) failed on another survivor, not on this one."""


def agreed_phase(comm: Any, work: Callable[[], None]) -> BaseException | None:
    """Run ``work`` (a phase's collectives on ``comm``), then agree whether every survivor
    completed it: None if all did, else the error to recover from (this rank's MPI error,
    or :class:`PhaseFailed`), on every survivor alike.

    Why: a collective may fail on some ranks and complete on others (the root of a gather
    or a broadcast learns of a failure the others have already left behind), so a rank
    cannot tell from its own call whether the phase is over. A rank that saw an error
    revokes ``comm`` first, so that none stays blocked in a collective the others have
    left; then ``Agree`` gives each survivor the same verdict. A rank whose ``work``
    raised anything else (a clean stop, say) still takes part in the agreement, with a
    "no", and then raises it, so that no survivor waits in ``Agree`` for it. Without
    ULFM the error is raised (a dead rank ends the job anyway).

    Raises:
        Exception: ``work``'s error, when ULFM is off or the error is not MPI's.
    """
    error: BaseException | None = None
    other: BaseException | None = None
    try:
        work()
    except Exception as e:  # noqa: BLE001 - MPI errors are returned, others re-raised after agreeing
        if not ulfm_enabled():
            raise
        if error_class(e) is None:
            other = e
        else:
            error = e
            revoke(comm)
    if not ulfm_enabled():
        return None
    everyone_ok, uniform = agree(comm, int(error is None and other is None))
    if other is not None:
        raise other
    if everyone_ok and uniform:
        return None
    return error or PhaseFailed("the phase failed on another rank")


def failed_ranks(comm: Any) -> list[int]:
    """Ranks of ``comm`` that this process knows to have failed (ULFM ``Get_failed``)."""
    try:
        group = comm.Get_failed()
    except Exception:  # noqa: BLE001 - ULFM off
        return []
    try:
        if group.Get_size() == 0:
            return []
        return list(group.Translate_ranks(list(range(group.Get_size())), comm.Get_group()))
    finally:
        group.Free()


def lost_ranks(old: Any, new: Any) -> list[int]:
    """Ranks of ``old`` that are not members of ``new`` (what a shrink or exclusion removed)."""
    from mpi4py import MPI

    og, ng = old.Get_group(), new.Get_group()
    try:
        kept = ng.Translate_ranks(list(range(ng.Get_size())), og)
    finally:
        ng.Free()
    gone = sorted(set(range(og.Get_size())) - {r for r in kept if r != MPI.UNDEFINED})
    og.Free()
    return gone
