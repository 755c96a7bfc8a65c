"""The compiled CPU codec: thc.py's encode and decode of float32 vectors in C (``_fastcodec``).

Why: the reference path runs a slice through numpy/torch one whole-array operation at a time
(signs, five GEMM passes, rounding, table lookups, packing), each a trip through memory; the
C code does the same arithmetic in two cache-sized passes per slice on one core, the rounding,
lookup and packing fused into the second (host/codec/_fastcodec.c says how).

What is identical and what is not, for the same arguments:

- the rotation signs and the counter-based rounding draws: bit for bit (rng.py's integers);
- the transform: radix-2/4 butterflies instead of the reference's ±1 GEMMs, so rotated values
  differ by float rounding (as numpy's and torch's GEMMs already differ from each other);
- hence indices: identical except where a rounding draw lies within that rounding of its
  threshold (about one coordinate in 10^6); decoded values: within a few float32 ulps of
  the slice's scale M / sqrt(d); where the norm sits in a few coordinates both transforms
  add values of size M, within the worst-case rounding of their summation orders (the
  reference's is its BLAS kernel's, tests/test_fastcodec.py);
- the draws for an explicit generator object (numpy or torch) or None: like the Triton
  kernels, the compiled path draws one 64-bit key from it and uses the counter-based draws
  of that key (an int generator uses the int itself); the reference path draws every
  uniform from the generator. Same distribution, other numbers.

thc.py picks this path for CPU numpy arrays and CPU torch tensors (``backend="auto"``, or
``"compiled"``), and for the slice norms of numpy arrays (sums of squares in float64, as
the reference's); ``backend="reference"`` or THC_CODEC_CPU=reference keeps the reference
path. Where the extension is missing, :data:`UNAVAILABLE` says why.

Measured with ``thc bench codec`` (2^24 floats, one core): encode + decode several times the
reference path's speed, about the FP16 cast's (README, "Measured"; docs/results.md).
"""
from __future__ import annotations

import numpy as np

from thc.built import stale
from thc.codec import rng
from thc.codec.hadamard import is_torch

try:
    from thc.codec import _fastcodec
except ImportError as e:
    _fastcodec = None
    UNAVAILABLE: str | None = (f"the compiled CPU codec is not built ({e}); `pip install -e .` "
                               f"with a C compiler builds it")
else:
    UNAVAILABLE = stale(_fastcodec, "compiled CPU codec")

_KINDS = {np.dtype(k) for k in ("u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8")}


def available() -> bool:
    return UNAVAILABLE is None


def on_cpu(x) -> bool:
    """True for a numpy array or a CPU torch tensor: what the compiled path takes."""
    return not is_torch(x) or x.device.type == "cpu"


def as_numpy(x) -> np.ndarray:
    """A C-contiguous, aligned numpy view of a CPU tensor or array (a copy only when not
    contiguous or, over another buffer, not aligned to its type: the C code reads through
    typed pointers, and refuses a misaligned buffer)."""
    if is_torch(x):   # a tensor over another buffer may be misaligned too
        return np.require(x.detach().resolve_neg().contiguous().numpy(), requirements="CA")
    return np.require(x, requirements="CA")


def sumsq(flat: np.ndarray, slice_size: int) -> np.ndarray:
    """Per-slice sums of squares (float64) of flat float32 ``flat``."""
    n, ss = flat.shape[0], int(slice_size)
    out = np.empty(-(-n // ss), dtype=np.float64)
    _fastcodec.sumsq(flat, n, ss, out)
    return out


def encode(flat: np.ndarray, slice_size: int, coef: np.ndarray, seed: int, round_: int,
           key: int, table, packed: bool, check: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Indices of flat float32 ``flat`` (packed 4-bit when ``packed``) and each slice's first
    rotated coordinate, NaN where ``check`` found any rotated coordinate not finite.
    ``coef``: per-slice scale g / (2 t_p M) as float32; ``key``: the rounding draws' counter
    key (the int generator)."""
    n = flat.shape[0]
    ss = int(slice_size)
    full, tail = divmod(n, ss)
    padded = full * ss + ((1 << (tail - 1).bit_length()) if tail else 0)
    out = np.empty((padded + 1) // 2 if packed else padded, dtype=np.uint8)
    first = np.empty(full + (1 if tail else 0), dtype=np.float32)
    _fastcodec.encode(flat, n, ss, np.ascontiguousarray(coef, np.float32),
                      rng.key_prefix(seed, round_, rng.SIGN_STREAM),
                      rng.key_prefix(key, round_, rng.UNIFORM_STREAM),
                      np.ascontiguousarray(table, np.int32), out, packed, first, check)
    return out, first


def sums_kind(sums: np.ndarray) -> tuple[np.ndarray, str]:
    """Sums in native byte order and the extension's name of their integer type."""
    if not sums.dtype.isnative:
        sums = sums.astype(sums.dtype.newbyteorder("="))
    if sums.dtype not in _KINDS:
        sums = sums.astype(np.int64)
    return np.require(sums, requirements="CA"), sums.dtype.str[1:]


def decode(sums: np.ndarray, kind: str, numel: int, slice_size: int, alpha: np.ndarray,
           centre: float, seed: int, round_: int, out: np.ndarray, table=None):
    """Writes the decode of ``sums`` (or, with kind ``index``, of indices mapped through
    ``table``) into float32 ``out``; ``alpha``: per-slice float32 factor 2 t_p M / (g d n).
    Returns (least, largest) of the sums read on the way (None for indices or no sums)."""
    tab = np.zeros(256, np.float32)
    if table is not None:
        tab[: len(table)] = np.asarray(table, np.float32)
    return _fastcodec.decode(sums, kind, int(numel), int(slice_size),
                             np.ascontiguousarray(alpha, np.float32), float(centre),
                             rng.key_prefix(seed, round_, rng.SIGN_STREAM), tab, out)
