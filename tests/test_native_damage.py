"""Damaged input: every kind raises ShardError naming the file and record or byte offset; fuzzed too."""

import json
import shutil
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import native

SCHEMA = {"image": ("uint8", (3, 4, 4)), "label": ("int64", ())}
N = 20
HEADER, FIELD, ENTRY, TRAILER = 64, 128, 16, 32


def records(n=N, first=0):
    img = (np.arange(n * 48, dtype=np.int64).reshape(n, 3, 4, 4) * 7 + first).astype(np.uint8)
    return {"image": img, "label": np.arange(first, first + n, dtype=np.int64)}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "good.shard"
    with native.ShardWriter(path, SCHEMA) as w:
        w.write(records())
    return path.read_bytes()


def u64(b, at):
    return struct.unpack_from("<Q", b, at)[0]


def reseal(b: bytearray) -> bytearray:
    """Recompute header, index and trailer checksums after a deliberate edit, so the
    structural check under test (not a checksum) must catch it."""
    nf = struct.unpack_from("<I", b, 16)[0]
    crc = native.crc32c(bytes(b[HEADER : HEADER + nf * FIELD]), native.crc32c(bytes(b[:60])))
    struct.pack_into("<I", b, 60, crc)
    t = len(b) - TRAILER
    count, index = u64(b, t + 8), u64(b, t + 16)
    if index + count * ENTRY <= len(b):
        struct.pack_into("<I", b, t + 24, native.crc32c(bytes(b[index : index + count * ENTRY])))
    struct.pack_into("<I", b, t + 28, native.crc32c(bytes(b[t : t + 28])))
    return b


def open_error(tmp_path, data, name="bad.shard"):
    path = tmp_path / name
    path.write_bytes(bytes(data))
    with pytest.raises(native.ShardError) as info:
        native.ShardReader(path)
    err = info.value
    assert str(path) in str(err) and err.path == str(path)
    return err


def index_at(good):
    return u64(good, 48)


def test_truncated(tmp_path, good):
    for cut in (0, 10, 95, len(good) // 2, len(good) - 1):
        err = open_error(tmp_path, good[:cut])
        assert "truncated" in str(err)
        assert err.offset is not None


def test_bad_magic(tmp_path, good):
    b = bytearray(good)
    b[:8] = b"NOTSHARD"
    err = open_error(tmp_path, b)
    assert "bad magic" in str(err) and err.offset == 0


def test_unknown_version(tmp_path, good):
    b = bytearray(good)
    struct.pack_into("<I", b, 8, 7)
    err = open_error(tmp_path, reseal(b))
    assert "version 7" in str(err) and err.offset == 8


def test_header_damage(tmp_path, good):
    b = bytearray(good)
    b[HEADER + 2] ^= 1  # inside the field table
    err = open_error(tmp_path, b)
    assert "header checksum" in str(err) and err.offset == 60


def test_index_offset_outside_file(tmp_path, good):
    ix = index_at(good)
    for value in (len(good) + 100, 2**63, 8):
        b = bytearray(good)
        struct.pack_into("<Q", b, ix + 3 * ENTRY, value)
        err = open_error(tmp_path, reseal(b))
        assert err.record == 3 and err.offset == ix + 3 * ENTRY
        assert "record 3" in str(err) and "outside" in str(err)


def test_unsorted_and_overlapping_offsets(tmp_path, good):
    ix = index_at(good)
    b = bytearray(good)  # swap entries 5 and 6
    b[ix + 5 * ENTRY : ix + 7 * ENTRY] = good[ix + 6 * ENTRY : ix + 7 * ENTRY] + good[ix + 5 * ENTRY : ix + 6 * ENTRY]
    err = open_error(tmp_path, reseal(b))
    assert err.record == 6 and "overlaps or precedes" in str(err)
    b = bytearray(good)
    struct.pack_into("<Q", b, ix + 9 * ENTRY, u64(good, ix + 8 * ENTRY) + 1)
    err = open_error(tmp_path, reseal(b))
    assert err.record == 9 and err.offset == ix + 9 * ENTRY


def test_record_checksum_mismatch(tmp_path, good):
    ix = index_at(good)
    off = u64(good, ix + 11 * ENTRY)
    b = bytearray(good)
    b[off + 5] ^= 0xFF
    path = tmp_path / "data.shard"
    path.write_bytes(bytes(b))
    r = native.ShardReader(path)  # structure is intact: opens
    np.testing.assert_array_equal(r.read([10, 12])["label"], [10, 12])
    with pytest.raises(native.ShardError) as info:
        r.read([3, 11])
    err = info.value
    assert err.record == 11 and err.offset == off and "checksum mismatch" in str(err)
    assert str(path) in str(err)
    with pytest.raises(native.ShardError, match="record 11"):
        r.verify()
    with pytest.raises(native.ShardError, match="record 11"):
        native.ShardReader(path, verify="always").read([11])
    # verify="never" trusts the bytes: the caller asked for it.
    assert native.ShardReader(path, verify="never").read([11])["label"][0] == 11


def test_empty_shard(tmp_path, good):
    data = u64(good, 40)
    b = bytearray(good[:data]) + bytearray(good[-TRAILER:])
    struct.pack_into("<Q", b, 24, 0)
    struct.pack_into("<Q", b, 48, data)
    struct.pack_into("<QQ", b, data + 8, 0, data)
    err = open_error(tmp_path, reseal(b))
    assert "empty shard" in str(err)


def test_unfinished_writer_leaves_nothing_that_opens(tmp_path):
    w = native.ShardWriter(tmp_path / "w.shard", SCHEMA)
    w.write(records())
    (tmp_file,) = tmp_path.iterdir()
    with pytest.raises(native.ShardError, match="bad magic"):
        native.ShardReader(tmp_file)  # the temp file has no header yet
    w.abort()


def test_index_out_of_range(tmp_path, good):
    path = tmp_path / "ok.shard"
    path.write_bytes(good)
    r = native.ShardReader(path)
    out = r.empty(3)
    out["label"][:] = -1
    for bad in ([0, N], [-1], [2**62], np.array([2**63 + 5], dtype=np.uint64)):
        with pytest.raises(native.ShardError, match="out of range") as info:
            r.read(bad, out=out)
        assert str(path) in str(info.value)
    assert (out["label"] == -1).all()  # nothing was written


def test_missing_file(tmp_path):
    with pytest.raises(native.ShardError, match="cannot open"):
        native.ShardReader(tmp_path / "nope.shard")
    with pytest.raises(native.ShardError, match="not a regular file"):
        native.ShardReader(tmp_path)


# ---- data sets -----------------------------------------------------------


def make_dataset(root, n=50, per=20):
    with native.DatasetWriter(root, SCHEMA, shard_records=per) as w:
        w.write(records(n))
    return root


def test_dataset_manifest_missing_or_malformed(tmp_path):
    root = make_dataset(tmp_path / "ds")
    m = root / "manifest.json"
    good = m.read_text()
    with pytest.raises(native.ShardError, match="no such data set"):
        native.open_dataset(tmp_path / "absent")
    m.unlink()
    with pytest.raises(native.ShardError, match="manifest.json: missing"):
        native.open_dataset(root)
    for text in (
        "{",
        "[]",
        '{"format": "x"}',
        good.replace('"version": 1', '"version": 9'),
        good.replace('"records": 50', '"records": "50"'),
    ):
        m.write_text(text)
        with pytest.raises(native.ShardError, match="manifest"):
            native.open_dataset(root)


def edit_manifest(root, fn):
    m = root / "manifest.json"
    obj = json.loads(m.read_text())
    fn(obj)
    m.write_text(json.dumps(obj))


def test_manifest_disagrees_with_shards(tmp_path):
    cases = {
        "records": lambda o: o["shards"][1].__setitem__("records", 19),
        "bytes": lambda o: o["shards"][2].__setitem__("bytes", 1),
        "total": lambda o: o.__setitem__("records", 51),
        "file": lambda o: o["shards"][0].__setitem__("file", "gone.shard"),
        "traversal": lambda o: o["shards"][0].__setitem__("file", "../x.shard"),
        "schema": lambda o: o["schema"][1].__setitem__("dtype", "int32"),
        "entry": lambda o: o["shards"][0].pop("crc32c"),
        "noshards": lambda o: o.__setitem__("shards", []),
    }
    for name, fn in cases.items():
        root = make_dataset(tmp_path / name)
        edit_manifest(root, fn)
        with pytest.raises(native.ShardError) as info:
            native.open_dataset(root)
        assert str(root) in str(info.value), name


def test_manifest_checksum_checked_by_verify(tmp_path):
    root = make_dataset(tmp_path / "ds")
    edit_manifest(root, lambda o: o["shards"][1].__setitem__("crc32c", "00000000"))
    ds = native.open_dataset(root)
    with pytest.raises(native.ShardError, match="shard-00001.shard: file checksum"):
        ds.verify()


def test_schema_mismatch_between_shards(tmp_path):
    root = make_dataset(tmp_path / "ds")
    other = {"image": ("uint8", (3, 4, 4)), "label": ("int32", ())}
    with native.ShardWriter(root / "shard-00001.shard", other) as w:
        w.write({"image": records(20)["image"], "label": np.arange(20, dtype=np.int32)})
    size = (root / "shard-00001.shard").stat().st_size
    edit_manifest(root, lambda o: o["shards"][1].__setitem__("bytes", size))
    with pytest.raises(native.ShardError, match="shard-00001.shard: schema mismatch"):
        native.open_dataset(root)


def test_damaged_shard_in_dataset_names_the_shard(tmp_path):
    root = make_dataset(tmp_path / "ds")
    p = root / "shard-00002.shard"
    b = bytearray(p.read_bytes())
    b[0] = 0
    p.write_bytes(bytes(b))
    with pytest.raises(native.ShardError, match="shard-00002.shard: bad magic"):
        native.open_dataset(root)


def test_dataset_index_out_of_range(tmp_path):
    root = make_dataset(tmp_path / "ds")
    ds = native.open_dataset(root)
    with pytest.raises(native.ShardError, match="record index 50 .*holds 50 records") as info:
        ds.read([3, 50])
    assert str(info.value).startswith(f"{root}:") and info.value.record == 50


# ---- fuzz ------------------------------------------------------------------

FUZZ_SETTINGS = settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

edits = st.lists(
    st.tuples(st.integers(min_value=0, max_value=10**6), st.integers(0, 255)),
    min_size=1,
    max_size=8,
)


def check_outcome(path, expected):
    """Either the data read is exactly right, or the damage surfaced as a ShardError."""
    try:
        r = native.ShardReader(path)
    except native.ShardError:
        return "refused"
    try:
        idx = np.arange(len(r))
        b = r.read(idx)
    except native.ShardError:
        return "read error"
    if r.schema != native.parse_schema(SCHEMA):
        # Only a resealed edit gets here: a consistent header describing the same
        # bytes differently (int8 instead of uint8, say). Reading it must still be safe.
        for f in r.schema:
            assert b[f.name].shape == (len(r), *f.shape)
        return "reinterpreted"
    assert len(r) == N
    np.testing.assert_array_equal(b["image"], expected["image"])
    np.testing.assert_array_equal(b["label"], expected["label"])
    return "ok"


@FUZZ_SETTINGS
@given(edits=edits, cut=st.one_of(st.none(), st.integers(0, 10**6)), seal=st.booleans())
def test_fuzz_mutated_and_truncated_shards(tmp_path, good, edits, cut, seal):
    """Random byte edits and truncation; with seal=True the header, index and trailer
    checksums are recomputed afterwards, so the structural checks face the edits
    (offsets, counts, shapes) directly instead of a checksum catching them first."""
    b = bytearray(good)
    for pos, value in edits:
        b[pos % len(b)] = value
    if cut is not None:
        b = b[: cut % (len(b) + 1)]
    if seal and len(b) >= HEADER + TRAILER:
        nf = struct.unpack_from("<I", b, 16)[0]
        if HEADER + min(nf, 64) * FIELD + TRAILER <= len(b):
            struct.pack_into("<I", b, 16, min(nf, 64))
            b = reseal(b)
    path = tmp_path / "fuzz.shard"
    path.write_bytes(bytes(b))
    check_outcome(path, records())


@FUZZ_SETTINGS
@given(
    entry=st.integers(0, N - 1),
    field=st.sampled_from([0, 8, 12]),
    value=st.integers(0, 2**64 - 1),
)
def test_fuzz_index_entries(tmp_path, good, entry, field, value):
    """Arbitrary values in an index entry (offset, length, checksum), index resealed."""
    b = bytearray(good)
    at = index_at(good) + entry * ENTRY + field
    if field == 0:
        struct.pack_into("<Q", b, at, value)
    else:
        struct.pack_into("<I", b, at, value & 0xFFFFFFFF)
    path = tmp_path / "fuzz.shard"
    path.write_bytes(bytes(reseal(b)))
    check_outcome(path, records())


@FUZZ_SETTINGS
@given(data=st.binary(min_size=0, max_size=600))
def test_fuzz_arbitrary_bytes(tmp_path, data):
    path = tmp_path / "junk.shard"
    path.write_bytes(b"MPSHARD\0" + data if data[:1] == b"\0" else data)
    with pytest.raises(native.ShardError):
        native.ShardReader(path)


def test_fuzz_copy_of_dataset_directory_survives(tmp_path):
    """A data set copied elsewhere still opens: the manifest holds names, not paths."""
    root = make_dataset(tmp_path / "a")
    shutil.copytree(root, tmp_path / "b")
    assert len(native.open_dataset(tmp_path / "b")) == 50


def test_file_truncated_while_mapped(tmp_path):
    """Another program shortens the file in place while a reader has it mapped: the
    lost pages raise SIGBUS, which the reader turns into a ShardError, not a crash."""
    path = tmp_path / "shrink.shard"
    n = 40000  # about 2.2 MB
    with native.ShardWriter(path, SCHEMA) as w:
        w.write(records(n))
    r = native.ShardReader(path, verify="never")
    import os

    os.truncate(path, 100_000)
    assert r.read([0, 1])["label"].tolist() == [0, 1]
    with pytest.raises(native.ShardError, match="truncated while in use") as info:
        r.read([0, n - 1])
    assert str(path) in str(info.value) and info.value.offset >= 100_000
    with pytest.raises(native.ShardError, match="truncated while in use"):
        r.verify()
    assert r.read([2])["label"].tolist() == [2]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("fuzzds") / "ds")


@FUZZ_SETTINGS
@given(
    path=st.lists(
        st.sampled_from(
            [
                "schema",
                "shards",
                "records",
                0,
                1,
                2,
                "name",
                "dtype",
                "shape",
                "file",
                "bytes",
                "crc32c",
                "format",
                "version",
            ]
        ),
        min_size=1,
        max_size=3,
    ),
    value=json_values,
)
def test_fuzz_manifest(tmp_path, dataset_dir, path, value):
    """Any value anywhere in the manifest: the data set opens and reads right, or ShardError."""
    root = tmp_path / "ds"
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(dataset_dir, root)
    obj = json.loads((root / "manifest.json").read_text())
    node = obj
    for key in path[:-1]:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return
    try:
        node[path[-1]] = value
    except (IndexError, TypeError):
        return
    (root / "manifest.json").write_text(json.dumps(obj))
    try:
        ds = native.open_dataset(root)
    except native.ShardError:
        return
    b = ds.read(np.arange(len(ds)))
    np.testing.assert_array_equal(b["label"], records(50)["label"])


def test_manifest_values_of_the_wrong_type(tmp_path):
    cases = [
        lambda o: o["shards"][0].__setitem__("bytes", float("inf")),
        lambda o: o["shards"][0].__setitem__("records", True),
        lambda o: o["shards"][0].__setitem__("records", 20.0),
        lambda o: o.__setitem__("records", True),
        lambda o: o["schema"][0].__setitem__("dtype", None),
        lambda o: o["schema"][0].__setitem__("dtype", {}),
        lambda o: o["schema"][0].__setitem__("shape", [3, 4.0, 4]),
        lambda o: o["schema"][0].__setitem__("shape", "344"),
        lambda o: o["schema"].__setitem__(0, 5),
        lambda o: o["shards"].__setitem__(0, "shard-00000.shard"),
    ]
    for i, fn in enumerate(cases):
        root = make_dataset(tmp_path / f"c{i}")
        m = root / "manifest.json"
        obj = json.loads(m.read_text())
        fn(obj)
        m.write_text(json.dumps(obj))
        with pytest.raises(native.ShardError) as info:
            native.open_dataset(root)
        assert str(root) in str(info.value), i


def test_check_command(tmp_path, good, capsys):
    from native import check

    path = tmp_path / "ok.shard"
    path.write_bytes(good)
    assert check.main([str(path), "--verify"]) == 0
    out = capsys.readouterr().out
    assert f"{N} records of 56 bytes" in out and "field 'label': int64 ()" in out
    root = make_dataset(tmp_path / "ds")
    assert check.main([str(root)]) == 0
    assert "50 records in 3 shard(s)" in capsys.readouterr().out
    b = bytearray(good)
    b[u64(good, 40) + 56 * 4 + 1] ^= 1
    path.write_bytes(bytes(b))
    assert check.main([str(path)]) == 0  # structure intact
    assert check.main([str(path), "--verify"]) == 1
    err = capsys.readouterr().err
    assert "damaged" in err and "record 4" in err and str(path) in err
