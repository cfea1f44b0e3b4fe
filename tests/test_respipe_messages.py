"""The codec of a round's two messages: round trips, a refused version, large rank numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpipipe.respipe import messages
from mpipipe.respipe.messages import VERSION, Decision, MessageError, StateReport

pytestmark = pytest.mark.timeout(60)

REPORT = StateReport(gen=3, rank=70, backup=True, index=1, done=41, latest=40, prev=39,
                     reason="failed", suspect=200, t_detect=1.7e9 + 0.25, dead=(64, 70, 200),
                     waited_s=math.inf, after_step=True, records_from=40, resumable=False)
DECISION = Decision(gen=4, step=41, go_on=True, lost_stage=-1, merge=-1, shrink=True,
                    reason="rejoin", suspect=1, t_detect=1.7e9 + 0.25, waited_s=1.7e9,
                    members=(0, 2, 4, 70, 200), route=(0, 200, 2), choices={1: 40, 0: 39},
                    silent=(), admit=70, admit_stage=1, backups={0: (4,), 1: (70,), 2: ()},
                    log=2)


@pytest.mark.parametrize("msg", [REPORT, DECISION], ids=["report", "decision"])
def test_round_trip(msg) -> None:
    v = msg.encode()
    assert v.dtype == np.float64 and v[0] == VERSION
    assert type(msg).decode(v) == msg
    assert type(msg).decode(v.tolist()) == msg  # any sequence of floats


def test_ranks_beyond_64_survive_exactly() -> None:
    """Dead ranks used to travel as a bitmask in a float (exact below 53 ranks)."""
    back = StateReport.decode(REPORT.encode())
    assert back.dead == (64, 70, 200) and back.suspect == 200
    big = Decision.decode(DECISION.encode())
    assert big.members == (0, 2, 4, 70, 200) and big.route == (0, 200, 2)
    assert big.backups[1] == (70,) and big.admit == 70


def test_a_report_without_dead_ranks_and_nan_waits() -> None:
    r = StateReport(gen=0, rank=0, backup=False, index=0, done=0, latest=-1, prev=-1,
                    reason="none", suspect=-1, t_detect=0.0, dead=(), waited_s=math.nan,
                    after_step=False, records_from=0, resumable=True)
    back = StateReport.decode(r.encode())
    assert back.dead == () and math.isnan(back.waited_s)


def test_another_version_is_refused_naming_both() -> None:
    v = REPORT.encode()
    v[0] = VERSION + 1
    with pytest.raises(MessageError, match=f"version {VERSION + 1:g}.*reads version {VERSION}"):
        StateReport.decode(v)


def test_another_kind_or_length_is_refused() -> None:
    with pytest.raises(MessageError, match="expected a Decision"):
        Decision.decode(REPORT.encode())
    with pytest.raises(MessageError, match="ends early"):
        StateReport.decode(REPORT.encode()[:-1])
    with pytest.raises(MessageError, match="1 numbers more"):
        StateReport.decode(np.append(REPORT.encode(), 0.0))
    with pytest.raises(MessageError, match="too short"):
        Decision.decode(np.zeros(1))


def test_an_unknown_reason_is_refused() -> None:
    with pytest.raises(MessageError, match="not one of"):
        messages.encode(StateReport(**{**REPORT.__dict__, "reason": "bored"}))
    v = REPORT.encode()
    v[9] = len(messages.REASONS)  # the reason's slot: version, kind, then 7 fields before it
    with pytest.raises(MessageError, match="reason code"):
        StateReport.decode(v)
