"""Drawing run logs: the helpers every report plot uses, and the registry of each system's own plots.

Why in the tools: ``mpipipe report`` (a command, on top) draws what every run has (loss,
accuracy, samples/s, per-rank time), and a system draws what only its runs have
(Stannis: batch size and samples per joule per rank, in ``stannis/plots.py``). A system
may import the core and the tools only, so the helpers both need, and the registry through
which the report finds a system's plots, live here; no rank draws, so not in the core.

A system ``X`` whose logs say ``system = "X"`` provides its plots in a module ``X.plots``
that calls :func:`register_plots` when imported; the report (a command, which may import
any system) imports that module by name when it meets such a log
(``mpipipe.report.plots_for``) and reads the registry. The tools import no system.
matplotlib is imported inside the functions that draw, so that reading logs never needs it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mpipipe.core.logs.logschema import EventKind as K
from mpipipe.core.logs.runlog import RunData

__all__ = ["SystemPlots", "register_plots", "registered_plots", "as_float", "first_step_time", "roles",
           "rank_time", "rank_label", "mark_events", "save", "LINESTYLES", "ROUTINE_EVENTS",
           "UNMARKED_EVENTS", "MAX_MARKED", "EVENT_STYLES", "LABEL_GAP", "LABEL_STACK_PT",
           "percent_axis"]

# Events that recur every few steps: counted in the summary, not listed or marked one by one.
ROUTINE_EVENTS = frozenset({K.CHECKPOINT, K.LATE})
# Events listed in the summary but not drawn on plots (they say how, not when something happened).
UNMARKED_EVENTS = ROUTINE_EVENTS | {K.ENERGY_SOURCE, K.BENCHMARK, K.COST_MODEL, K.CPU_BINDING, K.RESUME}
# A kind with more events than this in one run is not drawn either: the lines would hide the curves.
MAX_MARKED = 20

LINESTYLES = ("-", "--", ":", "-.")
EVENT_STYLES: dict[str, Any] = {K.FAILURE_DETECTED: ":", K.TAKEOVER: "--", K.FAULT_INJECTED: "-.",
                                K.RETUNE: (0, (5, 1, 1, 1)), K.TAKEOVER_RECOVERED: (0, (1, 3))}
LABEL_GAP = 0.04  # events closer than this share of the axis get one label, so labels never overlap
# A label near one already on the axes (another run's, drawn on the same axes) is moved this
# many points further left per label there: about a line of the labels' 7-point text.
LABEL_STACK_PT = 9.0
# Short names on the plots, so that a label of several kinds fits the axes' height.
SHORT = {K.FAULT_INJECTED: "fault", K.FAILURE_DETECTED: "detected", K.TAKEOVER_RECOVERED: "recovered",
         K.LOG_WRITER_MOVED: "log moved"}


# ---------------------------------------------------------------- the registry


@dataclass(frozen=True)
class SystemPlots:
    """The plots a system adds for its own runs: ``plot(runs, labels, path)`` writes one PNG
    of ``runs`` (all of that system) to ``path`` and returns it; ``suffix`` names the file
    (``<runs>-<suffix>.png``)."""

    system: str
    suffix: str
    plot: Callable[[Sequence[RunData], list[str], Path], Path]


_PLOTS: dict[str, SystemPlots] = {}


def register_plots(plots: SystemPlots) -> SystemPlots:
    """Register a system's plots (again: harmless, the latest wins: a reloaded module)."""
    _PLOTS[plots.system] = plots
    return plots


def registered_plots(system: str) -> SystemPlots | None:
    """The plots ``system`` registered, or None."""
    return _PLOTS.get(system)


# ---------------------------------------------------------------- helpers


def as_float(col: np.ndarray) -> np.ndarray:
    """A column as float64, with the -1 back-fill of integer columns turned into NaN."""
    a = np.asarray(col)
    if np.issubdtype(a.dtype, np.integer):
        out = a.astype(np.float64)
        out[a < 0] = np.nan
        return out
    return a.astype(np.float64)


def first_step_time(run: RunData) -> float:
    """The log time of the first step row: where the plots' time axes start (0 if none)."""
    t = as_float(run.steps.get("time", np.array([])))
    return float(t[0]) if len(t) and not math.isnan(t[0]) else 0.0


def roles(run: RunData) -> dict[int, str]:
    """Rank -> role name, from the ``plan`` attribute (``0=stage 0, 1=stage 1, ...``)."""
    out = {}
    for part in str(run.attrs.get("plan", "")).split(","):
        rank, _, role = part.partition("=")
        if rank.strip().isdigit() and role.strip():
            out[int(rank)] = role.strip()
    return out


def rank_time(run: RunData, cols: dict[str, np.ndarray]) -> np.ndarray:
    """The log time of each of a rank's rows, looked up by step (NaN where the step row is missing)."""
    when = dict(zip(run.steps.get("step", []).tolist(), as_float(run.steps.get("time", np.array([]))).tolist(),
                    strict=True))
    return np.array([when.get(int(s), math.nan) for s in cols["step"]], dtype=np.float64)


def rank_label(label: str, rank: int, role: str, several: bool) -> str:
    """A rank's legend entry: ``rank 1 (csd 1)``, prefixed by the run's label when several are drawn."""
    name = f"rank {rank}" + (f" ({role})" if role else "")
    return f"{label}: {name}" if several else name


def percent_axis(ax: Any) -> None:
    """End a percentage axis (accuracy) at 100 and start it at 0 at the lowest: matplotlib's
    margin around points near 100% would run it to about 104%, a value no accuracy takes."""
    lo, hi = ax.get_ylim()
    ax.set_ylim(max(lo, 0.0), min(hi, 100.0))


def mark_events(ax: Any, run: RunData, color: Any, x: str, *, label_kinds: bool) -> None:
    """Vertical lines at the notable events of ``run`` (x = 'step' or 'time'; time counts from
    the first step, as the curves do). Events closer together than LABEL_GAP of the axis share
    one label, written once. Several runs drawn on one axes (a comparison) each label their
    own events, in their own colour: a label that would fall within LABEL_GAP of labels already
    on these axes goes into a column beside the first of them, LABEL_STACK_PT points further
    left per label, so that runs with a fault at the same step never print their labels over
    one another."""
    from matplotlib.transforms import blended_transform_factory, offset_copy

    shift = first_step_time(run) if x == "time" else 0.0
    counts = Counter(e["kind"] for e in run.events)
    marks: list[tuple[float, str]] = []
    for ev in run.events:
        pos = float(ev[x]) - shift
        if ev["kind"] in UNMARKED_EVENTS or counts[ev["kind"]] > MAX_MARKED or math.isnan(pos) or pos < 0:
            continue
        if (pos, ev["kind"]) not in marks:
            marks.append((pos, ev["kind"]))
            ax.axvline(pos, color=color, linestyle=EVENT_STYLES.get(ev["kind"], "--"), linewidth=1, alpha=0.7)
    if not label_kinds or not marks:
        return
    ends = as_float(run.steps.get(x, np.array([]))) - shift
    ends = ends[~np.isnan(ends)]
    lo = min([0.0, *[p for p, _ in marks]])
    hi = max([float(ends[-1]) if len(ends) else 0.0, *[p for p, _ in marks]])
    gap = LABEL_GAP * (hi - lo) if hi > lo else 0.0
    trans = blended_transform_factory(ax.transData, ax.transAxes)
    clusters: list[tuple[float, list[str]]] = []
    for pos, kind in sorted(marks, key=lambda m: m[0]):  # log order within a position
        if clusters and pos - clusters[-1][0] <= gap:
            if kind not in clusters[-1][1]:
                clusters[-1][1].append(kind)
        else:
            clusters.append((pos, [kind]))
    placed: list[float] = ax.__dict__.setdefault("_mpipipe_event_labels", [])  # by earlier runs too
    for pos, kinds in clusters:
        near = [p for p in placed if abs(p - pos) <= gap]
        # in a column beside the first label there, one line further left per label
        at = near[0] if near else pos
        where = offset_copy(trans, fig=ax.figure, x=-LABEL_STACK_PT * len(near), units="points")
        ax.text(at, 0.98, " " + ", ".join(SHORT.get(k, k) for k in kinds), transform=where, rotation=90,
                va="top", ha="right", fontsize=7, color=color)
        placed.append(at)


def save(fig: Any, path: Path) -> Path:
    """Write ``fig`` as a PNG and free it (a report may draw many)."""
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
