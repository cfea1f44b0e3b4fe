"""Readers: one shard file, or a data set directory of shards, gathered into numpy batches."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from . import _shard
from .errors import ShardError
from .schema import CODE_DTYPES, Field, Schema, describe, parse_schema
from .writer import MANIFEST, MANIFEST_FORMAT, MANIFEST_VERSION

# Drop the mapping's pages (MADV_DONTNEED) after this many bytes of shuffled reads,
# so resident memory stays bounded on data sets larger than RAM.
DEFAULT_RELEASE_BYTES = 2 << 30
DEFAULT_READAHEAD_BYTES = 8 << 20


def _schema_of(shard: Any) -> Schema:
    fields = []
    for name, code, shape, _off, _size in shard.fields():
        fields.append(Field(name, np.dtype(CODE_DTYPES[code]), tuple(shape)))
    return tuple(fields)


class _Records:
    """The read interface shared by ShardReader and Dataset."""

    schema: Schema
    _set: Any
    _names: tuple[str, ...]

    def _init_fields(self) -> None:
        self._names = tuple(f.name for f in self.schema)
        self._shapes = tuple(f.shape for f in self.schema)
        self._dtypes = tuple(f.dtype for f in self.schema)

    def __len__(self) -> int:
        return int(self._set.total)

    def empty(self, n: int) -> dict[str, np.ndarray]:
        """Preallocated output arrays for batches of up to n records (pass as `out`)."""
        return {f.name: np.empty((n, *f.shape), f.dtype) for f in self.schema}

    def read(self, indices: ArrayLike, out: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Gather the records `indices` (global record numbers) into numpy arrays.

        The copy runs in C without the GIL, straight from the mapped file into
        the result. With `out` (e.g. from `empty(batch_size)`, reused every
        batch) nothing is allocated: the arrays are filled in place and returned
        (as views [:len(indices)] if they have more rows). The arrays are
        C-contiguous, so `torch.from_numpy` wraps them without a copy.

        Raises:
            ShardError: an index out of range, a record whose checksum fails,
                or `out` arrays of the wrong dtype, shape or size.
        """
        if (
            type(indices) is np.ndarray
            and indices.dtype == np.int64
            and indices.ndim == 1
            and indices.flags.c_contiguous
        ):
            idx = indices
        else:
            idx = self._as_index(indices)
        n = idx.shape[0]
        if out is None:
            arrays = [np.empty((n, *s), d) for s, d in zip(self._shapes, self._dtypes, strict=True)]
            self._set.gather(idx, arrays)
            return dict(zip(self._names, arrays, strict=True))
        try:
            arrays = [out[name] for name in self._names]
        except KeyError as exc:
            raise ShardError(
                f"{self._set.name}: `out` has no array for field {exc}; make it with .empty(n)",
                path=self._set.name,
            ) from exc
        except TypeError as exc:
            raise ShardError(f"{self._set.name}: `out` must be a dict of arrays") from exc
        for a in arrays:
            if type(a) is not np.ndarray:
                raise ShardError(f"{self._set.name}: `out` values must be numpy arrays")
        self._set.gather(idx, arrays)
        if all(a.shape[0] == n for a in arrays):
            return out if type(out) is dict else dict(out)
        return {name: a[:n] for name, a in zip(self._names, arrays, strict=True)}

    def _as_index(self, indices: ArrayLike) -> np.ndarray:
        arr = np.asarray(indices)
        if arr.ndim == 0:
            arr = arr.reshape(1)
        if arr.size and arr.dtype.kind not in "iu":
            raise ShardError(
                f"{self._set.name}: indices must be integers, got dtype {arr.dtype}",
                path=self._set.name,
            )
        if arr.ndim != 1:
            raise ShardError(
                f"{self._set.name}: indices must be one-dimensional, got shape {arr.shape}",
                path=self._set.name,
            )
        if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
            bad = int(arr.max())
            raise ShardError(
                f"{self._set.name}: record index {bad} is out of range: the data holds {len(self)} records",
                path=self._set.name,
                record=bad,
            )
        return np.ascontiguousarray(arr, dtype=np.int64)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        """One record, as arrays of the per-record shape (a copy)."""
        batch = self.read(np.array([i], dtype=np.int64))
        return {k: v[0] for k, v in batch.items()}

    def prefetch(self, indices: ArrayLike) -> None:
        """Tell the kernel these records are needed soon (MADV_WILLNEED), e.g. the
        next batch while this one trains. Never blocks on I/O."""
        idx = self._as_index(indices)
        for j, shard in enumerate(self._set.shards):
            start = self._starts[j]
            local = idx[(idx >= start) & (idx < start + shard.count)] - start
            if local.size:
                shard.prefetch(np.ascontiguousarray(local, dtype=np.int64))

    def verify(self) -> None:
        """Check every record's CRC32C now (otherwise each is checked on first read).

        Raises:
            ShardError: naming the first damaged record, its file and byte offset.
        """
        for shard in self._set.shards:
            shard.verify_all()

    @property
    def released_bytes(self) -> int:
        """Bytes of mapping returned to the kernel with MADV_DONTNEED so far."""
        return sum(int(s.released_bytes) for s in self._set.shards)

    def close(self) -> None:
        for shard in self._set.shards:
            shard.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class ShardReader(_Records):
    """Reads one shard file through a read-only memory map.

    Opening validates the whole structure (magic, version, header and index
    checksums, every index offset inside the file, sorted and not overlapping,
    trailer present), so later reads touch only bytes already proven to exist.
    Record checksums are checked on the first read of each record (`verify=`
    "first"), on every read ("always") or never ("never"); `verify()` checks all.

    Args:
        path: a shard file.
        verify: "first" (default), "always" or "never".
        release_bytes: after this many bytes of shuffled reads the mapping's
            pages are dropped (MADV_DONTNEED) so resident memory stays bounded;
            0 disables. In-order reads drop pages behind the reader instead.
        readahead_bytes: MADV_WILLNEED distance ahead of in-order reads.

    Raises:
        ShardError: the file is missing, truncated, damaged, empty or unfinished.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        verify: str = "first",
        release_bytes: int = DEFAULT_RELEASE_BYTES,
        readahead_bytes: int = DEFAULT_READAHEAD_BYTES,
    ) -> None:
        self.path = str(path)
        self._args = {"verify": verify, "release_bytes": release_bytes, "readahead_bytes": readahead_bytes}
        shard = _shard.Shard(self.path, verify)
        shard.set_release_budget(release_bytes)
        shard.set_readahead(readahead_bytes)
        self.schema = _schema_of(shard)
        self._init_fields()
        self._set = _shard.ShardSet([shard], list(self._dtypes), self.path)
        self._starts = [0]

    def __getstate__(self) -> dict[str, Any]:
        # A mapping cannot be pickled; a worker process re-opens the file.
        return {"path": self.path, **self._args}

    def __setstate__(self, state: dict[str, Any]) -> None:
        path = state.pop("path")
        self.__init__(path, **state)  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"ShardReader({self.path!r}: {len(self)} records of {describe(self.schema)})"


class Dataset(_Records):
    """A directory of shards with a manifest, read as one sequence of records.

    Opening checks that the manifest is complete, that every shard exists,
    has the size, record count and schema the manifest says, and that all
    shards share one schema. `verify()` also checks each file's CRC32C.
    Use `open_dataset(directory)`.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        verify: str = "first",
        release_bytes: int = DEFAULT_RELEASE_BYTES,
        readahead_bytes: int = DEFAULT_READAHEAD_BYTES,
    ) -> None:
        self.directory = Path(directory)
        self._args = {"verify": verify, "release_bytes": release_bytes, "readahead_bytes": readahead_bytes}
        name = str(self.directory)
        self.manifest = _load_manifest(self.directory)
        try:
            self.schema = parse_schema(self.manifest["schema"])
        except ShardError as exc:
            mpath = str(self.directory / MANIFEST)
            raise ShardError(f"{mpath}: {exc}", path=mpath) from None
        self._init_fields()
        entries = self.manifest["shards"]
        shards = []
        try:
            for i, entry in enumerate(entries):
                shards.append(self._open_shard(i, entry, verify))
        except BaseException:
            for s in shards:
                s.close()
            raise
        budget = release_bytes // len(shards) if release_bytes else 0
        for s in shards:
            s.set_release_budget(max(budget, 1 << 20) if release_bytes else 0)
            s.set_readahead(readahead_bytes)
        self._set = _shard.ShardSet(shards, list(self._dtypes), name)
        self._starts = list(np.cumsum([0] + [s.count for s in shards[:-1]]))
        if len(self) != self.manifest["records"]:
            raise ShardError(
                f"{name}/{MANIFEST}: says {self.manifest['records']} records in total, the shards hold {len(self)}",
                path=str(self.directory / MANIFEST),
            )

    def _open_shard(self, i: int, entry: Mapping[str, Any], verify: str) -> Any:
        mpath = self.directory / MANIFEST
        try:
            fname, records, size = entry["file"], entry["records"], entry["bytes"]
            if not all(type(v) is int and v >= 0 for v in (records, size)):
                raise ValueError("records and bytes must be non-negative integers")
            crc = entry["crc32c"]
            if not isinstance(crc, str) or len(crc) != 8:
                raise ValueError("crc32c must be 8 hex digits")
            int(crc, 16)
        except (KeyError, TypeError, ValueError) as exc:
            raise ShardError(f"{mpath}: shard entry {i} is malformed ({exc})", path=str(mpath)) from exc
        if not isinstance(fname, str) or "/" in fname or fname in ("", ".", ".."):
            raise ShardError(f"{mpath}: shard entry {i} has a bad file name {fname!r}", path=str(mpath))
        path = self.directory / fname
        if not path.is_file():
            raise ShardError(f"{path}: listed in {MANIFEST} (entry {i}) but missing", path=str(path))
        actual = path.stat().st_size
        if actual != size:
            raise ShardError(
                f"{path}: is {actual} bytes, the manifest says {size}: the shard was "
                "replaced, truncated or extended after the manifest was written",
                path=str(path),
                offset=min(actual, size),
            )
        shard = _shard.Shard(str(path), verify)
        if shard.count != records:
            n = shard.count
            shard.close()
            raise ShardError(f"{path}: holds {n} records, the manifest says {records}", path=str(path))
        got = _schema_of(shard)
        if got != self.schema:
            shard.close()
            raise ShardError(
                f"{path}: schema mismatch: the shard has [{describe(got)}], the data set has [{describe(self.schema)}]",
                path=str(path),
            )
        return shard

    def verify(self) -> None:
        """Check every shard file's CRC32C against the manifest, then every record.

        Raises:
            ShardError: naming the first damaged file (and record, if found).
        """
        for shard, entry in zip(self._set.shards, self.manifest["shards"], strict=True):
            crc = f"{shard.file_crc():08x}"
            if crc != str(entry["crc32c"]).lower():
                raise ShardError(
                    f"{shard.path}: file checksum {crc} does not match the manifest's {entry['crc32c']}",
                    path=shard.path,
                )
            shard.verify_all()

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": str(self.directory), **self._args}

    def __setstate__(self, state: dict[str, Any]) -> None:
        directory = state.pop("directory")
        self.__init__(directory, **state)  # type: ignore[misc]

    def __repr__(self) -> str:
        return (
            f"Dataset({str(self.directory)!r}: {len(self)} records in "
            f"{len(self._set.shards)} shards of {describe(self.schema)})"
        )


def _load_manifest(directory: Path) -> dict[str, Any]:
    mpath = directory / MANIFEST
    if not directory.is_dir():
        raise ShardError(f"{directory}: no such data set directory", path=str(directory))
    if not mpath.is_file():
        raise ShardError(
            f"{mpath}: missing: not a data set, or its writer did not finish (re-run the conversion)",
            path=str(mpath),
        )
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ShardError(f"{mpath}: unreadable manifest: {exc}", path=str(mpath)) from exc
    if not isinstance(manifest, dict):
        raise ShardError(f"{mpath}: manifest must be a JSON object", path=str(mpath))
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ShardError(
            f"{mpath}: format is {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}",
            path=str(mpath),
        )
    if manifest.get("version") != MANIFEST_VERSION:
        raise ShardError(
            f"{mpath}: unknown manifest version {manifest.get('version')!r} (this reader knows {MANIFEST_VERSION})",
            path=str(mpath),
        )
    for key, kind in (("schema", list), ("shards", list), ("records", int)):
        value = manifest.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ShardError(f"{mpath}: {key!r} is missing or not a {kind.__name__}", path=str(mpath))
    if not manifest["shards"]:
        raise ShardError(f"{mpath}: lists no shards (empty data set)", path=str(mpath))
    ranges = manifest.get("ranges", {})
    if not isinstance(ranges, dict) or not all(
            isinstance(span, list) and len(span) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in span)
            and span[0] <= span[1] for span in ranges.values()):
        raise ShardError(f"{mpath}: 'ranges' must map field names to [min, max] integer pairs",
                         path=str(mpath))
    return manifest


def open_dataset(
    directory: str | os.PathLike[str],
    *,
    verify: str = "first",
    release_bytes: int = DEFAULT_RELEASE_BYTES,
) -> Dataset:
    """Open a data set directory (shards + manifest.json) written by DatasetWriter
    or `python -m native.convert`.

    Raises:
        ShardError: missing or malformed manifest, a missing shard, or a shard
            whose size, record count or schema disagrees with the manifest.
    """
    return Dataset(directory, verify=verify, release_bytes=release_bytes)


def read_all(records: _Records, fields: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Every record in order (small data sets: tests, evaluation)."""
    batch = records.read(np.arange(len(records), dtype=np.int64))
    return {k: v for k, v in batch.items() if fields is None or k in fields}
