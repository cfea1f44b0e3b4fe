"""`python -m stannis prepare`: split a data set into the host's public part and per-CSD private parts.

On real hardware each CSD already holds its own data. For a run on one
machine any shard data set with train/ and test/ (made by ``native.convert``:
digits, CIFAR-10, a folder of images, a torch Dataset; any image shape, any
number of classes) is cut into a public share (read by the host) and N private
shard directories, one per CSD; the test split stays public (the host
evaluates on it). The split is seeded and written beside the data in
``split.json`` so a run can say exactly which records each rank held.

How the private records are dealt out (``--split``):

- ``iid`` (default): a seeded permutation of the train set; its first
  round(public_share * n) records are public, the rest is cut into N parts of
  equal size (differing by at most one), so every CSD sees every class.
- ``by-class:K`` (non-IID): the public part is drawn exactly as for iid (the
  same records for the same seed); the CSDs then hold K classes each. With the
  L classes in label order c_0 < ... < c_{L-1}, CSD j (1-based) holds
  c_{(j-1)K mod L}, ..., c_{(j-1)K+K-1 mod L}: consecutive windows dealt round
  robin, so N*K >= L covers every class. A class held by m CSDs has its
  private records (in the seeded order) cut into m equal parts, one per holder.
  Every train record is in exactly one place, as for iid.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

CHUNK = 8192  # records copied per read: memory stays flat whatever the data set's size


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


def parse_split(text: str) -> tuple[str, int]:
    """"iid" -> ("iid", 0); "by-class:K" -> ("by-class", K).

    Raises:
        ValueError: anything else (K must be a positive integer).
    """
    if text == "iid":
        return "iid", 0
    kind, _, k = text.partition(":")
    if kind == "by-class" and k.isdigit() and int(k) >= 1:
        return "by-class", int(k)
    raise ValueError(f"--split must be iid or by-class:K with K >= 1 classes per CSD, got {text!r}")


def class_windows(labels: Sequence[int], csds: int, k: int) -> list[list[int]]:
    """The classes each CSD holds under by-class:K: consecutive windows of K labels (in
    sorted order), CSD j starting at label index (j-1)*K, wrapping around.

    Raises:
        ValueError: K outside 1..L, or N*K < L (some class would be on no CSD).
    """
    ordered = sorted(labels)
    n_classes = len(ordered)
    if not 1 <= k <= n_classes:
        raise ValueError(f"--split by-class:{k}: each CSD holds K of the {n_classes} classes, so K must be "
                         f"1..{n_classes}")
    if csds * k < n_classes:
        raise ValueError(f"--split by-class:{k} over {csds} CSDs holds {csds * k} of the {n_classes} classes; "
                         f"use K >= {-(-n_classes // csds)} so every class is on some CSD")
    return [[ordered[(j * k + t) % n_classes] for t in range(k)] for j in range(csds)]


def _labels(dataset: Any) -> np.ndarray:
    """Every record's label, read in chunks (only the labels are kept)."""
    if "label" not in {f.name for f in dataset.schema}:
        raise ValueError(f"{dataset.directory} has no 'label' field; --split by-class needs one")
    n = len(dataset)
    out = np.empty(n, np.int64)
    for lo in range(0, n, CHUNK):
        out[lo:lo + CHUNK] = dataset.read(np.arange(lo, min(n, lo + CHUNK)))["label"]
    return out


def _copy(dataset: Any, indices: np.ndarray, directory: Path, overwrite: bool,
          classes: list[str] | None) -> np.ndarray:
    """Write records ``indices`` (in that order) of ``dataset`` to a new data set; returns
    the labels written (for the summary)."""
    from native import DatasetWriter
    from native.ingest import set_classes

    labels = []
    with DatasetWriter(directory, dataset.schema, overwrite=overwrite) as writer:
        for lo in range(0, len(indices), CHUNK):
            batch = dataset.read(indices[lo:lo + CHUNK])
            writer.write(batch)
            if "label" in batch:
                labels.append(np.asarray(batch["label"]).copy())
    if classes is not None:
        set_classes(directory, classes)
    return np.concatenate(labels) if labels else np.empty(0, np.int64)


def split(source: Path, out: Path, *, csds: int, public_share: float, seed: int = 0,
          overwrite: bool = False, mode: str = "iid") -> dict:
    """Write ``out/public/{train,test}`` and ``out/csd1..csdN`` from ``source/{train,test}``.

    ``mode`` is "iid" or "by-class:K" (see the module's docstring). Records are
    copied in chunks, so a large source (a folder of photos) needs little memory.
    Class names recorded in the source's manifest are kept in every part.

    Returns:
        What ``split.json`` holds: records per part, the classes (labels) of each
        part, the class names if known, the test records.

    Raises:
        ValueError: a share outside [0, 1], fewer than one CSD, a bad ``mode``, or
            a part that would get no record.
        native.ShardError: a data set already exists in ``out`` and ``overwrite`` is false.
    """
    from native import classes_of, open_dataset

    if not 0.0 <= public_share <= 1.0:
        raise ValueError(f"public share must be in [0, 1], got {public_share}")
    if csds < 1:
        raise ValueError(f"need at least one CSD, got {csds}")
    kind, k = parse_split(mode)
    train = open_dataset(source / "train")
    test = open_dataset(source / "test")
    names = classes_of(train)
    n = len(train)
    order = np.random.default_rng(seed).permutation(n)
    n_public = int(round(public_share * n))
    parts = {"public/train": order[:n_public]}
    private = order[n_public:]
    if kind == "iid":
        for j, idx in enumerate(np.array_split(private, csds), start=1):
            parts[f"csd{j}"] = idx
    else:
        labels = _labels(train)
        windows = class_windows(np.unique(labels).tolist(), csds, k)
        held: dict[str, list[np.ndarray]] = {f"csd{j}": [] for j in range(1, csds + 1)}
        for c in np.unique(labels):
            holders = [f"csd{j}" for j, w in enumerate(windows, start=1) if int(c) in w]
            for name, idx in zip(holders, np.array_split(private[labels[private] == c], len(holders)),
                                 strict=True):
                held[name].append(idx)
        for name, pieces in held.items():
            parts[name] = np.concatenate(pieces) if pieces else np.empty(0, np.int64)
    if any(len(idx) == 0 for idx in parts.values()):
        empty = [name for name, idx in parts.items() if len(idx) == 0]
        raise ValueError(f"{n} records cannot give every part a record ({', '.join(empty)} would be empty; "
                         f"public share {public_share}, {csds} CSDs, split {mode})")
    held_classes: dict[str, list[int]] = {}
    for name, idx in parts.items():
        written = _copy(train, np.sort(idx), out / name, overwrite, names)
        held_classes[name] = np.unique(written).tolist()
    test_labels = _copy(test, np.arange(len(test)), out / "public/test", overwrite, names)
    held_classes["public/test"] = np.unique(test_labels).tolist()
    info = {"source": str(source), "seed": seed, "public_share": public_share, "csds": csds,
            "split": mode, "records": {name: int(len(idx)) for name, idx in parts.items()},
            "test_records": len(test), "classes": held_classes, "class_names": names}
    (out / "split.json").write_text(json.dumps(info, indent=2) + "\n")
    train.close()
    test.close()
    return info


def describe(info: dict) -> list[str]:
    """One line per device: what the host (public part) and each CSD hold, and which classes."""
    names = info.get("class_names")

    def classes(labels: list[int]) -> str:
        shown = [names[c] if names and c < len(names) else str(c) for c in labels]
        text = ", ".join(shown[:12]) + (", ..." if len(shown) > 12 else "")
        return f"{len(labels)} class{'es' if len(labels) != 1 else ''} ({text})"

    held = info.get("classes", {})
    lines = []
    for name, count in info["records"].items():
        who = "host, public" if name == "public/train" else "CSD, private"
        lines.append(f"  {name} ({who}): {count} records, {classes(held.get(name, []))}")
    lines.append(f"  public/test (host, evaluation): {info['test_records']} records, "
                 f"{classes(held.get('public/test', []))}")
    return lines
