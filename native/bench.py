"""Read-throughput benchmark: native gather vs numpy take, DataLoader and memcpy, in one run.

All four read the same CIFAR-sized records (3,072 image bytes + an int64 label)
of one synthetic shard in warm page cache, in batches of 256. Figures are
reported as ratios to baselines measured in the same run, because the
machines are shared and noisy; each figure is the median over rounds that
interleave the methods.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from .reader import ShardReader
from .writer import ShardWriter

KEYS = (
    "native_gbps",
    "numpy_take_gbps",
    "dataloader_gbps",
    "memcpy_gbps",
    "native_vs_memcpy",
    "native_vs_numpy",
    "native_vs_dataloader",
)


def make_shard(path: Path, records: int, seed: int = 0) -> None:
    """A synthetic shard of CIFAR-sized records (uint8 3x32x32 image, int64 label)."""
    rng = np.random.default_rng(seed)
    schema = {"image": ("uint8", (3, 32, 32)), "label": ("int64", ())}
    with ShardWriter(path, schema) as w:
        for lo in range(0, records, 16384):
            n = min(16384, records - lo)
            w.write({"image": rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8), "label": rng.integers(0, 10, n)})


def _time(fn: Callable[[int], None], batches: int) -> tuple[float, float]:
    """(thread CPU seconds, wall seconds) for `batches` calls of fn.

    CPU time of this thread leaves out the time other processes on a shared
    machine hold the core; every method here does its work in the calling thread
    (the gather releases the GIL but runs on this thread; the DataLoader has no
    workers and torch is held to one thread)."""
    c0, w0 = time.thread_time(), time.perf_counter()
    for b in range(batches):
        fn(b)
    return time.thread_time() - c0, time.perf_counter() - w0


def run(
    records: int, batch: int, batches: int, loader_batches: int, rounds: int, directory: Path, clock: str = "cpu"
) -> dict[str, float]:
    path = directory / "bench.shard"
    make_shard(path, records)
    reader = ShardReader(path)
    shard = reader._set.shards[0]
    rs = reader._set.shards[0].record_size
    data_offset = shard.data_offset
    if shard.record_offset(records - 1) != data_offset + (records - 1) * rs:
        raise RuntimeError("benchmark shard is not laid out back to back")
    mm = np.memmap(path, dtype=np.uint8, mode="c", offset=data_offset, shape=(records, rs))
    reader.verify()  # reads every record once: page cache warm, checksums done
    mm.sum(axis=0, dtype=np.uint64)  # fault in the memmap's pages too

    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)  # per-sample collation in this thread only, like the others

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return records

        def __getitem__(self, i: int) -> np.ndarray:
            return mm[i]

    rng = np.random.default_rng(1)
    order = rng.permutation(records).astype(np.int64)
    n_batches = records // batch
    out = reader.empty(batch)
    buf = np.empty((batch, rs), dtype=np.uint8)
    per_batch = batch * rs  # bytes moved per batch, the same for every method

    # The same bytes come out of each method.
    probe = order[:batch]
    got = reader.read(probe, out=out)
    want = np.take(mm, probe, axis=0)
    if not (
        np.array_equal(got["image"].reshape(batch, -1), want[:, :3072])
        and np.array_equal(got["label"], want[:, 3072:3080].copy().view(np.int64)[:, 0])
    ):
        raise RuntimeError("native gather and numpy take disagree")

    cursor = {"native": 0, "numpy": 0, "memcpy": 0}

    def native(b: int) -> None:
        k = (cursor["native"] + b) % n_batches
        reader.read(order[k * batch : (k + 1) * batch], out=out)

    def numpy_take(b: int) -> None:
        k = (cursor["numpy"] + b) % n_batches
        np.take(mm, order[k * batch : (k + 1) * batch], axis=0, out=buf)

    def memcpy(b: int) -> None:
        k = (cursor["memcpy"] + b) % n_batches
        np.copyto(buf, mm[k * batch : (k + 1) * batch])

    loader = DataLoader(Rows(), batch_size=batch, sampler=order.tolist(), num_workers=0)

    def dataloader() -> tuple[float, float]:
        it = iter(loader)
        next(it)  # start-up is not throughput
        return _time(lambda b: next(it), loader_batches)

    # First reads of a fresh reader also check each record's CRC32C (verify="first").
    fresh = ShardReader(path)
    fresh_out = fresh.empty(batch)
    first = min(batches, n_batches)
    dt = _time(lambda b: fresh.read(order[b * batch : (b + 1) * batch], out=fresh_out), first)
    first_read = first * per_batch / dt[0 if clock == "cpu" else 1] / 1e9
    fresh.close()

    names = ("native", "numpy", "memcpy", "dataloader")
    results: dict[str, list[float]] = {k: [] for k in names}
    wall: dict[str, list[float]] = {k: [] for k in names}
    pick = 0 if clock == "cpu" else 1
    for _ in range(rounds):
        for name, fn in (("native", native), ("numpy", numpy_take), ("memcpy", memcpy)):
            dt = _time(fn, batches)
            cursor[name] += batches
            results[name].append(batches * per_batch / max(dt[pick], 1e-9) / 1e9)
            wall[name].append(batches * per_batch / max(dt[1], 1e-9) / 1e9)
        dt = dataloader()
        results["dataloader"].append(loader_batches * per_batch / max(dt[pick], 1e-9) / 1e9)
        wall["dataloader"].append(loader_batches * per_batch / max(dt[1], 1e-9) / 1e9)
    med = {k: statistics.median(v) for k, v in results.items()}
    spread = {k: (min(v), max(v)) for k, v in results.items()}
    wall_med = {k: statistics.median(v) for k, v in wall.items()}
    reader.close()
    return {
        "native_gbps": med["native"],
        "numpy_take_gbps": med["numpy"],
        "dataloader_gbps": med["dataloader"],
        "memcpy_gbps": med["memcpy"],
        "native_vs_memcpy": med["native"] / med["memcpy"],
        "native_vs_numpy": med["native"] / med["numpy"],
        "native_vs_dataloader": med["native"] / med["dataloader"],
        "_spread": spread,  # type: ignore[dict-item]
        "_wall": wall_med,  # type: ignore[dict-item]
        "_first_read": first_read,
        "_record_bytes": rs,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m native.bench",
        description="Native shard gather vs numpy take over np.memmap, a per-sample torch "
        "DataLoader, and in-order memcpy: shuffled batches of CIFAR-sized records in warm "
        "page cache. Reports GB/s (median of rounds) and the ratios.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    p.add_argument("--records", type=int, default=200_000, help="records in the shard (200000)")
    p.add_argument("--batch", type=int, default=256, help="records per batch (256)")
    p.add_argument("--batches", type=int, default=300, help="batches per method per round (300)")
    p.add_argument("--loader-batches", type=int, default=10, help="DataLoader batches per round (10; it is slow)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (5)")
    p.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="time by this thread's CPU time (default; other processes on a shared machine do not count) "
        "or by the wall clock",
    )
    p.add_argument("--dir", type=Path, default=None, help="where to write the temporary shard (default: a temp dir)")
    args = p.parse_args(argv)
    if args.records < 2 * args.batch:
        p.error("--records must be at least two batches")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="native-bench-") as tmp:
        res = run(args.records, args.batch, args.batches, args.loader_batches, args.rounds, Path(tmp), args.clock)
    if args.json:
        print(json.dumps({k: round(float(res[k]), 4) for k in KEYS}))
        return 0
    spread = res["_spread"]
    print(
        f"native.bench: {args.records} records of {res['_record_bytes']} bytes, batches of "
        f"{args.batch} shuffled, warm page cache, median of {args.rounds} rounds, timed by "
        f"{'thread CPU time' if args.clock == 'cpu' else 'wall clock'}"
    )
    print(
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on "
        f"{os.cpu_count()} CPUs: other processes slow the wall clock, not this thread's CPU time, "
        "but still share the caches and memory bandwidth"
    )
    print(f"{'method':<34}{'GB/s':>8}   {'min..max':<14}{'wall GB/s':>10}")
    rows = [
        ("native gather (mmap, C, no GIL)", "native_gbps", "native"),
        ("numpy take over np.memmap", "numpy_take_gbps", "numpy"),
        ("torch DataLoader, per sample", "dataloader_gbps", "dataloader"),
        ("memcpy in order (baseline)", "memcpy_gbps", "memcpy"),
    ]
    for label, key, s in rows:
        lo, hi = spread[s]
        print(f"{label:<34}{res[key]:>8.2f}   {lo:>6.2f}..{hi:<6.2f}{res['_wall'][s]:>10.2f}")
    print(f"{'native, first read + CRC32C check':<34}{res['_first_read']:>8.2f}   (one pass)")
    for key, target in (("native_vs_memcpy", 0.7), ("native_vs_numpy", 1.2), ("native_vs_dataloader", 5.0)):
        ok = "ok" if res[key] >= target else "BELOW TARGET"
        print(f"{key:<34}{res[key]:>8.2f}   target >= {target}  {ok}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
