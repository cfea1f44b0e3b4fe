"""Converters: digits, CIFAR-10 binary, MNIST IDX (raw and gzip), npz, synthetic; and the benchmark CLI."""

import gzip
import json
import struct
import subprocess
import sys

import numpy as np
import pytest

import native
from native import convert


def run(*argv):
    return convert.main([str(a) for a in argv])


def load(root, split):
    ds = native.open_dataset(root / split)
    ds.verify()
    return ds, ds.read(np.arange(len(ds)))


def test_digits(tmp_path, capsys):
    pytest.importorskip("sklearn")
    assert run("digits", tmp_path / "d") == 0
    printed = capsys.readouterr().out
    assert "d/train" in printed and "GB/s" in printed
    tr, btr = load(tmp_path / "d", "train")
    te, bte = load(tmp_path / "d", "test")
    assert len(tr) + len(te) == 1797 and 300 < len(te) < 400
    assert btr["image"].dtype == np.float32 and btr["image"].shape[1:] == (1, 8, 8)
    assert btr["label"].dtype == np.int64
    assert 0.0 <= btr["image"].min() and btr["image"].max() <= 1.0
    assert set(bte["label"].tolist()) == set(range(10))  # stratified held-out split
    # Held out means disjoint: no test image appears in train.
    train_rows = {r.tobytes() for r in btr["image"]}
    assert sum(r.tobytes() in train_rows for r in bte["image"]) < 5  # digits has a few dupes
    # Deterministic: a second run writes the same bytes.
    first = json.loads((tmp_path / "d" / "train" / "manifest.json").read_text())
    assert run("digits", tmp_path / "d", "--quiet") == 0
    again = json.loads((tmp_path / "d" / "train" / "manifest.json").read_text())
    assert first == again


def cifar_file(path, labels, seed):
    rng = np.random.default_rng(seed)
    pix = rng.integers(0, 256, (len(labels), 3072), dtype=np.uint8)
    rows = np.concatenate([np.array(labels, np.uint8)[:, None], pix], axis=1)
    path.write_bytes(rows.tobytes())
    return pix.reshape(-1, 3, 32, 32)


def test_cifar10_bin(tmp_path):
    a = cifar_file(tmp_path / "data_batch_1.bin", [0, 1, 2, 3, 9], 1)
    b = cifar_file(tmp_path / "data_batch_2.bin", [4, 5, 6], 2)
    t = cifar_file(tmp_path / "test_batch.bin", [7, 8], 3)
    files = [tmp_path / "data_batch_1.bin", tmp_path / "data_batch_2.bin", tmp_path / "test_batch.bin"]
    assert run("cifar10-bin", *files, tmp_path / "c", "--quiet") == 0
    _, tr = load(tmp_path / "c", "train")
    _, te = load(tmp_path / "c", "test")
    np.testing.assert_array_equal(tr["image"], np.concatenate([a, b]))
    assert tr["label"].tolist() == [0, 1, 2, 3, 9, 4, 5, 6]
    np.testing.assert_array_equal(te["image"], t)
    assert te["label"].tolist() == [7, 8]
    # float32 storage scales to [0, 1]; no test file: a held-out split.
    assert run("cifar10-bin", files[0], tmp_path / "f", "--dtype", "float32", "--test-fraction", "0.4", "--quiet") == 0
    _, tr = load(tmp_path / "f", "train")
    _, te = load(tmp_path / "f", "test")
    assert tr["image"].dtype == np.float32 and len(tr["label"]) == 3 and len(te["label"]) == 2
    merged = np.concatenate([tr["image"], te["image"]])
    assert np.allclose(np.sort(merged.reshape(5, -1), axis=0), np.sort(a.reshape(5, -1) / 255.0, axis=0))


def test_cifar10_bin_errors(tmp_path, capsys):
    cifar_file(tmp_path / "x.bin", [1, 2], 0)
    raw = (tmp_path / "x.bin").read_bytes()
    (tmp_path / "short.bin").write_bytes(raw[:-10])
    assert run("cifar10-bin", tmp_path / "short.bin", tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert "short.bin" in err and "not a whole number of CIFAR-10 records" in err
    (tmp_path / "lab.bin").write_bytes(bytes([11]) + raw[1:])
    assert run("cifar10-bin", tmp_path / "lab.bin", tmp_path / "o") == 2
    assert "record 0 has label 11" in capsys.readouterr().err
    assert run("cifar10-bin", tmp_path / "missing.bin", tmp_path / "o") == 2


def idx_bytes(arr, kind=0x08):
    head = bytes([0, 0, kind, arr.ndim]) + b"".join(struct.pack(">I", d) for d in arr.shape)
    return head + arr.tobytes()


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx(tmp_path, gz):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (12, 28, 28), dtype=np.uint8)
    y = np.arange(12, dtype=np.uint8) % 10
    tx, ty = x[:3], y[:3]
    wrap = gzip.compress if gz else (lambda b: b)
    sfx = ".gz" if gz else ""
    (tmp_path / f"imgs{sfx}").write_bytes(wrap(idx_bytes(x)))
    (tmp_path / f"labs{sfx}").write_bytes(wrap(idx_bytes(y)))
    (tmp_path / f"timgs{sfx}").write_bytes(wrap(idx_bytes(tx)))
    (tmp_path / f"tlabs{sfx}").write_bytes(wrap(idx_bytes(ty)))
    assert (
        run(
            "mnist-idx",
            tmp_path / f"imgs{sfx}",
            tmp_path / f"labs{sfx}",
            tmp_path / "m",
            "--test-images",
            tmp_path / f"timgs{sfx}",
            "--test-labels",
            tmp_path / f"tlabs{sfx}",
            "--quiet",
        )
        == 0
    )
    _, tr = load(tmp_path / "m", "train")
    _, te = load(tmp_path / "m", "test")
    assert tr["image"].shape == (12, 1, 28, 28) and tr["image"].dtype == np.uint8
    np.testing.assert_array_equal(tr["image"][:, 0], x)
    assert tr["label"].tolist() == y.tolist()
    np.testing.assert_array_equal(te["image"][:, 0], tx)
    # Without a test pair: held out, train and test together are the input.
    assert run("mnist-idx", tmp_path / f"imgs{sfx}", tmp_path / f"labs{sfx}", tmp_path / "h", "--quiet") == 0
    _, tr = load(tmp_path / "h", "train")
    _, te = load(tmp_path / "h", "test")
    assert sorted(tr["label"].tolist() + te["label"].tolist()) == sorted(y.tolist())


def test_mnist_idx_errors(tmp_path, capsys):
    x = np.zeros((4, 5, 5), np.uint8)
    good_imgs = idx_bytes(x)
    labels = idx_bytes(np.zeros(4, np.uint8))
    (tmp_path / "labs").write_bytes(labels)
    cases = {
        "trunc": good_imgs[:-1],
        "magic": b"\x01" + good_imgs[1:],
        "type": good_imgs[:2] + b"\x07" + good_imgs[3:],
        "head": good_imgs[:6],
        "badgz": b"\x1f\x8b" + b"junk",
        "count": idx_bytes(np.zeros((3, 5, 5), np.uint8)),
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        assert run("mnist-idx", tmp_path / name, tmp_path / "labs", tmp_path / "o") == 2, name
        err = capsys.readouterr().err
        assert "error:" in err and (name in err or "labs" in err), (name, err)


def test_npz_layouts(tmp_path):
    rng = np.random.default_rng(0)
    nhwc = rng.integers(0, 256, (10, 6, 6, 3), dtype=np.uint8)
    np.savez(tmp_path / "k.npz", x_train=nhwc, y_train=np.arange(10), x_test=nhwc[:2], y_test=np.arange(2))
    assert run("npz", tmp_path / "k.npz", tmp_path / "k", "--quiet") == 0
    _, tr = load(tmp_path / "k", "train")
    assert tr["image"].shape == (10, 3, 6, 6)
    np.testing.assert_array_equal(tr["image"], nhwc.transpose(0, 3, 1, 2))
    gray = rng.random((8, 5, 5))
    np.savez(tmp_path / "g.npz", images=gray, labels=np.arange(8).reshape(8, 1))
    assert run("npz", tmp_path / "g.npz", tmp_path / "g", "--test-fraction", "0.25", "--quiet") == 0
    ds, tr = load(tmp_path / "g", "train")
    assert tr["image"].dtype == np.float32 and tr["image"].shape[1:] == (1, 5, 5)
    assert len(ds) == 6
    np.savez(tmp_path / "bad.npz", a=gray)
    assert run("npz", tmp_path / "bad.npz", tmp_path / "b") == 2
    np.savez(tmp_path / "bad2.npz", x=gray, y=np.arange(7))
    assert run("npz", tmp_path / "bad2.npz", tmp_path / "b") == 2


def test_synthetic(tmp_path):
    assert (
        run(
            "synthetic",
            tmp_path / "s",
            "--shape",
            "3,8,8",
            "--classes",
            "4",
            "--count",
            "100",
            "--shard-records",
            "30",
            "--quiet",
        )
        == 0
    )
    ds, tr = load(tmp_path / "s", "train")
    assert len(ds) == 100 and len(ds.manifest["shards"]) == 4
    assert tr["image"].shape == (100, 3, 8, 8) and tr["label"].max() < 4
    te, _ = load(tmp_path / "s", "test")
    assert len(te) == 10
    with pytest.raises(SystemExit):
        run("synthetic", tmp_path / "s", "--shape", "3,8")


@pytest.mark.timeout(120)
def test_help_texts():
    for argv in (
        ["--help"],
        ["digits", "--help"],
        ["cifar10-bin", "--help"],
        ["mnist-idx", "--help"],
        ["npz", "--help"],
        ["synthetic", "--help"],
    ):
        p = subprocess.run([sys.executable, "-m", "native.convert", *argv], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and "usage:" in p.stdout, argv


@pytest.mark.timeout(180)
def test_bench_json_has_exactly_the_keys():
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "native.bench",
            "--json",
            "--records",
            "2048",
            "--batches",
            "4",
            "--loader-batches",
            "2",
            "--rounds",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1
    res = json.loads(lines[0])
    assert set(res) == {
        "native_gbps",
        "numpy_take_gbps",
        "dataloader_gbps",
        "memcpy_gbps",
        "native_vs_memcpy",
        "native_vs_numpy",
        "native_vs_dataloader",
    }
    assert all(v > 0 for v in res.values())
