"""`python -m mpipipe cost`: ResPipe's communication cost against R, from a configuration,
and with ``--failure-rate`` the goodput of each (mode, R) and the one to run.

A command on top of :mod:`mpipipe.respipe.costmodel` (bytes) and
:mod:`mpipipe.respipe.goodput` (time under failures); it needs no MPI.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from mpipipe.core.run.cli import add_dry_run_arguments
from mpipipe.respipe.costmodel import DEFAULT_R, MODES, shapes_from_config, trade_off

__all__ = ["add_parser", "cost_main", "format_table", "format_goodput"]

def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f}"


def _aligned(head: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """Columns right-aligned to their widest cell, the header first."""
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The trade-off table as aligned text (what ``python -m mpipipe cost`` prints)."""
    head = ("mode", "R", "plain/step", "respipe/step", "replica/step", "shadow/step", "overhead",
            "max lost updates")
    body = [(r["mode"], str(r["R"]), _size(r["plain_bytes"]), _size(r["respipe_bytes"]),
             _size(r["replica_bytes"]), _size(r["shadow_bytes"]), f"{100 * r['overhead']:.1f}%",
             str(r["lost_updates"])) for r in rows]
    return _aligned(head, body)


def format_goodput(rows: Sequence[Mapping[str, Any]]) -> str:
    """The goodput table as aligned text (``python -m mpipipe cost --failure-rate``)."""
    head = ("mode", "R", "bytes/step", "step", "samples/s", "goodput", "lose run", "lost upd.")
    body = [(r["mode"], str(r["R"]), _size(r["respipe_bytes"]), f"{1000 * r['step_s']:.2f} ms",
             f"{r['samples_per_s']:,.0f}", f"{r['goodput']:,.0f}", f"{100 * r['lose_run']:.3g}%",
             f"{r['lost_updates']:g}") for r in rows]
    return _aligned(head, body)


# -- `python -m mpipipe cost` ------------------------------------------------------------------

def add_parser(subparsers: Any) -> Any:
    """Register ``cost`` on the ``python -m mpipipe`` dispatcher."""


    parser = subparsers.add_parser(
        "cost", help="print the communication cost of ResPipe against R (no MPI needed)",
        description="Predict bytes per optimizer step for the plain pipeline and for ResPipe "
                    "over a range of replication intervals R, in cold and hot modes, and the "
                    "updates a takeover can lose. The model is built from the configuration.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dry_run_arguments(parser)
    parser.add_argument("--r", metavar="R,R,...", default=",".join(map(str, DEFAULT_R)),
                        help="replication intervals to tabulate (default: %(default)s)")
    parser.add_argument("--modes", metavar="MODE,...", default="cold,hot,neighbour",
                        help="modes to tabulate (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="one JSON line instead of a table")
    g = parser.add_argument_group(
        "goodput under failures", "with --failure-rate: each (mode, R)'s useful samples per "
        "second and chance of losing the run, and the setting to run (docs/goodput.md). The "
        "stages' compute is measured here, on one core each, unless --step-time is given.")
    g.add_argument("--failure-rate", metavar="RATE",
                   help="failures of each rank, e.g. 1/30min, 2/h, or per second (0: none)")
    g.add_argument("--link-rate", metavar="RATE", default="1gbit",
                   help="each node's link, e.g. 100mbit, 1gbit (default: %(default)s)")
    g.add_argument("--step-time", metavar="TIME",
                   help="the plain pipeline's measured step on your nodes, e.g. 50ms: the "
                        "stages' compute is scaled to it (default: measured here)")
    g.add_argument("--rejoin", metavar="TIME",
                   help="a failed rank is back as a backup after this long, e.g. 5min "
                        "(default: never)")
    g.add_argument("--run-time", metavar="TIME",
                   help="the run's length, for the chance of losing it (default: the "
                        "config's steps at the predicted step time)")
    g.add_argument("--detect", metavar="TIME", default="50ms",
                   help="time to detect a failure: ULFM's, or the deadline (default: %(default)s)")
    g.add_argument("--takeover", metavar="TIME", default="100ms",
                   help="a takeover round with its rebuild (default: %(default)s)")
    parser.set_defaults(func=cost_main)
    return parser


def cost_main(args: Any) -> int:
    """Body of ``python -m mpipipe cost``; exit status 2 on a configuration error."""
    import json
    import sys

    from mpipipe.core.mpi.roles import PlanError
    from mpipipe.core.run.configfile import ConfigError, load_config
    from mpipipe.pipeline.config import PIPELINE_CHOICES, PIPELINE_DEFAULTS
    from mpipipe.pipeline.plan import backup_counts

    prog = "mpipipe cost"
    try:
        cfg = load_config(args.config, args.set, PIPELINE_DEFAULTS, PIPELINE_CHOICES)
        rs = [int(r) for r in args.r.split(",") if r.strip()]
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        bad = [m for m in modes if m not in MODES]
        if bad or not rs or min(rs) < 1:
            raise ConfigError(f"--modes must name {', '.join(MODES)} and --r positive integers")
        k = cfg["pipeline"]["stages"]
        backups = backup_counts(cfg["resilience"]["backups"], k)
        shapes, in_bytes, balance, note = shapes_from_config(cfg, args.in_shape)
    except (ConfigError, PlanError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    assumed = ""
    if not backups:
        backups = dict.fromkeys(range(k), 1)
        assumed = " (none configured: assuming one per stage)"
    batch = cfg["data"]["batch_size"]
    label = 8 if k > 1 else 0
    if args.failure_rate is not None:
        try:
            return _goodput(args, cfg, shapes, backups, assumed, modes, rs, label, in_bytes, balance)
        except ValueError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
    rows = trade_off(shapes, batch_size=batch, backups=backups, modes=modes, rs=rs,
                     label_bytes=label, input_bytes=in_bytes)
    if args.json:
        print(json.dumps({"balance": balance, "backups": backups, "batch_size": batch,
                          "rows": rows}))
        return 0
    chunks = f" of {len(balance) // k} chunks each" if len(balance) > k else ""
    model = cfg["model"]["factory"] or cfg["model"]["name"]
    print(f"{model} in {k} stages{chunks}, balance {balance}{note}; batch {batch}; "
          f"backups {backups}{assumed}")
    print(format_table(rows))
    print("bytes are payload per optimizer step, all ranks together; 'max lost updates' is "
          "what a takeover can lose of the failed stage")
    return 0




def _time(text: str | None, what: str) -> float | None:
    """A duration option in seconds (None if not given); ValueError names the option."""
    from mpipipe.core.units import parse_duration

    try:
        return None if text is None else parse_duration(text)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def _goodput(args: Any, cfg: Mapping[str, Any], shapes: Sequence[Any], backups: Mapping[int, int],
             assumed: str, modes: Sequence[str], rs: Sequence[int], label: int, in_bytes: int,
             balance: Sequence[int]) -> int:
    """``cost --failure-rate``: the goodput table and the recommendation."""
    import json

    from mpipipe.core.units import format_rate, parse_link_rate, parse_rate
    from mpipipe.respipe import goodput
    from mpipipe.respipe.costmodel import cut_from_config, predict

    try:
        rate = parse_rate(args.failure_rate)
    except ValueError as e:
        raise ValueError(f"--failure-rate: {e}") from None
    try:
        link = parse_link_rate(args.link_rate)
    except ValueError as e:
        raise ValueError(f"--link-rate: {e}") from None
    k, batch, chunks = cfg["pipeline"]["stages"], cfg["data"]["batch_size"], cfg["pipeline"]["chunks"]
    cut = cut_from_config(cfg, args.in_shape)
    compute, pack = goodput.measure_costs(cut.parts, cut.in_shape, cut.make_optimizer, k,
                                          batch_size=batch, chunks=chunks)
    costs = goodput.Costs(compute, batch, chunks, link, pack, _time(args.detect, "--detect"),
                          _time(args.takeover, "--takeover"), label, in_bytes)
    measured = "measured here"
    step_time = _time(args.step_time, "--step-time")
    if step_time is not None:  # scale the stages' compute so the plain step is the user's
        try:
            costs = goodput.scaled_to_plain_step(shapes, costs, step_time)
        except ValueError as e:
            raise ValueError(f"--step-time {args.step_time}: {e}") from None
        measured = f"scaled to a plain step of {args.step_time}"
    failures = goodput.Failures(rate, _time(args.rejoin, "--rejoin"), _time(args.run_time, "--run-time"),
                                int(cfg["run"]["steps"]) or 1000)
    preds = goodput.grid(shapes, costs, failures, backups=backups, modes=modes, rs=rs)
    plain = goodput.plain_samples_per_s(shapes, costs)
    best, why = goodput.recommend(preds, plain)
    rows = []
    for p in preds:
        c = predict(shapes, batch_size=batch, backups=backups, replicate_every=p.R, mode=p.mode,
                    label_bytes=label, input_bytes=in_bytes)
        rows.append({**p.row(), "respipe_bytes": c.total})
    if args.json:
        print(json.dumps({"balance": list(balance), "backups": dict(backups), "batch_size": batch,
                          "failure_rate_per_s": rate, "link_mbit": link,
                          "compute_s": list(costs.compute_s), "plain_samples_per_s": plain,
                          "rows": rows, "recommended": {"mode": best.mode, "R": best.R, "why": why}}))
        return 0
    model = cfg["model"]["factory"] or cfg["model"]["name"]
    print(f"{model} in {k} stages, balance {list(balance)}; batch {batch}, {chunks} micro-batches; "
          f"backups {dict(backups)}{assumed}")
    print(f"failures: {format_rate(rate)} per rank; links {link:g} Mbit/s; stage compute "
          f"{', '.join(f'{1000 * c:.2f}' for c in costs.compute_s)} ms per mini-batch ({measured}); "
          f"plain pipeline {plain:,.0f} samples/s")
    print(format_goodput(rows))
    print(f"recommended: {why}")
    return 0
