"""Native shard store: mmap'd shard files read into preallocated numpy batches."""

from ._shard import crc32c
from .augment import Augment, AugmentError, Draws, mix64, parse_ops, sample_keys
from .errors import ShardError
from .ingest import classes_of, write_dataset
from .reader import Dataset, ShardReader, open_dataset
from .sampler import Sampler
from .schema import Field, parse_schema
from .writer import DatasetWriter, ShardWriter

__all__ = [
    "Augment",
    "AugmentError",
    "Dataset",
    "DatasetWriter",
    "Draws",
    "Field",
    "Sampler",
    "ShardError",
    "ShardReader",
    "ShardWriter",
    "classes_of",
    "crc32c",
    "mix64",
    "open_dataset",
    "parse_ops",
    "parse_schema",
    "sample_keys",
    "write_dataset",
]
