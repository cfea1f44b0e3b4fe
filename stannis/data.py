"""Each rank's own records: the host's public shards, a CSD's private shards.

A rank reads only what lives on its device; the batches it draws never leave
it (only gradients do). Batch sizes change when HyperTune re-tunes, so the
stream hands out any number of records from a per-epoch shuffled order.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import native
from mpipipe.core.run.batches import DataError, TransformError, bad_label, damaged

__all__ = ["DataError", "open_split", "to_tensors", "BatchStream"]


def open_split(directory: str | Path) -> Any:
    """Open one shard data set (a directory with manifest.json) with the native reader.

    Raises:
        DataError: the directory does not exist or is not a shard data set.
    """
    import native

    d = Path(directory)
    if not d.is_dir():
        raise DataError(f"data directory {d} does not exist; make the demo data with "
                        "`python -m stannis prepare` or point the config at your shards")
    try:
        return native.open_dataset(str(d))
    except (native.ShardError, OSError) as e:
        raise DataError(f"data directory {d} is not a readable shard data set: {e}") from None


def to_tensors(batch: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Images as float32 (uint8 scaled to [0, 1], as mpipipe.core.run.batches does) and labels as int64."""
    image = batch["image"]
    x = torch.from_numpy(np.ascontiguousarray(image))
    x = x.float().div_(255.0) if image.dtype == np.uint8 else x.float()
    y = torch.from_numpy(np.ascontiguousarray(batch["label"])).long()
    return x, y


class BatchStream:
    """Batches of any size from one or more (reader, record indices) parts, reshuffled per epoch.

    ``augment`` (from ``mpipipe.core.run.batches.transforms(cfg["data"], seed=run.seed)``): random
    ops and normalization applied to each part's records as read. A sample is identified
    by (its data set, its record number in that data set), and its draws are a pure
    function of (run seed, this stream's epoch when it was drawn, that record number):
    not of the rank, the batch size HyperTune chose or the batch it fell in. Parts of
    different data sets may share record numbers (a CSD's private set and the public
    one); such samples share draws, which is harmless (their pixels differ).
    """

    def __init__(self, parts: Sequence[tuple[Any, np.ndarray]], *, seed: int,
                 num_classes: int | None = None, augment: native.Augment | None = None) -> None:
        self.num_classes = num_classes  # labels are checked against it as they are read
        self.parts = [(reader, np.asarray(idx, dtype=np.int64)) for reader, idx in parts
                      if len(idx)]
        self.augment = None if augment is None or augment.identity else augment
        if self.augment is not None:
            for reader, _ in self.parts:
                shape = next((f.shape for f in reader.schema if f.name == "image"), ())
                try:
                    self.augment.check_shape(shape)
                except native.AugmentError as e:
                    raise TransformError(f"{getattr(reader, 'directory', reader)}: {e}") from None
        self.sizes = [len(idx) for _, idx in self.parts]
        self.total = int(sum(self.sizes))
        self._starts = np.cumsum([0] + self.sizes)
        self._rng = np.random.default_rng(seed)
        self.epoch = 0
        self._order = self._rng.permutation(self.total) if self.total else np.empty(0, np.int64)
        self._pos = 0

    def __len__(self) -> int:
        return self.total

    def _take(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The next ``n`` positions of the stream's order, and the epoch of each."""
        out, epochs = [], []
        while n > 0:
            if self._pos == self.total:
                self.epoch += 1
                self._order = self._rng.permutation(self.total)
                self._pos = 0
            k = min(n, self.total - self._pos)
            out.append(self._order[self._pos:self._pos + k])
            epochs.append(np.full(k, self.epoch, dtype=np.int64))
            self._pos += k
            n -= k
        if not out:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        return np.concatenate(out), np.concatenate(epochs)

    def next(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``n`` records (wrapping into a new epoch when needed)."""
        if self.total == 0:
            raise DataError("this rank has no records but was given a non-empty batch")
        picks, epochs = self._take(n)
        xs, ys = [], []
        for p, (reader, idx) in enumerate(self.parts):
            lo, hi = self._starts[p], self._starts[p + 1]
            here = (picks >= lo) & (picks < hi)
            mine = picks[here] - lo
            if len(mine):
                records = idx[mine]
                order = np.argsort(records, kind="stable")  # in file order: read-ahead
                records = records[order]
                try:
                    batch = reader.read(records)
                except native.ShardError as e:
                    raise damaged(e, reader.directory) from None
                if self.num_classes is not None:
                    fault = bad_label(reader, records, batch["label"], self.num_classes)
                    if fault is not None:
                        raise fault
                if self.augment is None:
                    x, y = to_tensors(batch)
                else:  # a new array per part: the parts are concatenated below
                    x = torch.from_numpy(self.augment.apply(batch["image"], records, epochs[here][order]))
                    y = torch.from_numpy(np.ascontiguousarray(batch["label"])).long()
                xs.append(x)
                ys.append(y)
        return (xs[0], ys[0]) if len(xs) == 1 else (torch.cat(xs), torch.cat(ys))
