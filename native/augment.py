"""Augmentation and normalization of whole batches, deterministic per (seed, epoch, record).

The loader fills a uint8 (or float) N,C,H,W batch buffer straight from the mapped
shards; this module turns it into float32 with a few numpy passes over the batch
instead of a Python call per sample (a per-sample DataLoader transform is the
slow part of the usual recipe).

Every random choice for a sample is a pure function of (seed, epoch, record index):
a splitmix64-style hash of the three numbers, computed for the whole batch at once
in uint64 numpy arithmetic. So the same record in the same epoch gets the same crop
and flips whichever batch it falls in, in whatever order it is read, by whichever
process reads it: a replay after a takeover, a hot mirror, a resumed run and a
second reader all see the same augmented sample, and training stays bit-exact.

Ops (``Augment(ops=[...])``), each at most once, applied in the order given:

- ``random_crop:P``: zero-pad P pixels on each side, take a random H x W crop
  (CIFAR's recipe); every one of the (2P+1)^2 offsets is equally likely.
- ``hflip``: flip left-right with probability 1/2.
- ``vflip``: flip upside down with probability 1/2.

Then normalization, per channel: ``(x/255 - mean) / std`` for uint8 images (``x/255``
is what the loader gives today), ``(x - mean) / std`` for images stored as floats.
Padding is applied to the stored pixels, before normalization, as in the usual
recipe: a padded pixel becomes ``-mean/std``.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from numpy.lib.stride_tricks import as_strided
from numpy.typing import ArrayLike

__all__ = ["AugmentError", "Augment", "Draws", "Op", "KNOWN_OPS", "mix64", "parse_ops", "sample_keys"]

KNOWN_OPS = (
    "random_crop:P (zero-pad P pixels on each side, then a random crop back to the image size)",
    "hflip (flip left-right with probability 1/2)",
    "vflip (flip upside down with probability 1/2)",
)
_KNOWN = "; ".join(KNOWN_OPS)
_FLIPS = ("hflip", "vflip")

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
# Keeps this module's draws apart from any other user of the same seed (the sampler's
# shuffle, torch's initialisation): the first bytes of "augment" as a number.
_TAG = int.from_bytes(b"augment", "little")


class AugmentError(ValueError):
    """An augmentation op, its argument, mean/std, or the images it is given are wrong.

    The message is one line naming what is wrong and, for an op, listing the known
    ones; a configuration layer may prefix the key it came from.
    """


@dataclass(frozen=True)
class Op:
    """One parsed op: its name and integer argument (the padding P of random_crop, else 0)."""

    name: str
    arg: int = 0

    def __str__(self) -> str:
        return f"{self.name}:{self.arg}" if self.name == "random_crop" else self.name


class Draws(NamedTuple):
    """The random choices of each sample of a batch (arrays of length N).

    ``dy``, ``dx``: top-left corner of the crop in the padded image (0..2P; 0 without
    random_crop). ``hflip``, ``vflip``: whether that flip happens (False without the op).
    """

    dy: np.ndarray
    dx: np.ndarray
    hflip: np.ndarray
    vflip: np.ndarray


def _bad(spec: object, why: str) -> AugmentError:
    return AugmentError(f"augment op {spec!r}: {why}; known ops: {_KNOWN}")


def parse_ops(specs: Sequence[str]) -> tuple[Op, ...]:
    """Parse op strings such as ``["random_crop:4", "hflip"]``.

    Raises:
        AugmentError: an op that is not a string, unknown, with a bad argument, or
            given twice; one line that names it and lists the known ops.
    """
    if isinstance(specs, str) or not isinstance(specs, Sequence):
        raise AugmentError(f"augment must be a list of ops such as ['random_crop:4', 'hflip'], got {specs!r}")
    ops: list[Op] = []
    for spec in specs:
        if not isinstance(spec, str):
            raise _bad(spec, "an op is a string such as 'random_crop:4' or 'hflip'")
        name, sep, arg = spec.strip().partition(":")
        if name == "random_crop":
            if not sep:
                raise _bad(spec, "random_crop needs P, the pixels of padding, e.g. 'random_crop:4'")
            digits = arg.strip()
            if not (digits.isascii() and digits.isdigit()):
                raise _bad(spec, f"P must be a non-negative integer of pixels, got {arg!r}")
            op = Op(name, int(digits))
        elif name in _FLIPS:
            if sep:
                raise _bad(spec, f"{name} takes no argument")
            op = Op(name)
        else:
            raise _bad(spec, "unknown op")
        if any(o.name == op.name for o in ops):
            raise _bad(spec, f"{op.name} is given twice; give each op once")
        ops.append(op)
    return tuple(ops)


def _mix_int(x: int) -> int:
    """splitmix64's output function of state ``x`` (Python ints: for scalars)."""
    z = (x + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def mix64(x: ArrayLike) -> np.ndarray:
    """splitmix64's output function of each element (uint64, wrapping), vectorized.

    A bijection of 64-bit words whose every output bit depends on every input bit:
    consecutive counters (record numbers, epochs) give unrelated words.
    """
    a = np.asarray(x)
    z = np.array(a, dtype=np.uint64, ndmin=1)  # a copy: the in-place steps below wrap, never warn
    np.add(z, np.uint64(_GOLDEN), out=z)
    z ^= z >> np.uint64(30)
    z *= np.uint64(_M1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_M2)
    z ^= z >> np.uint64(31)
    return z.reshape(a.shape)


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or not 0 <= int(seed) <= _MASK:
        raise AugmentError(f"the augmentation seed must be an integer in 0..2**64-1, got {seed!r}")
    return int(seed)


def sample_keys(seed: int, epoch: ArrayLike, indices: ArrayLike) -> np.ndarray:
    """One 64-bit key per sample: a pure function of (seed, epoch, record index).

    ``epoch`` is one number or one per index. Keys are chained splitmix64 mixes,
    ``mix(mix(mix(seed ^ tag) + epoch) + index)``: a few vectorized passes per batch,
    where a numpy SeedSequence per sample would cost microseconds each.
    """
    base = _mix_int(_check_seed(seed) ^ _TAG)
    idx = np.asarray(indices)
    ep = np.asarray(epoch)
    shape = np.broadcast_shapes(idx.shape, ep.shape)
    k = np.full(shape, base, dtype=np.uint64)
    k += np.broadcast_to(ep, shape).astype(np.uint64)
    k = mix64(k)
    k += np.broadcast_to(idx, shape).astype(np.uint64)
    return mix64(k)


def _salt(name: str) -> np.uint64:
    """Each op draws from its own stream, keyed by its name, so adding or moving one op
    leaves the other ops' draws as they were."""
    return np.uint64(_mix_int(zlib.crc32(name.encode())))


def _stats(mean: Sequence[float], std: Sequence[float]) -> tuple[np.ndarray, np.ndarray] | None:
    for name, values in (("mean", mean), ("std", std)):
        if isinstance(values, str) or not isinstance(values, Sequence | np.ndarray):
            raise AugmentError(f"{name} must be a list of numbers, one per channel, got {values!r}")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int | float | np.integer | np.floating):
                raise AugmentError(f"{name} must be a list of numbers, one per channel, got {list(values)!r}")
    if len(mean) != len(std):
        raise AugmentError(f"mean and std go together, one value per channel each: mean has "
                           f"{len(mean)} values, std {len(std)}")
    if not len(mean):
        return None
    m = np.asarray(mean, dtype=np.float64)
    s = np.asarray(std, dtype=np.float64)
    if not np.all(np.isfinite(m)):
        raise AugmentError(f"mean must be finite numbers, got {list(mean)!r}")
    if not np.all(np.isfinite(s) & (s > 0)):
        raise AugmentError(f"std must be positive finite numbers, got {list(std)!r}")
    return m.astype(np.float32), s.astype(np.float32)


class Augment:
    """Random ops and per-channel normalization for whole batches (see the module doc).

    ``apply()`` augments and normalizes a training batch, ``normalize()`` only
    normalizes (evaluation). Both write float32, into ``out`` when given (reuse one
    buffer across batches), else into a new array. An instance keeps a scratch
    buffer between calls: use one instance per thread.

    Args:
        ops: op strings, e.g. ``["random_crop:4", "hflip"]``; empty: no augmentation.
        mean, std: one value per channel each, or both empty (no normalization).
        seed: non-negative integer; with the epoch and the record index it decides
            every draw.

    Raises:
        AugmentError: a bad op, argument, mean, std or seed (one line).
    """

    def __init__(self, ops: Sequence[str] = (), mean: Sequence[float] = (), std: Sequence[float] = (),
                 *, seed: int = 0) -> None:
        self.ops = parse_ops(ops)
        self.seed = _check_seed(seed)
        stats = _stats(mean, std)
        self.mean: np.ndarray | None = None if stats is None else stats[0]
        self.std: np.ndarray | None = None if stats is None else stats[1]
        names = [o.name for o in self.ops]
        self.pad = next((o.arg for o in self.ops if o.name == "random_crop"), 0)
        self._crop_at = names.index("random_crop") if "random_crop" in names else None
        # (op name, variant bit, after the crop?) of each flip, in list order
        self._flips = tuple((name, 1 << b, self._crop_at is not None and names.index(name) > self._crop_at)
                            for b, name in enumerate(n for n in names if n in _FLIPS))
        self._scratch: np.ndarray | None = None

    @property
    def augments(self) -> bool:
        """Whether any random op is on."""
        return bool(self.ops)

    @property
    def normalizes(self) -> bool:
        """Whether mean and std are given."""
        return self.mean is not None

    @property
    def identity(self) -> bool:
        """Neither ops nor normalization: callers keep their plain path (``x/255``)."""
        return not self.ops and self.mean is None

    def __repr__(self) -> str:
        stats = "" if self.mean is None else f", mean={self.mean.tolist()}, std={self.std.tolist()}"  # type: ignore[union-attr]
        return f"Augment({[str(o) for o in self.ops]}{stats}, seed={self.seed})"

    def check_shape(self, shape: Sequence[int]) -> None:
        """Check that the ops and mean/std fit images of shape (C, H, W).

        Raises:
            AugmentError: mean/std do not have one value per channel, or the crop's
                padding is as large as the image.
        """
        if len(shape) != 3:
            raise AugmentError(f"augmentation needs images of shape (C, H, W), got {tuple(shape)}")
        c, h, w = (int(s) for s in shape)
        if self.mean is not None and len(self.mean) != c:
            k = len(self.mean)
            raise AugmentError(f"mean and std have {k} value{'s' if k != 1 else ''} each but the images have "
                               f"{c} channel{'s' if c != 1 else ''} (shape {c}x{h}x{w}): give one value per channel")
        if self.pad and self.pad >= min(h, w):
            raise AugmentError(f"augment op 'random_crop:{self.pad}' pads as much as the {h}x{w} image or "
                               f"more: give P < {min(h, w)}")

    def draws(self, epoch: ArrayLike, indices: ArrayLike) -> Draws:
        """The random choices for records ``indices`` in ``epoch`` (one number or one per index).

        A pure function of (seed, epoch, index) per sample, so a test or a second
        reader can recompute any sample's augmentation.
        """
        keys = sample_keys(self.seed, epoch, np.asarray(indices).reshape(-1))
        n = keys.shape[0]
        zero = np.zeros(n, dtype=np.intp)
        no = np.zeros(n, dtype=bool)
        dy = dx = zero
        flips = {"hflip": no, "vflip": no}
        for op in self.ops:
            h = mix64(keys ^ _salt(op.name))
            if op.name == "random_crop":
                span = np.uint64(2 * op.arg + 1)
                dy = (h % span).astype(np.intp)
                dx = ((h // span) % span).astype(np.intp)
            else:
                flips[op.name] = (h >> np.uint64(63)).astype(bool)
        return Draws(dy, dx, flips["hflip"], flips["vflip"])

    def _images(self, images: np.ndarray) -> np.ndarray:
        if not isinstance(images, np.ndarray) or images.ndim != 4:
            raise AugmentError(f"augmentation needs a numpy batch of shape (N, C, H, W), got "
                               f"{getattr(images, 'shape', type(images).__name__)}")
        if images.dtype != np.uint8 and images.dtype.kind != "f":
            raise AugmentError(f"augmentation needs uint8 or float images, got {images.dtype}")
        self.check_shape(images.shape[1:])
        return images

    def _out(self, shape: tuple[int, ...], out: np.ndarray | None) -> np.ndarray:
        if out is None:
            return np.empty(shape, dtype=np.float32)
        if (not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape[1:] != shape[1:]
                or out.shape[0] < shape[0] or not out.flags.c_contiguous or not out.flags.writeable):
            raise AugmentError(f"out must be a writable C-contiguous float32 array of shape (>= {shape[0]}, "
                               f"{', '.join(map(str, shape[1:]))}), got "
                               f"{getattr(out, 'dtype', '?')} {getattr(out, 'shape', '?')}")
        return out[: shape[0]]

    def _finish(self, src: np.ndarray, out: np.ndarray) -> np.ndarray:
        """float32 x/255 for uint8 (each byte cast exactly, then the same float32 division as
        torch's x.float()/255, in one pass), a float32 copy for floats; then the
        normalization as written: (x/255 - mean) / std."""
        if src.dtype == np.uint8:
            np.divide(src, np.float32(255.0), out=out, dtype=np.float32)
        else:
            np.copyto(out, src, casting="same_kind")
        if self.mean is not None and self.std is not None:
            np.subtract(out, self.mean[:, None, None], out=out)
            np.divide(out, self.std[:, None, None], out=out)
        return out

    def normalize(self, images: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
        """float32 images, normalized (no random op): what evaluation reads.

        Raises:
            AugmentError: images of the wrong rank, dtype or channel count, or a bad ``out``.
        """
        x = self._images(images)
        return self._finish(x, self._out(x.shape, out))

    def apply(self, images: np.ndarray, indices: ArrayLike, epoch: ArrayLike, *,
              out: np.ndarray | None = None) -> np.ndarray:
        """Augment then normalize a batch of records ``indices`` read in ``epoch``.

        ``epoch`` is one number, or one per sample (a batch that spans two epochs).
        Sample i's result depends only on its pixels and (seed, epoch, indices[i]).

        Raises:
            AugmentError: images of the wrong rank, dtype or channel count, indices
                not one per image, or a bad ``out``.
        """
        x = self._images(images)
        idx = np.asarray(indices).reshape(-1)
        if idx.shape[0] != x.shape[0]:
            raise AugmentError(f"{idx.shape[0]} record indices for a batch of {x.shape[0]} images")
        out = self._out(x.shape, out)
        if self.ops and x.shape[0]:
            x = self._crop_flip(x, self.draws(epoch, idx))
        return self._finish(x, out)

    def _buffer(self, n: int, shape: tuple[int, int, int], dtype: np.dtype) -> np.ndarray:
        """The zero-bordered padded scratch buffer (n, C, H+2P, W+2P): only its interior is
        ever written, so its border stays zero from batch to batch."""
        c, h, w = shape
        want = (c, h + 2 * self.pad, w + 2 * self.pad)
        s = self._scratch
        if s is None or s.shape[1:] != want or s.dtype != dtype or s.shape[0] < n:
            s = self._scratch = np.zeros((n, *want), dtype=dtype)
        return s[:n]

    def _crop_flip(self, x: np.ndarray, d: Draws) -> np.ndarray:
        """Every sample's crop and flips in one gather.

        A flip commutes with the crop by mirroring the crop's offset (flip after the
        crop at dx == crop at 2P - dx of the flipped image), so each sample is one
        H x W window of its image, flipped first, in a zero-bordered buffer: the flipped
        samples are written flipped, then a strided view of all windows, indexed by
        (sample, dy, dx), copies every crop at once.
        """
        n, c, h, w = x.shape
        p = self.pad
        variant = np.zeros(n, dtype=np.intp)
        wy, wx = d.dy, d.dx
        for name, bit, after_crop in self._flips:
            flipped = d.hflip if name == "hflip" else d.vflip
            variant |= np.where(flipped, bit, 0)
            if after_crop:
                if name == "hflip":
                    wx = np.where(flipped, 2 * p - wx, wx)
                else:
                    wy = np.where(flipped, 2 * p - wy, wy)
        buf = self._buffer(n, (c, h, w), x.dtype)
        inner = buf[:, :, p:p + h, p:p + w]
        inner[...] = x
        for v in range(1, 1 << len(self._flips)):
            sel = np.flatnonzero(variant == v)
            if sel.size:
                inner[sel] = self._flipped(x[sel], v)
        if not p:
            return inner
        s = buf.strides
        windows = as_strided(buf, (n, c, 2 * p + 1, 2 * p + 1, h, w), (s[0], s[1], s[2], s[3], s[2], s[3]),
                             writeable=False)
        return windows[np.arange(n), :, wy, wx]

    def _flipped(self, x: np.ndarray, variant: int) -> np.ndarray:
        """``x`` (a contiguous copy) with the flips of ``variant``. Left-right on bytes
        reverses 8-byte words and swaps the bytes in each, 8 times fewer steps than
        one byte at a time."""
        for name, bit, _ in self._flips:
            if not variant & bit:
                continue
            if name == "vflip":
                x = x[..., ::-1, :]
            elif x.dtype == np.uint8 and x.shape[-1] % 8 == 0 and x.flags.c_contiguous:
                x = x.view(np.uint64)[..., ::-1].byteswap().view(np.uint8)
            else:
                x = x[..., ::-1]
        return x
