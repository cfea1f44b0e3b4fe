"""`python -m native.check PATH`: what a shard file or data set holds, and whether it is intact."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from . import _shard
from .errors import ShardError
from .reader import ShardReader, open_dataset
from .schema import CODE_DTYPES, describe


def describe_shard(path: Path) -> list[str]:
    """Lines describing one shard file (opening it runs every structural check)."""
    sh = _shard.Shard(str(path), "never")
    try:
        lines = [
            f"{path}: {sh.count} records of {sh.record_size} bytes, {sh.file_size} bytes in all",
            # A valid shard ends with its index (16 bytes a record) and a 32-byte trailer.
            f"  data at byte {sh.data_offset}, index at byte {sh.file_size - 32 - 16 * sh.count}",
        ]
        for name, code, shape, off, size in sh.fields():
            lines.append(f"  field {name!r}: {CODE_DTYPES[code]} {shape}, bytes {off}..{off + size} of a record")
        return lines
    finally:
        sh.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m native.check",
        description="Describe a shard file or a data set directory (shards + manifest.json). "
        "Opening checks the structure; --verify also checks every checksum. Exit status 1 "
        "and the error's message (file, record, byte offset) if anything is damaged.",
    )
    p.add_argument("path", type=Path, metavar="PATH", help="a .shard file or a data set directory")
    p.add_argument("--verify", action="store_true", help="check every record (and file) checksum")
    args = p.parse_args(argv)
    try:
        if args.path.is_dir():
            ds = open_dataset(args.path)
            print(f"{args.path}: {len(ds)} records in {len(ds.manifest['shards'])} shard(s) of [{describe(ds.schema)}]")
            for entry in ds.manifest["shards"]:
                print(
                    f"  {entry['file']}: {entry['records']} records, {entry['bytes']} bytes, crc32c {entry['crc32c']}"
                )
            if args.verify:
                ds.verify()
            ds.close()
        else:
            for line in describe_shard(args.path):
                print(line)
            if args.verify:
                with ShardReader(args.path) as r:
                    r.verify()
        if args.verify:
            print("all checksums match")
    except ShardError as exc:
        print(f"{p.prog}: damaged: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
