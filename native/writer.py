"""Writers: one shard file (atomic: temp, fsync, rename) and a data set directory of shards."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from . import _shard
from .errors import ShardError
from .schema import DTYPE_CODES, Schema, SchemaLike, parse_schema, schema_to_json

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "mpipipe-shards"
MANIFEST_VERSION = 1
DEFAULT_SHARD_BYTES = 64 << 20


def _record_dtype(schema: Schema) -> tuple[np.dtype, int]:
    """A numpy structured dtype whose bytes are exactly one on-disk record."""
    try:
        size, layout = _shard.layout([(f.name, DTYPE_CODES[f.dtype.name], f.shape) for f in schema])
        if size >= 1 << 32:
            raise ValueError(f"records must be under 4 GiB, this schema needs {size} bytes")
        dtype = np.dtype(
            {
                "names": [f.name for f in schema],
                "formats": [(f.dtype, f.shape) if f.shape else f.dtype for f in schema],
                "offsets": [off for off, _ in layout],
                "itemsize": size,
            }
        )
    except ValueError as exc:
        raise ShardError(f"schema: {exc}") from exc
    return dtype, size


class ShardWriter:
    """Writes records to one shard file.

    Records go to a temp file beside `path`; `close()` writes the index and the
    trailer, fsyncs and renames, so a crash at any point leaves either no file
    or the previous one, never a file that looks valid and is not. Use it as a
    context manager: an exception inside the block aborts the file.

    Args:
        path: the shard file to create (replaced atomically if it exists).
        schema: {name: (dtype, per-record shape)} or [(name, dtype, shape)].
    """

    def __init__(self, path: str | os.PathLike[str], schema: SchemaLike) -> None:
        self.path = str(path)
        self.schema: Schema = parse_schema(schema)
        self._dtype, self.record_size = _record_dtype(self.schema)
        self._writer: Any = _shard.Writer(
            self.path, [(f.name, DTYPE_CODES[f.dtype.name], f.shape) for f in self.schema]
        )
        self.closed = False

    def __len__(self) -> int:
        return int(self._writer.count)

    def write(self, batch: Mapping[str, ArrayLike]) -> int:
        """Append len(batch[any]) records; every field must be given with a leading
        record axis. Values are cast with numpy's 'same_kind' rule (no float to int).
        Returns the number of records written."""
        if self.closed:
            raise ShardError(f"{self.path}: writer is closed", path=self.path)
        names = {f.name for f in self.schema}
        if set(batch) != names:
            raise ShardError(
                f"{self.path}: batch fields {sorted(batch)} do not match the schema {sorted(names)}",
                path=self.path,
            )
        n = None
        arrays = {}
        for f in self.schema:
            a = np.asarray(batch[f.name])
            if a.shape[1:] != f.shape or a.ndim != len(f.shape) + 1:
                raise ShardError(
                    f"{self.path}: field {f.name!r} has shape {a.shape}, expected (records,) + {f.shape}",
                    path=self.path,
                )
            try:
                arrays[f.name] = a.astype(f.dtype, casting="same_kind", copy=False)
            except TypeError as exc:
                raise ShardError(
                    f"{self.path}: field {f.name!r} is {a.dtype}, cannot store as {f.dtype}",
                    path=self.path,
                ) from exc
            if n is None:
                n = a.shape[0]
            elif a.shape[0] != n:
                raise ShardError(
                    f"{self.path}: fields have different record counts ({n} and {a.shape[0]})",
                    path=self.path,
                )
        assert n is not None
        if n == 0:
            return 0
        rec = np.zeros(n, dtype=self._dtype)  # zeros: padding bytes are deterministic
        for name, a in arrays.items():
            rec[name] = a
        self._writer.append(rec.view(np.uint8).reshape(-1), n)
        return n

    def write_record(self, **fields: ArrayLike) -> None:
        """Append one record given as keyword arguments, one per field."""
        self.write({k: np.asarray(v)[None] for k, v in fields.items()})

    def close(self) -> None:
        """Finish the file: index, trailer, header, fsync, rename.

        Raises:
            ShardError: no records were written (an empty shard is never created).
        """
        if not self.closed:
            self.closed = True
            self._writer.close()

    def abort(self) -> None:
        """Drop the temp file; the target path is left as it was."""
        if not self.closed:
            self.closed = True
            self._writer.abort()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename or a new file in ``directory`` durable (the directory entry itself)."""
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=1)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.shard"


class DatasetWriter:
    """Writes a data set: a directory of shards plus manifest.json.

    The manifest (schema, records per shard, size and CRC32C of every shard
    file) is written last and atomically, so a directory without a manifest
    is an unfinished data set and `open_dataset` says so.

    Args:
        directory: created if missing.
        schema: as for ShardWriter.
        shard_records: records per shard (default: about 64 MiB per shard).
        overwrite: replace an existing data set in `directory`.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        schema: SchemaLike,
        *,
        shard_records: int | None = None,
        overwrite: bool = False,
    ) -> None:
        self.directory = Path(directory)
        self.schema = parse_schema(schema)
        _, record_size = _record_dtype(self.schema)
        if shard_records is None:
            shard_records = max(1, DEFAULT_SHARD_BYTES // record_size)
        if shard_records < 1:
            raise ShardError(f"{directory}: shard_records must be >= 1, got {shard_records}")
        self.shard_records = int(shard_records)
        if (self.directory / MANIFEST).exists() and not overwrite:
            raise ShardError(
                f"{self.directory}: a data set already exists here; pass overwrite=True (or --overwrite) to replace it",
                path=str(self.directory),
            )
        self.directory.mkdir(parents=True, exist_ok=True)
        # Until the new manifest is written the directory is an unfinished data set.
        (self.directory / MANIFEST).unlink(missing_ok=True)
        self._shards: list[dict[str, Any]] = []
        self._current: ShardWriter | None = None
        self.closed = False
        # [min, max] of every scalar integer field (a label), for the manifest: a trainer
        # checks them against its number of classes before it starts.
        self._ranges: dict[str, list[int]] = {
            f.name: [] for f in self.schema
            if f.shape == () and np.issubdtype(np.dtype(f.dtype), np.integer)}

    def __len__(self) -> int:
        done = sum(s["records"] for s in self._shards)
        return done + (len(self._current) if self._current else 0)

    def write(self, batch: Mapping[str, ArrayLike]) -> int:
        """Append records (same form as ShardWriter.write), starting new shards as needed."""
        arrays = {k: np.asarray(v) for k, v in batch.items()}
        n = len(next(iter(arrays.values()))) if arrays else 0
        for name, span in self._ranges.items():
            values = arrays.get(name)
            if values is not None and values.size:
                lo, hi = int(values.min()), int(values.max())
                span[:] = [min(lo, span[0]), max(hi, span[1])] if span else [lo, hi]
        done = 0
        while done < n:
            if self._current is None:
                path = self.directory / shard_name(len(self._shards))
                self._current = ShardWriter(path, self.schema)
            room = self.shard_records - len(self._current)
            take = min(room, n - done)
            self._current.write({k: v[done : done + take] for k, v in arrays.items()})
            done += take
            if len(self._current) == self.shard_records:
                self._finish_shard()
        return n

    def _finish_shard(self) -> None:
        w = self._current
        assert w is not None
        self._current = None
        w.close()
        sh = _shard.Shard(w.path, "never")
        self._shards.append(
            {
                "file": Path(w.path).name,
                "records": int(sh.count),
                "bytes": int(sh.file_size),
                "crc32c": f"{sh.file_crc():08x}",
            }
        )
        sh.close()

    def close(self) -> None:
        """Finish the last shard and write the manifest; remove stale shards of an
        earlier data set in the same directory."""
        if self.closed:
            return
        self.closed = True
        if self._current is not None and len(self._current):
            self._finish_shard()
        elif self._current is not None:
            self._current.abort()
            self._current = None
        if not self._shards:
            raise ShardError(
                f"{self.directory}: empty data set: no records were written",
                path=str(self.directory),
            )
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "schema": schema_to_json(self.schema),
            "records": sum(s["records"] for s in self._shards),
            "shards": self._shards,
            "ranges": {name: span for name, span in self._ranges.items() if span},
        }
        _write_json_atomic(self.directory / MANIFEST, manifest)
        keep = {s["file"] for s in self._shards}
        for p in self.directory.glob("shard-*.shard"):
            if p.name not in keep:
                p.unlink()

    def abort(self) -> None:
        if self._current is not None:
            self._current.abort()
            self._current = None
        self.closed = True

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
