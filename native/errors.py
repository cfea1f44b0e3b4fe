"""The one exception every kind of damaged or mismatched shard input raises."""

from __future__ import annotations


class ShardError(ValueError):
    """A shard file, data set or read request is invalid.

    The message always names the file (or data set directory) and, where it
    applies, the record number and byte offset, so the damaged spot can be
    found with a hex dump. The same facts are kept as attributes for code.

    Attributes:
        path: file or directory involved, if known.
        record: record number involved, if any.
        offset: byte offset in the file involved, if any.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        record: int | None = None,
        offset: int | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.record = record
        self.offset = offset
