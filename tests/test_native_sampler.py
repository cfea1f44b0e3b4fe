"""Sampler: deterministic per-epoch order, split across ranks, drop-last or pad, resume."""

import numpy as np
import pytest

from native import Sampler


def epoch(s, bs):
    return [b.copy() for b in s.batches(bs)]


def test_deterministic_and_new_order_each_epoch():
    a, b = Sampler(100, seed=7), Sampler(100, seed=7)
    e0a, e0b = epoch(a, 10), epoch(b, 10)
    assert all(np.array_equal(x, y) for x, y in zip(e0a, e0b, strict=True))
    e1 = epoch(a, 10)
    assert not np.array_equal(np.concatenate(e0a), np.concatenate(e1))
    assert sorted(np.concatenate(e1).tolist()) == list(range(100))
    c = Sampler(100, seed=8)
    assert not np.array_equal(np.concatenate(epoch(c, 10)), np.concatenate(e0a))
    assert all(b.dtype == np.int64 for b in e0a)


def test_no_shuffle_is_in_order():
    s = Sampler(10, seed=0, shuffle=False, drop_last=False)
    assert np.concatenate(epoch(s, 5)).tolist() == list(range(10))


@pytest.mark.parametrize("n,world", [(100, 4), (103, 4), (10, 3), (7, 7)])
def test_ranks_own_disjoint_contiguous_blocks(n, world):
    seen = []
    for rank in range(world):
        s = Sampler(n, seed=1, rank=rank, world=world, drop_last=False)
        own = np.concatenate(epoch(s, 1))
        assert own.min() >= s.start and own.max() < s.stop  # only its own part
        seen.append(set(own.tolist()))
        assert len(own) == -(-n // world)  # every rank: the same count (padded)
    assert set().union(*seen) == set(range(n))  # every record somewhere
    for i in range(world):
        for j in range(i + 1, world):
            assert not seen[i] & seen[j]


def test_drop_last_and_pad_counts():
    # 103 records, 4 ranks: blocks of 25 or 26; batches of 8.
    for rank in range(4):
        d = Sampler(103, seed=0, rank=rank, world=4, drop_last=True)
        bd = epoch(d, 8)
        assert len(d) == 25 and d.num_batches(8) == 3 == len(bd)
        assert all(len(b) == 8 for b in bd)
        p = Sampler(103, seed=0, rank=rank, world=4, drop_last=False)
        bp = epoch(p, 8)
        assert len(p) == 26 and p.num_batches(8) == 4 == len(bp)
        assert all(len(b) == 8 for b in bp)  # padded: every batch full
        flat = np.concatenate(bp)
        assert set(flat.tolist()) == set(range(p.start, p.stop))


def test_drop_last_drops_different_records_each_epoch():
    s = Sampler(11, seed=3, rank=1, world=2)  # block 5..10 holds 6 records, 5 are used
    assert (s.start, s.stop, len(s)) == (5, 11, 5)
    dropped = set()
    for _ in range(20):
        used = set(np.concatenate(epoch(s, 5)).tolist())
        assert len(used) == 5
        dropped |= set(range(s.start, s.stop)) - used
    assert len(dropped) > 1


def test_resume_mid_epoch_gives_the_same_batches():
    ref = Sampler(200, seed=11, rank=1, world=3)
    full = [epoch(ref, 16) for _ in range(3)]
    s = Sampler(200, seed=11, rank=1, world=3)
    it = s.batches(16)
    for _ in range(2):
        next(it)
    pos = s.position
    assert pos == (0, 32)
    resumed = Sampler(200, seed=11, rank=1, world=3)
    resumed.seek(*pos)
    rest = epoch(resumed, 16)
    assert all(np.array_equal(a, b) for a, b in zip(rest, full[0][2:], strict=True))
    assert resumed.position == (1, 0)
    nxt = epoch(resumed, 16)
    assert all(np.array_equal(a, b) for a, b in zip(nxt, full[1], strict=True))


def test_position_after_last_batch_reads_as_next_epoch():
    s = Sampler(32, seed=0)
    batches = list(s.batches(8))
    assert len(batches) == 4 and s.position == (1, 0)
    s = Sampler(32, seed=0)
    for i, _ in enumerate(s.batches(8)):
        if i == 3:
            assert s.position == (1, 0)  # checkpoint taken inside the last step
    s.seek(5, 100)  # beyond the epoch: nothing left, moves on
    assert list(s.batches(8)) == [] and s.position == (6, 0)


def test_bad_arguments():
    for kwargs in ({"rank": 2, "world": 2}, {"rank": -1}, {"world": 0}, {"seed": -1}):
        with pytest.raises(ValueError):
            Sampler(10, **{"seed": 0, **kwargs})
    with pytest.raises(ValueError, match="cannot be split"):
        Sampler(3, seed=0, rank=0, world=4)
    with pytest.raises(ValueError):
        next(Sampler(10, seed=0).batches(0))
    with pytest.raises(ValueError):
        Sampler(10, seed=0).seek(-1, 0)
