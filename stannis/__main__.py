"""Command line: `python -m stannis train|prepare|chaos|defaults`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mpipipe.core.run.cli import add_train_arguments
from mpipipe.core.version import package_version


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m stannis",
        description="Data-parallel training on one host and N computational storage devices "
                    "(CSDs), with HyperTune batch sizing. Launch with mpirun -n 1+N.")
    parser.add_argument("--version", action="version", version=f"stannis {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train (under mpirun -n 1+N)")
    add_train_arguments(train, resume=False)  # Stannis keeps no checkpoints
    prep = sub.add_parser("prepare", help="split a data set into public and per-CSD private "
                                          "shard directories (demo data)")
    prep.add_argument("--source", default="data/digits",
                      help="data set with train/ and test/ (made with native.convert digits "
                           "if missing); any shard data set: a folder of images, a torch "
                           "Dataset, any image shape and number of classes")
    prep.add_argument("--out", default="data/stannis-digits", help="where to write the split")
    prep.add_argument("--csds", type=int, default=4, help="number of CSDs")
    prep.add_argument("--public-share", type=float, default=0.5,
                      help="share of the train set that is public (read by the host)")
    prep.add_argument("--seed", type=int, default=0)
    prep.add_argument("--overwrite", action="store_true", help="replace an existing split")
    prep.add_argument("--split", default="iid", metavar="iid|by-class:K",
                      help="how the private records are dealt: iid (default; every CSD an equal "
                           "random share) or by-class:K (non-IID: each CSD holds K classes, "
                           "consecutive windows of the sorted classes dealt round robin)")
    sub.add_parser("defaults", help="print the default configuration as TOML")
    chaos = sub.add_parser(
        "chaos", help="run a random fault campaign on your job and judge every run",
        description="Draw N seeded fault scenarios on your Stannis job (kills, stalls and "
                    "slow-downs of CSDs, several at once and at re-tunes; now and then a kill "
                    "of the host), run each under mpirun --with-ft ulfm with a time limit, and "
                    "judge it against docs/stannis.md. Exit status 1 if any run hung, crashed, "
                    "gave a wrong result or ended in a way the docs do not allow.")
    from .chaos import add_arguments

    add_arguments(chaos)
    return parser


def _defaults() -> str:
    from mpipipe.core.run.configfile import dump_toml

    from .config import STANNIS_DEFAULTS

    return dump_toml(STANNIS_DEFAULTS)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the chosen subcommand; its return value is the exit
    status (also the console script ``stannis``)."""
    args = _parser().parse_args(argv)
    if args.command == "defaults":
        print(_defaults(), end="")
        return 0
    if args.command == "chaos":
        from .chaos import main as chaos_main

        return chaos_main(args)
    if args.command == "prepare":
        from native import ShardError

        from .prepare import describe, ensure_source, parse_split, split
        try:
            parse_split(args.split)
        except ValueError as e:
            print(f"stannis prepare: error: {e}", file=sys.stderr)
            return 2
        done = Path(args.out) / "split.json"
        if done.exists() and not args.overwrite:
            import json

            info = json.loads(done.read_text())
            same = (info.get("csds"), info.get("public_share"), info.get("seed"),
                    info.get("split", "iid")) == (args.csds, args.public_share, args.seed, args.split)
            if same:
                print(f"stannis prepare: {args.out} is already split this way "
                      "(--overwrite to redo it)")
                return 0
        try:
            ensure_source(Path(args.source))
            info = split(Path(args.source), Path(args.out), csds=args.csds,
                         public_share=args.public_share, seed=args.seed,
                         overwrite=args.overwrite, mode=args.split)
        except (ValueError, ShardError) as e:
            print(f"stannis prepare: error: {e}", file=sys.stderr)
            return 2
        print(f"stannis prepare: wrote {args.out}: " + ", ".join(
            f"{k} {v}" for k, v in info["records"].items()) + f", public/test {info['test_records']}")
        print("\n".join(describe(info)))
        return 0
    from . import mpicount

    mpicount.enable()  # MPI's own byte counters for the privacy audit (before MPI_Init)
    from mpipipe.core.mpi.roles import TrainingFailed, report_failure

    from .trainer import main as train_main

    try:
        return train_main(args)
    except TrainingFailed as e:  # one line on rank 0, status 2 on every rank
        return report_failure(e)


if __name__ == "__main__":
    sys.exit(main())
