"""`python -m mpipipe COMMAND`: the one entry point of the pipeline system.

Commands: train, cost, plan (a dry run: how the model is cut into stages), report, chaos,
testbed (the emulated cluster), linkprobe (throughput between ranks), defaults.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mpipipe import cost, linkprobe_command, package_version, plan_command, report_command, train_command
from mpipipe.respipe import chaos
from mpipipe.tools import emulator


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand registers itself with ``add_parser(subparsers)`` and sets ``func``."""
    parser = argparse.ArgumentParser(
        prog="python -m mpipipe",
        description="Resilient pipeline-parallel CNN training on MPI (ResPipe), and its tools.",
    )
    parser.add_argument("--version", action="version", version=f"mpipipe {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    train_command.add_parser(sub)
    cost.add_parser(sub)
    plan_command.add_parser(sub)
    report_command.add_parser(sub)
    chaos.add_parser(sub)
    emulator.add_parser(sub)
    linkprobe_command.add_parser(sub)
    defaults = sub.add_parser("defaults", help="print the default configuration as TOML")
    defaults.set_defaults(func=_print_defaults)
    return parser


def _print_defaults(args: argparse.Namespace) -> int:
    from mpipipe.core.run.configfile import dump_toml
    from mpipipe.pipeline.config import PIPELINE_DEFAULTS

    print(dump_toml(PIPELINE_DEFAULTS), end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run the chosen subcommand; its return value is the exit status."""
    from mpipipe.core.mpi.roles import TrainingFailed, report_failure

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except TrainingFailed as e:  # one line on rank 0, status 2 on every rank
        return report_failure(e)


if __name__ == "__main__":
    sys.exit(main())
