"""The `report` subcommand's command line: HDF5 run logs in, a terminal summary and PNG
plots out.

The tables and plots are made by :mod:`mpipipe.report`, a library that scripts and
benches call too; here are only the arguments, the printing and the exit status. A log
cut short by a killed run is reported up to its last step; a file that is not a run log
gives one error line and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from mpipipe.core.logs.progress import THROUGHPUT
from mpipipe.core.logs.runlog import LogError
from mpipipe.report import compare, load_run, one_line, plot_runs, summarize

__all__ = ["add_parser", "run_report", "main"]

PROG = "mpipipe report"


def _configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("logs", nargs="+", metavar="RUN.h5",
                        help="HDF5 run logs (several are compared and overlaid, labelled by file name)")
    parser.add_argument("--out", metavar="DIR",
                        help="directory for the PNG plots (default: the directory of the first log)")
    parser.add_argument("--no-plots", action="store_true", help="print the summary only")
    parser.set_defaults(func=run_report)
    return parser


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``report`` on the dispatcher's subparsers; it sets ``func`` (args -> exit status)."""
    return _configure(subparsers.add_parser(
        "report", help="summarise run logs and plot them",
        description="Summarise HDF5 run logs in the terminal and write PNG plots: loss, accuracy and "
                    "samples/s against step and time with events marked, per-rank step time split into "
                    "compute and waiting, and for stannis per-rank batch size and samples per joule. "
                    f"{THROUGHPUT}. A log may be read while its run still writes it.",
    ))


class _Stdout:
    """Standard output that goes quiet when the reader leaves (``report X.h5 | head -1``):
    the rest of the report (the plots) is still made, and no BrokenPipeError is printed."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.closed = stream, False

    def write(self, text: str) -> int:
        if not self.closed:
            try:
                self.stream.write(text)
                self.stream.flush()
            except BrokenPipeError:
                self.closed = True
                try:  # Python flushes stdout at exit: point it at /dev/null first
                    devnull = os.open(os.devnull, os.O_WRONLY)
                    os.dup2(devnull, self.stream.fileno())
                    os.close(devnull)
                except (OSError, ValueError, AttributeError):
                    pass
        return len(text)

    def flush(self) -> None:
        self.write("")


def run_report(args: argparse.Namespace, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Body of ``report``: 0 when every log was reported, 2 when one could not be read.

    A log that cannot be read gets one error line naming it; the others are reported
    all the same, and the exit status says that one failed.
    """
    stdout = _Stdout(stdout or sys.stdout)  # type: ignore[assignment]
    stderr = stderr or sys.stderr
    runs, failed = [], False
    for path in args.logs:
        try:
            runs.append(load_run(path))
        except LogError as e:
            print(f"{PROG}: error: {e}", file=stderr, flush=True)
            failed = True
    if not runs:
        return 2
    status = 2 if failed else 0
    out = Path(args.out) if args.out else runs[0].path.parent
    if not args.no_plots:
        try:  # before any output, so that a bad --out is one error line and nothing else
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            print(f"{PROG}: error: cannot write plots to {out}: {one_line(str(e))}", file=stderr)
            return 2
    for run in runs:
        print(summarize(run), file=stdout)
        print(file=stdout)
    if len(runs) > 1:
        print(compare(runs), file=stdout)
        print(file=stdout)
    if not args.no_plots:
        try:
            paths = plot_runs(runs, out)
        except OSError as e:
            print(f"{PROG}: error: cannot write plots to {out}: {one_line(str(e))}", file=stderr)
            return 2
        print("plots: " + ", ".join(str(p) for p in paths), file=stdout)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mpipipe report ...`` as a function, for tests and scripts."""
    parser = _configure(argparse.ArgumentParser(
        prog=PROG, description="Summarise HDF5 run logs and write PNG plots (see docs/hdf5-log.md)."))
    args = parser.parse_args(argv)
    return run_report(args)


if __name__ == "__main__":
    sys.exit(main())
