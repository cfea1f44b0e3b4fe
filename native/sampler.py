"""Per-epoch record order: deterministic shuffle, split across ranks, drop-last or pad, resume."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


class Sampler:
    """Which records this rank reads, in which order, epoch after epoch.

    Records are split into `world` contiguous blocks, one per rank (sizes
    differ by at most one), so each rank reads only its own part of the data:
    its own shards, pages and, on a CSD, its own flash. Within its block a rank
    shuffles with a generator seeded by (seed, epoch, rank): the same seed gives
    the same order on every run, a new epoch a new order.

    Every rank sees the same number of records per epoch, so data-parallel
    ranks run the same number of steps:
      - drop_last=True: each rank uses `n_records // world` records (a block
        one larger drops one record, a different one each shuffled epoch), and
        `batches()` drops a final partial batch.
      - drop_last=False (pad): each rank uses `ceil(n_records / world)` records,
        repeating the start of its own order to fill a short block, and the
        final batch is filled the same way, so every batch is full. Padded
        records are seen twice in that epoch; evaluate with world=1 and
        read(arange) instead if each record must count once.

    The position (epoch, offset) counts records of this rank's epoch order
    already handed out; save it with a checkpoint and `seek()` to resume.

    Args:
        n_records: records in the data set (len(reader)).
        seed: non-negative integer.
        rank, world: this rank and the number of ranks sharing the data.
        shuffle: False gives the block in order (in-order reads get read-ahead).
        drop_last: see above.
    """

    def __init__(
        self,
        n_records: int,
        *,
        seed: int,
        rank: int = 0,
        world: int = 1,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank must be in 0..world-1 and world >= 1, got {rank}/{world}")
        if n_records < world:
            raise ValueError(
                f"{n_records} records cannot be split over {world} ranks (need at least one record per rank)"
            )
        if seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed}")
        self.n_records = int(n_records)
        self.seed = int(seed)
        self.rank = int(rank)
        self.world = int(world)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.start = self.rank * self.n_records // self.world
        self.stop = (self.rank + 1) * self.n_records // self.world
        self._epoch = 0
        self._offset = 0
        self._epoch_len: int | None = None

    def __len__(self) -> int:
        """Records this rank uses per epoch (before batching)."""
        if self.drop_last:
            return self.n_records // self.world
        return -(-self.n_records // self.world)

    def order(self, epoch: int) -> np.ndarray:
        """This rank's record order for an epoch (int64), before batching."""
        own = np.arange(self.start, self.stop, dtype=np.int64)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, int(epoch), self.rank])
            own = rng.permutation(own)
        want = len(self)
        if len(own) > want:
            own = own[:want]
        elif len(own) < want:
            own = np.resize(own, want)  # repeats from the start of the order
        return own

    def epoch_order(self, epoch: int, batch_size: int) -> np.ndarray:
        """The order `batches(batch_size)` walks for an epoch: trimmed to whole
        batches (drop_last) or padded up to them (pad)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        order = self.order(epoch)
        if self.drop_last:
            return order[: len(order) // batch_size * batch_size]
        full = -(-len(order) // batch_size) * batch_size
        return order if full == len(order) else np.resize(order, full)

    def num_batches(self, batch_size: int) -> int:
        """Batches per epoch for this rank."""
        if self.drop_last:
            return len(self) // batch_size
        return -(-len(self) // batch_size)

    def batches(self, batch_size: int) -> Iterator[np.ndarray]:
        """Yield the rest of the current epoch as int64 index arrays (views, no copies),
        then move the position to the next epoch. The position advances as each
        batch is handed out, so a checkpoint taken after training on a batch
        resumes after it."""
        epoch = self._epoch
        order = self.epoch_order(epoch, batch_size)
        self._epoch_len = len(order)
        while self._offset < len(order) and self._epoch == epoch:
            lo = self._offset
            batch = order[lo : lo + batch_size]
            self._offset = lo + len(batch)
            yield batch
        if self._epoch == epoch:
            self._epoch, self._offset = epoch + 1, 0

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, records of this epoch already handed out); an epoch handed out to
        the end reads as (epoch + 1, 0)."""
        if self._epoch_len is not None and self._offset >= self._epoch_len:
            return self._epoch + 1, 0
        return self._epoch, self._offset

    def seek(self, epoch: int, offset: int = 0) -> None:
        """Continue from a saved position: the next batch starts at `offset`."""
        if epoch < 0 or offset < 0:
            raise ValueError(f"position must be non-negative, got ({epoch}, {offset})")
        self._epoch, self._offset = int(epoch), int(offset)
        self._epoch_len = None

    def __repr__(self) -> str:
        return (
            f"Sampler({self.n_records} records, rank {self.rank}/{self.world}, "
            f"records {self.start}..{self.stop}, seed={self.seed}, shuffle={self.shuffle}, "
            f"drop_last={self.drop_last}, position={self.position})"
        )
