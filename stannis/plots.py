"""Stannis's own report plots: batch size and samples per joule per rank.

``mpipipe report`` draws what every run log has; for a log whose ``system`` is
``stannis`` it imports this module (mpipipe.tools.logplot.plots_for), which registers
:func:`plot_stannis`. Why here: the plots read Stannis's own columns (``batch_size``,
``joules``) and events (``energy_source``), so they change with Stannis, not with the
report; and Stannis may import the core only, not the report command.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mpipipe.core.logs.logschema import EventKind
from mpipipe.core.logs.runlog import RunData
from mpipipe.tools.logplot import (
    LINESTYLES,
    SystemPlots,
    as_float,
    first_step_time,
    mark_events,
    rank_label,
    rank_time,
    register_plots,
    roles,
    save,
)

__all__ = ["plot_stannis"]


def plot_stannis(runs: Sequence[RunData], labels: list[str], path: Path) -> Path:
    """Batch size, samples/s while computing and samples per joule, per rank against time:
    what the tuner moved and what it bought (one PNG; several runs are overlaid)."""
    import matplotlib
    import matplotlib.pyplot as plt

    cmap = matplotlib.colormaps["tab10"]
    several = len(runs) > 1
    fig, axes = plt.subplots(3, 1, figsize=(11, 12), sharex=True)
    modelled = any("model" in json.dumps(e["detail"]) for r in runs for e in r.events
                   if e["kind"] == EventKind.ENERGY_SOURCE)
    for i, (run, label) in enumerate(zip(runs, labels, strict=True)):
        role_of = roles(run)
        for rank, cols in run.ranks.items():
            if "batch_size" not in cols or not len(cols["step"]):
                continue
            t = rank_time(run, cols) - first_step_time(run)
            batch = as_float(cols["batch_size"])
            compute = as_float(cols["compute_s"])
            style = {"color": cmap(rank % 10), "linestyle": LINESTYLES[i % 4], "linewidth": 1.2,
                     "label": rank_label(label, rank, role_of.get(rank, ""), several)}
            axes[0].plot(t, batch, drawstyle="steps-pre", **style)
            with np.errstate(divide="ignore", invalid="ignore"):
                axes[1].plot(t, np.where(compute > 0, batch / compute, np.nan), **style)
                if "joules" in cols:
                    joules = as_float(cols["joules"])
                    axes[2].plot(t, np.where(joules > 0, batch / joules, np.nan), **style)
        for ax in axes:
            mark_events(ax, run, "black", "time", label_kinds=(ax is axes[0] and not several))
    titles = ["batch size per rank", "samples/s per rank while computing (batch / compute time)",
              "samples per joule per rank" + (" (modelled power)" if modelled else "")]
    for ax, title in zip(axes, titles, strict=True):
        ax.set_ylabel(title.split(" (")[0])
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        else:
            ax.text(0.5, 0.5, "not recorded", transform=ax.transAxes, ha="center", va="center")
    axes[-1].set_xlabel("time since step 1 (s)")
    axes[-1].set_xlim(left=0)
    return save(fig, path)


register_plots(SystemPlots("stannis", "stannis", plot_stannis))
