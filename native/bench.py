"""Read-throughput benchmark: native gather vs numpy take, DataLoader and memcpy, in one run.

All four read the same CIFAR-sized records (3,072 image bytes + an int64 label)
of one synthetic shard in warm page cache, in batches of 256. Figures are
reported as ratios to baselines measured in the same run, because the
machines are shared and noisy; each figure is the median over rounds that
interleave the methods.

``--augment``: the training recipe instead (random_crop:4 + hflip + normalize):
native gather + native.Augment on the batch, against a torch DataLoader with two
workers doing the same transforms per sample in Python; and the augmentation's
time per batch as a share of one LeNet training step on that batch. It also times
`native.ingest.convert_folder` (``python -m native.convert folder``) on a generated
folder of PNG and JPEG files of mixed sizes, in images per second: the step a user
runs before training on their own images.
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
from typing import Any

import numpy as np

from .augment import Augment
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


AUGMENT_KEYS = (
    "augment_images_per_s",
    "dataloader_images_per_s",
    "augment_vs_dataloader",
    "augment_ms_per_batch",
    "lenet_step_ms",
    "augment_share_of_lenet_step",
    "convert_folder_images_per_s",
)
FOLDER_CLASSES = ("ant", "bee", "cat")
FOLDER_IMAGES = 600  # under a second a round on a loaded 2-CPU machine: --augment stays well under a minute
FOLDER_SIZE = 32
AUGMENT_OPS = ("random_crop:4", "hflip")
CROP_PAD = 4  # the padding of random_crop:4, for the per-sample torch transform
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


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


def _open_shard(path: Path, records: int, mode: str) -> tuple[ShardReader, np.ndarray]:
    """A reader of a fresh synthetic shard at `path` (page cache warm, checksums done) and a
    np.memmap of its records, one row of record_size bytes each."""
    make_shard(path, records)
    reader = ShardReader(path)
    shard = reader._set.shards[0]
    if shard.record_offset(records - 1) != shard.data_offset + (records - 1) * shard.record_size:
        raise RuntimeError("benchmark shard is not laid out back to back")
    mm = np.memmap(path, dtype=np.uint8, mode=mode, offset=shard.data_offset, shape=(records, shard.record_size))
    reader.verify()  # reads every record once: page cache warm, checksums done
    return reader, mm


def _check_gather(reader: ShardReader, mm: np.ndarray, probe: np.ndarray, out: dict[str, np.ndarray]) -> None:
    """The same bytes come out of each method."""
    got = reader.read(probe, out=out)
    want = np.take(mm, probe, axis=0)
    if not (
        np.array_equal(got["image"].reshape(len(probe), -1), want[:, :3072])
        and np.array_equal(got["label"], want[:, 3072:3080].copy().view(np.int64)[:, 0])
    ):
        raise RuntimeError("native gather and numpy take disagree")


def _gather_methods(
    reader: ShardReader, mm: np.ndarray, order: np.ndarray, out: dict[str, np.ndarray], cursor: dict[str, int]
) -> dict[str, Callable[[int], None]]:
    """native gather, numpy take and in-order memcpy of batch b (of len(out) records), each
    counted from its own cursor[name], which the caller moves on after every round."""
    batch = len(out["label"])
    n_batches = len(order) // batch
    buf = np.empty((batch, mm.shape[1]), dtype=np.uint8)

    def native(b: int) -> None:
        k = (cursor["native"] + b) % n_batches
        reader.read(order[k * batch : (k + 1) * batch], out=out)

    def numpy_take(b: int) -> None:
        k = (cursor["numpy"] + b) % n_batches
        np.take(mm, order[k * batch : (k + 1) * batch], axis=0, out=buf)

    def memcpy(b: int) -> None:
        k = (cursor["memcpy"] + b) % n_batches
        np.copyto(buf, mm[k * batch : (k + 1) * batch])

    return {"native": native, "numpy": numpy_take, "memcpy": memcpy}


def _dataloader_method(mm: np.ndarray, order: np.ndarray, batch: int, loader_batches: int
                       ) -> Callable[[], tuple[float, float]]:
    """A per-sample torch DataLoader (no workers) over the memmap's rows in `order`; the call
    times `loader_batches` batches of a new pass, after its first (start-up is not throughput)."""
    import torch
    from torch.utils.data import DataLoader

    records = len(mm)

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return records

        def __getitem__(self, i: int) -> np.ndarray:
            return mm[i]

    loader = DataLoader(Rows(), batch_size=batch, sampler=order.tolist(), num_workers=0)

    def dataloader() -> tuple[float, float]:
        it = iter(loader)
        next(it)  # start-up is not throughput
        return _time(lambda b: next(it), loader_batches)

    return dataloader


def _first_read_gbps(path: Path, order: np.ndarray, batch: int, batches: int, per_batch: int, pick: int) -> float:
    """GB/s of a fresh reader's first reads, which also check each record's CRC32C (verify="first")."""
    fresh = ShardReader(path)
    fresh_out = fresh.empty(batch)
    first = min(batches, len(order) // batch)
    dt = _time(lambda b: fresh.read(order[b * batch : (b + 1) * batch], out=fresh_out), first)
    fresh.close()
    return first * per_batch / dt[pick] / 1e9


def _interleave(
    methods: dict[str, Callable[[int], None]],
    dataloader: Callable[[], tuple[float, float]],
    cursor: dict[str, int],
    rounds: int,
    batches: int,
    loader_batches: int,
    per_batch: int,
    pick: int,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """GB/s of every method in each of `rounds` rounds, by the chosen clock and by the wall
    clock; a round runs each method once, so load that comes and goes slows them alike."""
    names = ("native", "numpy", "memcpy", "dataloader")
    results: dict[str, list[float]] = {k: [] for k in names}
    wall: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(rounds):
        for name, fn in methods.items():
            dt = _time(fn, batches)
            cursor[name] += batches
            results[name].append(batches * per_batch / max(dt[pick], 1e-9) / 1e9)
            wall[name].append(batches * per_batch / max(dt[1], 1e-9) / 1e9)
        dt = dataloader()
        results["dataloader"].append(loader_batches * per_batch / max(dt[pick], 1e-9) / 1e9)
        wall["dataloader"].append(loader_batches * per_batch / max(dt[1], 1e-9) / 1e9)
    return results, wall


def run(
    records: int, batch: int, batches: int, loader_batches: int, rounds: int, directory: Path, clock: str = "cpu"
) -> dict[str, float]:
    """GB/s of native gather, numpy take, a per-sample DataLoader and memcpy over one shard
    (median of interleaved rounds, by `clock`), their ratios, and (keys starting "_") the
    spread, the wall clock figures, a fresh reader's first read and the record size."""
    path = directory / "bench.shard"
    reader, mm = _open_shard(path, records, "c")
    mm.sum(axis=0, dtype=np.uint64)  # fault in the memmap's pages too
    rs = mm.shape[1]

    import torch

    torch.set_num_threads(1)  # per-sample collation in this thread only, like the others

    rng = np.random.default_rng(1)
    order = rng.permutation(records).astype(np.int64)
    out = reader.empty(batch)
    per_batch = batch * rs  # bytes moved per batch, the same for every method
    _check_gather(reader, mm, order[:batch], out)
    cursor = {"native": 0, "numpy": 0, "memcpy": 0}
    methods = _gather_methods(reader, mm, order, out, cursor)
    dataloader = _dataloader_method(mm, order, batch, loader_batches)
    pick = 0 if clock == "cpu" else 1
    first_read = _first_read_gbps(path, order, batch, batches, per_batch, pick)
    results, wall = _interleave(methods, dataloader, cursor, rounds, batches, loader_batches, per_batch, pick)
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


def _lenet(num_classes: int = 10) -> Any:
    """LeNet-5 for 3x32x32, as the project's model zoo builds it (mpipipe.core.run.models.lenet).
    Written out here because native imports nothing of mpipipe (tests/test_layers.py)."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 8 * 8, 120), nn.ReLU(),
        nn.Linear(120, 84), nn.ReLU(),
        nn.Linear(84, num_classes),
    )


def _torch_sample(t: Any, dy: int, dx: int, flip: bool, pad: int, mean: Any, std: Any) -> Any:
    """One sample the usual way: torch ops on its own tensor (pad, crop, flip, normalize)."""
    import torch
    import torch.nn.functional as F

    h, w = t.shape[1:]
    t = F.pad(t, (pad, pad, pad, pad))[:, dy:dy + h, dx:dx + w]
    if flip:
        t = torch.flip(t, dims=(2,))
    return (t.float().div(255.0) - mean) / std


def _check_augment(aug: Augment, reader: ShardReader, images: np.ndarray, probe: np.ndarray,
                   out: dict[str, np.ndarray], x: np.ndarray, norm: tuple[Any, Any]) -> None:
    """The two ways compute the same samples: the per-sample torch transform, given the
    draws of native.Augment, equals its batch output bit for bit."""
    import torch

    batch = len(probe)
    got = aug.apply(reader.read(probe, out=out)["image"], probe, 0, out=x)
    d = aug.draws(0, probe)
    for i in range(0, batch, max(1, batch // 16)):
        want = _torch_sample(torch.from_numpy(np.array(images[probe[i]])), int(d.dy[i]), int(d.dx[i]),
                             bool(d.hflip[i]), CROP_PAD, *norm)
        if not torch.equal(torch.from_numpy(got[i]), want):
            raise RuntimeError("native.Augment and the per-sample torch transform disagree")


def _augment_loader(images: np.ndarray, order: np.ndarray, batch: int, loader_batches: int,
                    norm: tuple[Any, Any]) -> tuple[Any, Any]:
    """A DataLoader with two persistent (forked) workers that transform per sample with
    torch ops, as usual, and its sampler, whose `start` and `batches` the caller sets
    before each pass."""
    import torch
    from torch.utils.data import DataLoader

    records = len(images)
    pad = CROP_PAD
    mean_t, std_t = norm

    class Samples(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return records

        def __getitem__(self, i: int) -> tuple[Any, int]:
            t = torch.from_numpy(np.array(images[i]))
            dy, dx = (int(v) for v in torch.randint(0, 2 * pad + 1, (2,)))
            flip = bool(torch.rand(()) < 0.5)
            return _torch_sample(t, dy, dx, flip, pad, mean_t, std_t), int(i)

    class Window(torch.utils.data.Sampler):
        """Exactly this round's records, so no batch is still being made in the workers
        while the native method is timed."""

        def __init__(self) -> None:
            self.start = 0
            self.batches = loader_batches

        def __len__(self) -> int:
            return self.batches * batch

        def __iter__(self) -> Any:
            idx = np.arange(self.start, self.start + len(self)) % records
            return iter(order[idx].tolist())

    window = Window()
    loader = DataLoader(Samples(), batch_size=batch, sampler=window, num_workers=2, persistent_workers=True,
                        multiprocessing_context="fork",
                        worker_init_fn=lambda _: torch.set_num_threads(1))
    return loader, window


def _lenet_step(x: np.ndarray, labels: np.ndarray) -> Callable[[], None]:
    """One LeNet training step (forward, backward, SGD) on the batch that the buffers x and
    labels hold when it is called."""
    import torch

    model = _lenet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    xt, yt = torch.from_numpy(x), torch.from_numpy(labels)

    def lenet_step() -> None:
        opt.zero_grad()
        loss_fn(model(xt), yt).backward()
        opt.step()

    return lenet_step


def _augment_round(reader: ShardReader, aug: Augment, order: np.ndarray, out: dict[str, np.ndarray],
                   x: np.ndarray, first: int, batches: int, r: int) -> tuple[float, float]:
    """Native gather + Augment (epoch r) of `batches` batches from batch `first` on: (images/s
    by the wall clock, Augment's thread CPU seconds per batch)."""
    batch = len(x)
    n_batches = len(order) // batch
    w0 = time.perf_counter()
    spent = 0.0
    for b in range(batches):
        k = (first + b) % n_batches
        idx = order[k * batch:(k + 1) * batch]
        got_batch = reader.read(idx, out=out)
        c0 = time.thread_time()
        aug.apply(got_batch["image"], idx, r, out=x)
        spent += time.thread_time() - c0
    return batches * batch / max(time.perf_counter() - w0, 1e-9), spent / batches


def _loader_images_per_s(loader: Any) -> float:
    """One pass of the DataLoader, in images/s by the wall clock."""
    w0 = time.perf_counter()
    made = 0
    for xb, _ in loader:  # to the end: no batch is left in the making for the next method
        made += len(xb)
    return made / max(time.perf_counter() - w0, 1e-9)


def _augment_result(native_ips: list[float], loader_ips: list[float], ratios: list[float],
                    aug_cpu: list[float], step_cpu: list[float]) -> dict[str, Any]:
    """The medians of the rounds' figures (AUGMENT_KEYS but the folder conversion's), and their spread."""
    shares = [a / s for a, s in zip(aug_cpu, step_cpu, strict=True)]
    return {
        "augment_images_per_s": statistics.median(native_ips),
        "dataloader_images_per_s": statistics.median(loader_ips),
        "augment_vs_dataloader": statistics.median(ratios),
        "augment_ms_per_batch": statistics.median(aug_cpu) * 1e3,
        "lenet_step_ms": statistics.median(step_cpu) * 1e3,
        "augment_share_of_lenet_step": statistics.median(shares),
        "_spread": {"augment_vs_dataloader": (min(ratios), max(ratios)),
                    "augment_share_of_lenet_step": (min(shares), max(shares)),
                    "augment_images_per_s": (min(native_ips), max(native_ips)),
                    "dataloader_images_per_s": (min(loader_ips), max(loader_ips)),
                    "augment_ms_per_batch": (min(aug_cpu) * 1e3, max(aug_cpu) * 1e3),
                    "lenet_step_ms": (min(step_cpu) * 1e3, max(step_cpu) * 1e3)},
    }


def run_augment(records: int, batch: int, batches: int, loader_batches: int, steps: int, rounds: int,
                directory: Path) -> dict[str, Any]:
    """Native gather + native.Augment against a 2-worker DataLoader with per-sample torch
    transforms, in images/s by the wall clock (the DataLoader works in other processes,
    so this thread's CPU time would leave its work out), rounds interleaved; and
    native.Augment's thread CPU time per batch against one LeNet step's (one thread,
    as each rank trains), which load on the machine slows alike."""
    import torch

    torch.set_num_threads(1)
    reader, mm = _open_shard(directory / "bench.shard", records, "r")
    images = mm[:, :3072].reshape(records, 3, 32, 32)
    aug = Augment(AUGMENT_OPS, CIFAR_MEAN, CIFAR_STD, seed=0)
    norm = (torch.tensor(CIFAR_MEAN).reshape(3, 1, 1), torch.tensor(CIFAR_STD).reshape(3, 1, 1))
    order = np.random.default_rng(1).permutation(records).astype(np.int64)
    out = reader.empty(batch)
    x = np.empty((batch, 3, 32, 32), dtype=np.float32)
    _check_augment(aug, reader, images, order[:batch], out, x, norm)
    loader, window = _augment_loader(images, order, batch, loader_batches, norm)
    lenet_step = _lenet_step(x, out["label"])
    lenet_step()  # first call allocates
    window.batches = 2
    for _ in loader:  # starts the workers (kept across rounds): start-up is not throughput
        pass
    window.batches = loader_batches
    native_ips: list[float] = []
    loader_ips: list[float] = []
    ratios: list[float] = []
    aug_cpu: list[float] = []
    step_cpu: list[float] = []
    for r in range(rounds):
        ips, cpu = _augment_round(reader, aug, order, out, x, r * batches, batches, r)
        native_ips.append(ips)
        aug_cpu.append(cpu)

        window.start = (r * loader_batches * batch) % records
        loader_ips.append(_loader_images_per_s(loader))
        ratios.append(native_ips[-1] / loader_ips[-1])

        c0 = time.thread_time()
        for _ in range(steps):
            lenet_step()
        step_cpu.append((time.thread_time() - c0) / steps)
    reader.close()
    del loader
    return _augment_result(native_ips, loader_ips, ratios, aug_cpu, step_cpu)


def make_image_folder(root: Path, images: int, seed: int = 0) -> None:
    """root/<class>/img<i>.png|jpg, `images` files spread over FOLDER_CLASSES, seeded.

    Half PNG, half JPEG, each side 48..128 px, so the conversion decodes both formats
    and scales and crops every image, as it does a photo folder of mixed sizes. The
    content is smooth with a little noise: JPEG and PNG then compress about as they
    do real pictures (pure noise would make the PNGs unrealistically large)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in FOLDER_CLASSES:
        (root / c).mkdir(parents=True)
    for i in range(images):
        h, w = (int(v) for v in rng.integers(48, 129, 2))
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([x * 255 // w, y * 255 // h, np.full_like(x, (37 * i) % 256)], axis=-1)
        pixels = (base + rng.integers(0, 24, (h, w, 3))).clip(0, 255).astype(np.uint8)
        target = root / FOLDER_CLASSES[i % len(FOLDER_CLASSES)] / f"img{i}.{'png' if i % 2 == 0 else 'jpg'}"
        if i % 2 == 0:
            Image.fromarray(pixels).save(target)
        else:
            Image.fromarray(pixels).save(target, quality=85)


def run_convert_folder(images: int, rounds: int, directory: Path) -> dict[str, Any]:
    """`convert_folder` of a generated image folder to FOLDER_SIZE px square, in images/s by the wall clock
    (it decodes, writes and fsyncs: waiting on the disk is part of its cost), median of
    `rounds` conversions into fresh OUT directories. Only the conversion is timed, not
    making the folder; the first round also warms the page cache, as a user's second
    conversion of the same folder would find it.

    Raises:
        RuntimeError: the conversion did not write every image, or lost the class names.
    """
    from .ingest import classes_of, convert_folder

    src = directory / "folder"
    make_image_folder(src, images)
    rates: list[float] = []
    for r in range(rounds):
        out = directory / f"converted-{r}"
        t0 = time.perf_counter()
        summary = convert_folder(src, out, size=(FOLDER_SIZE, FOLDER_SIZE))
        dt = time.perf_counter() - t0
        if sum(summary.records.values()) != images or classes_of(out / "train") != list(FOLDER_CLASSES):
            raise RuntimeError(f"convert_folder wrote {summary.records} with classes {summary.classes}, "
                               f"expected {images} images of {list(FOLDER_CLASSES)}")
        rates.append(images / max(dt, 1e-9))
    return {"convert_folder_images_per_s": statistics.median(rates),
            "_spread": {"convert_folder_images_per_s": (min(rates), max(rates))}}


def main_augment(args: argparse.Namespace) -> int:
    load_before = os.getloadavg()[0]
    records = args.records if args.records is not None else 25_600
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="native-bench-") as tmp:
        res = run_augment(records, args.batch, args.batches if args.batches is not None else 40,
                          args.loader_batches if args.loader_batches is not None else 10,
                          args.lenet_steps, args.rounds, Path(tmp))
        folder = run_convert_folder(FOLDER_IMAGES, args.rounds, Path(tmp))
    res["convert_folder_images_per_s"] = folder["convert_folder_images_per_s"]
    res["_spread"].update(folder["_spread"])
    if args.json:
        print(json.dumps({k: round(float(res[k]), 4) for k in AUGMENT_KEYS}))
        return 0
    spread = res["_spread"]
    print(f"native.bench --augment: {records} records of 3x32x32 uint8, batches of {args.batch} shuffled, "
          f"{', '.join(AUGMENT_OPS)} + normalize; median of {args.rounds} interleaved rounds")
    print(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs: "
          "images/s are wall clock (the DataLoader's workers are other processes), the share is "
          "this thread's CPU time (one torch thread, as a rank trains)")
    print(f"{'figure':<48}{'median':>10}   min..max")
    rows = [
        ("native gather + Augment (images/s, wall)", "augment_images_per_s", "{:>10.0f}", "{:.0f}..{:.0f}"),
        ("DataLoader, 2 workers, per sample (images/s)", "dataloader_images_per_s", "{:>10.0f}", "{:.0f}..{:.0f}"),
        ("Augment, CPU ms per batch", "augment_ms_per_batch", "{:>10.2f}", "{:.2f}..{:.2f}"),
        ("LeNet step (fwd+bwd+SGD), CPU ms per batch", "lenet_step_ms", "{:>10.1f}", "{:.1f}..{:.1f}"),
        (f"convert folder, {FOLDER_IMAGES} PNG/JPEG to {FOLDER_SIZE}px (images/s)",
         "convert_folder_images_per_s", "{:>10.0f}", "{:.0f}..{:.0f}"),
    ]
    for label, key, fmt, sfmt in rows:
        print(f"{label:<48}{fmt.format(res[key])}   {sfmt.format(*spread[key])}")
    for key, ok, target in (
        ("augment_vs_dataloader", res["augment_vs_dataloader"] >= 5.0, "target >= 5"),
        ("augment_share_of_lenet_step", res["augment_share_of_lenet_step"] < 0.05, "target < 0.05"),
    ):
        lo, hi = spread[key]
        print(f"{key:<48}{res[key]:>10.3f}   {lo:.3f}..{hi:.3f}  {target}  {'ok' if ok else 'BELOW TARGET'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m native.bench",
        description="Native shard gather vs numpy take over np.memmap, a per-sample torch "
        "DataLoader, and in-order memcpy: shuffled batches of CIFAR-sized records in warm "
        "page cache. Reports GB/s (median of rounds) and the ratios.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    p.add_argument("--augment", action="store_true",
                   help="benchmark the training recipe instead: gather + native.Augment (random_crop:4, "
                   "hflip, normalize) vs a 2-worker DataLoader transforming per sample, and the "
                   "augmentation's share of a LeNet step, and folder conversion (images/s)")
    p.add_argument("--records", type=int, default=None, help="records in the shard (200000; --augment: 25600)")
    p.add_argument("--batch", type=int, default=256, help="records per batch (256)")
    p.add_argument("--batches", type=int, default=None, help="batches per method per round (300; --augment: 40)")
    p.add_argument("--loader-batches", type=int, default=None,
                   help="DataLoader batches per round (10; it is slow)")
    p.add_argument("--lenet-steps", type=int, default=3, help="--augment: LeNet steps timed per round (3)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (5)")
    p.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="time by this thread's CPU time (default; other processes on a shared machine do not count) "
        "or by the wall clock",
    )
    p.add_argument("--dir", type=Path, default=None, help="where to write the temporary shard (default: a temp dir)")
    return p


def print_table(args: argparse.Namespace, res: dict[str, Any], load_before: float) -> None:
    """The gather benchmark's table: GB/s of each method (median, min..max, wall clock) and
    the ratios against their targets."""
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


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.records is not None and args.records < 2 * args.batch:
        p.error("--records must be at least two batches")
    if args.augment:
        return main_augment(args)
    args.records = 200_000 if args.records is None else args.records
    args.batches = 300 if args.batches is None else args.batches
    args.loader_batches = 10 if args.loader_batches is None else args.loader_batches
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="native-bench-") as tmp:
        res = run(args.records, args.batch, args.batches, args.loader_batches, args.rounds, Path(tmp), args.clock)
    if args.json:
        print(json.dumps({k: round(float(res[k]), 4) for k in KEYS}))
        return 0
    print_table(args, res, load_before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
