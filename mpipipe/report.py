"""The `report` library: HDF5 run logs in, a terminal summary, tables and PNG plots out.

One report reads every run either system writes (the schema is shared, see
docs/hdf5-log.md), so ResPipe can be laid over the plain pipeline and tuned
batches over equal ones on the same axes. A log cut short by a killed run is
reported up to its last step. The command line (``python -m mpipipe report``: its
arguments, printing and exit status) is :mod:`mpipipe.report_command`; benches and
scripts call the functions here.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mpipipe.core.logs.logschema import RECIPE, EventKind
from mpipipe.core.logs.logschema import required as required_columns
from mpipipe.core.logs.progress import throughput as _throughput
from mpipipe.core.logs.runlog import LogError, RunData, open_for_reading, open_log
from mpipipe.tools.logplot import (
    EVENT_STYLES,
    LINESTYLES,
    MAX_MARKED,
    ROUTINE_EVENTS,
    UNMARKED_EVENTS,
    SystemPlots,
    as_float,
    first_step_time,
    mark_events,
    percent_axis,
    rank_label,
    registered_plots,
    roles,
    save,
)

__all__ = ["load_run", "summarize", "recipe_lines", "compare", "plot_runs", "plot_tradeoff"]

# Columns a log must hold once its group has any rows (mpipipe/core/logs/logschema.py).
_REQUIRED = {group: required_columns(group) for group in ("steps", "eval", "ranks")}
_EVENT_COLUMNS = required_columns("events")

# Configuration keys worth a glance, in display order; other sections are shown whole.
_HIGHLIGHTS = (
    "model.name", "data.batch_size", "optim.name", "optim.lr", "optim.base_batch", "run.steps", "run.epochs",
    "run.seed", "pipeline.stages", "pipeline.chunks", "pipeline.schedule", "pipeline.balance",
    "resilience.backups", "resilience.replicate_every", "resilience.mode", "resilience.deadline_s",
    "resilience.deadline_factor", "resilience.inject",
    "stannis.csds", "stannis.global_batch", "stannis.tune", "stannis.objective", "stannis.retune_every",
    "stannis.imbalance_threshold", "stannis.inject", "csd.slowdown", "csd.slowdowns", "csd.emulated",
    "host.energy",
)
# Where a run's data set keeps its training split under data.path: train/ (mpipipe), or
# public/train/ (stannis prepare: the host's public part; the CSDs' parts hold the same classes).
_TRAIN_SPLITS = ("train", "public/train")
MAX_CLASSES_SHOWN = 20  # a 1000-class data set gets the first names and a count, not a page of them
_QUIET_SECTIONS = frozenset({"run", "data", "model", "optim", "pipeline", "resilience", "plan",
                             "stannis", "host", "csd"})

# ---------------------------------------------------------------- loading


# A log read while its run writes it may be caught mid-flush (h5py: "bad heap index"):
# read it again. Under load a read takes longer and overlaps more writes: 5 tries 0.2 s
# apart all failed once beside two busy loops (make test-stress), with a writer
# appending a row every 5 ms.
READ_TRIES = 20
READ_RETRY_S = 0.1


def load_run(path: str | Path) -> RunData:
    """Read and check one run log, so that the report never meets a missing column.

    A log still being written is read too (open_log does not take HDF5's file
    lock); a read that meets a half-written record is tried again a few times
    before the file is called damaged.

    Raises:
        LogError: the file is missing, not HDF5, not a run log, or damaged;
            the one-line message names the file and what is missing.
    """
    for attempt in range(READ_TRIES):
        try:
            run = open_log(path)
            break
        except LogError as e:
            if not Path(path).exists() or "not an mpipipe run log" in str(e) or attempt == READ_TRIES - 1:
                raise LogError(one_line(str(e))) from None
        except KeyError as e:
            if attempt == READ_TRIES - 1:
                raise LogError(one_line(f"{path}: damaged run log: column {e} is missing "
                                         f"(schema: docs/hdf5-log.md)")) from None
        except (OSError, ValueError, TypeError, RuntimeError) as e:
            # h5py raises these for a file damaged inside (bad chunk, broken link)
            if attempt == READ_TRIES - 1:
                raise LogError(one_line(f"{path}: damaged run log ({type(e).__name__}: {e})")) from None
        time.sleep(READ_RETRY_S)
    missing = _missing_event_columns(run.path)
    if missing:
        raise LogError(f"{run.path}: damaged run log: /events lacks column(s) {', '.join(missing)} "
                       f"(schema: docs/hdf5-log.md)")
    tables = [("/steps", run.steps, _REQUIRED["steps"]), ("/eval", run.eval, _REQUIRED["eval"])]
    tables += [(f"/ranks/{r}", cols, _REQUIRED["ranks"]) for r, cols in run.ranks.items()]
    for where, cols, required in tables:
        if not cols:
            continue  # nothing recorded yet (a run killed before its first step)
        missing = [c for c in required if c not in cols]
        if missing:
            raise LogError(f"{run.path}: damaged run log: {where} lacks column(s) "
                           f"{', '.join(missing)} (schema: docs/hdf5-log.md)")
    return run


def _missing_event_columns(path: Path) -> list[str]:
    """The /events columns RunLog always creates but this file lacks (open_log reads such a file as eventless)."""
    try:
        with open_for_reading(path) as f:
            return [c for c in _EVENT_COLUMNS if c not in f["events"]]
    except (OSError, KeyError):  # open_log read it a moment ago; nothing more to say
        return []


def one_line(text: str) -> str:
    """``text`` on one line (an error message is one line of the report's output)."""
    return " ".join(text.split())


# ---------------------------------------------------------------- figures


def _nansum(a: np.ndarray) -> float:
    return float(np.nansum(a)) if a.size and not np.all(np.isnan(a)) else math.nan


def last_step(run: RunData) -> int:
    steps = run.steps.get("step")
    return int(steps[-1]) if steps is not None and len(steps) else 0


def throughput(run: RunData) -> float:
    """The run's samples/s, as the summary line and the progress display give it:
    :func:`mpipipe.core.logs.progress.throughput` of the log's ``time`` and ``samples`` columns
    (samples of steps 2..n over the wall seconds from step 1 to step n)."""
    t = as_float(run.steps.get("time", np.array([])))
    s = as_float(run.steps.get("samples", np.array([])))
    steps = run.steps.get("step", np.arange(1, len(t) + 1))
    return _throughput(t.tolist(), s.tolist(), steps.tolist(), [e["step"] for e in run.events_of(EventKind.RESUME)])


def final_loss(run: RunData) -> float:
    loss = as_float(run.steps.get("loss", np.array([])))
    ok = loss[~np.isnan(loss)]
    return float(ok[-1]) if ok.size else math.nan


def final_accuracy(run: RunData) -> tuple[float, int]:
    acc = as_float(run.eval.get("accuracy", np.array([])))
    if not acc.size:
        return math.nan, 0
    return float(acc[-1]), int(run.eval["step"][-1])


def idle_ranks(run: RunData) -> list[int]:
    """Ranks of the plan with no per-step row: backups that only stood by (a cold backup
    receives replicas but runs no step), or a rank that died before its first step."""
    return sorted(r for r in roles(run) if not len(run.ranks.get(r, {}).get("step", [])))


def rank_figures(cols: dict[str, np.ndarray]) -> dict[str, float]:
    """Totals of one rank's per-step columns (NaN where the rank did not record a figure)."""
    compute = as_float(cols.get("compute_s", np.array([])))
    wait = as_float(cols.get("wait_s", np.array([])))
    n = len(cols.get("step", []))
    busy = _nansum(compute) + _nansum(wait) if n else math.nan
    fig = {
        "steps": float(n),
        "compute_s": _nansum(compute),
        "wait_s": _nansum(wait),
        "step_s": busy / n if n else math.nan,
        "wait_frac": _nansum(wait) / busy if n and busy > 0 else math.nan,
        "bytes_sent": _nansum(as_float(cols.get("bytes_sent", np.array([])))),
        "bytes_recv": _nansum(as_float(cols.get("bytes_recv", np.array([])))),
    }
    if "batch_size" in cols:
        batch = as_float(cols["batch_size"])
        fig["batch_last"] = float(batch[~np.isnan(batch)][-1]) if np.any(~np.isnan(batch)) else math.nan
        fig["samples"] = _nansum(batch)
        compute_total = _nansum(compute)
        fig["samples_per_s"] = fig["samples"] / compute_total if compute_total > 0 else math.nan
    if "joules" in cols:
        fig["joules"] = _nansum(as_float(cols["joules"]))
        if "samples" in fig and fig["joules"] > 0:
            fig["samples_per_j"] = fig["samples"] / fig["joules"]
    return fig


# ---------------------------------------------------------------- text


def _fmt(value: float, spec: str = ".4g", missing: str = "-") -> str:
    return missing if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _bytes(n: float) -> str:
    if math.isnan(n):
        return "-"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _flatten(cfg: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value and prefix == "":
            out.update(_flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def config_highlights(run: RunData) -> list[str]:
    """``key=value`` for the settings that explain a result; free-form sections shown whole."""
    flat = _flatten(run.config)
    items = [(k, flat[k]) for k in _HIGHLIGHTS if k in flat]
    items += [(k, v) for k, v in flat.items() if k.split(".", 1)[0] not in _QUIET_SECTIONS]
    out = []
    for key, value in items:
        if value in ({}, [], "", None):
            continue
        text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
        out.append(f"{key}={text if len(text) <= 60 else text[:57] + '...'}")
    return out


def dataset_classes(run: RunData) -> list[str] | None:
    """The class names of the data set the run trained on, read from its manifest now.

    Why: the log records only ``data.path``, and label numbers mean nothing to a reader
    without the names (issue 27); the names live in the data set's manifest
    (`native.classes_of`). The path is taken as the run was given it, so a relative one
    is read from the current directory, as the run read it. A data set that has moved,
    been deleted, or has no names (made from arrays), gives None: a report of an old
    log must still work, so nothing here ever raises.
    """
    data = run.config.get("data") if isinstance(run.config, dict) else None
    root = data.get("path") if isinstance(data, dict) else None
    if not isinstance(root, str) or not root:
        return None
    try:  # here, not at the top: a report of logs copied to a laptop needs no built extension
        from native import ShardError, classes_of
    except ImportError:
        return None
    for split in _TRAIN_SPLITS:
        where = Path(root) / split
        try:
            if not where.is_dir():
                continue
            names = classes_of(where)
        except (ShardError, OSError, ValueError):  # no manifest, unreadable, or a malformed "classes"
            continue
        if names:
            return names
    return None


def classes_line(names: Sequence[str]) -> str:
    """``classes: a, b, c`` (label i is the i-th name); past MAX_CLASSES_SHOWN names, the
    first ones and how many there are, so the summary stays a summary."""
    if len(names) <= MAX_CLASSES_SHOWN:
        return "classes: " + ", ".join(names)
    return f"classes: {', '.join(names[:MAX_CLASSES_SHOWN])}, ... ({len(names)} in all)"


# How a part of the recipe came to the run (its "source", mpipipe.core.logs.logschema.RECIPE).
_SOURCES = {"object": "given to train()", "builder": "built by the function given to train()",
            "factory": "model.factory", "shipped": "shipped", "config": "from the configuration"}


def _setting(key: str, value: Any) -> str | None:
    """``key=value`` of one hyper-parameter, or None for an unset one (None, false)."""
    if value is None or value is False:
        return None

    def short(v: Any) -> Any:  # 6 significant digits: 0.0007999999999999986 is 0.0008
        if isinstance(v, float):
            return float(f"{v:.6g}")
        return [short(x) for x in v] if isinstance(v, list) else v

    text = value if isinstance(value, str) else json.dumps(short(value), separators=(",", ":"))
    return f"{key}={text if len(text) <= 40 else text[:37] + '...'}"


def _settings(values: Any, skip: Sequence[str] = ()) -> list[str]:
    """The ``key=value`` words of a mapping (private keys, lists of objects and ``skip`` left out)."""
    if not isinstance(values, dict):
        return []
    words = []
    for key, value in values.items():
        if key.startswith("_") or key in skip or (isinstance(value, list) and any(isinstance(v, dict) for v in value)):
            continue
        word = _setting(key, value)
        if word:
            words.append(word)
    return words


def recipe_lines(run: RunData) -> list[str]:
    """The recipe that ran, one part a line (wrapped): the log's ``recipe`` attribute, read
    from the objects themselves (docs/hdf5-log.md); nothing for a log without one (a run
    that failed before its model was built, or an older writer's)."""
    if not run.attrs.get("recipe"):
        return []
    try:
        record = json.loads(str(run.attrs["recipe"]))
    except json.JSONDecodeError:
        return ["   recipe: unreadable (root attribute 'recipe' is not JSON)"]
    if not isinstance(record, dict) or not record:
        return []
    lines = ["   recipe (what ran):"]
    for part in RECIPE:
        item = record.get(part)
        if not isinstance(item, dict):
            continue
        where = f" ({item['module']})" if item.get("module") else ""
        source = _SOURCES.get(str(item.get("source")), str(item.get("source", "")))
        if part == "model" and item.get("source") == "shipped":
            source = f"shipped {item.get('name', '?')!r}"
        elif part == "model" and item.get("source") == "factory":
            source = f"model.factory = {item.get('factory', '?')!r}"
        head = f"{item.get('class', '')}{where}".strip()
        words = [f"{head}, {source}:" if head else f"{source}:"]
        if part == "model":
            words += [f"{item.get('parameters', 0):,} parameters", f"digest {item.get('digest', '?')}"]
            words += _settings(item.get("kwargs"))
        elif part == "optimizer":
            groups = item.get("groups") or []
            for i, group in enumerate(groups):
                words += ([f"group {i}:"] if len(groups) > 1 else []) + _settings(group)
            words += [f"error: {item['error']}"] if item.get("error") else []
        elif part == "schedule":
            if "class" in item:
                words += _settings(item.get("arguments"), skip=("base_lrs",)) + _settings(item.get("group"))
                if isinstance(item.get("first_step"), dict):
                    words += ["step 1:", *_settings(item["first_step"])]
            else:
                words = [f"{item.get('rule', '?')} (no scheduler), {source}:",
                         *_settings({k: v for k, v in item.items() if k not in ("rule", "source")})]
        else:
            words += _settings(item.get("arguments"))
        body = _wrap(words, " " * 16)
        lines += [f"     {part:<10} {body[0].lstrip()}", *body[1:]]
    return lines


def _wrap(words: list[str], indent: str, width: int = 100) -> list[str]:
    lines, line = [], indent
    for w in words:
        if len(line) + len(w) + 2 > width and line.strip():
            lines.append(line.rstrip())
            line = indent
        line += w + "  "
    if line.strip():
        lines.append(line.rstrip())
    return lines


def _event_line(ev: dict[str, Any], role: str) -> str:
    detail = dict(ev["detail"])
    timing = []
    for key in ("detected_after_s", "recovery_s"):
        if isinstance(detail.get(key), int | float):
            timing.append(f"{key.removesuffix('_s').replace('_', ' ')} {detail.pop(key):.3f} s")
    rest = json.dumps(detail, separators=(",", ":"), default=str) if detail else ""
    if len(rest) > 70:
        rest = rest[:67] + "..."
    who = f"rank {ev['rank']}" + (f" ({role})" if role else "") if ev["rank"] >= 0 else ""
    return (f"    step {ev['step']:>5}  t={ev['time']:8.2f}s  {ev['kind']:<16} {who:<18} "
            f"{'  '.join(timing)}{'  ' if timing and rest else ''}{rest}").rstrip()


def _summarized(kind: str, counts: Counter[str]) -> bool:
    """Routine kinds past 5 and any kind past 10 are counted, not listed (random delays make hundreds)."""
    return counts[kind] > (5 if kind in ROUTINE_EVENTS else 10)


def summarize(run: RunData) -> str:
    """The terminal summary of one run: what ran, how far, how fast, where time went, what happened."""
    lines = _about_lines(run) + _progress_lines(run)
    if run.ranks:
        lines += _rank_lines(run)
    lines += _events_lines(run)
    return "\n".join(lines)


def _about_lines(run: RunData) -> list[str]:
    """What ran: the file, system and status, when and where, plan, emulation, settings,
    recipe and the data set's classes."""
    a = run.attrs
    status = str(a.get("status", "?"))
    lines = [f"== {run.path}  ({run.system}, {a.get('world_size', '?')} ranks, status: {status})"]
    if status == "running":
        lines.append(f"   ! the run did not finish (killed, or still going): reported up to step {last_step(run)}")
    elif status.startswith("failed"):
        lines.append(f"   ! {status}")
    started = a.get("start_time", "?")
    where = f" on {a['hostname']}" if a.get("hostname") else ""
    ended = f", ended {a['end_time']}" if a.get("end_time") else ""
    lines.append(f"   started {started}{where}{ended}")
    if a.get("plan"):
        lines.append(f"   plan: {a['plan']}")
    emulation = a.get("emulation", "{}")
    if emulation not in ("{}", "", None):
        lines.append(f"   emulated: {emulation if len(str(emulation)) <= 90 else str(emulation)[:87] + '...'}")
    cfg = config_highlights(run)
    if cfg:
        lines.append("   config:")
        lines += _wrap(cfg, "     ")
    lines += recipe_lines(run)
    names = dataset_classes(run)
    if names:
        lines.append("   " + classes_line(names))
    return lines


def _progress_lines(run: RunData) -> list[str]:
    """How far and how fast: steps, samples, samples/s, the final loss and test accuracy."""
    n = len(run.steps.get("step", []))
    lines = []
    if n == 0:
        lines.append("   steps: none recorded")
    else:
        t = as_float(run.steps["time"])
        samples = _nansum(as_float(run.steps["samples"]))
        lines.append(f"   steps: {n} (last step {last_step(run)}, {samples:,.0f} samples, "
                     f"{_fmt(float(t[-1]), '.1f')} s since start)")
        sps = as_float(run.steps["samples_per_s"])
        median = float(np.nanmedian(sps)) if np.any(~np.isnan(sps)) else math.nan
        lines.append(f"   samples/s: {_fmt(throughput(run), ',.1f')} (samples of steps 2..n / seconds "
                     f"from step 1 to n); median per step {_fmt(median, ',.1f')}")
    acc, acc_step = final_accuracy(run)
    acc_text = f"{acc * 100:.2f}% (step {acc_step}, {len(run.eval.get('step', []))} evaluations)" \
        if not math.isnan(acc) else "not evaluated"
    lines.append(f"   final loss: {_fmt(final_loss(run), '.4f')}    test accuracy: {acc_text}")
    return lines


def _rank_lines(run: RunData) -> list[str]:
    """Where time went: one row per rank (Stannis: with batch, speed and energy), the idle
    ranks, and Stannis's energy in all."""
    role_of = roles(run)
    stannis = any("batch_size" in c for c in run.ranks.values())
    head = f"   {'rank':>4} {'role':<10} {'steps':>5} {'compute s':>10} {'wait s':>9} {'wait':>6} " \
           f"{'step s':>8} {'sent':>10} {'received':>10}"
    if stannis:
        head += f" {'batch':>6} {'samples/s':>10} {'joules':>9} {'samples/J':>10}"
    lines = ["   per rank (compute = forward, backward, optimizer; wait = blocked on messages):", head]
    total_samples = total_j = 0.0
    for rank, cols in run.ranks.items():
        f = rank_figures(cols)
        row = (f"   {rank:>4} {role_of.get(rank, '?'):<10} {f['steps']:>5.0f} {_fmt(f['compute_s'], '10.3f'):>10} "
               f"{_fmt(f['wait_s'], '9.3f'):>9} {_fmt(f['wait_frac'] * 100, '5.1f') + '%':>6} "
               f"{_fmt(f['step_s'], '8.4f'):>8} {_bytes(f['bytes_sent']):>10} {_bytes(f['bytes_recv']):>10}")
        if stannis:
            row += _stannis_columns(f)
            total_samples += 0 if math.isnan(f.get("samples", math.nan)) else f["samples"]
            total_j += 0 if math.isnan(f.get("joules", math.nan)) else f["joules"]
        lines.append(row)
    for rank in idle_ranks(run):
        lines.append(f"   {rank:>4} {role_of.get(rank, '?'):<10} {0:>5}  idle: no step rows (a backup "
                     f"that stood by, or a rank gone before its first step)")
    if stannis:
        lines.append("   (samples/s per rank = samples / compute time: the rank's own speed; samples/J = "
                     "samples / joules)")
    if stannis and total_j > 0:
        lines.append(f"   energy: {total_j:,.1f} J in all, {total_samples / total_j:,.2f} samples per joule")
    return lines


def _stannis_columns(f: dict[str, float]) -> str:
    """The columns a Stannis rank adds to its row: last batch, samples/s, joules, samples/J."""
    return (f" {_fmt(f.get('batch_last', math.nan), '6.0f'):>6} "
            f"{_fmt(f.get('samples_per_s', math.nan), '10.1f'):>10} "
            f"{_fmt(f.get('joules', math.nan), '9.2f'):>9} "
            f"{_fmt(f.get('samples_per_j', math.nan), '10.2f'):>10}")


def _events_lines(run: RunData) -> list[str]:
    """What happened: every event, except kinds so frequent that they are counted instead."""
    lines = [f"   events: {len(run.events) or 'none'}"]
    role_of = roles(run)
    counts = Counter(e["kind"] for e in run.events)
    for ev in run.events:
        if not _summarized(ev["kind"], counts):
            lines.append(_event_line(ev, role_of.get(ev["rank"], "")))
    for kind in sorted(k for k in counts if _summarized(k, counts)):
        steps = [e["step"] for e in run.events if e["kind"] == kind]
        lines.append(f"    {kind} x{counts[kind]} (steps {min(steps)}..{max(steps)})")
    return lines


def labels_for(runs: Sequence[RunData]) -> list[str]:
    """File names, or longer paths where two runs share a file name."""
    names = [r.path.name for r in runs]
    if len(set(names)) == len(names):
        return names
    return [str(r.path) for r in runs]


def compare(runs: Sequence[RunData]) -> str:
    """A side-by-side table of several runs, the first one as the reference for ratios."""
    labels = labels_for(runs)
    width = max(12, *(len(s) for s in labels))
    lines = ["== comparison (ratios against the first run)",
             f"   {'run':<{width}} {'system':<8} {'status':<10} {'steps':>6} {'samples/s':>10} {'x first':>8} "
             f"{'final loss':>10} {'accuracy':>9} {'sent/step':>10} {'events':>7}"]
    base = throughput(runs[0])
    for label, run in zip(labels, runs, strict=True):
        sps = throughput(run)
        acc, _ = final_accuracy(run)
        n = max(1, last_step(run))
        sent = float(np.nansum([_nansum(as_float(c.get("bytes_sent", np.array([])))) for c in run.ranks.values()]))
        sent = sent / n if run.ranks else math.nan
        acc_text = f"{acc * 100:.2f}%" if not math.isnan(acc) else "-"
        notable = sum(1 for e in run.events if e["kind"] not in ROUTINE_EVENTS)
        status = str(run.attrs.get("status", "?"))
        lines.append(
            f"   {label:<{width}} {run.system:<8} {status[:10]:<10} {last_step(run):>6} {_fmt(sps, ',.1f'):>10} "
            f"{_fmt(sps / base if base and not math.isnan(base) else math.nan, '.2f'):>8} "
            f"{_fmt(final_loss(run), '.4f'):>10} {acc_text:>9} "
            f"{_bytes(sent):>10} {notable:>7}")
    return "\n".join(lines)


# ---------------------------------------------------------------- plots


def _run_colors(n: int) -> list[Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def _plot_training(runs: Sequence[RunData], labels: list[str], colors: list[Any], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(12, 11))
    panels = [("steps", "loss", "training loss"), ("eval", "accuracy", "test accuracy"),
              ("steps", "samples_per_s", "samples/s")]
    for row, (group, col, title) in enumerate(panels):
        for c, x in enumerate(("step", "time")):
            ax = axes[row][c]
            drawn = False
            for run, label, color in zip(runs, labels, colors, strict=True):
                table = getattr(run, group)
                if col in table and len(table[col]):
                    y = as_float(table[col]) * (100 if col == "accuracy" else 1)
                    xs = as_float(table[x]) - (first_step_time(run) if x == "time" else 0.0)
                    ax.plot(xs, y, color=color, label=label,
                            marker="o" if col == "accuracy" else None, markersize=3, linewidth=1.2)
                    drawn = True
                mark_events(ax, run, color, x, label_kinds=(row == 0))
            ax.set_xlabel("step" if x == "step" else "time since step 1 (s)")
            if x == "time":
                ax.set_xlim(left=0)  # time axes start at the first step
            ax.set_ylabel(title + (" (%)" if col == "accuracy" else ""))
            ax.set_title(f"{title} against {x}")
            ax.grid(alpha=0.3)
            if drawn and col == "accuracy":
                percent_axis(ax)
            if not drawn:
                ax.text(0.5, 0.5, f"no {title} recorded", transform=ax.transAxes, ha="center", va="center")
            elif row == 0 and c == 0:
                _legend_with_events(ax, runs)
    return save(fig, path)


def _legend_with_events(ax: Any, runs: Sequence[RunData]) -> None:
    from matplotlib.lines import Line2D

    handles, names = ax.get_legend_handles_labels()
    kinds: set[str] = set()
    for run in runs:
        counts = Counter(e["kind"] for e in run.events)
        kinds |= {k for k, n in counts.items() if k not in UNMARKED_EVENTS and n <= MAX_MARKED}
    for kind in sorted(kinds):
        handles.append(Line2D([], [], color="grey", linestyle=EVENT_STYLES.get(kind, "--")))
        names.append(f"event: {kind}")
    ax.legend(handles, names, fontsize=8)


def _plot_ranks(runs: Sequence[RunData], labels: list[str], path: Path) -> Path:
    import matplotlib
    import matplotlib.pyplot as plt

    cmap = matplotlib.colormaps["tab10"]
    several = len(runs) > 1
    fig, (left, right) = plt.subplots(2, 1, figsize=(12, 9))
    for i, (run, label) in enumerate(zip(runs, labels, strict=True)):
        role_of = roles(run)
        for rank, cols in run.ranks.items():
            if not len(cols.get("step", [])):
                continue
            step_s = as_float(cols["compute_s"]) + as_float(cols["wait_s"])
            left.plot(as_float(cols["step"]), step_s, color=cmap(rank % 10), linestyle=LINESTYLES[i % 4],
                      linewidth=1, label=rank_label(label, rank, role_of.get(rank, ""), several))
        mark_events(left, run, "black", "step", label_kinds=not several)
    # log scale: the first step (start-up, first allocations) is many times the others
    # and would flatten every later step into one line
    if left.lines:
        left.set_yscale("log")
    idle = [f"{label + ': ' if several else ''}rank {r}" + (f" ({roles(run)[r]})" if r in roles(run) else "")
            for run, label in zip(runs, labels, strict=True) for r in idle_ranks(run)]
    if idle:
        left.text(0.01, 0.02, "idle, no step rows: " + ", ".join(idle), transform=left.transAxes,
                  fontsize=7, va="bottom")
    left.set_xlabel("step")
    left.set_ylabel("step time per rank: compute + wait (s, log scale)")
    left.set_title("per-rank step time (lower is faster)")
    left.grid(alpha=0.3)
    if left.lines:
        left.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                    ncol=2 if sum(len(r.ranks) for r in runs) > 16 else 1)

    # mean compute and wait per step, side by side per run, ranks on the x axis
    width = 0.8 / len(runs)
    for i, (run, label) in enumerate(zip(runs, labels, strict=True)):
        ranks = [r for r, c in run.ranks.items() if len(c.get("step", []))]
        figs = [rank_figures(run.ranks[r]) for r in ranks]
        x = np.array(ranks, dtype=float) + (i - (len(runs) - 1) / 2) * width
        compute = np.array([f["compute_s"] / max(f["steps"], 1) for f in figs])
        wait = np.array([f["wait_s"] / max(f["steps"], 1) for f in figs])
        color = _run_colors(len(runs))[i]
        right.bar(x, np.nan_to_num(compute), width, color=color, label=f"{label}: compute" if several else "compute")
        right.bar(x, np.nan_to_num(wait), width, bottom=np.nan_to_num(compute), color=color, alpha=0.35,
                  hatch="//", label=f"{label}: wait" if several else "wait")
        for r in idle_ranks(run):
            xr = r + (i - (len(runs) - 1) / 2) * width
            right.text(xr, 0, "idle", ha="center", va="bottom", fontsize=7, rotation=90 if several else 0)
    right.set_xlabel("rank")
    right.set_ylabel("mean seconds per step")
    right.set_title("where each rank's time goes (idle: a backup that ran no step)")
    all_ranks = sorted({r for run in runs for r in run.ranks} | {r for run in runs for r in idle_ranks(run)})
    right.set_xticks(all_ranks)
    right.grid(alpha=0.3, axis="y")
    if all_ranks:
        right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save(fig, path)


def plots_for(system: str) -> SystemPlots | None:
    """The plots a system draws for its own runs: those that the module ``<system>.plots``
    registers (mpipipe.tools.logplot) when imported here, by the name the log gives in its
    ``system`` attribute. None if the system has no such module.

    Raises:
        ImportError (or whatever it raises): ``<system>.plots`` exists but fails to import;
            a broken plot module must not pass for a system without plots.
    """
    if registered_plots(system) is None and system.isidentifier():
        try:
            found = importlib.util.find_spec(f"{system}.plots")
        except ModuleNotFoundError:  # no package of that name
            found = None
        if found is not None:
            importlib.import_module(f"{system}.plots")
    return registered_plots(system)


def plot_runs(runs: Sequence[RunData], out: str | Path) -> list[Path]:
    """Write the PNG plots of ``runs`` (overlaid when several) into ``out``; return their paths.

    Uses matplotlib's Agg backend so that it works on a cluster node with no display.
    """
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "+".join(r.path.stem for r in runs)
    if len(stem) > 80:
        stem = f"{runs[0].path.stem}+{len(runs) - 1}-more"
    labels = labels_for(runs)
    colors = _run_colors(len(runs))
    paths = [_plot_training(runs, labels, colors, out / f"{stem}-training.png")]
    if any(run.ranks for run in runs):
        paths.append(_plot_ranks(runs, labels, out / f"{stem}-ranks.png"))
    for system in dict.fromkeys(r.system for r in runs):  # each system's own plots, in run order
        own = plots_for(system)
        if own is not None:
            mine = [i for i, r in enumerate(runs) if r.system == system]
            paths.append(own.plot([runs[i] for i in mine], [labels[i] for i in mine],
                                  out / f"{stem}-{own.suffix}.png"))
    return paths


def plot_tradeoff(rows: Sequence[dict[str, Any]], out: str | Path, *, title: str = "",
                  measured_lost: Sequence[tuple[str, int, float]] = ()) -> Path:
    """ResPipe's trade-off on one PNG: failure-free overhead and lost updates against R.

    Why: the replication interval R buys less overhead with more updates a takeover can
    lose, and how much less depends on the link rate; one figure shows both sides.
    ``rows`` carry ``mode``, ``R``, ``link_mbit``, ``overhead`` (measured step time over
    the plain pipeline's, minus 1) and ``lost_updates`` (the cost model's bound for that
    mode and R), and may carry ``overhead_interval`` ((lo, hi), drawn as an error bar);
    ``measured_lost`` adds (mode, R, lost updates) seen in runs with a fault.
    Left: overhead against R, one line per mode and link rate. Right: lost updates.

    Raises:
        ValueError: no rows, or a row without one of those keys.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _check_tradeoff_rows(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    _draw_tradeoff(left, right, rows, measured_lost)
    _label_tradeoff(left, right)
    if title:
        fig.suptitle(title)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save(fig, path)


_TRADEOFF_KEYS = ("mode", "R", "link_mbit", "overhead", "lost_updates")
_MODES = ("cold", "hot", "neighbour")  # the order of ResPipe's modes in the legend


def _check_tradeoff_rows(rows: Sequence[dict[str, Any]]) -> None:
    """Raises ValueError for no rows, or a row without one of the keys the plot reads."""
    if not rows:
        raise ValueError("plot_tradeoff needs at least one row")
    for row in rows:
        missing = [k for k in _TRADEOFF_KEYS if k not in row]
        if missing:
            raise ValueError(f"a trade-off row lacks {', '.join(missing)}: {row}")


def _draw_tradeoff(left: Any, right: Any, rows: Sequence[dict[str, Any]],
                   measured_lost: Sequence[tuple[str, int, float]]) -> None:
    """Overhead per mode and link rate on ``left``; the lost-update bound per mode, and
    the losses measured, on ``right`` (a colour per mode, a line style per link rate)."""
    modes = sorted({r["mode"] for r in rows}, key=lambda m: _MODES.index(m) if m in _MODES else 9)
    rates = sorted({float(r["link_mbit"]) for r in rows})
    colors = _run_colors(len(modes))
    for mode, color in zip(modes, colors, strict=True):
        for i, rate in enumerate(rates):
            pts = sorted((r["R"], 100 * r["overhead"]) for r in rows
                         if r["mode"] == mode and float(r["link_mbit"]) == rate and not math.isnan(r["overhead"]))
            if pts:
                left.plot(*zip(*pts, strict=True), marker="o", color=color, linestyle=LINESTYLES[i % 4],
                          label=f"{mode}, {rate:g} Mbit/s")
            for r in rows:  # a point measured in pairs: its bootstrap interval as an error bar
                if r["mode"] == mode and float(r["link_mbit"]) == rate and r.get("overhead_interval"):
                    lo, hi = r["overhead_interval"]
                    mid = 100 * r["overhead"]
                    left.errorbar([r["R"]], [mid], yerr=[[mid - 100 * lo], [100 * hi - mid]], fmt="none",
                                  color=color, capsize=3)
        bound = sorted({(r["R"], r["lost_updates"]) for r in rows if r["mode"] == mode})
        right.plot(*zip(*bound, strict=True), marker="o", color=color, label=f"{mode}: most a takeover can lose")
    for mode, r, lost in measured_lost:
        color = colors[modes.index(mode)] if mode in modes else "black"
        right.plot([r], [lost], marker="x", markersize=10, color=color, linestyle="none",
                   label=f"{mode}: lost in a node-kill run")


def _label_tradeoff(left: Any, right: Any) -> None:
    """Axes, titles, grids and legends of the two trade-off panels (a label once)."""
    left.axhline(0, color="grey", linewidth=0.8)
    left.set_xscale("log")
    left.set_xlabel("replication interval R (steps)")
    left.set_ylabel("failure-free step time over the plain pipeline (%)")
    left.set_title("overhead (measured)")
    right.set_xscale("log")
    right.set_xlabel("replication interval R (steps)")
    right.set_ylabel("updates of the failed stage lost")
    right.set_title("lost updates (the same at every link rate)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        ax.legend(unique.values(), unique.keys(), fontsize=7)
