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
    # Deterministic: a second run (asked to replace the first) writes the same bytes.
    first = json.loads((tmp_path / "d" / "train" / "manifest.json").read_text())
    assert run("digits", tmp_path / "d", "--quiet", "--overwrite") == 0
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


# ---- OUT is replaced only when asked, and only by a complete conversion ---------------


def tree_hashes(root):
    """Every file below root (relative path -> sha256), symlinks and directories included."""
    import hashlib

    seen = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            seen[rel] = "link:" + str(p.readlink())
        elif p.is_dir():
            seen[rel] = "dir"
        else:
            seen[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return seen


def one_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("python -m native.convert: error: "), err
    assert "Traceback" not in err[0]
    return err[0]


@pytest.fixture
def existing(tmp_path):
    """A converted data set OUT (synthetic, small) with a user's own file beside the splits."""
    out = tmp_path / "data" / "set"
    assert run("synthetic", out, "--shape", "1,4,4", "--count", "50", "--shard-records", "20", "--quiet") == 0
    (out / "NOTES.txt").write_text("my notes\n")
    return out


def no_partials(out):
    return [p.name for p in out.parent.iterdir() if ".partial-" in p.name] == []


def test_existing_out_is_refused_without_overwrite(existing, capsys):
    before = tree_hashes(existing)
    assert run("synthetic", existing, "--count", "30", "--quiet") == 2
    line = one_error_line(capsys)
    assert "already holds train/ and test/" in line and "--overwrite" in line
    assert tree_hashes(existing) == before and no_partials(existing)
    # with --overwrite the splits are replaced and the user's file is kept
    assert run("synthetic", existing, "--shape", "1,2,2", "--count", "30", "--overwrite", "--quiet") == 0
    ds, batch = load(existing, "train")
    assert len(ds) == 30 and batch["image"].shape[1:] == (1, 2, 2)
    assert (existing / "NOTES.txt").read_text() == "my notes\n"
    assert sorted(p.name for p in existing.iterdir()) == ["NOTES.txt", "test", "train"]
    assert no_partials(existing)
    # an OUT that is a file is refused, not replaced
    (existing.parent / "afile").write_text("x")
    assert run("synthetic", existing.parent / "afile", "--quiet") == 2
    assert "is not a directory" in one_error_line(capsys)
    assert (existing.parent / "afile").read_text() == "x"


def test_new_out_is_written_whole_and_nothing_is_left_beside_it(tmp_path):
    out = tmp_path / "deep" / "new"
    assert run("synthetic", out, "--count", "30", "--quiet") == 0
    assert sorted(p.name for p in out.iterdir()) == ["test", "train"]
    assert no_partials(out)
    # an empty directory made beforehand is fine: it holds no data set yet
    (tmp_path / "empty").mkdir()
    assert run("synthetic", tmp_path / "empty", "--count", "30", "--quiet") == 0
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == ["test", "train"]


def _bad_inputs(tmp):
    """(name, argv before OUT, words of the error line) for inputs every converter must refuse."""
    rng = np.random.default_rng(0)
    x = rng.random((6, 1, 4, 4)).astype(np.float32)
    y = np.arange(6) % 3
    nan = x.copy()
    nan[4, 0, 2, 1] = np.nan
    np.savez(tmp / "nan.npz", x=nan, y=y)
    inf = x.astype(np.float64)
    inf[3, 0, 0, 0] = 1e300  # finite in float64, Inf once stored as float32
    np.savez(tmp / "inf.npz", x=inf, y=y)
    np.savez(tmp / "testnan.npz", x_train=x, y_train=y, x_test=nan[3:], y_test=y[3:])
    np.save(tmp / "single.npy", x)
    (tmp / "text.npz").write_text("x,y\n1,2\n")
    np.savez(tmp / "objects.npz", x=np.array([x[0], x[1, 0]], dtype=object), y=y[:2])
    (tmp / "cut.npz").write_bytes((tmp / "nan.npz").read_bytes()[:300])
    np.savez(tmp / "keys.npz", a=x, b=y)
    np.savez(tmp / "shape.npz", x=x[:, 0, 0], y=y)
    np.savez(tmp / "dtype.npz", x=x.astype(np.int16), y=y)
    np.savez(tmp / "labels.npz", x=x, y=y.astype(np.float32))
    np.savez(tmp / "labshape.npz", x=x, y=np.stack([y, y], axis=1))
    np.savez(tmp / "count.npz", x=x, y=y[:5])
    np.savez(tmp / "empty.npz", x=x[:0], y=y[:0])
    np.savez(tmp / "mixed.npz", x_train=x, y_train=y, x_test=x[:2, :, :2], y_test=y[:2])
    cifar_file(tmp / "cifar.bin", [1, 2], 0)
    (tmp / "short.bin").write_bytes((tmp / "cifar.bin").read_bytes()[:-7])
    (tmp / "labs").write_bytes(idx_bytes(np.zeros(4, np.uint8)))
    (tmp / "imgs").write_bytes(idx_bytes(np.zeros((3, 5, 5), np.uint8)))
    return [
        ("nan", ["npz", tmp / "nan.npz"], "nan.npz[x]: sample 4 has NaN"),
        ("inf", ["npz", tmp / "inf.npz"], "inf.npz[x]: sample 3 has Inf"),
        ("test-nan", ["npz", tmp / "testnan.npz"], "testnan.npz[x_test]: sample 1 has NaN"),
        ("npy", ["npz", tmp / "single.npy"], "a single .npy array, not an .npz"),
        ("text", ["npz", tmp / "text.npz"], "not an .npz file"),
        ("missing", ["npz", tmp / "nowhere.npz"], "nowhere.npz: cannot read"),
        ("objects", ["npz", tmp / "objects.npz"], "objects.npz[x]: holds Python objects"),
        ("cut", ["npz", tmp / "cut.npz"], "cut.npz: damaged .npz"),
        ("keys", ["npz", tmp / "keys.npz"], "expected arrays x_train/y_train"),
        ("shape", ["npz", tmp / "shape.npz"], "images must be N,H,W"),
        ("dtype", ["npz", tmp / "dtype.npz"], "must be uint8 or floating point, got int16"),
        ("labels", ["npz", tmp / "labels.npz"], "labels must be integers"),
        ("labshape", ["npz", tmp / "labshape.npz"], "labels must have shape (N,) or (N, 1)"),
        ("count", ["npz", tmp / "count.npz"], "6 images but 5 labels"),
        ("empty", ["npz", tmp / "empty.npz"], "no samples"),
        ("mixed", ["npz", tmp / "mixed.npz"], "mixed.npz: test images are float32 (1, 2, 4) but train images are"),
        ("cifar", ["cifar10-bin", tmp / "short.bin"], "not a whole number of CIFAR-10 records"),
        ("mnist", ["mnist-idx", tmp / "imgs", tmp / "labs"], "expected 3 labels"),
        ("synthetic", ["synthetic", "--count", "0"], "--count and --classes must be >= 1"),
        # fails inside the writer, after the partial directory is made
        ("shard-records", ["synthetic", "--shard-records", "0"], "shard_records must be >= 1"),
    ]


def test_a_failed_conversion_leaves_an_existing_out_byte_identical(existing, tmp_path, capsys):
    before = tree_hashes(existing)
    for name, argv, words in _bad_inputs(tmp_path):
        code = run(*argv, existing, "--overwrite", "--quiet")
        line = one_error_line(capsys)
        assert code == 2, name
        assert words in line, (name, line)
        assert tree_hashes(existing) == before, name
        assert no_partials(existing), name
        # and into a new OUT nothing is created
        assert run(*argv, tmp_path / "fresh", "--quiet") == 2, name
        capsys.readouterr()
        assert not (tmp_path / "fresh").exists(), name


def test_nonfinite_images_are_kept_when_asked(tmp_path, capsys):
    x = np.ones((5, 1, 2, 2), np.float32)
    x[2, 0, 1, 1] = np.inf
    np.savez(tmp_path / "f.npz", x=x, y=np.arange(5))
    assert run("npz", tmp_path / "f.npz", tmp_path / "o") == 2
    assert "sample 2 has Inf" in one_error_line(capsys) and not (tmp_path / "o").exists()
    assert run("npz", tmp_path / "f.npz", tmp_path / "o", "--allow-nonfinite", "--quiet") == 0
    _, tr = load(tmp_path / "o", "train")
    _, te = load(tmp_path / "o", "test")
    assert np.isinf(np.concatenate([tr["image"], te["image"]])).sum() == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_an_interrupted_conversion_leaves_an_existing_out_byte_identical(existing, sig):
    import signal
    import time

    before = tree_hashes(existing)
    # Tens of thousands of tiny shards, and the signal as the 11th is written: it must land
    # before the last (the rename that replaces OUT). 5000 shards left about 2 s of writing
    # after the 11th on a quiet 2-core machine, a race a starved test process could lose;
    # 20000 leave four times that. Interrupted as it should be, the run costs no more.
    argv = ["synthetic", "--shape", "1,4,4", "--count", "400000", "--shard-records", "20", "--overwrite",
            str(existing)]
    proc = subprocess.Popen([sys.executable, "-m", "native.convert", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not list(existing.parent.glob(".set.partial-*/train/shard-00010.shard")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the conversion never started writing"
            time.sleep(0.01)
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + getattr(signal, sig), err
    lines = err.strip().splitlines()
    assert lines == [f"python -m native.convert: interrupted by {sig}; {existing} was left as it was"], err
    assert tree_hashes(existing) == before and no_partials(existing)
