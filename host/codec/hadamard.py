"""Randomized Hadamard transform (RHT) for numpy arrays and torch tensors, and slice layout.

The normalized Walsh–Hadamard transform of length n = 2^L is H_n / sqrt(n) with
H_n = H_K1 ⊗ H_K2 ⊗ ... . Instead of L butterfly passes over memory, the transform is applied
as a few small dense ±1 matrix products (K <= 16) on reshaped views, one per Kronecker
factor: each pass is a BLAS GEMM, so a 2^20 slice takes 5 passes instead of 20. Both
backends run the same sequence of operations, so their results agree to float rounding
(bit for bit on inputs whose partial sums are exact, e.g. small integers).

The random ±1 diagonal of slice ``i`` in round ``r`` is a pure function of (seed, r, i, index)
(host/codec/rng.py), so numpy, torch (CPU or CUDA) and the Triton kernels see the same
rotation and every worker of a job draws the same diagonal without communicating.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Iterator, Sequence

import numpy as np

from thc.codec import rng

MAX_FACTOR_BITS = 4
"""Largest Kronecker factor 2^4 = 16: 5 GEMM passes for a 2^20 slice at 32 flops per element
each; measured fastest on one core against 8, 32, 64 and 128 (numpy/OpenBLAS and torch/MKL)."""


def is_torch(x) -> bool:
    """True for a torch tensor, without importing torch when nobody else has."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _factor_bits(levels: int) -> list[int]:
    """Split L levels into balanced factors of at most MAX_FACTOR_BITS levels each."""
    if levels == 0:
        return []
    parts = -(-levels // MAX_FACTOR_BITS)
    base, extra = divmod(levels, parts)
    return [base + 1] * extra + [base] * (parts - extra)


@lru_cache(maxsize=None)
def hadamard_matrix(k: int) -> np.ndarray:
    """Sylvester's unnormalized H_{2^k} as float32 (symmetric, entries ±1); read-only."""
    h = np.ones((1, 1), dtype=np.float32)
    for _ in range(k):
        h = np.block([[h, h], [h, -h]])
    h.setflags(write=False)
    return h


_TORCH_H: dict = {}


def _hadamard_like(k: int, scale: float, x):
    """H_{2^k} * scale on x's backend, device and dtype (the unscaled matrix is cached; the
    scale changes with every slice, so scaled copies are made per call: 16x16, negligible)."""
    if not is_torch(x):
        h = hadamard_matrix(k)
        if scale == 1.0:
            return h
        if x.dtype == np.float64:   # the input's precision; else the codec's float32 scale
            return h.astype(np.float64) * scale
        return (h * np.float32(scale)).astype(x.dtype, copy=False)
    key = (k, x.device, x.dtype)
    h = _TORCH_H.get(key)
    if h is None:
        import torch
        h = _TORCH_H[key] = torch.tensor(hadamard_matrix(k), dtype=x.dtype, device=x.device)
    s = scale if str(x.dtype) == "torch.float64" else np.float32(scale)
    return h * s if scale != 1.0 else h


def _matmul(a, b, out):
    if is_torch(out):
        import torch
        torch.matmul(a, b, out=out)
    else:
        np.matmul(a, b, out=out)


def fwht(x, normalized: bool = True, scale: float | None = None,
         overwrite_input: bool = False):
    """Walsh–Hadamard transform along the last axis (length a power of two).

    ``normalized`` divides by sqrt(n) (the orthonormal transform, its own inverse); ``scale``
    overrides that factor (it is folded into the first matrix product, so it costs nothing).
    With ``overwrite_input`` the input (float32/64, contiguous) may serve as a scratch buffer,
    saving an allocation; otherwise it is left untouched.
    """
    n = x.shape[-1]
    if n == 0 or n & (n - 1):
        raise ValueError(f"fwht needs a power-of-two length, got {n}")
    if scale is None:
        scale = 1.0 / math.sqrt(n) if normalized else 1.0
    shape = x.shape
    torch_in = is_torch(x)
    if torch_in:
        src = x if x.is_floating_point() else x.float()
        src = src.reshape(-1, n)
        new = src.new_empty
    else:
        src = np.asarray(x)
        if src.dtype not in (np.float32, np.float64):
            src = src.astype(np.float32)
        src = src.reshape(-1, n)
        new = lambda sh: np.empty(sh, dtype=src.dtype)  # noqa: E731
    factors = _factor_bits(n.bit_length() - 1)
    if not factors:
        return (src * scale).reshape(shape)
    # ping-pong between two buffers; the input may be the second one when it is ours to spoil
    first = new(src.shape)
    second = src if overwrite_input and _shares_memory(src, x) else None
    stride = 1
    for i, kk in enumerate(factors):
        if i % 2 == 0:
            out = first
        else:
            if second is None:
                second = new(src.shape)
            out = second
        k = 1 << kk
        h = _hadamard_like(kk, scale if i == 0 else 1.0, src)
        if stride == 1:
            _matmul(src.reshape(-1, k), h, out.reshape(-1, k))
        else:
            _matmul(h, src.reshape(-1, k, stride), out.reshape(-1, k, stride))
        src = out
        stride *= k
    return src.reshape(shape)


def _shares_memory(a, b) -> bool:
    if is_torch(a):
        return a.is_contiguous() and a.data_ptr() == b.data_ptr()
    return a.flags.c_contiguous and np.shares_memory(a, b)


def random_signs(n: int, seed: int, round: int = 0, slice_index: int | Sequence[int] = 0,
                 like=None):
    """The RHT diagonal: ±1 float32 of length n, or (len(slice_index), n) for several slices.

    Drawn by the codec's counter-based generator (:func:`thc.codec.rng.signs`), so every
    backend and device computes the same diagonal.
    """
    return rng.signs(n, seed, round, slice_index, like=like)


def rht(x, seed: int, round: int = 0, slice_index: int | Sequence[int] = 0):
    """Randomized Hadamard transform (H/sqrt(n)) D x of the last axis, zero-padded to 2^k.

    For a 2-D input with an integer ``slice_index``, row r uses diagonal slice_index + r.
    """
    n = x.shape[-1]
    n_pad = next_pow2(n)
    x2 = x.reshape(-1, n)
    rows = x2.shape[0]
    idx = _row_indices(slice_index, rows, x.ndim)
    d = random_signs(n_pad, seed, round, idx, like=x2)
    if is_torch(x2):
        import torch
        y = torch.nn.functional.pad(x2.float() if not x2.is_floating_point() else x2,
                                    (0, n_pad - n)) * d
    else:
        y = np.zeros((rows, n_pad), dtype=np.result_type(x2.dtype, np.float32))
        y[:, :n] = x2
        y *= d
    y = fwht(y, overwrite_input=True)
    return y.reshape(tuple(x.shape[:-1]) + (n_pad,))


def irht(y, seed: int, round: int = 0, slice_index: int | Sequence[int] = 0,
         n: int | None = None):
    """Inverse of :func:`rht`: D (H/sqrt(n)) y, cropped to the first ``n`` coordinates."""
    n_pad = y.shape[-1]
    y2 = y.reshape(-1, n_pad)
    idx = _row_indices(slice_index, y2.shape[0], y.ndim)
    d = random_signs(n_pad, seed, round, idx, like=y2)
    x = fwht(y2)
    x *= d
    x = x[:, : n_pad if n is None else n]
    return x.reshape(tuple(y.shape[:-1]) + (x.shape[-1],))


def _row_indices(slice_index, rows: int, ndim: int):
    if isinstance(slice_index, (int, np.integer)):
        return int(slice_index) if ndim == 1 else list(range(int(slice_index),
                                                              int(slice_index) + rows))
    idx = list(slice_index)
    if len(idx) != rows:
        raise ValueError(f"{rows} rows but {len(idx)} slice indices")
    return idx


@dataclass(frozen=True)
class SliceGroup:
    """Consecutive slices sharing one padded length: rows of one batched transform."""

    first: int          # index of the first slice
    count: int          # number of slices
    length: int         # unpadded length of each slice
    padded: int         # padded (power-of-two) length of each slice
    start: int          # offset of the first slice in the flat tensor
    padded_start: int   # offset of the first slice in the padded (wire) vector


@dataclass(frozen=True)
class SliceLayout:
    """How a flat tensor of ``numel`` elements is cut into slices of at most ``slice_size``.

    All slices but the last have exactly ``slice_size`` elements; the last one is padded to
    the next power of two. ``total_padded`` is the length of the index vector on the wire.
    """

    numel: int
    slice_size: int

    def __post_init__(self) -> None:
        s = self.slice_size
        if s < 1 or s & (s - 1):
            raise ValueError(f"slice_size must be a power of two, got {s}")
        if self.numel < 0:
            raise ValueError(f"numel must be >= 0, got {self.numel}")

    @cached_property
    def full(self) -> int:
        return self.numel // self.slice_size

    @cached_property
    def tail(self) -> int:
        return self.numel % self.slice_size

    @cached_property
    def tail_padded(self) -> int:
        return next_pow2(self.tail) if self.tail else 0

    @property
    def n_slices(self) -> int:
        return self.full + (1 if self.tail else 0)

    @property
    def total_padded(self) -> int:
        return self.full * self.slice_size + self.tail_padded

    @cached_property
    def lengths(self) -> tuple[int, ...]:
        return (self.slice_size,) * self.full + ((self.tail,) if self.tail else ())

    @cached_property
    def padded(self) -> tuple[int, ...]:
        return (self.slice_size,) * self.full + ((self.tail_padded,) if self.tail else ())

    @cached_property
    def starts(self) -> tuple[int, ...]:
        return tuple(i * self.slice_size for i in range(self.n_slices))

    @cached_property
    def padded_starts(self) -> tuple[int, ...]:
        return self.starts

    def groups(self, max_elements: int = 1 << 20) -> Iterator[SliceGroup]:
        """Batches of equal-length slices of about ``max_elements``, so that a batch's
        temporaries stay in cache while it runs through the whole pipeline."""
        ss = self.slice_size
        per = max(1, max_elements // ss)
        for first in range(0, self.full, per):
            count = min(per, self.full - first)
            yield SliceGroup(first, count, ss, ss, first * ss, first * ss)
        if self.tail:
            s = self.full * ss
            yield SliceGroup(self.full, 1, self.tail, self.tail_padded, s, s)
