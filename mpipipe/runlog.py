"""The HDF5 run log: one file per run, written by rank 0, flushed after every record.

Both systems write the same schema (docs/hdf5-log.md), so one report command
reads every run. Rows are appended to extendable datasets and the file is
flushed after each call, so a run killed at any moment leaves a file that
reads up to its last completed step.
"""

from __future__ import annotations

import json
import math
import platform
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import h5py
import numpy as np

__all__ = ["FORMAT", "FORMAT_VERSION", "RunLog", "LogError", "RunData", "open_log", "package_versions"]

FORMAT = "mpipipe-runlog"
FORMAT_VERSION = 1

_STEP_FIELDS = {"step": np.int64, "time": np.float64, "loss": np.float64,
                "samples": np.int64, "samples_per_s": np.float64}
_EVAL_FIELDS = {"step": np.int64, "time": np.float64, "accuracy": np.float64, "loss": np.float64}
_RANK_FIELDS = {"step": np.int64, "compute_s": np.float64, "wait_s": np.float64,
                "bytes_sent": np.int64, "bytes_recv": np.int64}
_STR = h5py.string_dtype("utf-8")
_EVENT_FIELDS = {"step": np.int64, "time": np.float64, "kind": _STR, "rank": np.int64, "detail": _STR}


class LogError(ValueError):
    """A file is not a readable run log; the message names what is missing."""


def package_versions() -> dict[str, str]:
    """Versions of everything that shapes a result, for the root attributes."""
    out = {"python": platform.python_version()}
    for name in ("numpy", "h5py", "torch", "mpi4py"):
        mod = sys.modules.get(name)
        if mod is None:
            try:
                mod = __import__(name)
            except ImportError:
                continue
        out[name] = getattr(mod, "__version__", "?")
    try:
        from mpi4py import MPI

        out["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
    except Exception:  # noqa: BLE001 - versions are informative only
        pass
    return out


def _append(group: h5py.Group, fields: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> None:
    """Append rows to the parallel extendable datasets of ``group`` (one resize each)."""
    n = None
    for name, dtype in fields.items():
        if name not in group:
            group.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(256,))
        ds = group[name]
        n = ds.shape[0] if n is None else n
        ds.resize((n + len(rows),))
        missing = "" if dtype is _STR else (-1 if np.issubdtype(dtype, np.integer) else math.nan)
        values = [missing if row.get(name) is None else row.get(name) for row in rows]
        ds[n:] = np.asarray(values, dtype=object if dtype is _STR else dtype)


class RunLog:
    """Writer of one run's HDF5 log. Create it on rank 0; other ranks use :meth:`null`."""

    def __init__(
        self,
        path: str | Path,
        *,
        system: str,
        config: Mapping[str, Any],
        comm_size: int,
        emulation: Mapping[str, Any] | None = None,
        attrs: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._t0 = time.time()
        self._file: h5py.File | None = h5py.File(self.path, "w")
        f = self._file
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["system"] = system
        f.attrs["config"] = json.dumps(config, sort_keys=True)
        f.attrs["world_size"] = comm_size
        f.attrs["versions"] = json.dumps(package_versions(), sort_keys=True)
        f.attrs["start_time"] = datetime.now(UTC).isoformat(timespec="seconds")
        f.attrs["start_unix"] = self._t0
        f.attrs["hostname"] = socket.gethostname()
        f.attrs["command"] = " ".join(sys.argv)
        f.attrs["emulation"] = json.dumps(emulation or {}, sort_keys=True)
        f.attrs["status"] = "running"
        for key, value in (attrs or {}).items():
            f.attrs[key] = value if isinstance(value, str | int | float) else json.dumps(value)
        for name in ("steps", "eval", "ranks", "events"):
            f.create_group(name)
        for name, dtype in _EVENT_FIELDS.items():
            f["events"].create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(64,))
        f.flush()

    @classmethod
    def null(cls) -> RunLog:
        """A log that writes nothing: what ranks other than 0 hold."""
        obj = cls.__new__(cls)
        obj._file = None
        obj._t0 = time.time()
        obj.path = None  # type: ignore[assignment]
        return obj

    @property
    def active(self) -> bool:
        return self._file is not None

    def elapsed(self) -> float:
        """Seconds since the log was opened: the ``time`` column of every row."""
        return time.time() - self._t0

    def step(
        self,
        step: int,
        *,
        time: float | None = None,
        loss: float,
        samples: int,
        samples_per_s: float,
        ranks: Mapping[int, Mapping[str, float]] | None = None,
    ) -> None:
        """Record one optimizer step and the per-rank figures gathered for it."""
        self.steps([{"step": step, "time": time, "loss": loss, "samples": samples,
                     "samples_per_s": samples_per_s, "ranks": ranks}])

    def steps(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Record several steps at once (keyword arguments of :meth:`step` per row).

        One resize and one write per dataset for all of them: what a writer that
        has fallen behind uses to catch up.
        """
        if self._file is None or not rows:
            return
        now = self.elapsed()
        _append(self._file["steps"], _STEP_FIELDS, [
            {**{k: v for k, v in row.items() if k != "ranks"},
             "time": now if row.get("time") is None else row["time"]} for row in rows])
        per_rank: dict[int, list[Mapping[str, Any]]] = {}
        for row in rows:
            for rank, figures in (row.get("ranks") or {}).items():
                per_rank.setdefault(int(rank), []).append({"step": row["step"], **figures})
        for rank, rank_rows in per_rank.items():
            group = self._file["ranks"].require_group(str(rank))
            fields = dict(_RANK_FIELDS)
            for figures in rank_rows:
                for key, value in figures.items():
                    if key not in fields:
                        fields[key] = np.int64 if isinstance(value, int | np.integer) else np.float64
            n = group["step"].shape[0] if "step" in group else 0
            for key, dtype in fields.items():
                if key not in group and n:
                    # a figure that appears late is back-filled so columns stay aligned
                    group.create_dataset(key, shape=(n,), maxshape=(None,), dtype=dtype, chunks=(256,),
                                         fillvalue=-1 if np.issubdtype(dtype, np.integer) else math.nan)
            _append(group, fields, rank_rows)
        self._file.flush()

    def eval(self, step: int, *, accuracy: float, loss: float = math.nan, time: float | None = None) -> None:
        """Record one evaluation on the held-out split."""
        if self._file is None:
            return
        t = self.elapsed() if time is None else time
        _append(self._file["eval"], _EVAL_FIELDS, [{"step": step, "time": t, "accuracy": accuracy, "loss": loss}])
        self._file.flush()

    def event(self, kind: str, *, step: int, rank: int = -1, time: float | None = None, **detail: Any) -> None:
        """Record one event (fault injected, failure detected, takeover, re-tune, ...)."""
        if self._file is None:
            return
        t = self.elapsed() if time is None else time
        _append(self._file["events"], _EVENT_FIELDS, [{
            "step": step, "time": t, "kind": kind, "rank": rank,
            "detail": json.dumps(detail, sort_keys=True, default=_jsonable),
        }])
        self._file.flush()

    def set_attr(self, key: str, value: Any) -> None:
        """Set a root attribute (e.g. the final summary)."""
        if self._file is None:
            return
        self._file.attrs[key] = value if isinstance(value, str | int | float) else json.dumps(value, default=_jsonable)
        self._file.flush()

    def close(self, status: str = "completed") -> None:
        """Mark the run finished (``completed`` or ``failed: why``) and close the file."""
        if self._file is None:
            return
        self._file.attrs["status"] = status
        self._file.attrs["end_time"] = datetime.now(UTC).isoformat(timespec="seconds")
        self._file.close()
        self._file = None

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close("completed" if exc_type is None else f"failed: {exc}")


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


# ---------------------------------------------------------------- reading


@dataclass
class RunData:
    """A run log read back into memory (numpy columns), for reports and tests."""

    path: Path
    attrs: dict[str, Any]
    config: dict[str, Any]
    steps: dict[str, np.ndarray]
    eval: dict[str, np.ndarray]
    ranks: dict[int, dict[str, np.ndarray]]
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def system(self) -> str:
        return str(self.attrs.get("system", "?"))

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]


def _columns(group: h5py.Group, where: str) -> dict[str, np.ndarray]:
    cols = {}
    for name, ds in group.items():
        if not isinstance(ds, h5py.Dataset):
            raise LogError(f"{where}/{name} is not a dataset")
        cols[name] = ds[()]
    lengths = {len(v) for v in cols.values()}
    if len(lengths) > 1:
        # a run killed between two column writes: keep the rows every column has
        n = min(lengths)
        cols = {k: v[:n] for k, v in cols.items()}
    return cols


def open_log(path: str | Path) -> RunData:
    """Read a run log written by :class:`RunLog`.

    Raises:
        LogError: the file is missing, not HDF5, not a run log, of a newer
            format, or lacks a group the schema requires; the message names it.
    """
    p = Path(path)
    if not p.exists():
        raise LogError(f"{p}: no such file")
    try:
        f = h5py.File(p, "r")
    except OSError as e:
        raise LogError(f"{p}: not a readable HDF5 file ({e})") from None
    with f:
        if f.attrs.get("format") != FORMAT:
            raise LogError(
                f"{p}: not an mpipipe run log (root attribute 'format' is "
                f"{f.attrs.get('format')!r}, expected {FORMAT!r})"
            )
        version = int(f.attrs.get("format_version", 0))
        if version > FORMAT_VERSION:
            raise LogError(f"{p}: log format version {version} is newer than this reader ({FORMAT_VERSION})")
        for name in ("steps", "eval", "ranks", "events"):
            if name not in f or not isinstance(f[name], h5py.Group):
                raise LogError(f"{p}: group /{name} is missing")
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
        try:
            config = json.loads(attrs.get("config", "{}"))
        except json.JSONDecodeError:
            raise LogError(f"{p}: root attribute 'config' is not JSON") from None
        steps = _columns(f["steps"], "/steps")
        evals = _columns(f["eval"], "/eval")
        ranks = {}
        for name, group in f["ranks"].items():
            if not name.isdigit():
                raise LogError(f"{p}: /ranks/{name} is not a rank number")
            ranks[int(name)] = _columns(group, f"/ranks/{name}")
        ev = _columns(f["events"], "/events")
        events = []
        for i in range(len(ev.get("kind", []))):
            kind = ev["kind"][i]
            detail = ev["detail"][i]
            kind = kind.decode() if isinstance(kind, bytes) else str(kind)
            detail = detail.decode() if isinstance(detail, bytes) else str(detail)
            try:
                parsed = json.loads(detail) if detail else {}
            except json.JSONDecodeError:
                parsed = {"raw": detail}
            events.append({"step": int(ev["step"][i]), "time": float(ev["time"][i]), "kind": kind,
                           "rank": int(ev["rank"][i]), "detail": parsed})
    return RunData(p, attrs, config, steps, evals, dict(sorted(ranks.items())), events)
