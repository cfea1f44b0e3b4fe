"""Field schemas: names, numpy dtypes and per-record shapes, and their codes on disk."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np

from .errors import ShardError

# Codes stored in the shard's field table (shard.h, enum shard_dtype).
DTYPE_CODES: dict[str, int] = {
    "uint8": 1,
    "int8": 2,
    "uint16": 3,
    "int16": 4,
    "uint32": 5,
    "int32": 6,
    "uint64": 7,
    "int64": 8,
    "float16": 9,
    "float32": 10,
    "float64": 11,
    "bool": 12,
}
CODE_DTYPES: dict[int, str] = {v: k for k, v in DTYPE_CODES.items()}


class Field(NamedTuple):
    """One field of every record: `shape` is per record (a label has shape ())."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype.name, "shape": list(self.shape)}


Schema = tuple[Field, ...]
SchemaLike = Mapping[str, Any] | Iterable[Any]


def _field(name: Any, dtype: Any, shape: Any) -> Field:
    if not isinstance(name, str) or not name:
        raise ShardError(f"schema: field name must be a non-empty string, got {name!r}")
    if dtype is None:
        raise ShardError(f"schema: field {name!r} has no dtype")
    try:
        dt = np.dtype(dtype)
    except Exception as exc:  # numpy raises TypeError, ValueError, ... for junk
        raise ShardError(f"schema: field {name!r} has an unknown dtype {dtype!r}") from exc
    if dt.name not in DTYPE_CODES:
        raise ShardError(f"schema: field {name!r} has dtype {dt}; supported: {', '.join(DTYPE_CODES)}")
    if isinstance(shape, int | np.integer):
        shape = (int(shape),)
    if not isinstance(shape, list | tuple) or not all(
        isinstance(d, int | np.integer) and not isinstance(d, bool) for d in shape
    ):
        raise ShardError(f"schema: field {name!r} shape must be a tuple of ints, got {shape!r}")
    shp = tuple(int(d) for d in shape)
    if len(shp) > 8 or any(d < 1 for d in shp):
        raise ShardError(f"schema: field {name!r} shape {shp} must have at most 8 dimensions, each >= 1")
    return Field(name, np.dtype(dt.newbyteorder("<")) if dt.itemsize > 1 else dt, shp)


def parse_schema(schema: SchemaLike) -> Schema:
    """Normalise a schema given as {name: (dtype, shape)}, or [(name, dtype, shape)],
    or the manifest's JSON list [{"name", "dtype", "shape"}], into Fields in order."""
    if isinstance(schema, Mapping):
        items = [(k, *v) for k, v in schema.items()]
    else:
        items = []
        for item in schema:
            if isinstance(item, Field):
                items.append(tuple(item))
            elif isinstance(item, Mapping):  # the manifest's JSON form: strings only
                try:
                    entry = (item["name"], item["dtype"], item["shape"])
                except KeyError as exc:
                    raise ShardError(f"schema: entry {item!r} lacks {exc}") from exc
                if not isinstance(entry[1], str):
                    raise ShardError(f"schema: entry {item!r}: dtype must be a string")
                items.append(entry)
            else:
                try:
                    items.append(tuple(item))
                except TypeError as exc:
                    raise ShardError(f"schema: expected (name, dtype, shape), got {item!r}") from exc
    fields = []
    for item in items:
        if len(item) != 3:
            raise ShardError(f"schema: expected (name, dtype, shape), got {item!r}")
        fields.append(_field(*item))
    names = [f.name for f in fields]
    if not fields or len(set(names)) != len(names):
        raise ShardError(f"schema: needs at least one field and unique names, got {names}")
    return tuple(fields)


def schema_to_json(schema: Schema) -> list[dict[str, Any]]:
    return [f.to_json() for f in schema]


def describe(schema: Schema) -> str:
    """Short text form, e.g. "image float32 (1, 8, 8), label int64 ()"."""
    return ", ".join(f"{f.name} {f.dtype.name} {f.shape}" for f in schema)
