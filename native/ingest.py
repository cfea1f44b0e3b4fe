"""Bring a user's own data into shard data sets: a folder of images, or any map-style Dataset.

Both sources stream: records are decoded one at a time into a small batch
buffer (a few MB) and handed to `DatasetWriter`, so memory stays flat however
large the source is. Both write into a hidden directory beside OUT and rename
it into place only when every split is complete (see `staged`): a failed or
interrupted conversion leaves OUT as it was and nothing beside it.

Besides the shards and manifest, every split written here holds:

- ``manifest.json["classes"]``: the class names, label ``i`` being
  ``classes[i]``; `classes_of` reads them back (None for a data set without).
- ``sources.jsonl``: one JSON value a line, record ``i``'s source: the image
  file's path relative to SRC, or the Dataset index. It lets a user trace any
  record (a misclassified one, say) back to what it was made from.

This module also holds what every converter of ``python -m native.convert``
shares (held-out split, refusing an existing OUT, the atomic install and its
signal handling), so that one copy of that state exists even when
``native.convert`` runs as ``__main__``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import itertools
import json
import os
import shutil
import signal
import struct
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from .errors import ShardError
from .reader import Dataset, open_dataset
from .writer import MANIFEST, DatasetWriter, _write_json_atomic, fsync_dir

SPLITS = ("train", "test")
SOURCES = "sources.jsonl"
# The extensions torchvision's ImageFolder reads (compared in lower case).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# Pillow modes with one colour channel (an alpha channel, as in "LA", is dropped).
GRAY_MODES = frozenset({"1", "L", "LA", "La", "I", "I;16", "I;16L", "I;16B", "I;16N", "F"})
BATCH_BYTES = 4 << 20  # records are handed to the writer in batches of about this size


class ConvertError(ValueError):
    """Input that a converter cannot use; the message names the file and what is wrong."""


# ---- shared by every converter: held-out split, refusing OUT, atomic install --------------


def split_holdout(
    n: int, fraction: float, seed: int, labels: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic (train, test) index split; stratified by label when labels are given,
    so every class with two or more records appears in the held-out set and keeps at
    least one training record. Both come back shuffled (a class-sorted source must not
    give each rank's contiguous block of records a few classes only)."""
    if not 0.0 < fraction < 1.0:
        raise ConvertError(f"the held-out fraction (--holdout, --test-fraction) must be between 0 and 1, "
                           f"got {fraction}")
    rng = np.random.default_rng(seed)
    if labels is None:
        perm = rng.permutation(n)
        k = max(1, round(n * fraction))
        return perm[k:], perm[:k]
    train, test = [], []
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        k = min(max(1, round(len(members) * fraction)), len(members) - 1)
        test.append(members[:k])
        train.append(members[k:])
    tr, te = np.concatenate(train), np.concatenate(test)
    return rng.permutation(tr), rng.permutation(te)


def check_out(out: Path, overwrite: bool, names: Sequence[str] = SPLITS) -> None:
    """Refuse an OUT that is not a directory, or that already holds one of the splits
    `names` without --overwrite: a conversion never replaces a user's data unless asked to."""
    if out.exists() and not out.is_dir():
        raise ConvertError(f"{out} exists and is not a directory; choose another OUT")
    held = [name for name in names if os.path.lexists(out / name)]
    if held and not overwrite:
        raise ConvertError(
            f"{out} already holds {' and '.join(f'{n}/' for n in held)}; pass --overwrite to replace "
            f"{'it' if len(held) == 1 else 'them'}, or choose another OUT"
        )


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived while converting (before anything was moved into OUT)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_installing: list[int] = []  # signals that arrived while the finished data sets were moved in


def on_signal(signum: int, frame: object) -> None:
    """SIGINT/SIGTERM handler of the command line: abort the conversion, unless the finished
    data sets are being moved into OUT (microseconds), which must not stop half way."""
    if _installing:
        _installing.append(signum)
        return
    raise Interrupted(signum)


def install(partial: Path, out: Path, overwrite: bool, names: Sequence[str] = SPLITS) -> None:
    """Move the finished PARTIAL/<name> data sets into OUT.

    A new OUT is one rename. Into an existing OUT each old split is first moved
    aside into PARTIAL, then the new one moved in; if a rename fails, what was
    moved is put back, so OUT holds either the old data sets or the new ones."""
    check_out(out, overwrite, names)  # again: another conversion may have finished meanwhile
    if not out.exists():
        os.rename(partial, out)
        fsync_dir(out.parent)
        return
    aside = partial / "replaced"
    aside.mkdir()
    moved_out: list[str] = []
    moved_in: list[str] = []
    try:
        for name in names:
            if os.path.lexists(out / name):
                os.rename(out / name, aside / name)
                moved_out.append(name)
        for name in names:
            os.rename(partial / name, out / name)
            moved_in.append(name)
    except OSError:
        for name in moved_in:
            os.rename(out / name, partial / name)
        for name in moved_out:
            os.rename(aside / name, out / name)
        raise
    fsync_dir(out)


@contextmanager
def staged(out: Path, overwrite: bool, names: Sequence[str] = SPLITS) -> Iterator[Path]:
    """A hidden directory beside OUT (.OUT.partial-PID) to write the splits `names` into;
    they are moved into OUT when the block ends normally. On any exception, Ctrl-C
    included, the directory is removed and OUT is left exactly as it was."""
    check_out(out, overwrite, names)
    out.parent.mkdir(parents=True, exist_ok=True)
    for k in itertools.count():  # a stale directory of a dead process with our PID is left alone
        partial = out.parent / f".{out.name}.partial-{os.getpid()}{f'-{k}' if k else ''}"
        try:
            partial.mkdir()
            break
        except FileExistsError:
            continue
    try:
        yield partial
        _installing.append(0)
        try:
            install(partial, out, overwrite, names)
        finally:
            _installing.clear()
    finally:
        shutil.rmtree(partial, ignore_errors=True)


# ---- class names in the manifest ------------------------------------------------------------


def set_classes(directory: str | os.PathLike[str], classes: Sequence[str]) -> None:
    """Record the class names in a finished data set's manifest (label i is classes[i]).

    The manifest is the data set's one description, so the names travel with the
    shards wherever they are copied; it is rewritten atomically.

    Raises:
        ShardError: no data set in `directory`, or its labels reach past the names.
    """
    names = [str(c) for c in classes]
    ds = open_dataset(directory, verify="never")
    try:
        manifest = dict(ds.manifest)
    finally:
        ds.close()
    span = manifest.get("ranges", {}).get("label")
    if span and span[1] >= len(names):
        raise ShardError(f"{directory}: labels reach {span[1]} but only {len(names)} class names were given",
                         path=str(directory))
    manifest["classes"] = names
    _write_json_atomic(Path(directory) / MANIFEST, manifest)


def classes_of(dataset: Dataset | str | os.PathLike[str]) -> list[str] | None:
    """The class names of a data set (an open Dataset or its directory): label i is
    the i-th name. None when the data set records no names (made from arrays).

    Raises:
        ShardError: the manifest's "classes" entry is not a list of strings.
    """
    if isinstance(dataset, Dataset):
        manifest, where = dataset.manifest, dataset.directory
    else:
        where = Path(dataset)
        try:
            manifest = json.loads((where / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ShardError(f"{where / MANIFEST}: unreadable manifest: {exc}", path=str(where)) from None
    names = manifest.get("classes") if isinstance(manifest, dict) else None
    if names is None:
        return None
    if not isinstance(names, list) or not all(isinstance(c, str) for c in names):
        raise ShardError(f"{where / MANIFEST}: 'classes' must be a list of strings", path=str(where))
    return list(names)


# ---- streaming records into one split --------------------------------------------------------


class _Sink:
    """One split being written: records gathered in a small batch buffer, handed to a
    DatasetWriter when it is full, each record's source appended to sources.jsonl."""

    def __init__(self, directory: Path, shape: tuple[int, ...], shard_records: int | None) -> None:
        self.directory = directory
        self.shape = shape
        self.writer = DatasetWriter(directory, {"image": ("uint8", shape), "label": ("int64", ())},
                                    shard_records=shard_records)
        rows = max(1, min(1024, BATCH_BYTES // max(1, int(np.prod(shape)))))
        self.images = np.empty((rows, *shape), np.uint8)
        self.labels = np.empty(rows, np.int64)
        self.fill = 0
        self.count = 0
        self.sources = open(directory / SOURCES, "w", encoding="utf-8")  # closed in close() or abort()

    def add(self, image: np.ndarray, label: int, source: str | int) -> None:
        self.images[self.fill] = image
        self.labels[self.fill] = label
        self.fill += 1
        self.count += 1
        self.sources.write(json.dumps(source) + "\n")
        if self.fill == len(self.labels):
            self.flush()

    def flush(self) -> None:
        if self.fill:
            self.writer.write({"image": self.images[: self.fill], "label": self.labels[: self.fill]})
            self.fill = 0

    def close(self) -> None:
        self.flush()
        self.sources.close()
        self.writer.close()

    def abort(self) -> None:
        self.sources.close()
        self.writer.abort()

    def __enter__(self) -> _Sink:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


@dataclass
class Summary:
    """What one conversion wrote, for the summary line and for callers of the Python API."""

    out: Path
    records: dict[str, int]
    shape: tuple[int, ...]
    classes: list[str] | None
    seconds: float
    mode: str | None = None  # the Pillow mode images were converted to (folder only)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, reason) with --skip-bad
    links_not_followed: int = 0

    @property
    def images_per_second(self) -> float:
        """Records written per second of the whole conversion (listing and decoding included)."""
        return sum(self.records.values()) / max(self.seconds, 1e-9)

    def line(self) -> str:
        """One line: records per split, classes, skipped files and images per second."""
        parts = ", ".join(f"{name} {n}" for name, n in self.records.items())
        kind = f" {self.mode}" if self.mode else ""
        if self.classes:
            shown = ", ".join(self.classes[:8]) + (", ..." if len(self.classes) > 8 else "")
            classes = f"{len(self.classes)} classes ({shown})"
        else:
            classes = "no class names"
        total = sum(self.records.values())
        return (f"{self.out}: {parts} records of image uint8 {self.shape}{kind}; {classes}; "
                f"{len(self.skipped)} skipped; {total} images in {self.seconds:.2f} s "
                f"({self.images_per_second:.0f} images/s)")


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


# ---- a folder of images (torchvision ImageFolder layout) --------------------------------------


def parse_size(text: str) -> tuple[int, int]:
    """"32" -> (32, 32); "32x48" -> (32, 48), as (height, width)."""
    try:
        dims = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) not in (1, 2) or min(dims) < 1:
        raise ValueError(f"expected a size H or HxW in pixels (e.g. 32 or 32x48), got {text!r}")
    return (dims[0], dims[-1])


def fit(image: Any, size: tuple[int, int]) -> Any:
    """Scale a PIL image so it covers `size` (height, width), then cut out the centre.

    The rule, exactly: scale = max(H / h, W / w) for an h x w image; resize to
    (max(W, round(w * scale)), max(H, round(h * scale))) with Pillow's BILINEAR
    filter (skipped when the image already has that size); crop the H x W box
    whose top-left corner is ((width - W) // 2, (height - H) // 2). For a square
    target this is "shorter side to the target, then centre crop": nothing is
    stretched, and only the longer side loses its edges.
    """
    from PIL import Image

    h_t, w_t = size
    w, h = image.size
    scale = max(h_t / h, w_t / w)
    nw, nh = max(w_t, round(w * scale)), max(h_t, round(h * scale))
    if (nw, nh) != (w, h):
        image = image.resize((nw, nh), Image.Resampling.BILINEAR)
    if (nw, nh) != (w_t, h_t):
        left, top = (nw - w_t) // 2, (nh - h_t) // 2
        image = image.crop((left, top, left + w_t, top + h_t))
    return image


def _pillow_errors() -> tuple[type[BaseException], ...]:
    """What Pillow raises for a damaged or unsupported file (not Ctrl-C, not a signal)."""
    from PIL import Image

    return (OSError, ValueError, SyntaxError, EOFError, IndexError, KeyError, TypeError, struct.error,
            Image.DecompressionBombError)


def load_image(path: str | os.PathLike[str], mode: str, size: tuple[int, int] | None) -> np.ndarray:
    """Decode one image file into uint8 C,H,W: Pillow decodes it (no EXIF rotation, no
    JPEG draft scaling, as torchvision's loader), `Image.convert(mode)` makes it "RGB"
    (C=3) or "L" (C=1), and `fit` brings it to `size` when one is given.

    Raises:
        OSError, ValueError, ...: what Pillow raises for a damaged file.
    """
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "corrupt EXIF" and the like: the pixels are what count
        with Image.open(path) as im:
            im.load()  # decode now, so a damaged file fails here whatever the mode
            img = im if im.mode == mode else im.convert(mode)
            if size is not None:
                img = fit(img, size)
            a = np.asarray(img, dtype=np.uint8)
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)


def _class_dirs(src: Path) -> list[str]:
    try:
        with os.scandir(src) as it:
            names = sorted(e.name for e in it if not e.name.startswith(".") and e.is_dir())
    except FileNotFoundError:
        raise ConvertError(f"{src}: no such directory") from None
    except NotADirectoryError:
        raise ConvertError(f"{src}: not a directory; expected SRC/<class>/<image>") from None
    except OSError as exc:
        raise ConvertError(f"{src}: cannot list: {exc.strerror or exc}") from None
    return names


def _walk_class(root: Path) -> tuple[list[str], int]:
    """Image files under one class folder (relative paths, sorted) and the number of
    directory symlinks met, which are not followed: a loop cannot make the walk endless."""
    files: list[str] = []
    links = 0
    stack = [""]
    while stack:
        rel = stack.pop()
        here = root / rel if rel else root
        try:
            with os.scandir(here) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            raise ConvertError(f"{here}: cannot list: {exc.strerror or exc}") from None
        for e in entries:
            if e.name.startswith("."):
                continue
            r = f"{rel}/{e.name}" if rel else e.name
            if e.is_dir(follow_symlinks=False):
                stack.append(r)
            elif e.is_symlink() and e.is_dir():
                links += 1
            elif os.path.splitext(e.name)[1].lower() in IMAGE_EXTENSIONS:
                files.append(r)  # a broken symlink stays: reading it fails, naming the file
    files.sort()
    return files, links


def scan_folder(src: Path, classes: Sequence[str] | None = None) -> tuple[list[str], list[str], np.ndarray, int]:
    """List SRC/<class>/**/<image>: (class names, files relative to SRC, labels, directory
    symlinks not followed). Classes are the sorted subfolder names, or `classes` in the
    order given. A class folder may itself be a symlink.

    Raises:
        ConvertError: no class folders, fewer than two classes, an unknown class name,
            a class without images, or a class folder that leads back to SRC.
    """
    found = _class_dirs(src)
    if classes is None:
        chosen = found
    else:
        chosen = list(classes)
        unknown = [c for c in chosen if c not in found]
        if unknown:
            have = ", ".join(found[:20]) + (", ..." if len(found) > 20 else "")
            raise ConvertError(f"{src}: no class folder {', '.join(map(repr, unknown))} (--classes); "
                               f"the class folders are: {have or 'none'}")
        if len(set(chosen)) != len(chosen):
            raise ConvertError(f"--classes names a class twice: {','.join(chosen)}")
    if not chosen:
        raise ConvertError(f"{src}: no class folders; expected SRC/<class>/<image> (one folder per class)")
    if len(chosen) < 2:
        raise ConvertError(f"{src}: only one class ({chosen[0]!r}); a classifier needs at least two class "
                           "folders SRC/<class>/<image>")
    top = src.resolve()
    files: list[str] = []
    labels: list[np.ndarray] = []
    links = 0
    for label, name in enumerate(chosen):
        root = src / name
        real = root.resolve()
        if real == top or real in top.parents:
            raise ConvertError(f"{root}: a symlink to SRC or a folder above it, not a class folder; "
                               "remove it or pick classes with --classes")
        rel, n_links = _walk_class(root)
        if not rel:
            raise ConvertError(f"{root}: class {name!r} has no images ({', '.join(IMAGE_EXTENSIONS)}); "
                               "add some, remove the folder, or pick classes with --classes")
        files.extend(f"{name}/{r}" for r in rel)
        labels.append(np.full(len(rel), label, np.int64))
        links += n_links
    return chosen, files, np.concatenate(labels), links


def _headers(src: Path, files: list[str], skip_bad: bool,
             skip: Callable[[str, str], None]) -> tuple[list[bool], list[tuple[int, int] | None]]:
    """Pillow reads only each file's header here: its mode (colour or not) and size."""
    from PIL import Image

    errors = _pillow_errors()
    gray: list[bool] = []
    sizes: list[tuple[int, int] | None] = []
    for rel in files:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with Image.open(src / rel) as im:
                    gray.append(im.mode in GRAY_MODES)
                    sizes.append((im.size[1], im.size[0]))
        except errors as exc:
            if not skip_bad:
                raise ConvertError(f"{src / rel}: cannot read the image ({_one_line(exc)}); fix or remove it, "
                                   "or pass --skip-bad to skip unreadable images") from None
            skip(str(src / rel), _one_line(exc))
            gray.append(True)
            sizes.append(None)
    return gray, sizes


def convert_folder(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    size: tuple[int, int] | None = None,
    holdout: float = 0.2,
    classes: Sequence[str] | None = None,
    skip_bad: bool = False,
    color: str = "auto",
    seed: int = 0,
    overwrite: bool = False,
    shard_records: int | None = None,
    on_skip: Callable[[str, str], None] | None = None,
) -> Summary:
    """Convert SRC/<class>/<image> (torchvision's ImageFolder layout) into OUT/train and
    OUT/test: image uint8 (C, H, W), label int64 (the class's index), class names in
    each manifest.

    Args:
        size: (H, W) every image is brought to with `fit`; None keeps the images'
            own size, which must then be the same for all.
        holdout: fraction of each class held out into OUT/test (seeded, stratified).
        classes: the classes to take, in label order (default: every subfolder, sorted).
        skip_bad: skip (and count) images Pillow cannot decode instead of stopping.
        color: "rgb" (C=3), "gray" (C=1), or "auto": gray when every image's header
            says one channel (so an MNIST-like folder is not stored three times over),
            otherwise RGB.
        on_skip: called with (file, reason) for each skipped image.

    Raises:
        ConvertError: the folder, an image, or an option is unusable; the message is
            one line naming the file.
    """
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    _check_folder_options(color, holdout)
    check_out(out, overwrite)
    names, files, labels, links = scan_folder(src, classes)
    skipped: list[tuple[str, str]] = []

    def skip(path: str, reason: str) -> None:
        skipped.append((path, reason))
        if on_skip is not None:
            on_skip(path, reason)

    files, labels, mode, size = _mode_and_size(src, files, labels, color, size, skip_bad, skip)
    shape = (3 if mode == "RGB" else 1, *size)
    train, test = split_holdout(len(files), holdout, seed, labels)
    records: dict[str, int] = {}
    with staged(out, overwrite) as partial:
        for name, order in zip(SPLITS, (train, test), strict=True):
            with _Sink(partial / name, shape, shard_records) as sink:
                _write_images(sink, src, [files[i] for i in order], labels[order], mode, size, skip_bad, skip)
                if sink.count == 0:
                    raise ConvertError(f"{src}: no {name} records: every image held out for {name} was skipped")
                records[name] = sink.count
            set_classes(partial / name, names)
    return Summary(out=out, records=records, shape=shape, classes=names, mode=mode, skipped=skipped,
                   seconds=time.perf_counter() - t0, links_not_followed=links)


def _check_folder_options(color: str, holdout: float) -> None:
    """convert_folder's options that argparse does not check for a caller of the Python API."""
    if color not in ("auto", "rgb", "gray"):
        raise ConvertError(f"color must be auto, rgb or gray, got {color!r}")
    if not 0.0 < holdout < 1.0:
        raise ConvertError(f"--holdout must be between 0 and 1 (a share of each class for OUT/test), got {holdout}")


def _mode_and_size(src: Path, files: list[str], labels: np.ndarray, color: str, size: tuple[int, int] | None,
                   skip_bad: bool, skip: Callable[[str, str], None]
                   ) -> tuple[list[str], np.ndarray, str, tuple[int, int]]:
    """The Pillow mode and (H, W) size every image is stored in, with the files (and their
    labels) left after skipping unreadable ones. Only what --color auto or a missing --size
    needs is read first: each file's header, not its pixels."""
    mode = {"rgb": "RGB", "gray": "L"}.get(color)
    if color == "auto" or size is None:
        gray, sizes = _headers(src, files, skip_bad, skip)
        ok = [i for i, s in enumerate(sizes) if s is not None]
        if mode is None:
            mode = "L" if all(gray[i] for i in ok) else "RGB"
        if size is None and ok:
            first = ok[0]
            size0 = sizes[first]
            for i in ok:
                if sizes[i] != size0:
                    h, w = sizes[i]  # type: ignore[misc]
                    raise ConvertError(
                        f"{src / files[i]}: is {h}x{w} (HxW) but {src / files[first]} is {size0[0]}x{size0[1]}; "
                        "pass --size H[xW] to bring every image to one size")
            size = size0
        files = [files[i] for i in ok]
        labels = labels[ok]
    if not files:
        raise ConvertError(f"{src}: every image was skipped as unreadable")
    assert size is not None and mode is not None
    return files, labels, mode, size


def _write_images(sink: _Sink, src: Path, files: list[str], labels: np.ndarray, mode: str,
                  size: tuple[int, int], skip_bad: bool, skip: Callable[[str, str], None]) -> None:
    """Decode SRC/files[k] one at a time into the sink with label labels[k]; an image Pillow
    cannot decode stops the conversion, or with skip_bad is skipped (and reported)."""
    errors = _pillow_errors()
    for rel, label in zip(files, labels, strict=True):
        path = src / rel
        try:
            image = load_image(path, mode, size)
        except errors as exc:
            if not skip_bad:
                raise ConvertError(f"{path}: cannot decode the image ({_one_line(exc)}); fix or "
                                   "remove it, or pass --skip-bad to skip unreadable images") from None
            skip(str(path), _one_line(exc))
            continue
        if image.shape != sink.shape:  # a header that lied about the size
            raise ConvertError(f"{path}: decoded to {image.shape[1:]} (HxW), not {sink.shape[1:]}; "
                               "pass --size H[xW]")
        sink.add(image, int(label), rel)


# ---- any map-style Dataset of (image tensor, int label) ----------------------------------------


def _as_image(image: Any, index: int) -> np.ndarray:
    """One item's image as uint8 C,H,W: uint8 kept, float in [0, 1] scaled by 255 and rounded."""
    torch = sys.modules.get("torch")  # a tensor's module is imported already: never import it here
    if torch is not None and isinstance(image, torch.Tensor):
        t = image.detach().cpu()
        if t.is_floating_point() and t.dtype not in (torch.float32, torch.float64):
            t = t.float()  # float16/bfloat16: numpy has no bfloat16
        a = t.numpy()
    elif isinstance(image, np.ndarray):
        a = image
    else:
        raise ConvertError(f"item {index}: the image is a {type(image).__module__}.{type(image).__qualname__}; "
                           "expected a torch tensor or numpy array of shape C,H,W")
    if a.ndim != 3 or 0 in a.shape:
        raise ConvertError(f"item {index}: the image has shape {tuple(a.shape)}; expected C,H,W (three axes)")
    if a.dtype == np.uint8:
        return a
    if a.dtype.kind == "f":
        lo, hi = float(a.min()), float(a.max())
        if not (0.0 <= lo and hi <= 1.0):  # also NaN
            raise ConvertError(f"item {index}: float image values must be in [0, 1] (ToTensor-style), found "
                               f"{lo:g}..{hi:g}; leave normalisation to the trainer")
        return np.rint(a * 255.0).astype(np.uint8)
    raise ConvertError(f"item {index}: the image is {a.dtype}; expected uint8, or float in [0, 1]")


def _as_label(label: Any, index: int) -> int:
    torch = sys.modules.get("torch")
    value: Any = label
    if torch is not None and isinstance(label, torch.Tensor):
        if label.numel() != 1 or label.is_floating_point() or label.is_complex() or label.dtype == torch.bool:
            value = None
        else:
            value = int(label.item())
    elif isinstance(label, np.ndarray) and label.ndim == 0:
        value = label[()]
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise ConvertError(f"item {index}: the label {label!r} ({type(label).__name__}) is not an integer "
                           "class index")
    if value < 0:
        raise ConvertError(f"item {index}: the label {int(value)} is negative; labels are class indices 0..K-1")
    return int(value)


def _get(dataset: Any, index: int) -> tuple[np.ndarray, int]:
    try:
        item = dataset[index]
    except Exception as exc:  # the user's code: its own traceback says most, with the index
        exc.add_note(f"raised by dataset[{index}] while native.write_dataset read it")
        raise
    if not isinstance(item, tuple | list) or len(item) != 2:
        raise ConvertError(f"item {index}: expected an (image, label) pair, got "
                           f"{type(item).__name__}{f' of {len(item)}' if isinstance(item, tuple | list) else ''}")
    return _as_image(item[0], index), _as_label(item[1], index)


def _targets(dataset: Any, n: int) -> np.ndarray | None:
    """The labels of every item without decoding any, where the Dataset lists them
    (torchvision's convention: a `targets` attribute); None otherwise."""
    t = getattr(dataset, "targets", None)
    if t is None:
        return None
    try:
        arr = np.asarray([int(v) for v in t], dtype=np.int64)
    except (TypeError, ValueError):
        return None
    return arr if len(arr) == n else None


def write_dataset(
    dataset: Any,
    out: str | os.PathLike[str],
    *,
    holdout: float = 0.0,
    seed: int = 0,
    overwrite: bool = False,
    split: str = "train",
    classes: Sequence[str] | None = None,
    shard_records: int | None = None,
) -> Summary:
    """Write a map-style Dataset of (image, label) items as shard data sets in OUT.

    Images are torch tensors or numpy arrays of shape C,H,W, all of one shape:
    uint8 is stored as is, float in [0, 1] (ToTensor-style) as round(x * 255).
    Labels are integer class indices (int, numpy integer or one-element integer
    tensor). Items are read once, one at a time, in a seeded shuffled order (so a
    class-sorted Dataset does not give ranks class-sorted blocks); sources.jsonl
    lists each record's Dataset index. torch is never imported here.

    Args:
        holdout: 0 writes everything to OUT/<split>; a fraction in (0, 1) writes
            OUT/train and OUT/test, stratified by label when the Dataset has a
            `targets` list, otherwise a seeded random share.
        split: "train" or "test", where everything goes when holdout is 0 (write a
            separate test Dataset with split="test").
        overwrite: replace OUT's splits of the same names; otherwise an existing one
            is an error.
        classes: class names to record in the manifests (default: the Dataset's
            `classes` attribute, if it is a list of strings).

    Returns:
        A Summary: records per split, image shape, class names, seconds.

    Raises:
        ConvertError: an item that is not an (image, label) pair, a bad label or image,
            images of different shapes (each naming the item), or an existing OUT.
        Anything the Dataset raises, with a note naming the index. On any exception,
        Ctrl-C included, nothing is left behind and OUT is as it was.
    """
    t0 = time.perf_counter()
    out = Path(out)
    n = _map_style_len(dataset)
    if split not in SPLITS:
        raise ConvertError(f"split must be 'train' or 'test', got {split!r}")
    if not 0.0 <= holdout < 1.0:
        raise ConvertError(f"holdout must be in [0, 1), got {holdout}")
    if classes is None:
        classes = _named_classes(dataset)
    parts = _split_orders(dataset, n, holdout, seed, split)
    check_out(out, overwrite, tuple(parts))
    first_index = int(next(iter(parts.values()))[0])
    shape = tuple(_get(dataset, first_index)[0].shape)
    with staged(out, overwrite, tuple(parts)) as partial:
        records = _write_parts(partial, dataset, parts, first_index, shape, classes, shard_records)
    return Summary(out=out, records=records, shape=shape, classes=list(classes) if classes else None,
                   seconds=time.perf_counter() - t0)


def _map_style_len(dataset: Any) -> int:
    """len(dataset), refusing what is not a non-empty map-style Dataset."""
    try:
        n = len(dataset)
        dataset.__getitem__  # noqa: B018 - a map-style Dataset needs both
    except (TypeError, AttributeError):
        raise ConvertError(f"{type(dataset).__name__} is not a map-style Dataset (it needs __len__ and "
                           "__getitem__)") from None
    if n == 0:
        raise ConvertError("the Dataset is empty (len 0)")
    return n


def _named_classes(dataset: Any) -> list[str] | None:
    """The Dataset's `classes` attribute (torchvision's convention), if it is a list of strings."""
    named = getattr(dataset, "classes", None)
    if isinstance(named, list | tuple) and named and all(isinstance(c, str) for c in named):
        return list(named)
    return None


def _split_orders(dataset: Any, n: int, holdout: float, seed: int, split: str) -> dict[str, np.ndarray]:
    """The Dataset indices of each split written, in the (seeded, shuffled) order they are read."""
    if holdout:
        if n < 2:
            raise ConvertError("a holdout needs at least two items")
        return dict(zip(SPLITS, split_holdout(n, holdout, seed, _targets(dataset, n)), strict=True))
    return {split: np.random.default_rng(seed).permutation(n)}


def _write_parts(partial: Path, dataset: Any, parts: dict[str, np.ndarray], first_index: int,
                 shape: tuple[int, ...], classes: Sequence[str] | None, shard_records: int | None) -> dict[str, int]:
    """Read dataset[i] for each i of parts[name], in that order, into PARTIAL/<name>; returns the
    records per split. Every image must have the shape of item first_index's, and the labels
    (of this split and those before it) must have a name when class names are given."""
    records: dict[str, int] = {}
    top = -1
    for name, order in parts.items():
        with _Sink(partial / name, shape, shard_records) as sink:
            for i in order:
                image, label = _get(dataset, int(i))
                if image.shape != shape:
                    raise ConvertError(f"item {int(i)}: the image has shape {tuple(image.shape)} but item "
                                       f"{first_index} has {shape}; every item must have one shape")
                top = max(top, label)
                sink.add(image, label, int(i))
            records[name] = sink.count
        if classes is not None:
            if top >= len(classes):
                raise ConvertError(f"labels reach {top} but only {len(classes)} class names were given")
            set_classes(partial / name, classes)
    return records


def load_factory(spec: str) -> Callable[..., Any]:
    """The function named by "package.module:function" (the current directory is on
    the import path) or "path/to/file.py:function".

    Raises:
        ConvertError: a malformed spec, a missing module, file or function.
    """
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise ConvertError(f"{spec!r}: expected MODULE:FUNCTION (e.g. mydata:make) or FILE.py:FUNCTION")
    if target.endswith(".py") or "/" in target or os.sep in target:
        path = Path(target)
        if not path.is_file():
            raise ConvertError(f"{path}: no such file (from {spec!r})")
        modname = "_native_dataset_" + "".join(c if c.isalnum() else "_" for c in str(path.resolve()))
        loader_spec = importlib.util.spec_from_file_location(modname, path)
        if loader_spec is None or loader_spec.loader is None:
            raise ConvertError(f"{path}: cannot be imported as Python")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[modname] = module  # classes defined there (dataclasses, pickling) need it
        loader_spec.loader.exec_module(module)
    else:
        cwd = os.getcwd()
        if cwd not in sys.path and "" not in sys.path:
            sys.path.insert(0, cwd)
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            if exc.name and (target == exc.name or target.startswith(exc.name + ".")):
                raise ConvertError(f"{spec!r}: no module named {exc.name!r} (looked in {cwd} and the "
                                   "installed packages)") from None
            raise
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConvertError(f"{spec!r}: {target} has no function {name!r}")
    return fn


def dataset_from_spec(spec: str, kwargs: Mapping[str, Any] | None = None) -> Any:
    """Call the function named by `spec` (see `load_factory`) with `kwargs`; its result
    is the Dataset. Arguments that do not fit its signature are a ConvertError."""
    fn = load_factory(spec)
    kwargs = dict(kwargs or {})
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as exc:
        raise ConvertError(f"{spec!r}: {exc} (--kwargs)") from None
    except ValueError:
        pass  # no signature to check (a builtin): let the call say
    return fn(**kwargs)
