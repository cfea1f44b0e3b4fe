"""Native shard store: mmap'd shard files read into preallocated numpy batches."""

from ._shard import crc32c
from .errors import ShardError
from .reader import Dataset, ShardReader, open_dataset
from .sampler import Sampler
from .schema import Field, parse_schema
from .writer import DatasetWriter, ShardWriter

__all__ = [
    "Dataset",
    "DatasetWriter",
    "Field",
    "Sampler",
    "ShardError",
    "ShardReader",
    "ShardWriter",
    "crc32c",
    "open_dataset",
    "parse_schema",
]
