"""The training plot's layout: the accuracy axis ends at 100%, and event labels never
print over one another, in one run or in several compared on one axes (issue 37, item 5)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import matplotlib
import pytest

matplotlib.use("Agg")

from mpipipe import report, report_command  # noqa: E402
from mpipipe.core.logs.runlog import RunData, RunLog  # noqa: E402
from mpipipe.tools import logplot  # noqa: E402


def near_perfect_log(path: Path, *, fault_step: int = 40, steps: int = 60) -> Path:
    """A run whose accuracy climbs to 100%, with four events at one step (a kill, its
    detection, the takeover and the recovery) and two more faults at that same step."""
    log = RunLog(path, system="mpipipe", config={}, comm_size=3,
                 attrs={"plan": "0=stage 0, 1=stage 1, 2=backup 1"})
    for step in range(1, steps + 1):
        log.step(step, time=step * 0.1, loss=1.0 / step, samples=8, samples_per_s=80.0,
                 ranks={r: {"compute_s": 0.05, "wait_s": 0.05, "bytes_sent": 1, "bytes_recv": 1} for r in (0, 1)})
        if step % 10 == 0:
            log.eval(step, time=step * 0.1, accuracy=min(1.0, 0.95 + step / 1000))
    t = fault_step * 0.1
    for kind, dt in (("fault_injected", 0.0), ("fault_injected", 0.001), ("fault_injected", 0.002),
                     ("failure_detected", 0.05), ("takeover", 0.1), ("takeover_recovered", 0.2)):
        log.event(kind, step=fault_step, rank=1, time=t + dt)
    log.close()
    return path


def drawn_figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The figures the report saves, kept open (the report closes each after saving)."""
    figures: list[Any] = []

    def keep(fig: Any, path: Path) -> Path:
        figures.append(fig)
        fig.savefig(path, dpi=50)
        return path

    monkeypatch.setattr(report, "save", keep)
    return figures


def axes_titled(figures: list[Any], title: str) -> Any:
    return next(ax for fig in figures for ax in fig.axes if ax.get_title() == title)


@pytest.mark.timeout(120)
def test_the_accuracy_axis_ends_at_100_percent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures = drawn_figures(monkeypatch)
    log = near_perfect_log(tmp_path / "run.h5")
    assert report_command.main([str(log), "--out", str(tmp_path / "plots")]) == 0
    for x in ("step", "time"):
        ax = axes_titled(figures, f"test accuracy against {x}")
        lo, hi = ax.get_ylim()
        assert hi == pytest.approx(100.0), (x, lo, hi)
        assert 0.0 <= lo <= 96.0, (x, lo, hi)  # the lowest point (96%) stays in view
        assert max(line.get_ydata().max() for line in ax.lines if len(line.get_ydata()) > 2) == 100.0
    # the other panels keep matplotlib's own limits
    loss = axes_titled(figures, "training loss against step")
    assert loss.get_ylim()[1] < 2.0


def test_percent_axis_keeps_a_range_inside_0_to_100() -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([1, 2, 3], [20.0, 50.0, 70.0])
    before = ax.get_ylim()
    logplot.percent_axis(ax)
    assert ax.get_ylim() == pytest.approx(before)  # inside 0..100: as matplotlib chose
    ax.plot([1, 2], [0.0, 100.0])
    ax.relim()
    ax.autoscale()
    logplot.percent_axis(ax)
    assert ax.get_ylim() == pytest.approx((0.0, 100.0))
    plt.close(fig)


def _overlaps(fig: Any, texts: list[Any]) -> list[tuple[str, str]]:
    """Pairs of texts whose drawn boxes overlap (in display pixels)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    return [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2) if box_a.overlaps(box_b)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("x", ["step", "time"])
@pytest.mark.parametrize("runs", [1, 4])
def test_event_labels_at_one_step_never_overprint(tmp_path: Path, x: str, runs: int) -> None:
    """Four runs compared on one axes, each with its faults at step 40 (what the training
    plot of a comparison draws), and one run alone: each label is readable."""
    import matplotlib.pyplot as plt

    logs: list[RunData] = [report.load_run(near_perfect_log(tmp_path / f"run{i}.h5")) for i in range(runs)]
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot([0, 60], [0, 1])
    colors = matplotlib.colormaps["tab10"]
    for i, run in enumerate(logs):
        logplot.mark_events(ax, run, colors(i), x, label_kinds=True)
    texts = list(ax.texts)
    assert len(texts) == runs, [t.get_text() for t in texts]  # one label per run at that step
    assert all(t.get_text().strip() == "fault, detected, takeover, recovered" for t in texts)
    assert _overlaps(fig, texts) == []
    # each label stays beside its events' line: within a few labels' width of it
    fig.canvas.draw()
    line_px = ax.transData.transform((logs[0].events[0][x] - logplot.first_step_time(logs[0]) * (x == "time"), 0))[0]
    for t in texts:
        box = t.get_window_extent(fig.canvas.get_renderer())
        assert line_px - 20 * (runs + 1) < box.x1 <= line_px + 1, (box, line_px)
    plt.close(fig)


@pytest.mark.timeout(120)
def test_labels_of_events_far_apart_stay_at_their_lines(tmp_path: Path) -> None:
    """Stacking moves only labels that would collide: two runs with faults at different steps
    keep each label at its own line."""
    import matplotlib.pyplot as plt

    a = report.load_run(near_perfect_log(tmp_path / "a.h5", fault_step=10))
    b = report.load_run(near_perfect_log(tmp_path / "b.h5", fault_step=50))
    fig, ax = plt.subplots(figsize=(6, 3))
    for run, color in ((a, "C0"), (b, "C1")):
        logplot.mark_events(ax, run, color, "step", label_kinds=True)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for t, step in zip(ax.texts, (10, 50), strict=True):
        right = t.get_window_extent(renderer).x1
        assert math.isclose(right, ax.transData.transform((step, 0))[0], abs_tol=1.0)
    plt.close(fig)
