"""`python -m mpipipe cost`: ResPipe's communication cost against R, from a configuration.

A command on top of :mod:`mpipipe.respipe.costmodel` (the model itself); it needs no MPI.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from mpipipe.core.run.cli import add_dry_run_arguments
from mpipipe.respipe.costmodel import DEFAULT_R, MODES, shapes_from_config, trade_off

__all__ = ["add_parser", "cost_main", "format_table"]



def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f}"


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The trade-off table as aligned text (what ``python -m mpipipe cost`` prints)."""
    head = ("mode", "R", "plain/step", "respipe/step", "replica/step", "shadow/step", "overhead",
            "max lost updates")
    body = [(r["mode"], str(r["R"]), _size(r["plain_bytes"]), _size(r["respipe_bytes"]),
             _size(r["replica_bytes"]), _size(r["shadow_bytes"]), f"{100 * r['overhead']:.1f}%",
             str(r["lost_updates"])) for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)


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


