"""Your own data: `native.convert folder` (a folder of images per class) and `dataset` / `native.write_dataset`
(any map-style Dataset). Both stream, are atomic, and record the class names."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import native
from native import convert

CLASSES = ["ant", "bee", "cat"]  # sorted: labels 0, 1, 2


def run(*argv: object) -> int:
    return convert.main([str(a) for a in argv])


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def no_partials(out: Path) -> bool:
    return [p.name for p in out.parent.iterdir() if ".partial-" in p.name] == []


def make_folder(root: Path, per_class: int = 8, seed: int = 0, sizes: bool = True) -> list[str]:
    """root/<class>/... with PNG and JPEG files of mixed sizes (some in a subfolder);
    returns the files relative to root."""
    rng = np.random.default_rng(seed)
    files = []
    for c in CLASSES:
        for i in range(per_class):
            h, w = (int(v) for v in rng.integers(12, 60, 2)) if sizes else (16, 16)
            # smooth content, so JPEG is not all noise; plus a little noise for PNG
            y, x = np.mgrid[0:h, 0:w]
            base = np.stack([(x * 255 // w), (y * 255 // h), np.full_like(x, 40 * i)], axis=-1)
            pixels = (base + rng.integers(0, 30, (h, w, 3))).clip(0, 255).astype(np.uint8)
            ext = "png" if i % 2 == 0 else "jpg"
            rel = f"{c}/{'more/' if i % 3 == 0 else ''}img{i}.{ext}"
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels).save(root / rel, quality=85) if ext == "jpg" else \
                Image.fromarray(pixels).save(root / rel)
            files.append(rel)
    return files


def reference(path: Path, size: tuple[int, int] | None, mode: str = "RGB") -> np.ndarray:
    """Pillow's own decode, then the documented rule: scale by max(H/h, W/w) with BILINEAR
    to (max(W, round(w*s)), max(H, round(h*s))), crop the centre H x W."""
    with Image.open(path) as im:
        im = im.convert(mode)
        if size is not None:
            H, W = size
            w, h = im.size
            s = max(H / h, W / w)
            nw, nh = max(W, round(w * s)), max(H, round(h * s))
            if (nw, nh) != (w, h):
                im = im.resize((nw, nh), Image.Resampling.BILINEAR)
            left, top = (nw - W) // 2, (nh - H) // 2
            im = im.crop((left, top, left + W, top + H))
        a = np.asarray(im)
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)


def records(out: Path, split: str) -> tuple[dict[str, np.ndarray], list]:
    ds = native.open_dataset(out / split)
    ds.verify()
    batch = ds.read(np.arange(len(ds)))
    sources = [json.loads(line) for line in (out / split / "sources.jsonl").read_text().splitlines()]
    assert len(sources) == len(ds)
    ds.close()
    return batch, sources


@pytest.mark.timeout(120)
def test_folder_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "photos"
    files = make_folder(src)
    (src / "README.txt").write_text("not an image\n")
    (src / "bee" / "notes.txt").write_text("ignored\n")
    out = tmp_path / "out"
    assert run("folder", src, out, "--size", "24x32", "--holdout", "0.25") == 0
    printed = capsys.readouterr().out.splitlines()
    line = printed[0]
    assert "train 18, test 6 records" in line and "(3, 24, 32) RGB" in line, line
    assert "3 classes (ant, bee, cat)" in line and "0 skipped" in line and "images/s" in line, line
    seen: dict[str, list] = {}
    for split in ("train", "test"):
        assert native.classes_of(out / split) == CLASSES
        assert native.classes_of(native.open_dataset(out / split)) == CLASSES
        batch, sources = records(out, split)
        seen[split] = sources
        assert batch["image"].dtype == np.uint8 and batch["image"].shape[1:] == (3, 24, 32)
        assert batch["label"].dtype == np.int64
        for image, label, rel in zip(batch["image"], batch["label"], sources, strict=True):
            assert CLASSES[label] == rel.split("/")[0]  # the label is the class folder
            # bit-exact against Pillow's own decode (PNG lossless, JPEG deterministic) and resize
            np.testing.assert_array_equal(image, reference(src / rel, (24, 32)), err_msg=rel)
    # the holdout: disjoint, together everything, every class in test (stratified)
    assert set(seen["train"]).isdisjoint(seen["test"])
    assert sorted(seen["train"] + seen["test"]) == sorted(files)
    assert {s.split("/")[0] for s in seen["test"]} == set(CLASSES)
    assert no_partials(out)
    # deterministic: the same seed gives the same bytes
    assert run("folder", src, tmp_path / "again", "--size", "24x32", "--holdout", "0.25", "--quiet") == 0
    assert tree_hashes(out) == tree_hashes(tmp_path / "again")


@pytest.mark.timeout(120)
def test_square_size_and_own_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    make_folder(src, per_class=4)
    assert run("folder", src, tmp_path / "sq", "--size", "20", "--quiet") == 0
    batch, sources = records(tmp_path / "sq", "train")
    assert batch["image"].shape[1:] == (3, 20, 20)
    for image, rel in zip(batch["image"], sources, strict=True):
        np.testing.assert_array_equal(image, reference(src / rel, (20, 20)))
    # without --size all images must share one size ...
    assert run("folder", src, tmp_path / "mixed") == 2
    line = one_error_line(capsys)
    assert "pass --size" in line and "(HxW)" in line
    assert not (tmp_path / "mixed").exists()
    # ... and then they are kept as they are
    same = tmp_path / "same"
    make_folder(same, per_class=4, sizes=False)
    assert run("folder", same, tmp_path / "kept", "--quiet") == 0
    batch, sources = records(tmp_path / "kept", "train")
    assert batch["image"].shape[1:] == (3, 16, 16)
    for image, rel in zip(batch["image"], sources, strict=True):
        np.testing.assert_array_equal(image, reference(same / rel, None))


@pytest.mark.timeout(120)
def test_grayscale_folder_is_one_channel_unless_asked(tmp_path: Path) -> None:
    src = tmp_path / "gray"
    rng = np.random.default_rng(1)
    for c in CLASSES[:2]:
        (src / c).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(rng.integers(0, 256, (10, 14), dtype=np.uint8)).save(src / c / f"{i}.png")
    assert run("folder", src, tmp_path / "a", "--size", "8", "--quiet") == 0
    batch, sources = records(tmp_path / "a", "train")
    assert batch["image"].shape[1:] == (1, 8, 8)
    for image, rel in zip(batch["image"], sources, strict=True):
        np.testing.assert_array_equal(image, reference(src / rel, (8, 8), "L"))
    assert run("folder", src, tmp_path / "b", "--size", "8", "--color", "rgb", "--quiet") == 0
    batch, _ = records(tmp_path / "b", "train")
    assert batch["image"].shape[1:] == (3, 8, 8)
    # one colour image makes the whole folder RGB
    Image.fromarray(rng.integers(0, 256, (10, 14, 3), dtype=np.uint8)).save(src / "ant" / "colour.png")
    assert run("folder", src, tmp_path / "c", "--size", "8", "--quiet") == 0
    assert records(tmp_path / "c", "train")[0]["image"].shape[1:] == (3, 8, 8)


@pytest.mark.timeout(120)
def test_classes_option_picks_and_orders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    make_folder(src, per_class=4)
    out = tmp_path / "out"
    assert run("folder", src, out, "--size", "8", "--classes", "cat,ant", "--quiet") == 0
    for split in ("train", "test"):
        assert native.classes_of(out / split) == ["cat", "ant"]
        batch, sources = records(out, split)
        assert [["cat", "ant"][y] for y in batch["label"]] == [s.split("/")[0] for s in sources]
    assert run("folder", src, tmp_path / "x", "--classes", "cat,dog") == 2
    line = one_error_line(capsys)
    assert "no class folder 'dog'" in line and "ant, bee, cat" in line


@pytest.mark.timeout(120)
def test_a_truncated_jpeg_is_named_or_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    files = make_folder(src, per_class=6)
    bad = src / next(f for f in files if f.endswith(".jpg"))
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) * 2 // 3])  # the header is whole: decoding fails part way
    out = tmp_path / "out"
    assert run("folder", src, out, "--size", "16") == 2
    line = one_error_line(capsys)
    assert line.startswith("python -m native.convert: error: ") and str(bad) in line and "--skip-bad" in line
    assert not out.exists() and no_partials(out)
    # a file cut inside its header fails at open, also one line
    bad.write_bytes(data[:40])
    assert run("folder", src, out, "--size", "16") == 2
    assert str(bad) in one_error_line(capsys)
    # with --skip-bad it is left out, named on stderr and counted in the summary
    assert run("folder", src, out, "--size", "16", "--skip-bad") == 0
    captured = capsys.readouterr()
    assert "1 skipped" in captured.out.splitlines()[0]
    assert f"skipped {bad}" in captured.err
    written = records(out, "train")[1] + records(out, "test")[1]
    assert sorted(written) == sorted(f for f in files if src / f != bad)


@pytest.mark.timeout(60)
def test_a_symlink_loop_does_not_hang(tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = make_folder(src, per_class=3)
    os.symlink(src / "ant", src / "ant" / "more" / "loop")  # a cycle inside a class
    os.symlink(src, src / "bee" / "up")  # back up to SRC
    out = tmp_path / "out"
    assert run("folder", src, out, "--size", "8", "--quiet") == 0
    written = records(out, "train")[1] + records(out, "test")[1]
    assert sorted(written) == sorted(files)  # each image once, nothing through the links
    # a class folder that is a symlink to SRC itself is refused, not walked
    os.symlink(src, src / "dog")
    assert run("folder", src, tmp_path / "o2", "--size", "8", "--quiet") == 2


@pytest.mark.timeout(60)
def test_empty_folder_and_single_class_are_clear_errors(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    assert run("folder", tmp_path / "empty", tmp_path / "o") == 2
    assert "no class folders" in one_error_line(capsys)
    (tmp_path / "noimg" / "a").mkdir(parents=True)
    (tmp_path / "noimg" / "b").mkdir(parents=True)
    (tmp_path / "noimg" / "a" / "x.txt").write_text("x")
    assert run("folder", tmp_path / "noimg", tmp_path / "o") == 2
    assert "class 'a' has no images" in one_error_line(capsys)
    one = tmp_path / "one" / "only"
    one.mkdir(parents=True)
    Image.new("RGB", (4, 4)).save(one / "a.png")
    assert run("folder", tmp_path / "one", tmp_path / "o") == 2
    assert "only one class ('only')" in one_error_line(capsys)
    assert run("folder", tmp_path / "nowhere", tmp_path / "o") == 2
    assert "no such directory" in one_error_line(capsys)
    assert not (tmp_path / "o").exists()


@pytest.mark.timeout(120)
def test_existing_out_is_refused_without_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    make_folder(src, per_class=4)
    out = tmp_path / "out"
    assert run("folder", src, out, "--size", "8", "--quiet") == 0
    (out / "NOTES.txt").write_text("mine\n")
    before = tree_hashes(out)
    assert run("folder", src, out, "--size", "12", "--quiet") == 2
    line = one_error_line(capsys)
    assert "already holds train/ and test/" in line and "--overwrite" in line
    assert tree_hashes(out) == before and no_partials(out)
    assert run("folder", src, out, "--size", "12", "--overwrite", "--quiet") == 0
    assert records(out, "train")[0]["image"].shape[1:] == (3, 12, 12)
    assert (out / "NOTES.txt").read_text() == "mine\n" and no_partials(out)


# ---- any map-style Dataset ----------------------------------------------------------------------


class Items:
    """A map-style dataset of float images in [0, 1] made from the index (no storage)."""

    classes = ["zero", "one", "two"]

    def __init__(self, n: int, shape: tuple[int, ...] = (3, 8, 8), stop_at: int | None = None) -> None:
        self.n, self.shape, self.stop_at = n, shape, stop_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[object, int]:
        import torch

        if i == self.stop_at:
            raise KeyboardInterrupt
        g = torch.Generator().manual_seed(i)
        return torch.rand(self.shape, generator=g), i % 3


def expected(i: int, shape: tuple[int, ...] = (3, 8, 8)) -> np.ndarray:
    import torch

    x = torch.rand(shape, generator=torch.Generator().manual_seed(i)).numpy()
    return np.rint(x * 255.0).astype(np.uint8)


@pytest.mark.timeout(120)
def test_write_dataset_round_trip(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    summary = native.write_dataset(Items(40), tmp_path / "out", holdout=0.25, seed=3)
    assert summary.records == {"train": 30, "test": 10} and summary.shape == (3, 8, 8)
    seen = []
    for split in ("train", "test"):
        batch, sources = records(tmp_path / "out", split)
        assert native.classes_of(tmp_path / "out" / split) == Items.classes
        for image, label, i in zip(batch["image"], batch["label"], sources, strict=True):
            assert label == i % 3
            np.testing.assert_array_equal(image, expected(i))
        seen += sources
    assert sorted(seen) == list(range(40))
    # uint8 tensors are stored as they are; a separate test set goes to OUT/test
    import torch

    pairs = [(torch.full((1, 2, 2), i, dtype=torch.uint8), torch.tensor(i % 2)) for i in range(6)]
    native.write_dataset(pairs, tmp_path / "u", split="test")
    batch, sources = records(tmp_path / "u", "test")
    assert [int(b[0, 0, 0]) for b in batch["image"]] == sources and not (tmp_path / "u" / "train").exists()
    with pytest.raises(ValueError, match="already holds test/"):
        native.write_dataset(pairs, tmp_path / "u", split="test")
    native.write_dataset(pairs, tmp_path / "u", split="test", overwrite=True)


@pytest.mark.timeout(120)
def test_write_dataset_names_the_bad_item(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")

    class Bad(Items):
        def __init__(self, kind: str) -> None:
            super().__init__(20)
            self.kind = kind

        def __getitem__(self, i: int) -> tuple[object, object]:
            image, label = super().__getitem__(i)
            if i == 13:
                if self.kind == "label":
                    return image, 1.0
                if self.kind == "shape":
                    return torch.zeros(3, 8, 9), label
                if self.kind == "range":
                    return image * 2 - 1, label
            return image, label

    for kind, words in [("label", "item 13: the label 1.0"), ("shape", "item 13: the image has shape (3, 8, 9)"),
                        ("range", "item 13: float image values must be in [0, 1]")]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            native.write_dataset(Bad(kind), tmp_path / kind)
        assert not (tmp_path / kind).exists() and no_partials(tmp_path / kind)


MEMORY_SCRIPT = """
import json, sys, threading, time
import numpy as np
import torch
import native

def rss_anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")

class Big:
    # 10,000 items of 3x64x64 float32 (48 KB each, 491 MB in all; 123 MB as uint8)
    def __len__(self):
        return 10_000
    def __getitem__(self, i):
        return torch.full((3, 64, 64), (i % 256) / 255.0), i % 10

peak = [0]
done = threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss_anon())
        time.sleep(0.002)

Big()[0]  # torch's first-use allocations before the baseline
base = rss_anon()
t = threading.Thread(target=sample, daemon=True)
t.start()
summary = native.write_dataset(Big(), sys.argv[1])
done.set()
t.join()
peak[0] = max(peak[0], rss_anon())
print(json.dumps({"base": base, "peak": peak[0], "records": summary.records}))
"""


@pytest.mark.timeout(300)
def test_write_dataset_streams_with_flat_memory(tmp_path: Path) -> None:
    """Anonymous memory (heap: what holding items would take) grows by less than 50 MB while
    10,000 items (123 MB as uint8) are written. File pages the writer maps to checksum a
    finished shard are page cache, not held data, so RssAnon is the measure, sampled
    every few ms in the converting process itself."""
    pytest.importorskip("torch")
    script = tmp_path / "mem.py"
    script.write_text(MEMORY_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "big")], capture_output=True, text=True,
                          timeout=280, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["records"] == {"train": 10_000}
    growth = result["peak"] - result["base"]
    assert growth < 50 << 20, f"anonymous memory grew by {growth / 2**20:.1f} MB"
    ds = native.open_dataset(tmp_path / "big" / "train")
    assert len(ds) == 10_000
    sources = [int(s) for s in (tmp_path / "big" / "train" / "sources.jsonl").read_text().split()]
    batch = ds.read(np.arange(0, 10_000, 997))
    for image, label, i in zip(batch["image"], batch["label"], sources[::997], strict=True):
        assert label == i % 10 and (image == round((i % 256) / 255.0 * 255)).all()


@pytest.mark.timeout(120)
def test_ctrl_c_in_getitem_leaves_nothing(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        native.write_dataset(Items(10_000, stop_at=5000), out, shard_records=1000)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    # into an existing OUT (with --overwrite): it stays byte-identical
    native.write_dataset(Items(30), out, holdout=0.2)
    before = tree_hashes(out)
    with pytest.raises(KeyboardInterrupt):
        native.write_dataset(Items(10_000, stop_at=5000), out, holdout=0.2, overwrite=True)
    assert tree_hashes(out) == before and no_partials(out)


DATASET_MODULE = """
import torch

class Shapes(torch.utils.data.Dataset):
    classes = ["dark", "light"]

    def __init__(self, n, offset=0):
        self.n, self.offset = n, offset

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((1, 4, 4), (self.offset + i) % 256, dtype=torch.uint8), i % 2

def make(n=10, offset=0):
    return Shapes(n, offset)
"""


@pytest.mark.timeout(180)
def test_cli_dataset_with_kwargs(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    (tmp_path / "userdata_native_cli.py").write_text(textwrap.dedent(DATASET_MODULE))
    cmd = [sys.executable, "-m", "native.convert", "dataset"]
    done = subprocess.run([*cmd, "userdata_native_cli:make", "out", "--kwargs", '{"n": 30, "offset": 7}',
                           "--holdout", "0.2"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "train 24, test 6 records" in done.stdout and "2 classes (dark, light)" in done.stdout
    for split in ("train", "test"):
        batch, sources = records(tmp_path / "out", split)
        assert [int(b[0, 0, 0]) for b in batch["image"]] == [(7 + i) % 256 for i in sources]
        assert batch["label"].tolist() == [i % 2 for i in sources]
    # the file form, a test set on its own, and a bad --kwargs as one line
    done = subprocess.run([*cmd, "./userdata_native_cli.py:make", "out", "--split", "test", "--overwrite",
                           "--kwargs", '{"n": 5}'], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert records(tmp_path / "out", "test")[1] != [] and len(records(tmp_path / "out", "test")[1]) == 5
    done = subprocess.run([*cmd, "userdata_native_cli:make", "o2", "--kwargs", '{"size": 5}'], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "unexpected keyword argument 'size'" in done.stderr and not (tmp_path / "o2").exists()
