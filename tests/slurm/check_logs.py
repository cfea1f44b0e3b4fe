"""Check the HDF5 logs of the two jobs that tests/slurm/run.sh submits to Slurm."""

from __future__ import annotations

import argparse
import sys

from mpipipe.core.logs.runlog import LogError, open_log


def check(path: str, *, system: str, steps: int, events: tuple[str, ...] = ()) -> list[str]:
    """Return what is wrong with one run log (empty when it holds a whole run).

    A whole run is one that says it completed, logged every step from 1 to
    ``steps`` (a step replayed after a takeover may appear twice) with figures
    for every rank, and recorded each event kind in ``events``.
    """
    try:
        run = open_log(path)
    except LogError as e:
        return [str(e)]
    problems = []
    if run.system != system:
        problems.append(f"{path}: system is {run.system!r}, expected {system!r}")
    status = str(run.attrs.get("status", "?"))
    if status != "completed":
        problems.append(f"{path}: status is {status!r}, expected 'completed'")
    logged = sorted({int(s) for s in run.steps.get("step", [])})
    if logged != list(range(1, steps + 1)):
        shown = f"{logged[:3]}...{logged[-3:]}" if len(logged) > 6 else str(logged)
        problems.append(f"{path}: /steps/step holds {len(logged)} distinct steps {shown}, "
                        f"expected 1..{steps}")
    if not run.ranks:
        problems.append(f"{path}: /ranks has no per-rank figures")
    kinds = sorted({e["kind"] for e in run.events})
    for kind in events:
        if kind not in kinds:
            problems.append(f"{path}: no {kind!r} event in /events (events: {kinds or 'none'})")
    if not problems:
        print(f"{path}: {system}, {len(logged)} steps, world size {run.attrs.get('world_size')}, "
              f"events {kinds or 'none'}: ok")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--respipe", required=True, metavar="RUN.h5")
    parser.add_argument("--respipe-steps", type=int, required=True)
    parser.add_argument("--stannis", required=True, metavar="RUN.h5")
    parser.add_argument("--stannis-steps", type=int, required=True)
    args = parser.parse_args(argv)
    # The ResPipe job had a stage killed: it must have noticed and failed over.
    # (The killed rank logs nothing; rank 0 records what the survivors saw.)
    problems = check(args.respipe, system="mpipipe", steps=args.respipe_steps,
                     events=("failure_detected", "takeover"))
    problems += check(args.stannis, system="stannis", steps=args.stannis_steps)
    for problem in problems:
        print(f"check_logs: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
