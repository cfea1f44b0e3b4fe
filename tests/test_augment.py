"""Augmentation and normalization in the loader (issue 27, part 3): native.Augment, the
[data] keys augment/mean/std, TrainBatches, test_batches and Stannis's BatchStream.

What must hold: a sample's augmentation is a pure function of (seed, epoch, record), so it
is the same in any batch and any order (replays, resumed runs, mirrors); the vectorized
crop and flips equal a slow per-sample reference bit for bit; normalization is the
formula; and with none of the keys set the tensors are exactly today's x.float()/255.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import native
from mpipipe.core.run import batches
from mpipipe.core.run.configfile import ConfigError, load_config
from mpipipe.pipeline.config import PIPELINE_DEFAULTS

RECORDS = 200
SHAPE = (3, 10, 12)  # not square: a crop or flip that mixes up H and W is caught


def _images(n: int, shape: tuple[int, ...] = SHAPE, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, *shape), dtype=np.uint8)


@pytest.fixture(scope="module")
def cifarish(tmp_path_factory) -> Path:
    """A small uint8 data set (train/ and test/) whose label is the record number, so a
    batch says which records it holds."""
    root = tmp_path_factory.mktemp("augment") / "set"
    schema = {"image": ("uint8", SHAPE), "label": ("int64", ())}
    for split, n, seed in (("train", RECORDS, 1), ("test", 50, 2)):
        with native.DatasetWriter(root / split, schema, shard_records=64) as w:
            w.write({"image": _images(n, seed=seed), "label": np.arange(n, dtype=np.int64)})
    return root


def _all(path: Path, split: str) -> np.ndarray:
    ds = native.open_dataset(path / split)
    try:
        return ds.read(np.arange(len(ds), dtype=np.int64))["image"]
    finally:
        ds.close()


def _reference(aug: native.Augment, x: np.ndarray, indices: np.ndarray, epoch) -> np.ndarray:
    """The slow way, one sample at a time, ops in list order: np.pad, slice, flip; then
    (x/255 - mean)/std in float32 as written (x - mean)/std for float images."""
    d = aug.draws(epoch, indices)
    out = []
    for i in range(len(x)):
        img = x[i]
        for op in aug.ops:
            if op.name == "random_crop":
                p, (h, w) = op.arg, img.shape[1:]
                padded = np.pad(img, ((0, 0), (p, p), (p, p)))
                img = padded[:, d.dy[i]:d.dy[i] + h, d.dx[i]:d.dx[i] + w]
            elif op.name == "hflip" and d.hflip[i]:
                img = img[:, :, ::-1]
            elif op.name == "vflip" and d.vflip[i]:
                img = img[:, ::-1, :]
        y = img.astype(np.float32)
        if x.dtype == np.uint8:
            y = y / np.float32(255)
        if aug.mean is not None:
            y = (y - aug.mean[:, None, None]) / aug.std[:, None, None]
        out.append(y)
    return np.stack(out)


# ---- the hash ----------------------------------------------------------------------------

def _splitmix(x: int) -> int:
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


@pytest.mark.timeout(60)
def test_mix64_is_splitmix64():
    # splitmix64 seeded with 0 gives 0xE220A8397B1DCDAF first: the published value
    assert int(native.mix64(0)) == 0xE220A8397B1DCDAF
    xs = np.random.default_rng(3).integers(0, 2**63, 100, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    assert [int(v) for v in native.mix64(xs)] == [_splitmix(int(v)) for v in xs]


@pytest.mark.timeout(60)
def test_keys_are_a_pure_function_of_seed_epoch_and_index():
    idx = np.arange(1000)
    k = native.sample_keys(7, 2, idx)
    assert np.array_equal(k, native.sample_keys(7, 2, idx))
    assert np.array_equal(k[::-1], native.sample_keys(7, 2, idx[::-1]))  # order does not matter
    assert np.array_equal(k[5:9], native.sample_keys(7, np.full(4, 2), idx[5:9]))
    assert len(set(k.tolist())) == 1000  # no collisions among consecutive records
    assert not np.any(k == native.sample_keys(8, 2, idx))
    assert not np.any(k == native.sample_keys(7, 3, idx))


# ---- determinism -------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_same_seed_epoch_index_same_sample_in_any_batch_and_order():
    aug = native.Augment(["random_crop:3", "hflip", "vflip"], [0.5, 0.4, 0.3], [0.2, 0.25, 0.3], seed=11)
    x = _images(RECORDS)
    whole = aug.apply(x, np.arange(RECORDS), 4)
    rng = np.random.default_rng(5)
    order = rng.permutation(RECORDS)
    out = np.empty((32, *SHAPE), np.float32)  # one reused buffer, batches of any size
    for lo in range(0, RECORDS, 32):
        idx = order[lo:lo + 32]
        got = aug.apply(x[idx], idx, 4, out=out)
        assert np.array_equal(got, whole[idx])
    # one sample alone, from a fresh instance
    assert np.array_equal(native.Augment(["random_crop:3", "hflip", "vflip"], [0.5, 0.4, 0.3],
                                         [0.2, 0.25, 0.3], seed=11).apply(x[17:18], [17], 4), whole[17:18])


@pytest.mark.timeout(60)
def test_other_seeds_and_epochs_give_other_samples():
    x = _images(RECORDS)
    idx = np.arange(RECORDS)
    ops = ["random_crop:4", "hflip"]
    base = native.Augment(ops, seed=1).apply(x, idx, 0)
    for other in (native.Augment(ops, seed=2).apply(x, idx, 0), native.Augment(ops, seed=1).apply(x, idx, 1)):
        same = [np.array_equal(a, b) for a, b in zip(base, other, strict=True)]
        assert sum(same) < RECORDS // 4  # 1 in 162 alike by chance, not most
    d = native.Augment(ops, seed=1).draws(0, np.arange(20000))
    assert set(np.unique(d.dy)) == set(range(9)) and set(np.unique(d.dx)) == set(range(9))
    assert 0.45 < d.hflip.mean() < 0.55 and not d.vflip.any()


# ---- the vectorized ops against the slow reference ---------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("ops", [
    ["random_crop:4", "hflip"],
    ["hflip", "random_crop:2"],
    ["vflip", "random_crop:3", "hflip"],
    ["random_crop:1", "vflip"],
    ["hflip"],
    ["vflip", "hflip"],
    ["random_crop:0"],
    ["random_crop:9"],
])
@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_crop_and_flips_equal_the_slow_reference_bit_for_bit(ops, dtype):
    x = _images(96)
    if dtype == "float32":
        x = (x / 255).astype(np.float32)
    idx = np.random.default_rng(2).permutation(1000)[:96]
    epochs = np.arange(96) % 3  # a batch that spans epochs
    for stats in (((), ()), ([0.5, 0.25, 0.1], [0.2, 0.5, 1.5])):
        aug = native.Augment(ops, *stats, seed=9)
        got = aug.apply(x, idx, epochs)
        assert got.dtype == np.float32 and got.shape == x.shape
        assert np.array_equal(got, _reference(aug, x, idx, epochs))


@pytest.mark.timeout(60)
def test_normalization_is_the_formula_and_padding_is_a_zero_pixel():
    x = _images(64)
    mean, std = [0.4914, 0.4822, 0.4465], [0.247, 0.243, 0.261]
    aug = native.Augment([], mean, std)
    want = (x.astype(np.float64) / 255 - np.array(mean)[:, None, None]) / np.array(std)[:, None, None]
    assert np.abs(aug.normalize(x) - want).max() <= 1e-6
    assert np.abs(aug.apply(x, np.arange(64), 0) - want).max() <= 1e-6
    # a crop's padded border is a zero pixel, normalized: -mean/std
    crop = native.Augment(["random_crop:4"], mean, std, seed=0)
    d = crop.draws(0, np.arange(64))
    i = int(np.flatnonzero(d.dy == 0)[0])  # 4 padded rows on top
    got = crop.apply(x, np.arange(64), 0)
    assert np.abs(got[i, :, :4, :] - (-np.array(mean) / np.array(std))[:, None, None]).max() <= 1e-6


@pytest.mark.timeout(60)
def test_without_augment_mean_std_the_batches_are_todays_bit_for_bit(cifarish):
    every_byte = np.arange(256, dtype=np.uint8).reshape(1, 1, 16, 16)
    today = torch.from_numpy(every_byte).float().div_(255.0)
    assert torch.equal(torch.from_numpy(native.Augment().apply(every_byte, [0], 0)), today)
    assert torch.equal(torch.from_numpy(native.Augment().normalize(every_byte)), today)
    # the readers themselves keep the old path
    plain = batches.TrainBatches(cifarish, 32, seed=4)
    ds = native.open_dataset(cifarish / "train")
    for _ in range(8):
        x, y = plain.next()
        want = torch.from_numpy(ds.read(y.numpy())["image"]).float().div_(255.0)
        assert x.dtype == torch.float32 and torch.equal(x, want)
    ds.close()
    test = np.concatenate([x.numpy() for x, _ in batches.test_batches(cifarish, 16)])
    assert np.array_equal(test, torch.from_numpy(_all(cifarish, "test")).float().div_(255.0).numpy())


# ---- errors ------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("ops,named", [
    (["random_crop:-1"], "random_crop:-1"),
    (["random_crop:x"], "random_crop:x"),
    (["random_crop"], "random_crop"),
    (["hflip:3"], "hflip:3"),
    (["rotate:10"], "rotate:10"),
    (["hflip", "hflip"], "twice"),
    ([4], "4"),
])
def test_bad_ops_are_one_line_errors_naming_the_op_and_the_known_ones(ops, named):
    with pytest.raises(native.AugmentError) as e:
        native.Augment(ops)
    line = str(e.value)
    assert "\n" not in line and named in line
    assert all(k in line for k in ("random_crop:P", "hflip", "vflip"))
    assert isinstance(e.value, ValueError)
    # through the configuration: a ConfigError (and a DataError) naming the key
    cfg = load_config(None, [f"data.augment={ops!r}".replace("'", '"')], PIPELINE_DEFAULTS)
    with pytest.raises(batches.TransformError) as e2:
        batches.transforms(cfg["data"])
    assert isinstance(e2.value, ConfigError) and isinstance(e2.value, batches.DataError)
    assert str(e2.value).startswith("data.augment = ") and "\n" not in str(e2.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mean,std,shape,words", [
    ([0.5], [], None, "mean and std go together"),
    ([0.5, 0.5], [0.2, 0.0], None, "std must be positive"),
    (["a"], [0.2], None, "mean must be a list of numbers"),
    ([0.5, 0.5], [0.2, 0.2], (3, 8, 8), "have 2 values each but the images have 3 channels"),
])
def test_bad_mean_and_std_are_one_line_errors(mean, std, shape, words):
    with pytest.raises(batches.TransformError) as e:
        batches.transforms({"augment": [], "mean": mean, "std": std}, shape)
    assert words in str(e.value) and "\n" not in str(e.value) and "data.mean" in str(e.value)


@pytest.mark.timeout(60)
def test_the_channel_count_is_checked_when_the_data_set_is_known(cifarish):
    with pytest.raises(batches.TransformError,
                       match=r"^data\.mean, data\.std: mean and std have 1 value each but the images have 3 channels"):
        batches.TrainBatches(cifarish, 32, seed=0, mean=[0.5], std=[0.2])
    with pytest.raises(batches.TransformError, match="give P < 10"):
        batches.TrainBatches(cifarish, 32, seed=0, augment=["random_crop:10"])
    with pytest.raises(batches.TransformError):
        next(batches.test_batches(cifarish, 16, mean=[0.5], std=[0.2]))


# ---- the readers -------------------------------------------------------------------------

def _cfg(path: Path, **data_keys) -> dict:
    sets = [f'data.path="{path}"', "data.batch_size=24", "run.seed=5", "model.num_classes=200"]
    sets += [f"data.{k}={v!r}".replace("'", '"') for k, v in data_keys.items()]
    return load_config(None, sets, PIPELINE_DEFAULTS)


@pytest.mark.timeout(120)
def test_train_batches_apply_the_pure_function_of_seed_epoch_and_record(cifarish):
    cfg = _cfg(cifarish, augment=["random_crop:4", "hflip"], mean=[0.5, 0.5, 0.5], std=[0.25, 0.2, 0.3])
    reader = batches.TrainBatches.from_config(cfg)
    aug = native.Augment(["random_crop:4", "hflip"], [0.5, 0.5, 0.5], [0.25, 0.2, 0.3], seed=5)
    raw = _all(cifarish, "train")
    per_epoch = len(reader)  # 200 // 24 = 8 batches: a record is read in epochs 0, 1 and 2
    seen: dict[int, list[np.ndarray]] = {}
    for b in range(3 * per_epoch):
        x, y = reader.next()
        idx = y.numpy()
        assert np.array_equal(x.numpy(), aug.apply(raw[idx], idx, b // per_epoch))
        for row, record in zip(x.numpy(), idx, strict=True):
            seen.setdefault(int(record), []).append(row.copy())
    twice = [v for v in seen.values() if len(v) >= 2]
    assert twice and sum(np.array_equal(v[0], v[1]) for v in twice) < len(twice) // 4  # new draws each epoch


@pytest.mark.timeout(120)
@pytest.mark.parametrize("drop_last", [True, False])
def test_a_reader_resumed_with_seek_batch_gives_the_batches_of_one_that_read_through(cifarish, drop_last):
    kw = {"seed": 3, "drop_last": drop_last, "augment": ["random_crop:2", "vflip", "hflip"],
          "mean": [0.5, 0.4, 0.3], "std": [0.3, 0.3, 0.3]}
    through = batches.TrainBatches(cifarish, 24, **kw)
    expected = [tuple(t.clone() for t in through.next()) for _ in range(3 * len(through))]
    for start in (0, 5, len(through) - 1, len(through), 2 * len(through) + 3):
        ahead = batches.TrainBatches(cifarish, 24, **kw)
        ahead.seek_batch(start)
        for want_x, want_y in expected[start:start + 4]:
            x, y = ahead.next()
            assert torch.equal(y, want_y) and torch.equal(x, want_x)
    # seek to a saved position (checkpoints): the same
    again = batches.TrainBatches(cifarish, 24, **kw)
    for _ in range(len(through) + 2):
        again.next()
    pos = again.position
    resumed = batches.TrainBatches(cifarish, 24, **kw)
    resumed.seek(*pos)
    assert all(torch.equal(a, b) for a, b in zip(resumed.next(), again.next(), strict=True))


@pytest.mark.timeout(120)
def test_float_images_digits_are_augmented_without_the_byte_scale(digits):
    reader = batches.TrainBatches(digits, 32, seed=0, augment=["random_crop:1", "hflip"], mean=[0.5], std=[0.25])
    aug = native.Augment(["random_crop:1", "hflip"], [0.5], [0.25], seed=0)
    ds = native.open_dataset(digits / "train")
    order = native.Sampler(len(ds), seed=0).epoch_order(0, 32)
    x, _ = reader.next()
    idx = order[:32]
    raw = ds.read(idx)["image"]
    assert raw.dtype == np.float32
    assert np.array_equal(x.numpy(), _reference(aug, raw, idx, 0))
    ds.close()


@pytest.mark.timeout(60)
def test_test_batches_normalize_but_do_not_augment(cifarish):
    mean, std = [0.5, 0.4, 0.3], [0.25, 0.2, 0.3]
    got = np.concatenate([x.numpy() for x, _ in batches.test_batches(cifarish, 16, mean=mean, std=std)])
    want = native.Augment([], mean, std).normalize(_all(cifarish, "test"))
    assert np.array_equal(got, want)  # in order, every record once, never cropped or flipped
    ys = np.concatenate([y.numpy() for _, y in batches.test_batches(cifarish, 16, mean=mean, std=std)])
    assert ys.tolist() == list(range(50))


@pytest.mark.timeout(120)
def test_stannis_stream_gives_each_record_its_draws_whatever_the_batch_sizes(cifarish):
    from stannis.data import BatchStream, open_split

    aug = batches.transforms({"augment": ["random_crop:3", "hflip"], "mean": [0.5] * 3, "std": [0.25] * 3},
                          seed=6)
    raw = _all(cifarish, "train")

    def read(sizes: list[int]) -> dict[int, list[np.ndarray]]:
        reader = open_split(cifarish / "train")
        parts = [(reader, np.arange(0, 120)), (reader, np.arange(120, RECORDS))]
        stream = BatchStream(parts, seed=6000 + 1, augment=aug)
        rows: dict[int, list[np.ndarray]] = {}
        for n in sizes:
            x, y = stream.next(n)
            for row, record in zip(x.numpy(), y.numpy(), strict=True):
                rows.setdefault(int(record), []).append(row)
        return rows

    a = read([7] * 57 + [1])  # 400 records: two epochs, batches across the boundary
    b = read([13] * 30 + [10])
    assert a.keys() == b.keys() == set(range(RECORDS))
    for record in range(RECORDS):
        assert len(a[record]) == len(b[record]) == 2
        for epoch in (0, 1):
            want = aug.apply(raw[record:record + 1], [record], epoch)[0]
            assert np.array_equal(a[record][epoch], want) and np.array_equal(b[record][epoch], want)
    with pytest.raises(batches.TransformError, match="have 1 value each but the images have 3 channels"):
        BatchStream([(open_split(cifarish / "train"), np.arange(4))], seed=0,
                    augment=batches.transforms({"mean": [0.5], "std": [0.2]}))
