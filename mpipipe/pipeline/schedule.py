"""Micro-batch schedules: the ordered forward/backward actions one stage runs in one step."""

from __future__ import annotations

__all__ = ["Action", "gpipe", "onef1b", "actions", "SCHEDULES"]

Action = tuple[str, int]  # ("F" | "B", micro-batch index)


def gpipe(m: int) -> list[Action]:
    """Fill-drain (GPipe): all m forwards, then all m backwards.

    Every stage keeps the activations of all m micro-batches until the drain.
    """
    if m < 1:
        raise ValueError(f"need at least one micro-batch, got {m}")
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def onef1b(stage: int, k: int, m: int) -> list[Action]:
    """One-forward-one-backward (PipeDream-flush): same maths as GPipe, less memory.

    Stage s first runs min(k - s - 1, m) warm-up forwards, then alternates one forward
    and one backward, then drains the remaining backwards; at most k - s micro-batches
    are in flight on stage s instead of m.
    """
    if not 0 <= stage < k:
        raise ValueError(f"stage {stage} is not in 0..{k - 1}")
    if m < 1:
        raise ValueError(f"need at least one micro-batch, got {m}")
    warm = min(k - stage - 1, m)
    out: list[Action] = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        out += [("F", warm + i), ("B", i)]
    out += [("B", i) for i in range(m - warm, m)]
    return out


SCHEDULES = ("gpipe", "1f1b")


def actions(name: str, stage: int, k: int, m: int) -> list[Action]:
    """The action list of schedule `name` ("gpipe" or "1f1b") for one stage."""
    if name == "gpipe":
        return gpipe(m)
    if name == "1f1b":
        return onef1b(stage, k, m)
    raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
