"""Convert image data into shard data sets: digits, CIFAR-10 binary, MNIST IDX, npz, synthetic,
a folder of images (one subfolder per class) and any map-style (torch) Dataset.

Every converter writes OUT/train and OUT/test (the dataset source may write one
of them), each a data set directory (shards + manifest.json) with fields
`image` (per-record shape C,H,W) and `label` (int64).

The data sets are written into a hidden directory beside OUT and renamed into
place only when both are complete, so a failed or interrupted conversion leaves
OUT exactly as it was. An OUT that already holds train/ or test/ is refused
unless --overwrite is given (then only those two are replaced; anything else in
OUT is kept). The folder and dataset sources stream (see native.ingest); the
others load their input whole, as it comes in one file.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import signal
import sys
import threading
import time
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .ingest import (
    SPLITS,
    ConvertError,
    Interrupted,
    Summary,
    check_out,
    convert_folder,
    dataset_from_spec,
    on_signal,
    parse_size,
    split_holdout,
    staged,
    write_dataset,
)
from .reader import open_dataset
from .schema import describe
from .writer import DatasetWriter

CIFAR_RECORD = 1 + 3 * 32 * 32
IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
CHUNK = 16384
NPZ_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip archive (np.savez), possibly empty


def write_split(out: Path, name: str, images: np.ndarray, labels: np.ndarray, shard_records: int | None) -> Path:
    """Write one split (images N,C,H,W; labels N) as OUT/name (which must not hold a data set)."""
    directory = out / name
    schema = {"image": (images.dtype, images.shape[1:]), "label": ("int64", ())}
    with DatasetWriter(directory, schema, shard_records=shard_records) as w:
        for lo in range(0, len(images), CHUNK):
            w.write({"image": images[lo : lo + CHUNK], "label": labels[lo : lo + CHUNK].astype(np.int64)})
    return directory


def summarize(directory: Path) -> str:
    """One line: what was written and how fast it reads back (shuffled batches of 256)."""
    ds = open_dataset(directory)
    n = len(ds)
    total = sum(int(s["bytes"]) for s in ds.manifest["shards"])
    ds.verify()  # checks every file and record, and warms the page cache
    order = np.random.default_rng(0).permutation(n)
    out = ds.empty(256)
    t0 = time.perf_counter()
    for lo in range(0, n, 256):
        ds.read(order[lo : lo + 256], out=out)
    dt = max(time.perf_counter() - t0, 1e-9)
    rec = sum(f.dtype.itemsize * int(np.prod(f.shape)) for f in ds.schema)
    ds.close()
    return (
        f"{directory}: {n} records in {len(ds.manifest['shards'])} shard(s), "
        f"{total / 1e6:.2f} MB [{describe(ds.schema)}]; read back shuffled in "
        f"{dt * 1e3:.1f} ms ({n * rec / dt / 1e9:.2f} GB/s)"
    )


def _check_labels(labels: np.ndarray, source: str, classes: int | None = None) -> None:
    if labels.size and labels.min() < 0:
        raise ConvertError(f"{source}: negative label {labels.min()}")
    if classes is not None and labels.size and labels.max() >= classes:
        bad = int(np.argmax(labels >= classes))
        raise ConvertError(f"{source}: record {bad} has label {labels[bad]}, expected 0..{classes - 1}")


# ---- sources --------------------------------------------------------------


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 digits: image float32 (1,8,8) in [0,1], label int64."""
    from sklearn.datasets import load_digits as sk_load_digits

    d = sk_load_digits()
    images = (d.images.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    return images, d.target.astype(np.int64)


def load_cifar10_bin(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 binary batch: records of 1 label byte + 3,072 pixel bytes (R, G, B planes)."""
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size == 0 or raw.size % CIFAR_RECORD:
        raise ConvertError(
            f"{path}: {raw.size} bytes is not a whole number of CIFAR-10 records "
            f"({CIFAR_RECORD} bytes each: 1 label + 3072 pixels); the file is truncated or "
            f"not the binary version (byte {raw.size - raw.size % CIFAR_RECORD} starts a "
            "partial record)"
        )
    rows = raw.reshape(-1, CIFAR_RECORD)
    labels = rows[:, 0].astype(np.int64)
    _check_labels(labels, str(path), 10)
    return rows[:, 1:].reshape(-1, 3, 32, 32), labels


def _idx_open(path: Path) -> bytes:
    data = Path(path).read_bytes()
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise ConvertError(f"{path}: damaged gzip stream: {exc}") from exc
    return data


def load_idx(path: Path) -> np.ndarray:
    """An IDX file (MNIST's format), raw or gzip-compressed."""
    data = _idx_open(path)
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ConvertError(f"{path}: not an IDX file (bytes 0-1 must be zero)")
    kind, ndim = data[2], data[3]
    if kind not in IDX_TYPES:
        raise ConvertError(f"{path}: unknown IDX element type 0x{kind:02x} at byte 2")
    if ndim == 0 or len(data) < 4 + 4 * ndim:
        raise ConvertError(f"{path}: truncated IDX header ({ndim} dimensions)")
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    dtype = np.dtype(IDX_TYPES[kind])
    need = int(np.prod(dims)) * dtype.itemsize
    start = 4 + 4 * ndim
    if len(data) - start != need:
        raise ConvertError(
            f"{path}: dimensions {dims} need {need} data bytes after byte {start}, the file has {len(data) - start}"
        )
    return np.frombuffer(data, dtype=dtype, offset=start).reshape(dims)


def load_mnist_idx(images: Path, labels: Path) -> tuple[np.ndarray, np.ndarray]:
    x = load_idx(images)
    y = load_idx(labels)
    if x.ndim != 3:
        raise ConvertError(f"{images}: expected N x rows x cols images, got shape {x.shape}")
    if y.ndim != 1 or len(y) != len(x):
        raise ConvertError(f"{labels}: expected {len(x)} labels, got shape {y.shape}")
    if x.dtype != np.uint8:
        raise ConvertError(f"{images}: expected unsigned bytes, got {x.dtype}")
    y = y.astype(np.int64)
    _check_labels(y, str(labels))
    return x[:, None, :, :], y


def _nchw(x: np.ndarray, source: str) -> np.ndarray:
    if x.ndim == 3:
        return x[:, None]
    if x.ndim == 4 and x.shape[1] in (1, 3, 4):
        return x
    if x.ndim == 4 and x.shape[3] in (1, 3, 4):
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    raise ConvertError(f"{source}: images must be N,H,W or N,C,H,W or N,H,W,C with C in 1/3/4, got {x.shape}")


def _image_dtype(x: np.ndarray, source: str) -> np.ndarray:
    if x.dtype == np.uint8:
        return x
    if x.dtype.kind == "f":
        with np.errstate(over="ignore"):  # a value beyond float32 becomes Inf: check_finite names it
            return x.astype(np.float32)
    raise ConvertError(f"{source}: images must be uint8 or floating point, got {x.dtype}")


def _open_npz(path: Path) -> np.lib.npyio.NpzFile:
    """np.load for an .npz only: anything else is a ConvertError saying what the file is."""
    try:
        with open(path, "rb") as fh:
            magic = fh.read(6)
    except OSError as exc:
        raise ConvertError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if magic.startswith(b"\x93NUMPY"):
        raise ConvertError(
            f"{path}: a single .npy array, not an .npz; save images and labels together with "
            "np.savez(path, x=images, y=labels)"
        )
    if not magic.startswith(NPZ_MAGIC):
        raise ConvertError(
            f"{path}: not an .npz file (a zip of arrays made by np.savez); save images and labels "
            "with np.savez(path, x=images, y=labels)"
        )
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ConvertError(f"{path}: damaged .npz (zip) file: {exc}") from None


def _npz_array(z: np.lib.npyio.NpzFile, key: str, path: Path) -> np.ndarray:
    """One array of an open .npz; object arrays and damaged members are one-line errors."""
    try:
        return z[key]
    except ValueError as exc:
        if "pickle" in str(exc):
            raise ConvertError(
                f"{path}[{key}]: holds Python objects, not numbers; store a numeric array "
                "(e.g. np.stack(list_of_images))"
            ) from None
        raise ConvertError(f"{path}[{key}]: cannot read the array: {exc}") from None
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ConvertError(f"{path}[{key}]: damaged member of the .npz: {exc}") from None


def check_finite(images: np.ndarray, source: str) -> None:
    """Refuse NaN or Inf pixels, naming the first bad sample: such a value turns every
    loss and weight it touches into NaN, far from its cause. Checked in chunks so a
    large data set needs no second full-size array."""
    if images.dtype.kind != "f":
        return
    for lo in range(0, len(images), CHUNK):
        bad = ~np.isfinite(images[lo : lo + CHUNK].reshape(min(CHUNK, len(images) - lo), -1)).all(axis=1)
        if bad.any():
            first = lo + int(np.argmax(bad))
            what = "NaN" if np.isnan(images[first]).any() else "Inf"
            raise ConvertError(
                f"{source}: sample {first} has {what} pixel values; fix or drop it, or pass "
                "--allow-nonfinite to store it anyway"
            )


def load_npz(
    path: Path, *, allow_nonfinite: bool = False
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray] | None]:
    """Keys x_train/y_train[/x_test/y_test] (Keras style), or images/labels, or x/y.

    Every way the file can be unusable (not an npz, missing arrays, wrong shape or
    type, NaN or Inf images) is a ConvertError naming the file and the array."""
    with _open_npz(path) as z:
        keys = set(z.files)
        pairs = [("x_train", "y_train"), ("images", "labels"), ("x", "y")]
        for xk, yk in pairs:
            if xk in keys and yk in keys:
                break
        else:
            raise ConvertError(f"{path}: expected arrays x_train/y_train, images/labels or x/y; found {sorted(keys)}")
        out = []
        for a, b in [(xk, yk)] + ([("x_test", "y_test")] if {"x_test", "y_test"} <= keys else []):
            x = _image_dtype(_nchw(_npz_array(z, a, path), f"{path}[{a}]"), f"{path}[{a}]")
            y = _npz_array(z, b, path)
            if y.ndim != 1 and y.shape[1:] != (1,):
                raise ConvertError(f"{path}[{b}]: labels must have shape (N,) or (N, 1), got {y.shape}")
            y = y.reshape(-1)
            if y.dtype.kind not in "iu":
                raise ConvertError(f"{path}[{b}]: labels must be integers, got {y.dtype}")
            if len(y) != len(x):
                raise ConvertError(f"{path}: {len(x)} images but {len(y)} labels in {a}/{b}")
            if len(x) == 0:
                raise ConvertError(f"{path}[{a}]: no samples")
            if not allow_nonfinite:
                check_finite(x, f"{path}[{a}]")
            y = y.astype(np.int64)
            _check_labels(y, f"{path}[{b}]")
            out.append((x, y))
    return out[0], (out[1] if len(out) > 1 else None)


def make_synthetic(
    shape: tuple[int, ...], classes: int, count: int, seed: int, dtype: str
) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(count, *shape), dtype=np.uint8)
    if dtype == "float32":
        images = images.astype(np.float32) / 255.0
    return images, rng.integers(0, classes, size=count).astype(np.int64)


# ---- command line -----------------------------------------------------------


def _float_images(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32" and x.dtype == np.uint8:
        return x.astype(np.float32) / 255.0
    return x


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected C,H,W integers, got {text!r}") from exc
    if len(shape) != 3 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected three positive integers C,H,W, got {text!r}")
    return shape


def _size(text: str) -> tuple[int, int]:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected class names separated by commas, got {text!r}")
    return names


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"train\": true}}', got {text!r}")
    return value


@dataclass(frozen=True)
class Arg:
    """One add_argument call: the names (a positional's dest, or the option strings) and its keywords."""

    names: tuple[str, ...]
    options: Mapping[str, Any]


@dataclass(frozen=True)
class Source:
    """One subcommand: its sub_parser keywords and its own arguments, after those of its parent
    ("io": what every source has; "common": io and --test-fraction, for the sources read whole)."""

    name: str
    parent: str
    help: str
    description: str
    args: tuple[Arg, ...]
    epilog: str | None = None


DESCRIPTION = (
    "Convert image data into shard data sets OUT/train and OUT/test "
    "(fields: image C,H,W and label int64). Both are written beside OUT and moved into "
    "place only when complete: a failed or interrupted conversion leaves OUT as it was. "
    "An OUT that already holds train/ or test/ is refused unless --overwrite is given. "
    "Prints what was written and how fast it reads back."
)
EPILOG = (
    "examples:\n"
    "  python -m native.convert digits data/digits\n"
    "  python -m native.convert cifar10-bin cifar-10-batches-bin/*.bin data/cifar10\n"
    "  python -m native.convert mnist-idx train-images-idx3-ubyte.gz "
    "train-labels-idx1-ubyte.gz data/mnist \\\n"
    "      --test-images t10k-images-idx3-ubyte.gz --test-labels t10k-labels-idx1-ubyte.gz\n"
    "  python -m native.convert npz mnist.npz data/mnist\n"
    "  python -m native.convert synthetic --shape 3,32,32 --count 200000 data/synthetic\n"
    "  python -m native.convert folder photos/ data/photos --size 64 --holdout 0.1\n"
    "  python -m native.convert dataset mydata:make data/mine --kwargs '{\"train\": true}'\n"
    "run `python -m native.convert SOURCE --help` for the options of a source"
)

IO_ARGS = (  # what every source has
    Arg(
        ("--shard-records",),
        {
            "type": int,
            "default": None,
            "metavar": "N",
            "help": "records per shard file (default: about 64 MB per shard)",
        },
    ),
    Arg(("--seed",), {"type": int, "default": 0, "help": "seed of the deterministic held-out split (default 0)"}),
    Arg(("--quiet",), {"action": "store_true", "help": "print nothing on success"}),
    Arg(
        ("--overwrite",),
        {
            "action": "store_true",
            "help": "replace OUT/train and OUT/test if they exist (other files in OUT are kept)",
        },
    ),
)
COMMON_ARGS = (
    Arg(
        ("--test-fraction",),
        {
            "type": float,
            "default": 0.2,
            "metavar": "F",
            "help": "held-out share when the input has no test split (default 0.2)",
        },
    ),
)
OUT_ARG = Arg(("out",), {"type": Path, "metavar": "OUT", "help": "output directory"})
DTYPE_ARG = Arg(
    ("--dtype",),
    {
        "choices": ["uint8", "float32"],
        "default": "uint8",
        "help": "stored image type; float32 scales to [0,1] (default uint8)",
    },
)

SOURCES = (
    Source(
        "digits",
        "common",
        help="scikit-learn's bundled 8x8 digits (1,797 images; the demo data)",
        description="scikit-learn's bundled digits: image float32 (1,8,8) in "
        "[0,1], label int64; a stratified held-out test split.",
        args=(OUT_ARG,),
    ),
    Source(
        "cifar10-bin",
        "common",
        help="CIFAR-10 binary version files (data_batch_N.bin, test_batch.bin)",
        description="CIFAR-10 binary version: 1 label byte + 3,072 pixel bytes per "
        "record. Files named test* go to OUT/test; without one a fraction is "
        "held out.",
        args=(
            Arg(
                ("files",),
                {
                    "type": Path,
                    "nargs": "+",
                    "metavar": "FILE",
                    "help": "data_batch_*.bin and test_batch.bin (3,073 bytes per record)",
                },
            ),
            OUT_ARG,
            DTYPE_ARG,
        ),
    ),
    Source(
        "mnist-idx",
        "common",
        help="MNIST-style IDX image and label files (raw or .gz)",
        description="An IDX images file (N x H x W bytes) and its IDX labels, "
        "raw or gzip. Give --test-images/--test-labels for the t10k pair; "
        "otherwise a fraction is held out.",
        args=(
            Arg(
                ("images",),
                {
                    "type": Path,
                    "metavar": "IMAGES",
                    "help": "IDX file of N x H x W bytes, e.g. train-images-idx3-ubyte",
                },
            ),
            Arg(
                ("labels",),
                {
                    "type": Path,
                    "metavar": "LABELS",
                    "help": "IDX file of N label bytes, e.g. train-labels-idx1-ubyte",
                },
            ),
            OUT_ARG,
            Arg(
                ("--test-images",),
                {
                    "type": Path,
                    "default": None,
                    "metavar": "FILE",
                    "help": "IDX test images, e.g. t10k-images-idx3-ubyte",
                },
            ),
            Arg(
                ("--test-labels",),
                {
                    "type": Path,
                    "default": None,
                    "metavar": "FILE",
                    "help": "IDX test labels, e.g. t10k-labels-idx1-ubyte",
                },
            ),
            DTYPE_ARG,
        ),
    ),
    Source(
        "npz",
        "common",
        help="a numpy .npz of images and labels",
        description="A .npz with x_train/y_train (and x_test/y_test), or "
        "images/labels, or x/y. Images N,H,W or N,C,H,W or N,H,W,C; uint8 or "
        "float (stored as float32).",
        args=(
            Arg(("file",), {"type": Path, "metavar": "FILE", "help": "the .npz file"}),
            OUT_ARG,
            Arg(
                ("--allow-nonfinite",),
                {
                    "action": "store_true",
                    "help": "store images with NaN or Inf values (by default they are an error naming the sample)",
                },
            ),
        ),
    ),
    Source(
        "synthetic",
        "common",
        help="random images for benchmarks",
        description="Random uint8 images and uniform labels (for throughput "
        "benchmarks; there is nothing to learn in them).",
        args=(
            OUT_ARG,
            Arg(
                ("--shape",),
                {
                    "type": _parse_shape,
                    "default": (3, 32, 32),
                    "metavar": "C,H,W",
                    "help": "per-record image shape (default 3,32,32)",
                },
            ),
            Arg(
                ("--classes",),
                {"type": int, "default": 10, "metavar": "K", "help": "labels are drawn from 0..K-1 (default 10)"},
            ),
            Arg(("--count",), {"type": int, "default": 10000, "metavar": "N", "help": "training records"}),
            Arg(
                ("--test-count",),
                {"type": int, "default": None, "metavar": "M", "help": "test records (default N/10, at least 1)"},
            ),
            DTYPE_ARG,
        ),
    ),
    Source(
        "folder",
        "io",
        help="a folder of images, one subfolder per class (torchvision's ImageFolder layout)",
        description="Images in SRC/<class>/... (subfolders too; .jpg .jpeg .png .ppm .bmp .pgm .tif "
        ".tiff .webp), decoded with Pillow one at a time and streamed into OUT/train and OUT/test: "
        "image uint8 (C,H,W), label int64 = the class's index in the sorted class folder names (or in "
        "--classes). The class names are stored in each manifest (native.classes_of reads them) and "
        "each record's file in sources.jsonl. Directory symlinks inside class folders are not followed.",
        epilog="size rule: scale the image by max(H/h, W/w) (Pillow BILINEAR), so it covers HxW "
        "without stretching, then cut the centre HxW; for a square size this is \"shorter side to "
        "the size, then centre crop\". colour: --color auto stores one channel (L) when every "
        "image's header says grayscale, otherwise RGB; alpha is dropped. holdout: a seeded share of "
        "each class goes to OUT/test.",
        args=(
            Arg(("src",), {"type": Path, "metavar": "SRC", "help": "the folder holding one subfolder per class"}),
            OUT_ARG,
            Arg(
                ("--size",),
                {
                    "type": _size,
                    "default": None,
                    "metavar": "H[xW]",
                    "help": "bring every image to H x W (default: keep the size, which must then be the same for all)",
                },
            ),
            Arg(
                ("--holdout", "--test-fraction"),
                {
                    "dest": "test_fraction",
                    "type": float,
                    "default": 0.2,
                    "metavar": "F",
                    "help": "share of each class held out into OUT/test (default 0.2)",
                },
            ),
            Arg(
                ("--classes",),
                {
                    "type": _names,
                    "default": None,
                    "metavar": "a,b,...",
                    "help": "take only these class folders, labelled 0, 1, ... in this order (default: all, sorted)",
                },
            ),
            Arg(
                ("--skip-bad",),
                {
                    "action": "store_true",
                    "help": "skip images that cannot be decoded (each named on stderr, counted in the summary) "
                    "instead of stopping at the first",
                },
            ),
            Arg(
                ("--color",),
                {
                    "choices": ["auto", "rgb", "gray"],
                    "default": "auto",
                    "help": "rgb (3 channels), gray (1) or auto: gray only if every image is single-channel (default)",
                },
            ),
        ),
    ),
    Source(
        "dataset",
        "io",
        help="any map-style (torch) Dataset of (image tensor, int label)",
        description="Call FACTORY (\"package.module:function\", the current directory on the import "
        "path, or \"path/to/file.py:function\") with --kwargs; it returns a map-style Dataset whose "
        "items are (image, label): image a tensor or array C,H,W, uint8 or float in [0,1] (stored as "
        "round(x*255)), all of one shape; label an int. Items are read one at a time in a seeded "
        "shuffled order and streamed into OUT/train (and OUT/test with --holdout).",
        args=(
            Arg(("spec",), {"metavar": "FACTORY", "help": "package.module:function or path/to/file.py:function"}),
            OUT_ARG,
            Arg(
                ("--kwargs",),
                {
                    "type": _json_object,
                    "default": {},
                    "metavar": "JSON",
                    "help": "keyword arguments of FACTORY as a JSON object, e.g. '{\"train\": false}'",
                },
            ),
            Arg(
                ("--holdout", "--test-fraction"),
                {
                    "dest": "test_fraction",
                    "type": float,
                    "default": 0.0,
                    "metavar": "F",
                    "help": "share held out into OUT/test (stratified if the Dataset has .targets); default 0: "
                    "everything goes to OUT/SPLIT",
                },
            ),
            Arg(
                ("--split",),
                {
                    "choices": SPLITS,
                    "default": "train",
                    "help": "where everything goes without --holdout (default train; write a test Dataset with "
                    "--split test)",
                },
            ),
        ),
    ),
)


def _add_args(parser: argparse.ArgumentParser, args: Sequence[Arg]) -> None:
    # A copy of each keyword set: every parser gets defaults of its own (--kwargs' {} is mutable).
    for arg in args:
        parser.add_argument(*arg.names, **copy.deepcopy(dict(arg.options)))


def build_parser() -> argparse.ArgumentParser:
    """The command line, made from the tables above: DESCRIPTION/EPILOG, IO_ARGS and COMMON_ARGS
    (the parents), and one subcommand per SOURCES entry."""
    p = argparse.ArgumentParser(
        prog="python -m native.convert",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    io = argparse.ArgumentParser(add_help=False)
    _add_args(io, IO_ARGS)
    common = argparse.ArgumentParser(add_help=False, parents=[io])
    _add_args(common, COMMON_ARGS)
    parents = {"io": io, "common": common}
    sub = p.add_subparsers(dest="source", required=True, metavar="SOURCE")
    for source in SOURCES:
        s = sub.add_parser(
            source.name,
            parents=[parents[source.parent]],
            help=source.help,
            description=source.description,
            epilog=source.epilog,
        )
        _add_args(s, source.args)
    return p


def load(args: argparse.Namespace) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Read and check the input of one conversion; returns the (images, labels) of train and test."""
    test: tuple[np.ndarray, np.ndarray] | None = None
    if args.source == "digits":
        x, y = load_digits()
        tr, te = split_holdout(len(y), args.test_fraction, args.seed, y)
        train, test = (x[tr], y[tr]), (x[te], y[te])
    elif args.source == "cifar10-bin":
        parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {"train": [], "test": []}
        for f in args.files:
            parts["test" if f.name.startswith("test") else "train"].append(load_cifar10_bin(f))
        if not parts["train"]:
            raise ConvertError("cifar10-bin: no training files given (only test*)")
        train = tuple(np.concatenate(a) for a in zip(*parts["train"], strict=True))
        if parts["test"]:
            test = tuple(np.concatenate(a) for a in zip(*parts["test"], strict=True))
        train = (_float_images(train[0], args.dtype), train[1])
        if test is not None:
            test = (_float_images(test[0], args.dtype), test[1])
    elif args.source == "mnist-idx":
        x, y = load_mnist_idx(args.images, args.labels)
        train = (_float_images(x, args.dtype), y)
        if (args.test_images is None) != (args.test_labels is None):
            raise ConvertError("mnist-idx: give both --test-images and --test-labels, or neither")
        if args.test_images is not None:
            tx, ty = load_mnist_idx(args.test_images, args.test_labels)
            test = (_float_images(tx, args.dtype), ty)
    elif args.source == "npz":
        train, test = load_npz(args.file, allow_nonfinite=args.allow_nonfinite)
    elif args.source == "synthetic":
        if args.count < 1 or args.classes < 1:
            raise ConvertError("synthetic: --count and --classes must be >= 1")
        m = args.test_count if args.test_count is not None else max(1, args.count // 10)
        train = make_synthetic(args.shape, args.classes, args.count, args.seed, args.dtype)
        test = make_synthetic(args.shape, args.classes, max(1, m), args.seed + 1, args.dtype)
    else:  # pragma: no cover - argparse restricts the choices
        raise ConvertError(f"unknown source {args.source}")
    if test is None:
        tr, te = split_holdout(len(train[1]), args.test_fraction, args.seed)
        tr.sort()
        te.sort()
        train, test = (train[0][tr], train[1][tr]), (train[0][te], train[1][te])
    if (train[0].shape[1:], train[0].dtype) != (test[0].shape[1:], test[0].dtype):
        source = getattr(args, "file", None) or args.source
        raise ConvertError(
            f"{source}: test images are {test[0].dtype} {test[0].shape[1:]} but train images are "
            f"{train[0].dtype} {train[0].shape[1:]}; a model reads both, give them one shape and type"
        )
    return train, test


def convert(args: argparse.Namespace) -> list[Path]:
    """Run one conversion; returns the data set directories written (OUT/train, OUT/test).

    Nothing in OUT changes until both data sets are complete in a hidden directory
    beside it (.OUT.partial-PID); on any error that directory is removed."""
    out: Path = args.out
    check_out(out, args.overwrite)
    train, test = load(args)
    with staged(out, args.overwrite) as partial:
        for name, (images, labels) in zip(SPLITS, (train, test), strict=True):
            write_split(partial, name, images, labels, args.shard_records)
    return [out / name for name in SPLITS]


def ingest(args: argparse.Namespace, prog: str) -> Summary:
    """Run the streaming sources (folder, dataset); skipped images are named on stderr."""

    def skipped(path: str, reason: str) -> None:
        if not args.quiet:
            print(f"{prog}: skipped {path}: {reason}", file=sys.stderr)

    if args.source == "folder":
        return convert_folder(args.src, args.out, size=args.size, holdout=args.test_fraction,
                              classes=args.classes, skip_bad=args.skip_bad, color=args.color, seed=args.seed,
                              overwrite=args.overwrite, shard_records=args.shard_records, on_skip=skipped)
    check_out(args.out, args.overwrite, SPLITS if args.test_fraction else (args.split,))
    dataset = dataset_from_spec(args.spec, args.kwargs)
    return write_dataset(dataset, args.out, holdout=args.test_fraction, seed=args.seed, overwrite=args.overwrite,
                         split=args.split, shard_records=args.shard_records)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status (2 for unusable input, one line on stderr)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {}
    if threading.current_thread() is threading.main_thread():  # only there can Python catch signals
        handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    written: list[Path] = []
    try:
        t0 = time.perf_counter()
        if args.source in ("folder", "dataset"):
            summary = ingest(args, parser.prog)
            written = [summary.out / name for name in summary.records]
            if not args.quiet:
                print(summary.line())
                if summary.links_not_followed:
                    print(f"note: {summary.links_not_followed} directory symlink(s) inside class folders "
                          "were not followed")
        else:
            written = convert(args)
            if not args.quiet:
                print(f"converted {args.source} in {time.perf_counter() - t0:.2f} s")
        if not args.quiet:
            for d in written:
                print(summarize(d))
    except (ValueError, OSError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    except Interrupted as exc:
        fate = "the new data sets are in place" if written else f"{args.out} was left as it was"
        print(f"{parser.prog}: interrupted by {exc}; {fate}", file=sys.stderr)
        return 128 + exc.signum
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    return 0


if __name__ == "__main__":
    sys.exit(main())
