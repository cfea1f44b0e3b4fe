"""The journal of a writer that waits for the run log: its records, one JSON line each,
in a file beside the log (``<log>.queue-<order>-<host>-<pid>.jsonl``).

Why: a rank that takes the log over holds its records until the previous writer lets
go of the file. If it is killed (or replaced and lets go) before that, the records
would go with it; written through to its journal, they stay, and the next writer that
opens the file writes every earlier writer's journal first, in the order of the
hand-overs (:func:`replay`), then removes them.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from mpipipe.core.logs.logwriter import jsonable

__all__ = ["Journal", "journals", "replay"]


class Journal:
    """One waiting writer's journal, open for appending."""

    def __init__(self, file: TextIO) -> None:
        self._file = file

    @classmethod
    def start(cls, log: Path, order: int, start_unix: float) -> Journal | None:
        """Start a journal for the log at ``log``, its first line the run's start (a
        journal of another run is not replayed). None, with one warning, where it cannot
        be made: the records are then kept in memory only."""
        name = f"{log.stem}.queue-{order:06d}-{socket.gethostname()}-{os.getpid()}.jsonl"
        try:
            file = open(log.with_name(name), "w", encoding="utf-8")  # noqa: SIM115
            file.write(json.dumps({"start_unix": start_unix}) + "\n")
            file.flush()
        except OSError as e:
            print(f"mpipipe: warning: {log}: records waiting for the file are kept in "
                  f"memory only ({e})", file=sys.stderr, flush=True)
            return None
        return cls(file)

    @property
    def path(self) -> Path:
        return Path(self._file.name)

    def add(self, name: str, args: tuple, kwargs: dict) -> bool:
        """Write one waiting record through (a kill loses none). False, with one warning,
        where it cannot: the journal is then closed and kept as it is."""
        try:
            self._file.write(json.dumps({"m": name, "a": args, "k": kwargs}, default=jsonable) + "\n")
            self._file.flush()
        except OSError as e:
            print(f"mpipipe: warning: {self._file.name}: cannot write ({e}); records "
                  f"waiting for the log are kept in memory only", file=sys.stderr, flush=True)
            self.close(keep=True)
            return False
        return True

    def close(self, keep: bool = False) -> None:
        """Close the journal; remove it unless ``keep`` (left for the next writer)."""
        self._file.close()
        if not keep:
            Path(self._file.name).unlink(missing_ok=True)


def journals(log: Path) -> list[Path]:
    """The journals beside the log at ``log``, oldest hand-over first."""
    return sorted(log.parent.glob(f"{log.stem}.queue-*.jsonl"))


def replay(log: Path, start_unix: float, own: Path | None, record: Callable[[str], Callable[..., None]]) -> None:
    """Write the records of earlier writers that waited for the file and left the job
    before it freed up (killed, or replaced and let go), then remove their journals.
    ``record`` gives the writing method of a record's name (KeyError for none). A journal
    of another run (its start differs) is left alone, as is ``own``; a line cut by a kill
    ends its journal."""
    for path in journals(log):
        if path == own:
            continue
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
            if not lines or json.loads(lines[0]).get("start_unix") != start_unix:
                continue
        except (OSError, ValueError, AttributeError):
            continue
        for line in lines[1:]:
            try:
                rec = json.loads(line)
                method = record(rec["m"])
            except (ValueError, KeyError, TypeError, AttributeError):
                break
            method(*rec["a"], **rec["k"])
        path.unlink(missing_ok=True)
