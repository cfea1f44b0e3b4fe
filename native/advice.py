"""What lies at a path that should hold a shard data set, and which converter makes one of it.

Why: a run given a wrong ``data.path`` must say in one line what is missing (the folder
itself, its train/ or test/ directory, or the shards inside) and the one
``python -m native.convert`` command that fits what the user has. A folder of photos
sorted into class folders wants ``folder``, CIFAR-10 ``.bin`` files want ``cifar10-bin``;
suggesting ``digits`` (the demo data) to someone with their own images sends them the
wrong way. The converters named here are read from ``python -m native.convert --help``
itself (:func:`converters`), so the advice can only name real ones.

Looking costs little: only the first :data:`SCAN_LIMIT` entries of a folder and of each
of its first :data:`CLASS_DIRS` subfolders are read (a wrong path may point at a home
directory or a large file system).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .ingest import IMAGE_EXTENSIONS
from .writer import MANIFEST

__all__ = ["Found", "converters", "look", "missing_data"]

SCAN_LIMIT = 500  # entries read from one folder
CLASS_DIRS = 50  # subfolders looked into for images
_CIFAR = re.compile(r"^(data_batch_\d+|test_batch)\.bin$")
_IDX = re.compile(r"idx\d-ubyte(\.gz)?$")


def converters() -> dict[str, str]:
    """Each SOURCE of ``python -m native.convert`` and its help line, in --help's order."""
    from .convert import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {action.dest: action.help or "" for action in sub._choices_actions}


@dataclass(frozen=True)
class Found:
    """What a folder holds: ``kind`` is ``shards`` (a data set: train/manifest.json),
    ``classes`` (images in class folders), ``images`` (image files, no class folders),
    ``cifar10-bin``, ``mnist-idx``, ``npz`` or ``empty``; ``names``: the class folders
    or the files that decided it (sorted, at most a few)."""

    where: Path
    kind: str
    names: tuple[str, ...] = ()
    count: int = 0  # class folders, image files or matching files


def _entries(directory: Path) -> list[os.DirEntry[str]]:
    """Up to SCAN_LIMIT visible entries of ``directory`` (none if it cannot be listed)."""
    out: list[os.DirEntry[str]] = []
    try:
        with os.scandir(directory) as it:
            for e in it:
                if not e.name.startswith("."):
                    out.append(e)
                if len(out) >= SCAN_LIMIT:
                    break
    except OSError:
        return []
    return sorted(out, key=lambda e: e.name)


def _is_image(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def _has_images(directory: str | Path) -> bool:
    """Whether a class folder holds an image, directly or one folder down."""
    entries = _entries(Path(directory))
    if any(e.is_file() and _is_image(e.name) for e in entries):
        return True
    return any(any(s.is_file() and _is_image(s.name) for s in _entries(Path(e.path)))
               for e in entries[:CLASS_DIRS] if e.is_dir(follow_symlinks=False))


def look(directory: Path) -> Found:
    """What ``directory`` holds, as far as choosing a converter goes (see :class:`Found`)."""
    if (directory / "train" / MANIFEST).is_file() or (directory / "test" / MANIFEST).is_file():
        return Found(directory, "shards")
    entries = _entries(directory)
    files = [e.name for e in entries if e.is_file()]
    classes = [e.name for e in entries[:SCAN_LIMIT]
               if e.is_dir() and e.name not in ("train", "test")][:CLASS_DIRS]
    classes = [c for c in classes if _has_images(directory / c)]
    for kind, names in (("classes", classes) if len(classes) >= 2 else ("", []),
                        ("cifar10-bin", [f for f in files if _CIFAR.match(f)]),
                        ("mnist-idx", [f for f in files if _IDX.search(f)]),
                        ("npz", [f for f in files if f.endswith(".npz")]),
                        ("images", [f for f in files if _is_image(f)])):
        if kind and names:
            return Found(directory, kind, tuple(names[:4]), len(names))
    return Found(directory, "empty")


def _listed(found: Found) -> str:
    more = ", ..." if found.count > len(found.names) else ""
    return ", ".join(found.names) + more


def _idx_args(found: Found, out: str) -> str:
    """The mnist-idx arguments for the IDX files found: IMAGES LABELS OUT, and the test
    pair (``t10k-*``) as --test-images/--test-labels when both are there."""
    def pick(kind: str, test: bool) -> str | None:
        return next((f"{found.where}/{n}" for n in found.names
                     if kind in n and n.startswith("t10k") == test), None)

    images, labels = pick("images", False) or "IMAGES", pick("labels", False) or "LABELS"
    test = (pick("images", True), pick("labels", True))
    more = f" --test-images {test[0]} --test-labels {test[1]}" if all(test) else ""
    return f"{images} {labels} {out}{more}"


def advise(found: Found, out: str) -> str | None:
    """The converter command that makes ``out`` from what ``found`` holds, with what it
    saw; None when it holds nothing a converter reads."""
    src = str(found.where)
    if found.kind == "classes":
        return (f"{src} holds images in {found.count} class folders ({_listed(found)}): convert "
                f"them with `python -m native.convert folder {src} {out} --size 64`")
    if found.kind == "images":
        return (f"{src} holds {found.count} image files ({_listed(found)}) but no class folders: "
                f"put each class's images in a folder of its own ({src}/<class>/...), then run "
                f"`python -m native.convert folder {src} {out} --size 64`")
    if found.kind == "cifar10-bin":
        return (f"{src} holds CIFAR-10 binary files ({_listed(found)}): convert them with "
                f"`python -m native.convert cifar10-bin {src}/*.bin {out}`")
    if found.kind == "mnist-idx":
        return (f"{src} holds IDX files ({_listed(found)}): convert them with "
                f"`python -m native.convert mnist-idx {_idx_args(found, out)}`")
    if found.kind == "npz":
        return (f"{src} holds .npz files ({_listed(found)}): convert one with "
                f"`python -m native.convert npz {src}/{found.names[0]} {out}`")
    return None


def every_converter(out: str) -> str:
    """The generic advice: the command's shape and each SOURCE with its help line."""
    listed = "; ".join(f"{name}: {text}" for name, text in converters().items())
    return (f"make one with `python -m native.convert SOURCE ... {out}` (see "
            f"`python -m native.convert --help`), SOURCE being one of {listed}")


def _near_data_set(path: Path) -> Path | None:
    """A shard data set beside ``path`` whose name is close to its name (a typo)."""
    parent = path.parent
    names = [e.name for e in _entries(parent) if e.is_dir()]
    for name in difflib.get_close_matches(path.name, names, n=3, cutoff=0.6):
        if look(parent / name).kind == "shards":
            return parent / name
    return None


def _from_parent(path: Path, out: str) -> str:
    """Advice for a data.path that does not exist, from what lies near it: a data set of
    a close name beside it, images in class folders of the same name here (``fotos/``
    for ``data/fotos``) or beside it, or images in its parent folder itself."""
    parent = path.parent
    near = _near_data_set(path)
    if near is not None:
        return f"did you mean {near}? (a shard data set)"
    here = Path(path.name)
    candidates = [here] if here != path and here.is_dir() else []
    candidates += [parent / e.name for e in _entries(parent)[:CLASS_DIRS] if e.is_dir()]
    for found in [f for f in map(look, candidates) if f.kind == "classes"] + [look(parent)]:
        advice = advise(found, out)
        if advice is not None:
            return f"if these are your images: {advice}"
    return every_converter(out)


def missing_data(path: str | Path, split: str) -> str:
    """One line: what is missing of the data set at ``path`` (split ``train`` or ``test``)
    and the converter that fits what is there. Call it when ``path/split/manifest.json``
    is not a file."""
    given = str(path)
    p = Path(path)
    directory = p / split
    if not p.exists():
        parent = p.parent if str(p.parent) != "" else Path(".")
        if not parent.is_dir():
            return (f"data set {given} does not exist, nor does the folder {parent} that should "
                    f"hold it; {every_converter(given)}")
        return f"data set {given} does not exist (no such folder); {_from_parent(p, given)}"
    if not p.is_dir():
        kind = "npz" if p.suffix == ".npz" else None
        hint = (f"convert it with `python -m native.convert npz {given} {p.with_suffix('')}` and set "
                f"data.path = \"{p.with_suffix('')}\"" if kind else every_converter(f"{given}-shards"))
        return f"data.path {given} is a file, not a data set folder (with train/ and test/); {hint}"
    out = f"{given.rstrip('/')}-shards"
    use = f" and set data.path = \"{out}\""
    if not directory.is_dir():
        found = look(p)
        advice = advise(found, out)
        what = f"data set {given} has no {split}/ directory"
        if advice is not None:
            return f"{what}: it is not a converted data set; {advice}{use}"
        if found.kind == "shards":
            return (f"{what} (it has the other split only); convert the data again so that it "
                    f"writes both, e.g. with --holdout 0.2 (the dataset source)")
        return f"{what}; {every_converter(given)}"
    advice = advise(look(directory), out)
    what = f"{directory} holds no shards (no {MANIFEST}): it is not a converted data set"
    if advice is not None:
        return f"{what}; {advice}{use} (it holds a share of each class out as test/: --holdout)"
    return f"{what}; {every_converter(given)} (with --overwrite, as {given} has a {split}/)"
