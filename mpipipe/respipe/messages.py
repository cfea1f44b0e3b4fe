"""The two messages of a ResPipe round, typed: a rank's state report and the decision.

Why typed: both used to be float vectors read by position (``heard[w][4]``,
``m[7]``), and the set of dead ranks travelled as a bitmask stored in a float,
exact only below 53 world ranks. Each message is now a frozen dataclass whose
fields are its one field list; :func:`encode` walks that list to a float64
vector (what the control channel and the lobby carry) and :func:`decode` walks
it back. The vector starts with the codec's :data:`VERSION` and the message's
kind, so a rank never reads a message laid out by other code as if it were its
own.

How each field type travels (every number in a float64, so integers stay exact
up to 2**53, far beyond any rank or step):

- ``int``, ``float``, ``bool``: one number;
- ``str`` (the round's reason): its index in :data:`REASONS`;
- ``tuple[int, ...]`` (a set or list of ranks): its length, then the ranks;
- ``dict[int, int]``: its length, then key and value pairs, sorted by key;
- ``dict[int, tuple[int, ...]]``: its length, then per key (sorted) the key,
  the list's length and the list.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

__all__ = ["VERSION", "REASONS", "MessageError", "StateReport", "Decision", "encode", "decode"]

VERSION = 2  # raise on any change of a field list or of how a field type travels

# Why a round started, as announced; the index is what travels.
REASONS = ("none", "late", "failed", "revoked", "announced", "rejoin", "rebuild")

_KIND_REPORT, _KIND_DECISION = 1, 2


class MessageError(ValueError):
    """A control message that this code cannot read (another version, kind or length)."""


class _Message:
    """``msg.encode()`` and ``Cls.decode(vector)``, as :class:`mpipipe.pipeline.engine.Have` has."""

    def encode(self) -> np.ndarray:
        """This message as the float64 vector that carries it (see :func:`encode`)."""
        return encode(self)  # type: ignore[arg-type]

    @classmethod
    def decode(cls, vector: np.ndarray | typing.Sequence[float]) -> Any:
        """The message a vector from :meth:`encode` carries (see :func:`decode`)."""
        return decode(cls, vector)  # type: ignore[type-var]


@dataclass(frozen=True)
class StateReport(_Message):
    """What a rank announces when a round starts: where it stands and what it holds.

    The coordinator decides from these alone (see :func:`mpipipe.respipe.decide.decide`).
    """

    gen: int  # the generation the rank is in
    rank: int  # its world rank
    backup: bool  # False: it serves a stage; True: it backs one up (or mirrors it, hot)
    index: int  # the stage it serves or backs up
    done: int  # optimizer steps it has applied (a backup: the step it stands at)
    latest: int  # step count of its newest held replica (-1: none)
    prev: int  # of the one before (-1: none)
    reason: str  # why it joined the round (one of REASONS)
    suspect: int  # the world rank it found late or failed (-1: none)
    t_detect: float  # when it noticed (time.time())
    dead: tuple[int, ...]  # world ranks it knows to have failed, sorted
    waited_s: float  # how long it waited for the suspect (a rejoin: when the rank was replaced)
    after_step: bool  # between an applied update and the end of that step's after-work
    records_from: int  # the oldest step whose messages it can send again
    resumable: bool  # its pipeline can finish an interrupted step (hot mode)


@dataclass(frozen=True)
class Decision(_Message):
    """A round's verdict, sent by the coordinator to every member (and to an admitted rank)."""

    gen: int  # the new generation
    step: int  # P: the step every rank stands at after the round
    go_on: bool  # the step in flight is finished where the ranks stand (no replay)
    lost_stage: int  # a stage nobody can serve (-1: none): the run ends
    merge: int  # neighbour mode: the stage merged into its holder (-1: none)
    shrink: bool  # every rank left out had failed (none is merely silent)
    reason: str  # the reason of the earliest detection (one of REASONS)
    suspect: int  # its suspect
    t_detect: float  # its time
    waited_s: float  # its wait (a rejoin: when the rank was replaced)
    members: tuple[int, ...]  # world ranks of the new generation, sorted
    route: tuple[int, ...]  # the world rank serving each stage
    choices: dict[int, int]  # promoted stage -> the replica's step count its new rank loads
    silent: tuple[int, ...]  # ranks left out without an answer (they are told: demoted)
    admit: int  # a replaced rank admitted back (-1: none)
    admit_stage: int  # the stage it backs up (-1: none)
    backups: dict[int, tuple[int, ...]]  # stage -> its backups in the new generation
    log: int  # the world rank writing the log
    # "auto" (mpipipe.respipe.auto.Retune): R from the applied round on (0: unchanged), why
    # it was chosen again (RETUNE_* bits), and the model's inputs the choice assumed: the
    # failure rate per rank (per second), the factor on the measured compute, its step
    replicate_every: int = 0
    retuned: int = 0
    failure_rate: float = 0.0
    compute_scale: float = 1.0
    model_step_s: float = 0.0

    @property
    def comm_tag(self) -> str:
        """The tag the members build the new generation's communicator under
        (mpipipe.core.mpi.ft.from_group): unique to the generation and its members."""
        return f"mpipipe-gen{self.gen}-" + "-".join(map(str, sorted(self.members)))


M = TypeVar("M", StateReport, Decision)
_KINDS: dict[type, int] = {StateReport: _KIND_REPORT, Decision: _KIND_DECISION}


def _field_types(cls: type) -> list[tuple[str, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]


_FIELDS = {cls: _field_types(cls) for cls in _KINDS}


def encode(msg: StateReport | Decision) -> np.ndarray:
    """The float64 vector that carries ``msg`` (version, kind, then its fields in order).

    Raises:
        MessageError: a reason outside REASONS.
    """
    out: list[float] = [VERSION, _KINDS[type(msg)]]
    for name, hint in _FIELDS[type(msg)]:
        value = getattr(msg, name)
        if hint is str:
            if value not in REASONS:
                raise MessageError(f"{type(msg).__name__}.{name} = {value!r}: not one of {REASONS}")
            out.append(REASONS.index(value))
        elif hint in (int, float, bool):
            out.append(float(value))
        elif hint == tuple[int, ...]:
            out += [len(value), *value]
        elif hint == dict[int, int]:
            out.append(len(value))
            for k in sorted(value):
                out += [k, value[k]]
        elif hint == dict[int, tuple[int, ...]]:
            out.append(len(value))
            for k in sorted(value):
                out += [k, len(value[k]), *value[k]]
        else:  # pragma: no cover - a field type added without its codec
            raise TypeError(f"no codec for {type(msg).__name__}.{name}: {hint}")
    return np.asarray(out, dtype=np.float64)


def decode(cls: type[M], vector: np.ndarray | typing.Sequence[float]) -> M:
    """The ``cls`` message a vector from :func:`encode` carries.

    Raises:
        MessageError: the vector was written by another codec version, is another
            kind of message, or is too short or too long for its fields.
    """
    values = np.asarray(vector, dtype=np.float64).tolist()
    what = cls.__name__
    if len(values) < 2:
        raise MessageError(f"a {what} of {len(values)} numbers: too short to carry a version")
    if values[0] != VERSION:
        raise MessageError(
            f"a {what} of codec version {values[0]:g}, but this rank reads version {VERSION}: "
            "every rank of a job must run the same mpipipe (reinstall it on every node)")
    if values[1] != _KINDS[cls]:
        raise MessageError(f"expected a {what} (kind {_KINDS[cls]}), got message kind {values[1]:g}")
    it: Iterator[float] = iter(values[2:])

    def num() -> float:
        try:
            return next(it)
        except StopIteration:
            raise MessageError(f"a {what} of {len(values)} numbers ends early") from None

    def ints(n: float) -> tuple[int, ...]:
        return tuple(int(num()) for _ in range(int(n)))

    kw: dict[str, Any] = {}
    for name, hint in _FIELDS[cls]:
        if hint is str:
            code = int(num())
            if not 0 <= code < len(REASONS):
                raise MessageError(f"{what}.{name}: reason code {code} is not one of 0..{len(REASONS) - 1}")
            kw[name] = REASONS[code]
        elif hint in (int, float, bool):
            kw[name] = hint(num())
        elif hint == tuple[int, ...]:
            kw[name] = ints(num())
        elif hint == dict[int, int]:
            kw[name] = {int(num()): int(num()) for _ in range(int(num()))}
        else:  # dict[int, tuple[int, ...]]
            pairs = [(int(num()), ints(num())) for _ in range(int(num()))]
            kw[name] = dict(pairs)
    rest = sum(1 for _ in it)
    if rest:
        raise MessageError(f"a {what} with {rest} numbers more than its fields")
    return cls(**kw)




@dataclass
class Round:
    """What started a round on this rank (never sent: each rank reports it in its
    :class:`StateReport`): a late or failed peer, an announcement, a rejoin request
    (``suspect`` the rank asking, ``waited_s`` when it was told it was replaced), or a
    generation that was not built."""

    reason: str
    suspect: int
    t_detect: float
    waited_s: float = float("nan")


class RoundStarted(Exception):
    """A round is due (another rank started it, or this rank's own business); every part
    that notices raises it and the trainer runs the round."""

    def __init__(self, rnd: Round) -> None:
        super().__init__(rnd.reason)
        self.round = rnd
