"""What the codec's Triton kernels (host/codec/triton_kernels.py) compute on chip: the
counter-based generator (host/codec/rng.py's definition, in uint32), the ±1 Hadamard products
on the tensor cores, and the status flags. One module so that each kernel reads as its
passes' steps.
"""
from __future__ import annotations

import triton
import triton.language as tl




@triton.jit
def mix32(x):
    x ^= x >> 16
    x = x * 0x7FEB352D
    x ^= x >> 15
    x = x * 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def block(j, k0, k1):
    """rng.block: mix32(mix32(j ^ k0) ^ k1) on uint32."""
    return mix32(mix32(j ^ k0) ^ k1)


@triton.jit
def absorb(h, g, w):
    """rng.absorb on the state's two uint32 words."""
    h = mix32((h ^ w) + 0x9E3779B9)
    g = mix32(g ^ h)
    return mix32((h ^ g) + 0x85EBCA6B), g


@triton.jit
def round_prefix(prefix, ROUND, DEV_ROUND: tl.constexpr):
    """The key prefix of this call's round as its two words (h, g): as passed (an int64, g in
    the high half), or (``DEV_ROUND``) finished here from rng.seed_state and the int64 round
    at ``ROUND``, so that a CUDA graph replays each round with the round number the device
    holds then (rng.finish_prefix)."""
    p = prefix.to(tl.uint64)   # an int64, or an i32 where the value fits: sign-extended
    h, g = (p & 0xFFFFFFFF).to(tl.uint32), (p >> 32).to(tl.uint32)
    if DEV_ROUND:
        r = tl.load(ROUND).to(tl.uint64, bitcast=True)
        h, g = absorb(h, g, (r & 0xFFFFFFFF).to(tl.uint32))
        h, g = absorb(h, g, (r >> 32).to(tl.uint32))
    return h, g


@triton.jit
def program_key(h, g, first, s):
    """rng.key_from_prefix of slice first + s: the key schedule's last step, per program."""
    return absorb(h, g, (first + s).to(tl.uint32))


@triton.jit
def signed(x, rows, c0, k0, k1, M: tl.constexpr, C: tl.constexpr, W: tl.constexpr):
    """x, an (M, W) tile of coordinates rows C + c0 + (0..W-1), times their rotation signs:
    bit i mod 32 of block(i div 32), one block per word of 32 signs where the tile holds whole
    words (W >= 32) or lies in one (C >= 32), else one per coordinate."""
    if W >= 32:
        j = (rows[:, None] * (C // 32) + c0 // 32 + tl.arange(0, W // 32)[None, :])
        w = block(j.to(tl.uint32), k0, k1)
        bit = (w[:, :, None] >> tl.arange(0, 32).to(tl.uint32)[None, None, :]) & 1
        y = tl.reshape(x, (M, W // 32, 32))
        return tl.reshape(tl.where(bit == 1, -y, y), (M, W))
    elif C >= 32:
        w = block(((rows * C + c0) >> 5).to(tl.uint32), k0, k1)
        bit = (w[:, None] >> ((c0 & 31) + tl.arange(0, W)).to(tl.uint32)[None, :]) & 1
        return tl.where(bit == 1, -x, x)
    else:
        iu = (rows[:, None] * C + c0 + tl.arange(0, W)[None, :]).to(tl.uint32)
        bit = (block(iu >> 5, k0, k1) >> (iu & 31)) & 1
        return tl.where(bit == 1, -x, x)


@triton.jit
def hmat(K: tl.constexpr):
    """Sylvester's H_K (K <= 256) as float32: (-1)^popcount(a & b)."""
    a = tl.arange(0, K)
    p = a[:, None] & a[None, :]
    p ^= p >> 4
    p ^= p >> 2
    p ^= p >> 1
    return tl.where((p & 1) == 1, -1.0, 1.0)


@triton.jit
def dot(a, h, PREC: tl.constexpr):
    """a @ h for a ±1 matrix h (exact in TF32); tf32x2 splits a into its TF32 head and the
    float32 rest, so the tensor cores lose about 2 bits of a instead of 13."""
    if PREC == "tf32x2":
        hi = (a.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        y = tl.dot(hi, h, input_precision="tf32")
        y = tl.dot(a - hi, h, acc=y, input_precision="tf32")
    else:
        y = tl.dot(a, h, input_precision=PREC)
    return y


@triton.jit
def ldot(h, a, PREC: tl.constexpr):
    """h @ a for a ±1 matrix h, a split as in :func:`dot` (2-D, or 3-D: a batch)."""
    if PREC == "tf32x2":
        hi = (a.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
        y = tl.dot(h, hi, input_precision="tf32")
        y = tl.dot(h, a - hi, acc=y, input_precision="tf32")
    else:
        y = tl.dot(h, a, input_precision=PREC)
    return y


@triton.jit
def had_last(x, M: tl.constexpr, K: tl.constexpr, K1: tl.constexpr, PREC: tl.constexpr,
              FORM: tl.constexpr):
    """H_K along axis 1 of an (M, K) tile, K = K1 K2 (K1 = 1: one product). Viewing each row
    as a K1 x K2 matrix X (index a K2 + b), H_K x is H_K1 X H_K2: "sandwich" multiplies on
    both sides as X lies, "transpose" transposes X between two right products."""
    if K1 == 1:
        y = dot(x, hmat(K), PREC)
    elif FORM == "sandwich":
        K2: tl.constexpr = K // K1
        t = dot(tl.reshape(x, (M * K1, K2)), hmat(K2), PREC)
        if M == 1:
            y = ldot(hmat(K1), tl.reshape(t, (K1, K2)), PREC)
        else:
            h = tl.broadcast_to(tl.reshape(hmat(K1), (1, K1, K1)), (M, K1, K1))
            y = ldot(h, tl.reshape(t, (M, K1, K2)), PREC)
        y = tl.reshape(y, (M, K))
    else:
        K2: tl.constexpr = K // K1
        y = dot(tl.reshape(x, (M * K1, K2)), hmat(K2), PREC)
        y = tl.permute(tl.reshape(y, (M, K1, K2)), (0, 2, 1))
        y = dot(tl.reshape(y, (M * K2, K1)), hmat(K1), PREC)
        y = tl.reshape(tl.permute(tl.reshape(y, (M, K2, K1)), (0, 2, 1)), (M, K))
    return y


@triton.jit
def had_first(x, K: tl.constexpr, N: tl.constexpr, K1: tl.constexpr, PREC: tl.constexpr,
               FORM: tl.constexpr):
    """H_K along axis 0 of a (K, N) tile, K = K1 K2 (K1 = 1: one product), x viewed as
    K1 x K2 x N: "sandwich" applies H_K2 to each of the K1 blocks, then H_K1 across them,
    both from the left, with no transposes (where N >= 16); "transpose" moves the axes."""
    if K1 == 1:
        y = tl.trans(dot(tl.trans(x), hmat(K), PREC))
    elif FORM == "sandwich" and N >= 16:
        K2: tl.constexpr = K // K1
        h = tl.broadcast_to(tl.reshape(hmat(K2), (1, K2, K2)), (K1, K2, K2))
        t = ldot(h, tl.reshape(x, (K1, K2, N)), PREC)
        y = tl.reshape(ldot(hmat(K1), tl.reshape(t, (K1, K2 * N)), PREC), (K, N))
    else:
        K2: tl.constexpr = K // K1
        y = tl.permute(tl.reshape(x, (K1, K2, N)), (0, 2, 1))
        y = dot(tl.reshape(y, (K1 * N, K2)), hmat(K2), PREC)
        y = tl.permute(tl.reshape(y, (K1, N, K2)), (2, 1, 0))
        y = dot(tl.reshape(y, (K2 * N, K1)), hmat(K1), PREC)
        y = tl.reshape(tl.permute(tl.reshape(y, (K2, N, K1)), (2, 0, 1)), (K, N))
    return y


@triton.jit
def flag(STATUS, bad, bit: tl.constexpr, word, value):
    """OR ``bit`` into the status word and raise word ``word`` to ``value`` where ``bad``."""
    tl.atomic_or(STATUS, bit, mask=bad)
    tl.atomic_max(STATUS + word, value, mask=bad)


@triton.jit
def norm_bad(m, limit):
    """A max norm that is negative, NaN, infinite, or at or beyond ``limit``
    (common.norm_limit, below common.NORM_MARK)."""
    return (m != m) | (m < 0.0) | (m >= limit)
