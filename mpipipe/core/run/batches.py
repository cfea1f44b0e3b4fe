"""Mini-batches for the pipeline's first stage, read from the native shard store."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

import native
from mpipipe.core.run.configfile import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["DataError", "DataFault", "TransformError", "image_shape", "run_steps", "TrainBatches",
           "test_batches", "count_test_batches", "check_labels", "verify_split", "damaged", "transforms"]


class DataError(ValueError):
    """The data directory is missing or does not hold an image data set."""


class DataFault(DataError):
    """A fatal data error found while training: a damaged record or a label out of range.

    Not a failure of the rank that found it: every rank stops (mpipipe.core.mpi.stop), none
    takes over. The message is one line naming the shard, the record and the fix.
    """


class TransformError(ConfigError, DataError):
    """``data.augment``, ``data.mean`` or ``data.std`` is wrong, or does not fit the images.

    A configuration error (ConfigError) that is often found only once the data set's
    shape is known (DataError): both the static config checks and the data set checks,
    which already catch one of the two, report it as their one line.
    """


def transforms(d: Mapping[str, Any], shape: Sequence[int] | None = None, *,
               seed: int = 0) -> native.Augment:
    """The ``[data]`` section's augmentation and normalization as a native.Augment.

    ``shape``: the images' (C, H, W), when known: then mean/std must have one value per
    channel and the crop's padding must be smaller than the image. ``seed``: the run's
    seed; with the epoch and the record index it decides each sample's draws.

    Raises:
        TransformError: an unknown op, a bad argument, bad mean/std, or values that do
            not fit ``shape``; one line naming the key and, for an op, the known ones.
    """
    ops, mean, std = d.get("augment", []), d.get("mean", []), d.get("std", [])
    try:
        native.parse_ops(ops)
    except native.AugmentError as e:
        raise TransformError(f"data.augment = {ops!r}: {e}") from None
    try:
        augment = native.Augment(ops, mean, std, seed=seed)
    except native.AugmentError as e:
        raise TransformError(f"data.mean = {mean!r}, data.std = {std!r}: {e}") from None
    if shape is not None:
        try:
            augment.check_shape(shape)
        except native.AugmentError as e:
            key = ("data.mean, data.std" if augment.mean is not None and len(augment.mean) != shape[0]
                   else "data.augment")
            raise TransformError(f"{key}: {e}") from None
    return augment


def fix_hint(directory: str | Path) -> str:
    """How to find every damaged record of a data set, and how to repair it."""
    return (f"to find every damaged record run `python -m native.check --verify {directory}`, "
            "then convert the data again with python -m native.convert")


def damaged(error: native.ShardError, directory: str | Path) -> DataFault:
    """A ShardError met while reading, as a DataFault whose line also says what to do."""
    return DataFault(f"damaged record: {error}; {fix_hint(directory)}")


def _shard_of(dataset: native.Dataset, record: int) -> str:
    """The shard file that holds data set record ``record`` (manifest order)."""
    for entry in dataset.manifest["shards"]:
        if record < entry["records"]:
            return str(dataset.directory / entry["file"])
        record -= entry["records"]
    return str(dataset.directory)


def bad_label(dataset: native.Dataset, indices: np.ndarray, labels: np.ndarray,
              num_classes: int) -> DataFault | None:
    """A DataFault naming the first record whose label is outside [0, num_classes), or None."""
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if not len(bad):
        return None
    i = int(bad[0])
    record = int(indices[i])
    return DataFault(f"{_shard_of(dataset, record)}: record {record} of {dataset.directory} has "
                     f"label {int(labels[i])}, outside 0..{num_classes - 1} (model.num_classes = "
                     f"{num_classes}); set model.num_classes to cover the labels, or "
                     f"{fix_hint(dataset.directory)}")


def check_labels(path: str | Path, num_classes: int) -> str | None:
    """Start-up check of both splits' label range (from each manifest) against the model.

    Returns a note when a manifest predates label ranges (then labels are checked only
    as they are read). Why from the manifest: it costs nothing, and every rank reaches
    the same verdict without a message.

    Raises:
        DataError: a split's labels fall outside [0, num_classes).
    """
    notes = []
    for split in ("train", "test"):
        dataset = _open(path, split)
        known = label_range_ok(dataset, num_classes)
        dataset.close()
        if not known:
            notes.append(split)
    if notes:
        return (f"{path}: the manifest of {' and '.join(notes)} records no label range (converted "
                "by an older version); labels are checked as they are read. Convert again to "
                "check them at start-up")
    return None


def label_range_ok(dataset: native.Dataset, num_classes: int) -> bool:
    """Check the label range a data set's manifest records; False if it records none.

    Raises:
        DataError: the labels fall outside [0, num_classes), naming the data set and the fix.
    """
    span = dataset.manifest.get("ranges", {}).get("label")
    if span is None:
        return False
    lo, hi = span
    if lo < 0 or hi >= num_classes:
        raise DataError(f"{dataset.directory} has labels {lo}..{hi} but model.num_classes = "
                        f"{num_classes} (labels 0..{num_classes - 1}): set model.num_classes "
                        f"= {hi + 1}, or convert the data again with the right labels")
    return True


def verify_split(path: str | Path, split: str, num_classes: int) -> None:
    """Check every checksum and label of a split before training (the test split: it is
    read whole at every evaluation, so this costs one evaluation's reading once).

    Raises:
        DataError: a damaged record or a label out of range, in one line with the fix.
    """
    dataset = _open(path, split)
    try:
        dataset.verify()
        for lo in range(0, len(dataset), 4096):
            idx = np.arange(lo, min(lo + 4096, len(dataset)), dtype=np.int64)
            fault = bad_label(dataset, idx, dataset.read(idx)["label"], num_classes)
            if fault is not None:
                raise fault
    except native.ShardError as e:
        raise damaged(e, dataset.directory) from None
    finally:
        dataset.close()


def _open(path: str | Path, split: str) -> native.Dataset:
    """Open one split of the data set at ``path``.

    Raises:
        DataError: the folder, its ``split``/ directory or its manifest is missing (one
            line naming which, and the converter that fits what is there:
            :func:`native.advice.missing_data`), or the split is not an image data set.
    """
    directory = Path(path) / split
    if not (directory / native.writer.MANIFEST).is_file():
        from native.advice import missing_data

        raise DataError(missing_data(path, split))
    try:
        dataset = native.open_dataset(directory)
    except native.ShardError as e:
        raise DataError(f"cannot read {directory}: {e}") from None
    names = {f.name: f for f in dataset.schema}
    if "image" not in names or "label" not in names or len(names["image"].shape) != 3:
        raise DataError(f"{directory} must have fields image (C,H,W) and label; it has "
                        f"{', '.join(f'{f.name} {f.shape}' for f in dataset.schema)}")
    return dataset


def _image_field(dataset: native.Dataset) -> native.Field:
    return next(f for f in dataset.schema if f.name == "image")


def image_shape(path: str | Path) -> tuple[int, int, int]:
    """(C, H, W) of the training images: every rank reads it to build the same model."""
    dataset = _open(path, "train")
    shape = _image_field(dataset).shape
    dataset.close()
    return tuple(int(s) for s in shape)  # type: ignore[return-value]


def _open_train(path: str | Path, batch_size: int) -> native.Dataset:
    dataset = _open(path, "train")
    if (n := len(dataset)) < batch_size:
        dataset.close()
        raise DataError(f"{path}/train has {n} records, fewer than one batch of {batch_size}")
    return dataset


def run_steps(cfg: Mapping[str, Mapping[str, Any]]) -> int:
    """Optimizer steps of a run: ``run.steps``, or ``run.epochs`` times the batches per
    epoch, counted as the run's own reader counts them (``data.drop_last``: a short last
    batch is a step when it is padded, not when it is dropped). The one place epochs
    become steps: the loop, the learning-rate schedule and the progress bar all use it.
    Reads only the train manifest (no torch), so start-up checks can call it early.

    Raises:
        DataError: the data set is missing, not an image data set, or has fewer
            records than one batch.
    """
    run, d = cfg["run"], cfg["data"]
    dataset = _open_train(d["path"], d["batch_size"])
    records = len(dataset)
    dataset.close()
    if run["steps"] > 0 or run["epochs"] < 1:
        return int(run["steps"])
    per_epoch = native.Sampler(records, seed=0, drop_last=d["drop_last"]).num_batches(d["batch_size"])
    return int(run["epochs"]) * per_epoch


def _to_tensors(batch: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    image, label = batch["image"], batch["label"]
    x = torch.from_numpy(image)
    if image.dtype == np.uint8:  # stored as bytes: scale to [0, 1] as converters do for floats
        x = x.float().div_(255.0)
    return x, torch.from_numpy(label).long()


class TrainBatches:
    """Endless shuffled mini-batches of the train split, epoch after epoch, resumable.

    Only the pipeline's first stage reads (rank 0 of world 1 of the sampler): the
    labels travel to the last stage inside the pipeline. Output buffers are reused from
    batch to batch; that is safe because a pipeline step completes all its sends
    (including the labels) before it returns.

    ``augment``, ``mean``, ``std`` (``[data]``): random ops and per-channel normalization,
    applied to each batch as read (native.Augment). Each sample's draws are a pure
    function of (seed, epoch, record index), so a reader that seeks to a batch (a
    takeover, a hot mirror, a resumed run) produces the very same tensors as one that
    read through. Without any of the three, batches are exactly ``x.float() / 255`` as
    before.
    """

    def __init__(self, path: str | Path, batch_size: int, *, seed: int, shuffle: bool = True,
                 drop_last: bool = True, num_classes: int | None = None,
                 augment: Sequence[str] = (), mean: Sequence[float] = (),
                 std: Sequence[float] = ()) -> None:
        self.dataset = _open_train(path, batch_size)
        self.num_classes = num_classes  # labels are checked against it as they are read
        self.batch_size = batch_size
        try:
            self.augment = transforms({"augment": augment, "mean": mean, "std": std},
                                      _image_field(self.dataset).shape, seed=seed)
        except TransformError:
            self.dataset.close()
            raise
        self.sampler = native.Sampler(len(self.dataset), seed=seed, shuffle=shuffle,
                                      drop_last=drop_last)
        self._out = self.dataset.empty(batch_size)
        self._x: np.ndarray | None = None  # the float32 batch, when transformed
        if not self.augment.identity:
            self._x = np.empty(self._out["image"].shape, dtype=np.float32)
        self._it: Iterator[np.ndarray] | None = None

    @classmethod
    def from_config(cls, cfg: Mapping[str, Mapping[str, Any]]) -> TrainBatches:
        """The reader a run's configuration asks for (``[data]``, ``run.seed``,
        ``model.num_classes``): the one place every training loop opens it, so each
        reads the same batches.

        Raises:
            DataError: the data set is missing or too small for one batch.
            TransformError: data.augment, data.mean or data.std is wrong for the images.
        """
        d = cfg["data"]
        return cls(d["path"], d["batch_size"], seed=cfg["run"]["seed"], shuffle=d["shuffle"],
                   drop_last=d["drop_last"], num_classes=cfg["model"]["num_classes"],
                   augment=d.get("augment", ()), mean=d.get("mean", ()), std=d.get("std", ()))

    def __len__(self) -> int:
        """Batches per epoch."""
        return self.sampler.num_batches(self.batch_size)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next mini-batch (x float32 N,C,H,W; y int64 N).

        Raises:
            DataFault: a record of the batch is damaged, or its label is out of range.
        """
        while True:
            if self._it is None:
                self._it = self.sampler.batches(self.batch_size)
            try:
                indices = next(self._it)
            except StopIteration:
                self._it = None
                continue
            try:
                batch = self.dataset.read(indices, self._out)
            except native.ShardError as e:
                raise damaged(e, self.dataset.directory) from None
            if self.num_classes is not None:
                fault = bad_label(self.dataset, indices, batch["label"], self.num_classes)
                if fault is not None:
                    raise fault
            if self._x is None:
                return _to_tensors(batch)
            return self._transformed(batch, indices)

    def _transformed(self, batch: dict[str, np.ndarray], indices: np.ndarray
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        assert self._x is not None
        # The batch's epoch, from the position just after it: (epoch, records handed out
        # so far), or (epoch + 1, 0) once it was the epoch's last batch.
        epoch, offset = self.sampler.position
        if offset == 0:
            epoch -= 1
        x = self.augment.apply(batch["image"], indices, epoch, out=self._x)
        return torch.from_numpy(x), torch.from_numpy(batch["label"]).long()

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, offset) after the last batch handed out: saved in checkpoints."""
        return self.sampler.position

    def seek(self, epoch: int, offset: int) -> None:
        self.sampler.seek(epoch, offset)
        self._it = None

    def seek_batch(self, index: int) -> None:
        """Continue with the ``index``-th batch since the start (0-based), without reading
        the ones before: a backup that takes over the first or last stage at step S
        starts there in constant time."""
        epoch, k = divmod(index, len(self))
        self.seek(epoch, k * self.batch_size)


def count_test_batches(path: str | Path, batch_size: int) -> int:
    """Batches in one pass over the test split (the last one may be short)."""
    dataset = _open(path, "test")
    n = len(dataset)
    dataset.close()
    return -(-n // batch_size)


def test_batches(path: str | Path, batch_size: int, *, mean: Sequence[float] = (),
                 std: Sequence[float] = ()) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Every test record once, in order, in batches of `batch_size` (last one short).

    ``mean``/``std`` (``data.mean``, ``data.std``): normalized as the training batches
    are; never augmented (evaluation measures the model on the data as it is).

    Raises:
        TransformError: mean/std are wrong or do not have one value per channel.
    """
    import torch

    dataset = _open(path, "test")
    try:
        norm = transforms({"mean": mean, "std": std}, _image_field(dataset).shape)
        for lo in range(0, len(dataset), batch_size):
            indices = np.arange(lo, min(lo + batch_size, len(dataset)), dtype=np.int64)
            batch = dataset.read(indices)
            if norm.identity:
                yield _to_tensors(batch)
            else:
                yield (torch.from_numpy(norm.normalize(batch["image"])),
                       torch.from_numpy(batch["label"]).long())
    finally:
        dataset.close()


test_batches.__test__ = False  # type: ignore[attr-defined]  # not a pytest test
