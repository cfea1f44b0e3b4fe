"""`python -m stannis prepare`: split a data set into the host's public part and per-CSD private parts.

On real hardware each CSD already holds its own data. For the demo the
digits train set is cut into a public share (read by the host) and N equal
private shard directories, one per CSD; the test split stays public (the
host evaluates on it). The split is seeded and written beside the data in
``split.json`` so a run can say exactly which records each rank held.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np


def ensure_source(source: Path) -> None:
    """Make the digits data set at ``source`` with ``python -m native.convert`` if absent.

    Raises:
        ValueError: the conversion failed (for instance ``source`` holds only one of
            ``train/`` and ``test/``, which convert refuses to replace); its own line
            has been printed already.
    """
    if (source / "train").is_dir() and (source / "test").is_dir():
        return
    done = subprocess.run([sys.executable, "-m", "native.convert", "digits", str(source)])
    if done.returncode != 0:
        raise ValueError(f"could not make the source data set {source} (native.convert exit "
                         f"{done.returncode}); fix or remove {source}, or pass --source DIR")


def split(source: Path, out: Path, *, csds: int, public_share: float, seed: int = 0,
          overwrite: bool = False) -> dict:
    """Write ``out/public/{train,test}`` and ``out/csd1..csdN`` from ``source/{train,test}``.

    Raises:
        ValueError: a share outside [0, 1] or fewer than one CSD.
        native.ShardError: a data set already exists in ``out`` and ``overwrite`` is false.
    """
    from native import DatasetWriter, open_dataset
    from native.reader import read_all

    if not 0.0 <= public_share <= 1.0:
        raise ValueError(f"public share must be in [0, 1], got {public_share}")
    if csds < 1:
        raise ValueError(f"need at least one CSD, got {csds}")
    train = open_dataset(source / "train")
    test = open_dataset(source / "test")
    records = read_all(train)
    n = len(train)
    order = np.random.default_rng(seed).permutation(n)
    n_public = int(round(public_share * n))
    parts = {"public/train": order[:n_public]}
    for k, idx in enumerate(np.array_split(order[n_public:], csds), start=1):
        parts[f"csd{k}"] = idx
    if any(len(idx) == 0 for idx in parts.values()):
        raise ValueError(f"{n} records cannot give every part a record "
                         f"(public share {public_share}, {csds} CSDs)")
    for name, idx in parts.items():
        idx = np.sort(idx)
        with_writer(DatasetWriter(out / name, train.schema, overwrite=overwrite),
                    {k: v[idx] for k, v in records.items()})
    with_writer(DatasetWriter(out / "public/test", test.schema, overwrite=overwrite),
                read_all(test))
    info = {"source": str(source), "seed": seed, "public_share": public_share, "csds": csds,
            "records": {name: int(len(idx)) for name, idx in parts.items()},
            "test_records": len(test)}
    (out / "split.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def with_writer(writer, batch: dict) -> None:
    try:
        writer.write(batch)
    finally:
        writer.close()
