"""`python -m stannis prepare` on any shard data set: a folder of RGB images, digits; `--split iid`
(the default, unchanged) and `--split by-class:K` (each CSD holds K classes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import native
from mpipipe.tools.launch import ROOT, mpirun_env
from native import convert

CLASSES = ["ant", "bee", "cat"]


def prepare(*argv: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stannis", "prepare", *map(str, argv)], env=mpirun_env(),
                          cwd=ROOT, timeout=120, capture_output=True, text=True)


def read(directory: Path) -> dict[str, np.ndarray]:
    ds = native.open_dataset(directory)
    batch = ds.read(np.arange(len(ds)))
    ds.close()
    return batch


def rows(batch: dict[str, np.ndarray]) -> list[bytes]:
    """Each record as bytes (image and label): equal bytes mean the same record."""
    return [img.tobytes() + int(y).to_bytes(8, "little") for img, y in zip(batch["image"], batch["label"],
                                                                          strict=True)]


@pytest.fixture(scope="module")
def folder_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small data set made from a folder of RGB PNGs, 3 classes of 20 images."""
    root = tmp_path_factory.mktemp("prep")
    rng = np.random.default_rng(0)
    for c in CLASSES:
        (root / "src" / c).mkdir(parents=True)
        for i in range(20):
            Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)).save(root / "src" / c / f"{i}.png")
    argv = ["folder", str(root / "src"), str(root / "set"), "--size", "8", "--holdout", "0.25", "--quiet"]
    assert convert.main(argv) == 0
    return root / "set"


@pytest.mark.timeout(180)
def test_by_class_gives_each_csd_its_classes(folder_set: Path, tmp_path: Path) -> None:
    out = tmp_path / "split"
    done = prepare("--source", folder_set, "--out", out, "--csds", 3, "--split", "by-class:2",
                   "--public-share", 0.25)
    assert done.returncode == 0, done.stderr
    # windows of 2 over the sorted classes, dealt round robin: (0,1), (2,0), (1,2)
    want = {"csd1": {0, 1}, "csd2": {0, 2}, "csd3": {1, 2}}
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"stannis prepare: wrote {out}: public/train ")
    assert any(line.strip().startswith("csd1 (CSD, private):") and "2 classes (ant, bee)" in line for line in lines)
    assert any(line.strip().startswith("csd2 (CSD, private):") and "2 classes (ant, cat)" in line for line in lines)
    assert any(line.strip().startswith("csd3 (CSD, private):") and "2 classes (bee, cat)" in line for line in lines)
    assert any(line.strip().startswith("public/train (host, public):") and "3 classes (ant, bee, cat)" in line
               for line in lines)
    everywhere: list[bytes] = []
    for name, classes in want.items():
        batch = read(out / name)
        assert set(batch["label"].tolist()) == classes, name
        assert batch["image"].shape[1:] == (3, 8, 8)
        assert native.classes_of(out / name) == CLASSES
        everywhere += rows(batch)
    everywhere += rows(read(out / "public" / "train"))
    # every train record is in exactly one place
    assert sorted(everywhere) == sorted(rows(read(folder_set / "train")))
    assert sorted(rows(read(out / "public" / "test"))) == sorted(rows(read(folder_set / "test")))
    info = json.loads((out / "split.json").read_text())
    assert info["split"] == "by-class:2" and info["classes"]["csd2"] == [0, 2]
    # the public part is the iid split's public part (same seed, same records)
    iid = tmp_path / "iid"
    assert prepare("--source", folder_set, "--out", iid, "--csds", 3, "--public-share", 0.25).returncode == 0
    assert rows(read(iid / "public" / "train")) == rows(read(out / "public" / "train"))


@pytest.mark.timeout(180)
def test_iid_keeps_todays_split(folder_set: Path, tmp_path: Path) -> None:
    """The default is --split iid: a seeded permutation, round(share * n) public records, the
    rest cut into equal parts, each written in record order (what prepare always did)."""
    out = tmp_path / "split"
    done = prepare("--source", folder_set, "--out", out, "--csds", 4)
    assert done.returncode == 0, done.stderr
    src = read(folder_set / "train")
    n = len(src["label"])
    order = np.random.default_rng(0).permutation(n)
    n_public = int(round(0.5 * n))
    parts = {"public/train": order[:n_public]}
    for k, idx in enumerate(np.array_split(order[n_public:], 4), start=1):
        parts[f"csd{k}"] = idx
    for name, idx in parts.items():
        idx = np.sort(idx)
        got = read(out / name)
        np.testing.assert_array_equal(got["image"], src["image"][idx])
        np.testing.assert_array_equal(got["label"], src["label"][idx])
    info = json.loads((out / "split.json").read_text())
    assert info["records"] == {name: len(idx) for name, idx in parts.items()} and info["split"] == "iid"
    first = done.stdout.splitlines()[0]
    assert first == (f"stannis prepare: wrote {out}: " + ", ".join(f"{k} {len(v)}" for k, v in parts.items())
                     + f", public/test {len(read(folder_set / 'test')['label'])}")
    # asking again for the same split is a no-op; the explicit --split iid is the same split
    again = prepare("--source", folder_set, "--out", out, "--csds", 4, "--split", "iid")
    assert again.returncode == 0 and "already split this way" in again.stdout


@pytest.mark.timeout(180)
def test_by_class_on_digits_and_bad_k(digits: Path, tmp_path: Path) -> None:
    """Ten classes over 4 CSDs with K=3 covers them all; K out of range is one error line."""
    out = tmp_path / "d"
    done = prepare("--source", digits, "--out", out, "--csds", 4, "--split", "by-class:3")
    assert done.returncode == 0, done.stderr
    held = [set(read(out / f"csd{j}")["label"].tolist()) for j in range(1, 5)]
    assert held == [{0, 1, 2}, {3, 4, 5}, {6, 7, 8}, {9, 0, 1}]
    assert set().union(*held) == set(range(10))
    for argv, words in [(["--split", "by-class:11"], "K must be 1..10"),
                        (["--split", "by-class:2"], "use K >= 3"),
                        (["--split", "by-class:0"], "by-class:K with K >= 1"),
                        (["--split", "random"], "--split must be iid or by-class:K")]:
        bad = prepare("--source", digits, "--out", tmp_path / "bad", "--csds", 4, *argv)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
        assert bad.stderr.strip().splitlines() == [bad.stderr.strip()] and words in bad.stderr, bad.stderr
        assert not (tmp_path / "bad").exists()
