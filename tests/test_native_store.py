"""Shard store round trips: writer, reader, data sets, output buffers, zero-copy torch views."""

import pickle
import threading

import numpy as np
import pytest

import native
from native import _shard

SCHEMA = {"image": ("uint8", (3, 4, 4)), "label": ("int64", ())}


def make_records(n, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "image": rng.integers(0, 256, (n, 3, 4, 4), dtype=np.uint8),
        "label": np.arange(n, dtype=np.int64) * 3,
    }


def write_shard(path, recs, schema=SCHEMA):
    with native.ShardWriter(path, schema) as w:
        w.write(recs)
    return path


@pytest.fixture
def shard(tmp_path):
    recs = make_records(500)
    return write_shard(tmp_path / "a.shard", recs), recs


def test_crc32c_known_values():
    assert native.crc32c(b"123456789") == 0xE3069283
    assert native.crc32c(bytes(32)) == 0x8A9136AA
    assert native.crc32c(b"6789", native.crc32c(b"12345")) == 0xE3069283
    assert native.crc32c(b"") == 0


def test_round_trip_shuffled_and_in_order(shard):
    path, recs = shard
    r = native.ShardReader(path)
    assert len(r) == 500
    assert [f.name for f in r.schema] == ["image", "label"]
    idx = np.random.default_rng(1).permutation(500)
    b = r.read(idx)
    np.testing.assert_array_equal(b["image"], recs["image"][idx])
    np.testing.assert_array_equal(b["label"], recs["label"][idx])
    b = r.read(np.arange(100, 300))
    np.testing.assert_array_equal(b["label"], recs["label"][100:300])
    rec = r[7]
    assert rec["image"].shape == (3, 4, 4) and int(rec["label"]) == 21
    r.verify()
    r.close()


def test_index_forms(shard):
    path, recs = shard
    r = native.ShardReader(path)
    for idx in (
        [1, 2, 3],
        (1, 2, 3),
        np.array([1, 2, 3], dtype=np.int32),
        np.array([1, 2, 3], dtype=np.uint64),
        np.arange(10)[1:7:2],
    ):
        got = r.read(idx)["label"]
        np.testing.assert_array_equal(got, recs["label"][np.asarray(idx)])
    assert r.read(np.array(5))["label"].tolist() == [15]
    assert r.read([])["image"].shape == (0, 3, 4, 4)
    with pytest.raises(native.ShardError, match="integers"):
        r.read([1.5])
    with pytest.raises(native.ShardError, match="one-dimensional"):
        r.read([[1, 2]])


def test_out_buffers_are_reused_and_wrapped_by_torch_without_copy(shard):
    torch = pytest.importorskip("torch")
    path, recs = shard
    r = native.ShardReader(path)
    out = r.empty(64)
    ptrs = {k: v.ctypes.data for k, v in out.items()}
    for start in (0, 64, 128):
        idx = np.arange(start, start + 64)
        b = r.read(idx, out=out)
        assert b is out  # same dict, same arrays: nothing allocated per batch
        assert {k: v.ctypes.data for k, v in b.items()} == ptrs
        t = torch.from_numpy(b["image"])
        assert t.data_ptr() == ptrs["image"]
        np.testing.assert_array_equal(t.numpy(), recs["image"][idx])
    # A short last batch comes back as views of the same buffers.
    b = r.read(np.arange(490, 500), out=out)
    assert b["label"].shape == (10,) and b["label"].base is out["label"]
    np.testing.assert_array_equal(b["label"], recs["label"][490:])
    assert torch.from_numpy(b["label"]).data_ptr() == ptrs["label"]


def test_bad_out_buffers_are_refused(shard):
    path, _ = shard
    r = native.ShardReader(path)
    idx = np.arange(8)
    good = r.empty(8)
    bad_cases = [
        {"image": good["image"]},  # missing field
        {**good, "label": np.empty(8, np.int32)},  # dtype
        {**good, "image": np.empty((8, 3, 4, 5), np.uint8)},  # shape
        {**good, "image": np.empty((4, 3, 4, 4), np.uint8)},  # too few rows
        {**good, "image": np.empty((8, 4, 4, 3), np.uint8).transpose(0, 3, 1, 2)},  # layout
    ]
    ro = np.empty((8, 3, 4, 4), np.uint8)
    ro.flags.writeable = False
    bad_cases.append({**good, "image": ro})
    for out in bad_cases:
        with pytest.raises(native.ShardError):
            r.read(idx, out=out)


def test_all_dtypes_round_trip(tmp_path):
    schema = {name: (name, (2,)) for name in native.schema.DTYPE_CODES}
    rng = np.random.default_rng(3)
    recs = {}
    for name in native.schema.DTYPE_CODES:
        dt = np.dtype(name)
        if dt.kind == "b":
            recs[name] = rng.integers(0, 2, (9, 2)).astype(bool)
        elif dt.kind == "f":
            recs[name] = rng.standard_normal((9, 2)).astype(dt)
        else:
            info = np.iinfo(dt)
            recs[name] = rng.integers(info.min, info.max, (9, 2), dtype=dt, endpoint=True)
    write_shard(tmp_path / "d.shard", recs, schema)
    r = native.ShardReader(tmp_path / "d.shard")
    b = r.read(np.arange(9)[::-1])
    for name, v in recs.items():
        assert b[name].dtype == v.dtype
        np.testing.assert_array_equal(b[name], v[::-1])


def test_writer_casts_safely_and_checks_batches(tmp_path):
    schema = {"image": ("float32", (1, 2, 2)), "label": ("int64", ())}
    with native.ShardWriter(tmp_path / "c.shard", schema) as w:
        w.write({"image": np.ones((2, 1, 2, 2), np.uint8), "label": np.array([1, 2], np.uint8)})
        w.write_record(image=np.zeros((1, 2, 2)), label=5)
        assert len(w) == 3
        with pytest.raises(native.ShardError, match="cannot store"):
            w.write({"image": np.ones((1, 1, 2, 2)), "label": np.array([1.5])})
        with pytest.raises(native.ShardError, match="shape"):
            w.write({"image": np.ones((1, 2, 2)), "label": np.array([1])})
        with pytest.raises(native.ShardError, match="do not match"):
            w.write({"image": np.ones((1, 1, 2, 2))})
        with pytest.raises(native.ShardError, match="record counts"):
            w.write({"image": np.ones((2, 1, 2, 2)), "label": np.array([1])})
    b = native.ShardReader(tmp_path / "c.shard").read([0, 2])
    assert b["image"].dtype == np.float32 and b["label"].tolist() == [1, 5]


def test_writer_is_atomic(tmp_path):
    path = tmp_path / "x.shard"
    with pytest.raises(RuntimeError):
        with native.ShardWriter(path, SCHEMA) as w:
            w.write(make_records(5))
            assert not path.exists()
            raise RuntimeError("crash in the middle")
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []
    # An existing shard stays readable until the new one is complete.
    write_shard(path, make_records(5))
    w = native.ShardWriter(path, SCHEMA)
    w.write(make_records(9))
    assert len(native.ShardReader(path)) == 5
    w.close()
    assert len(native.ShardReader(path)) == 9
    with pytest.raises(native.ShardError, match="empty shard"):
        native.ShardWriter(tmp_path / "e.shard", SCHEMA).close()
    assert not (tmp_path / "e.shard").exists()


def test_schema_errors(tmp_path):
    for schema in (
        {},
        {"x": ("complex64", ())},
        {"x": ("uint8", (0,))},
        {"x": ("uint8", (1,) * 9)},
        {"": ("uint8", ())},
        [("a", "uint8")],
        {"n" * 40: ("uint8", ())},
    ):
        with pytest.raises((native.ShardError, ValueError)):
            native.ShardWriter(tmp_path / "s.shard", schema)


def test_pickled_reader_reopens(shard):
    path, recs = shard
    r = native.ShardReader(path, verify="always")
    r2 = pickle.loads(pickle.dumps(r))
    np.testing.assert_array_equal(r2.read([4, 2])["label"], recs["label"][[4, 2]])


def test_threads_read_concurrently(shard):
    """Gathers run without the GIL; concurrent readers must still get exact data."""
    path, recs = shard
    r = native.ShardReader(path)
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        out = r.empty(32)
        for _ in range(200):
            idx = rng.integers(0, 500, 32)
            b = r.read(idx, out=out)
            if not np.array_equal(b["label"], recs["label"][idx]):
                errors.append(seed)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_dataset_many_shards(tmp_path):
    recs = make_records(1000, seed=5)
    with native.DatasetWriter(tmp_path / "ds", SCHEMA, shard_records=300) as w:
        w.write({k: v[:450] for k, v in recs.items()})
        w.write({k: v[450:] for k, v in recs.items()})
    ds = native.open_dataset(tmp_path / "ds")
    assert len(ds) == 1000
    assert [s["records"] for s in ds.manifest["shards"]] == [300, 300, 300, 100]
    idx = np.random.default_rng(0).permutation(1000)
    out = ds.empty(1000)
    b = ds.read(idx, out=out)
    np.testing.assert_array_equal(b["image"], recs["image"][idx])
    np.testing.assert_array_equal(ds.read(np.arange(250, 650))["label"], recs["label"][250:650])
    ds.verify()
    ds.prefetch(idx[:50])
    assert "4 shards" in repr(ds)
    ds2 = pickle.loads(pickle.dumps(ds))
    assert len(ds2) == 1000
    # Rewriting with fewer shards removes the stale ones.
    with native.DatasetWriter(tmp_path / "ds", SCHEMA, overwrite=True) as w:
        w.write(recs)
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == ["manifest.json", "shard-00000.shard"]
    with pytest.raises(native.ShardError, match="already exists"):
        native.DatasetWriter(tmp_path / "ds", SCHEMA)


def test_in_order_reads_release_pages_behind(tmp_path):
    recs = make_records(40000)
    path = write_shard(tmp_path / "big.shard", recs)  # about 2.2 MB
    r = native.ShardReader(path, readahead_bytes=64 << 10)
    s = native.Sampler(len(r), seed=0, shuffle=False)
    out = r.empty(1000)
    for idx in s.batches(1000):
        b = r.read(idx, out=out)
        assert b["label"][0] == recs["label"][idx[0]]
    first = r.released_bytes
    assert first > 1_000_000
    for idx in s.batches(1000):  # the next epoch starts over and drops again
        b = r.read(idx, out=out)
        np.testing.assert_array_equal(b["label"], recs["label"][idx])
    assert r.released_bytes > first + 1_000_000


def test_shuffled_reads_release_after_budget(tmp_path):
    recs = make_records(40000)
    path = write_shard(tmp_path / "big.shard", recs)
    r = native.ShardReader(path, release_bytes=300_000)
    s = native.Sampler(len(r), seed=0)
    out = r.empty(1000)
    for idx in s.batches(1000):
        b = r.read(idx, out=out)
        np.testing.assert_array_equal(b["label"], recs["label"][idx])
    assert r.released_bytes > 0
    assert native.ShardReader(path, release_bytes=0).released_bytes == 0


def test_layout_matches_c_core():
    size, layout = _shard.layout([("a", 1, (3,)), ("b", 8, ()), ("c", 10, (2,))])
    assert size == 24 and layout == [(0, 3), (8, 8), (16, 8)]


def test_steady_state_reads_allocate_no_buffers(shard):
    import tracemalloc

    path, _ = shard
    r = native.ShardReader(path)
    s = native.Sampler(len(r), seed=0)
    out = r.empty(50)  # 2.8 KB per batch
    for idx in s.batches(50):
        r.read(idx, out=out)  # warm up
    it = s.batches(50)  # the epoch's order (one array per epoch) is made at the first batch
    r.read(next(it), out=out)
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    for idx in it:
        r.read(idx, out=out)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak - base < 1000  # less than one batch: no buffers, only small views


@pytest.mark.parametrize("verify", ["first", "always", "never"])
def test_cifar_sized_records_every_batch_size(tmp_path, verify):
    """Records with a big field take the grouped copy path (4 records side by side)."""
    rng = np.random.default_rng(9)
    recs = {
        "image": rng.integers(0, 256, (700, 3, 32, 32), dtype=np.uint8),
        "label": rng.integers(0, 10, 700),
    }
    schema = {"image": ("uint8", (3, 32, 32)), "label": ("int64", ())}
    with native.DatasetWriter(tmp_path / "ds", schema, shard_records=300) as w:
        w.write(recs)
    ds = native.open_dataset(tmp_path / "ds", verify=verify)
    out = ds.empty(64)
    for n in (1, 2, 3, 4, 5, 7, 8, 63, 64):
        idx = rng.integers(0, 700, n)
        b = ds.read(idx, out=out)
        np.testing.assert_array_equal(b["image"], recs["image"][idx])
        np.testing.assert_array_equal(b["label"], recs["label"][idx])
    b = ds.read(np.arange(280, 344))  # in order, across a shard boundary
    np.testing.assert_array_equal(b["image"], recs["image"][280:344])


class _Records:
    """A map-style torch dataset over a shard reader (module level: workers pickle it)."""

    def __init__(self, reader):
        self.reader = reader

    def __len__(self):
        return len(self.reader)

    def __getitem__(self, i):
        return self.reader[i]["label"]


@pytest.mark.timeout(120)
def test_dataloader_workers_read_the_shard(shard):
    torch = pytest.importorskip("torch")
    path, recs = shard
    loader = torch.utils.data.DataLoader(
        _Records(native.ShardReader(path)),
        batch_size=50,
        num_workers=2,
        multiprocessing_context="fork",
    )
    got = torch.cat(list(loader)).numpy()
    np.testing.assert_array_equal(got, recs["label"])
