"""Fused Triton kernels of THC's encode and decode (CUDA tensors, or CPU tensors under Triton's
interpreter, TRITON_INTERPRET=1, which is how the tests check them without a GPU).

Why this shape: a slice of d = 2^L coordinates (2^20 by default, 4 MiB) does not fit on chip,
so it is viewed as an R x C matrix (d = R C, index i = row C + col) and H_d = H_R (x) H_C is
applied in two passes, each on chip:

- encode pass 1 (rows): load x (float32, or float16/bfloat16 as they are), add up its squares
  (the slice norms of the MAX round come from this read; a NaN or Inf is flagged), apply the
  rotation signs (host/codec/rng.py, from the slice's key), transform rows with H_C, store
  float32 scratch. Only pass 2 needs the agreed max norm, so pass 1 can run before the MAX
  round. A program runs several row tiles, loading the next while it transforms one. A
  small kernel then finishes each slice's norm from its programs' parts.
- encode pass 2 (columns): transform whole columns with H_R, scale by g / (2 t_p M) (M, the
  agreed max norm, read here), shift by g/2, truncate to [0, g], round stochastically onto
  the table (uniforms from the counter-based generator), store indices (two a byte at b = 4).
  A coordinate the scale made infinite is flagged; the tile is searched for one only where
  the slice's own norm, from pass 1, does not rule it out (never, in a round: M is at least
  that norm).
- decode pass 1: load the sums (any integer width) or a worker's own indices (mapped through
  the table), subtract n g/2, transform rows; pass 2: transform columns, scale by
  2 t_p M / (g d n), apply the signs, store the unpadded float32 result.

Each H_K on chip is one or two small dense ±1 products (K = K1 K2, factors of 16..64 built in
registers from the parity of i & j) on the tensor cores: H's entries are exact in TF32, so
each product is split into x's TF32 head and the rest ("tf32x2": two TF32 products whose sum
keeps about 22 of float32's 24 bits). Two factors are laid out one of two ways (``FORM``).
Slices of fewer than 2^8 or more than 2^24 coordinates (a short tail slice) are left to the
reference path by the caller.

Nothing here waits for the device. Bad input is flagged in a status word on the device
(host/codec/common.py's ``status_word``) that the caller reads when it chooses
(host/codec/kernels.py): a NaN or Inf in x, a max norm that is negative or not finite, an
index outside the table.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from thc.codec import rng
from thc.codec.common import (BAD_INDEX, BAD_INPUT, BAD_NORMS, BAD_SUM, INDEX_CAP,
                              OVERFLOW_MARK, norm_floor, norm_limit)
from thc.codec.triton_onchip import (block, flag, had_first, had_last, norm_bad,
                                     program_key, round_prefix, signed)

MIN_LOG, MAX_LOG = 8, 24
"""Slice lengths 2^8..2^24 run here; others take the reference path."""
TILE, TILE_COLS = 4096, 4096
"""float32 elements a program holds: rows x C in the row passes, R x columns in the column
passes."""
NUM_WARPS, NUM_WARPS_COLS = 4, 8
COLS_FIRST = True
"""Order of the column passes' programs (one flat grid): column blocks of one slice next to
each other (True: the rows they read share DRAM pages) or one column block of every slice."""
COLS_LOG = 12
"""The smallest log2 C a slice is split with where it can be (12: a 2^20 slice is 256 x 4096,
so a column pass reads 64 bytes of each row; 0: 1024 x 1024)."""
ROW_TILES = 4
"""Tiles a program of the row passes runs one after another, loading the next before it
transforms the current one, so that its loads overlap its own arithmetic (fewer where the grid
would fall below ``MIN_PROGRAMS`` programs). The column passes run one tile a program: more
registers cost them more than the overlap gains (`thc bench kernels`, docs/results.md)."""
MIN_PROGRAMS = 1024
# Tiles, warps, order and split: the fastest of ten settings for encode plus decode at 2^26
# on an H200 (`thc bench kernels --configs`, docs/results.md).
PRECISIONS = ("tf32x2", "ieee", "tf32x3", "tf32")
"""How the ±1 products run: tf32x2 (the default, above); ieee (float32 FMAs, no tensor cores);
tf32x3 (Triton's three-product split); tf32 (one product: 10 bits of x, only for timing)."""
PRECISION = "tf32x2"
FORMS = ("sandwich", "transpose")
"""How a two-factor H_K is laid out on chip (see :func:`thc.codec.triton_onchip.had_last`): both
give the same values; sandwich, the default, is the faster on an H200 (`thc bench kernels
--configs ';FORM=transpose'`, docs/results.md)."""
FORM = "sandwich"
_INPUT, _NORMS, _INDEX = tl.constexpr(BAD_INPUT), tl.constexpr(BAD_NORMS), tl.constexpr(BAD_INDEX)
_SUM = tl.constexpr(BAD_SUM)
_INDEX_CAP = tl.constexpr(INDEX_CAP)


def supports(padded: int) -> bool:
    """Whether a slice padded to ``padded`` coordinates runs in these kernels."""
    log = int(padded).bit_length() - 1
    return padded == 1 << log and MIN_LOG <= log <= MAX_LOG


def _axis_factor(log: int) -> int:
    """K1 of an axis of 2^log (1: one dense product) with both factors in 16..64."""
    return 1 if log <= 6 else 1 << (log // 2)


def _split(log: int) -> tuple[int, int]:
    """(log R, log C) with each side either 2^4..2^6 (one product) or 2^8..2^12 (two), C at
    least 2^COLS_LOG where it can be, else at least the square root, else any."""
    starts = (max((log + 1) // 2, COLS_LOG), (log + 1) // 2, 4)
    for c in (c for a in starts for c in range(a, log - 3)):
        if all(4 <= e <= 6 or 8 <= e <= 12 for e in (log - c, c)):
            return log - c, c
    raise ValueError(f"no R x C split for a slice of 2^{log}")


KEYED = {"_encode_rows": "prefix", "_encode_cols": "uprefix", "_decode_cols": "prefix"}
"""Each kernel's key prefix, a 64-bit hash: a launch on a GPU makes an int argument equal to
1 a compile-time constant, which the key schedule cannot bitcast (a compile error once in
2^64 keys), so these are never specialized."""


@triton.jit(do_not_specialize=[KEYED["_encode_rows"]])
def _encode_rows(X, TMP, PART, STATUS, prefix, ROUND, first, length, d,
                 C: tl.constexpr, C1: tl.constexpr, BM: tl.constexpr, PREC: tl.constexpr,
                 FORM: tl.constexpr, DEV_ROUND: tl.constexpr, TILES: tl.constexpr):
    s = tl.program_id(0)
    ph, pg = round_prefix(prefix, ROUND, DEV_ROUND)
    k0, k1 = program_key(ph, pg, first, s)
    src, dst = X + s.to(tl.int64) * length, TMP + s.to(tl.int64) * d
    rows = tl.program_id(1) * (BM * TILES) + tl.arange(0, BM)
    i = rows[:, None] * C + tl.arange(0, C)[None, :]
    x = tl.load(src + i, mask=i < length, other=0.0)
    acc = tl.zeros((BM,), tl.float64)
    for t in tl.static_range(TILES):
        if t + 1 < TILES:
            ahead = tl.load(src + i + BM * C, mask=i + BM * C < length, other=0.0)
        x = x.to(tl.float32)
        wide = x.to(tl.float64)
        acc += tl.sum(wide * wide, 1)
        tl.store(dst + i, had_last(signed(x, rows, 0, k0, k1, BM, C, C), BM, C, C1, PREC,
                                    FORM))
        if t + 1 < TILES:
            x, rows, i = ahead, rows + BM, i + BM * C
    ssq = tl.sum(acc, 0)
    # this program's part of the slice's sum of squares (float64: finite float32 squares
    # neither overflow nor underflow it), added up after; inf - inf and NaN are not 0
    tl.store(PART + s * tl.num_programs(1) + tl.program_id(1), ssq)
    flag(STATUS, (ssq - ssq) != 0.0, _INPUT, 1, first + s + 1)


@triton.jit
def _finish_norms(PART, NORMS, STATUS, first, parts, limit, mark, P: tl.constexpr):
    s = tl.program_id(0)
    j = tl.arange(0, P)
    ssq = tl.sum(tl.load(PART + s * parts + j, mask=j < parts, other=0.0), 0)
    nrm = tl.sqrt(ssq).to(tl.float32)
    bad = ~(nrm < limit)
    flag(STATUS, bad, _INPUT, 1, first + s + 1)
    tl.store(NORMS + s, tl.where(bad, mark, nrm))


@triton.jit
def _col_block(count, NB: tl.constexpr, FIRST: tl.constexpr):
    """(slice, column block) of this program of a flat grid of count x NB."""
    pid = tl.program_id(0)
    if FIRST:
        return pid // NB, pid % NB
    return pid % count, pid // count


@triton.jit(do_not_specialize=[KEYED["_encode_cols"]])
def _encode_cols(TMP, OUT, MAXN, OWN, STATUS, uprefix, ROUND, first, count, LOWER, BASE, WIDTH,
                 d, g, scale, limit, floor, reach, R: tl.constexpr, C: tl.constexpr,
                 R1: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, FORM: tl.constexpr,
                 PACK: tl.constexpr, FIRST: tl.constexpr, DEV_ROUND: tl.constexpr,
                 HAS_OWN: tl.constexpr):
    s, nb = _col_block(count, C // BN, FIRST)
    m = tl.load(MAXN + first + s).to(tl.float32)
    flag(STATUS, norm_bad(m, limit) & (nb == 0), _NORMS, 2, first + s + 1)
    # a norm under the floor (common.norm_floor): encoded as a zero slice, as encode_coef does
    live = m >= floor
    coef = tl.where(live, tl.minimum(scale / tl.where(live, m, 1.0), 3.4028234663852886e38),
                    0.0)
    rows = tl.arange(0, R)
    i = rows[:, None] * C + (nb * BN + tl.arange(0, BN))[None, :]
    y = tl.load(TMP + s.to(tl.int64) * d + i)
    z = had_first(y, R, BN, R1, PREC, FORM) * coef + 0.5 * g
    # a value the transform made too large for the max norm given: inf, or NaN past inf - inf.
    # Every coordinate is at most ``reach`` times the slice's own norm (see encode_cols), so
    # where that bound is finite after the scale no coordinate can overflow and the tile's
    # reduction is skipped: always, for a max norm at least the slice's own
    sure = False
    if HAS_OWN:
        sure = coef * (tl.load(OWN + first + s) * reach) + g < 3.0e38
    if not sure:
        overflow = tl.max(tl.max(((z - z) != 0.0).to(tl.int32), 1), 0) > 0
        flag(STATUS, overflow, _INPUT, 1, first + s + 1)
    u = tl.minimum(tl.maximum(z, 0.0), g)
    k = tl.maximum(tl.minimum(u.to(tl.int32), g - 1), 0)
    lower = tl.load(LOWER + k).to(tl.int32)
    ph, pg = round_prefix(uprefix, ROUND, DEV_ROUND)
    uk0, uk1 = program_key(ph, pg, first, s)
    r = (block(i.to(tl.uint32), uk0, uk1) >> 8).to(tl.float32) * 5.9604644775390625e-08
    # r < (u - base) / width decided exactly (one rounding, no division; width > 0)
    idx = lower + (tl.fma(r, tl.load(WIDTH + k), tl.load(BASE + k) - u) < 0.0).to(tl.int32)
    if PACK:
        hi, lo = tl.split(tl.reshape(idx, (R, BN // 2, 2)))
        j = rows[:, None] * (C // 2) + (nb * (BN // 2) + tl.arange(0, BN // 2))[None, :]
        tl.store(OUT + s.to(tl.int64) * (d // 2) + j, ((hi << 4) | lo).to(tl.uint8))
    else:
        tl.store(OUT + s.to(tl.int64) * d + i, idx.to(tl.uint8))


@triton.jit
def _decode_rows(S, TMP, TABLE, STATUS, centre, d, levels, top,
                 C: tl.constexpr, C1: tl.constexpr, BM: tl.constexpr, PREC: tl.constexpr,
                 FORM: tl.constexpr, LOOKUP: tl.constexpr, TILES: tl.constexpr):
    s = tl.program_id(0)
    src, dst = S + s.to(tl.int64) * d, TMP + s.to(tl.int64) * d
    i = (tl.program_id(1) * (BM * TILES) + tl.arange(0, BM))[:, None] * C + \
        tl.arange(0, C)[None, :]
    v = tl.load(src + i)
    for t in tl.static_range(TILES):
        if t + 1 < TILES:
            ahead = tl.load(src + i + BM * C)
        if LOOKUP:
            # compared at full width: a wide index must not wrap into the table
            w = v.to(tl.int64)
            bad = (w < 0) | (w >= levels)
            seen = tl.max(tl.max(tl.where(bad, tl.minimum(tl.maximum(w, -1), _INDEX_CAP), -2),
                                 1), 0)
            flag(STATUS, seen != -2, _INDEX, 3, seen.to(tl.int32) + 2)
            v = tl.load(TABLE + tl.where(bad, 0, w).to(tl.int32))
        else:
            # a sum that n workers' table values cannot make (decoded with the wrong n)
            w = v.to(tl.int64)
            bad = (w < 0) | (w > top)
            seen = tl.max(tl.max(tl.where(bad, tl.minimum(tl.maximum(w, -1), _INDEX_CAP), -2),
                                 1), 0)
            flag(STATUS, seen != -2, _SUM, 4, seen.to(tl.int32) + 2)
        tl.store(dst + i, had_last(v.to(tl.float32) - centre, BM, C, C1, PREC, FORM))
        if t + 1 < TILES:
            v, i = ahead, i + BM * C


@triton.jit(do_not_specialize=[KEYED["_decode_cols"]])
def _decode_cols(TMP, OUT, MAXN, STATUS, prefix, ROUND, first, count, length, d, scale, limit,
                 floor, R: tl.constexpr, C: tl.constexpr, R1: tl.constexpr, BN: tl.constexpr,
                 PREC: tl.constexpr, FORM: tl.constexpr, FIRST: tl.constexpr,
                 DEV_ROUND: tl.constexpr):
    s, nb = _col_block(count, C // BN, FIRST)
    m = tl.load(MAXN + first + s).to(tl.float32)
    flag(STATUS, norm_bad(m, limit) & (nb == 0), _NORMS, 2, first + s + 1)
    rows = tl.arange(0, R)
    i = rows[:, None] * C + (nb * BN + tl.arange(0, BN))[None, :]
    y = tl.load(TMP + s.to(tl.int64) * d + i)
    z = had_first(y, R, BN, R1, PREC, FORM) * tl.where(m >= floor, scale * m, 0.0)
    ph, pg = round_prefix(prefix, ROUND, DEV_ROUND)
    k0, k1 = program_key(ph, pg, first, s)
    z = signed(z, rows, nb * BN, k0, k1, R, C, BN)
    tl.store(OUT + s.to(tl.int64) * length + i, z, mask=i < length)


class Shape:
    """Tile sizes of one slice length (all compile-time constants of the kernels)."""

    def __init__(self, padded: int):
        log = int(padded).bit_length() - 1
        lr, lc = _split(log)
        self.R, self.C = 1 << lr, 1 << lc
        self.R1, self.C1 = _axis_factor(lr), _axis_factor(lc)
        self.BM = max(1, min(self.R, TILE // self.C))
        self.BN = max(2, min(self.C, TILE_COLS // self.R))

    def tiles(self, count: int) -> int:
        """Row tiles a program runs for ``count`` slices (see ROW_TILES): a power of two, so
        that the programs cover every tile of a slice."""
        per_slice = self.R // self.BM
        t = 1 << (max(1, min(ROW_TILES, per_slice)).bit_length() - 1)
        while t > 1 and count * per_slice // t < MIN_PROGRAMS:
            t //= 2
        return t


def _prefix(seed: int, round_, stream: int, st):
    """(prefix, ROUND, DEV_ROUND) of the kernels' key schedule, the prefix's 64-bit state as
    the int64 they take (they finish each slice's key: no per-slice key table is computed on
    the host or copied to the device). ``round_``: an int (the prefix is finished here; ``st``
    fills the unused pointer) or a device int64 tensor the kernels read it from."""
    if isinstance(round_, torch.Tensor):
        p, ptr = rng.seed_state(seed, stream), round_
    else:
        p, ptr = rng.key_prefix(seed, round_, stream), st
    return (p - (1 << 64) if p >= 1 << 63 else p), ptr, ptr is round_


_LUTS: dict = {}


def _luts(table: tuple[int, ...], device):
    """(lower index, lower value, width) per unit step of [0, g], on the device."""
    key = (table, device)
    if key not in _LUTS:
        from thc.codec.quantize import segments
        lower, base, width = segments(table)
        _LUTS[key] = (torch.from_numpy(lower.astype(np.int32)).to(device),
                      torch.from_numpy(base).to(device), torch.from_numpy(width).to(device))
    return _LUTS[key]


def encode_rows(flat, grp, seed: int, round_: int, st):
    """Encode pass 1 of one group of equal slices of ``flat`` (contiguous; float32, float16
    or bfloat16): the signed, row-transformed scratch and each program's part of its slice's
    sum of squares (float64, from the same read of x; see :func:`finish_norms`); a NaN or
    Inf is flagged in ``st``."""
    sh, dev, d = Shape(grp.padded), flat.device, grp.padded
    x = flat[grp.start: grp.start + grp.count * grp.length]
    tmp = torch.empty(grp.count * d, dtype=torch.float32, device=dev)
    rt = sh.tiles(grp.count)
    part = torch.empty((grp.count, sh.R // sh.BM // rt), dtype=torch.float64, device=dev)
    pfx, rnd, on_dev = _prefix(seed, round_, rng.SIGN_STREAM, st)
    _encode_rows[part.shape](x, tmp, part, st, pfx, rnd, grp.first, grp.length, d, C=sh.C,
                             C1=sh.C1, BM=sh.BM, PREC=PRECISION, FORM=FORM, DEV_ROUND=on_dev,
                             TILES=rt, num_warps=NUM_WARPS)
    return tmp, part


def finish_norms(part, grp, params, st, out):
    """The group's slice norms from :func:`encode_rows`'s parts into ``out`` (float32), as
    common.wide_norms makes them (one not finite or beyond common.norm_limit flagged in
    ``st`` and sent as common.OVERFLOW_MARK), in one launch where small torch operations
    took seventeen: a small bucket's time is mostly launches (docs/results.md)."""
    parts = part.shape[1]
    _finish_norms[(grp.count,)](part, out, st, grp.first, parts, norm_limit(params),
                                OVERFLOW_MARK, P=triton.next_power_of_2(parts))


REACH = 2.0
"""A bound on a coordinate of the two passes' transform over sqrt(d) times the slice's norm:
exactly it is at most the sum of |x|, so at most sqrt(d) |x| (Cauchy-Schwarz); the products'
roundings (float32 sums of at most a few hundred terms, tf32x2's split) add under 0.1%."""


def encode_cols(tmp, grp, max_norms, params, round_: int, uniform_seed: int, out, pack: bool,
                st, own=None):
    """Encode pass 2 of one group: column transform, scale by g / (2 t_p M) from the device
    tensor ``max_norms`` (all slices'), truncation, stochastic rounding into ``out`` (uint8
    indices, or packed b = 4 bytes when ``pack``); bad max norms are flagged in ``st``, and
    so is a coordinate the scale made infinite. ``own``: the slices' own norms (all slices',
    as :func:`finish_norms` made them from the scratch ``tmp``), which spare that check its
    reduction over every tile where the scale cannot overflow."""
    sh, dev, d = Shape(grp.padded), tmp.device, grp.padded
    table = tuple(int(v) for v in params.table)
    upfx, rnd, on_dev = _prefix(uniform_seed, round_, rng.UNIFORM_STREAM, st)
    lower, base, width = _luts(table, dev)
    g = params.granularity
    _encode_cols[(grp.count * (sh.C // sh.BN),)](
        tmp, out, max_norms, max_norms if own is None else own, st, upfx, rnd, grp.first,
        grp.count, lower, base, width, d, g, g / (2.0 * params.t_p), norm_limit(params),
        norm_floor(params), REACH * math.sqrt(d), R=sh.R, C=sh.C, R1=sh.R1, BN=sh.BN,
        PREC=PRECISION, FORM=FORM, PACK=pack, FIRST=COLS_FIRST, DEV_ROUND=on_dev,
        HAS_OWN=own is not None, num_warps=NUM_WARPS_COLS)


def decode_rows(values, grp, n: int, params, st, table=None):
    """Decode pass 1 of one group: ``values`` are the group's sums of ``n`` workers (any
    integer dtype), flagged in ``st`` beyond 0..n g, or, with ``table`` (on the device), one
    worker's indices, flagged where outside it. Returns the float32 scratch."""
    sh, d = Shape(grp.padded), grp.padded
    tmp = torch.empty(grp.count * d, dtype=torch.float32, device=values.device)
    lookup, rt = table is not None, sh.tiles(grp.count)
    _decode_rows[(grp.count, sh.R // sh.BM // rt)](
        values, tmp, table if lookup else values, st, n * params.granularity / 2.0, d,
        params.levels, n * params.granularity, C=sh.C, C1=sh.C1, BM=sh.BM, PREC=PRECISION,
        FORM=FORM, LOOKUP=lookup, TILES=rt, num_warps=NUM_WARPS)
    return tmp


def decode_cols(tmp, grp, max_norms, n: int, params, round_: int, out, st):
    """Decode pass 2 of one group into ``out`` (its unpadded float32 coordinates), scaled by
    2 t_p M / (g d n) from the device tensor ``max_norms``, flagged in ``st`` if bad."""
    sh, d = Shape(grp.padded), grp.padded
    pfx, rnd, on_dev = _prefix(params.seed, round_, rng.SIGN_STREAM, st)
    _decode_cols[(grp.count * (sh.C // sh.BN),)](
        tmp, out, max_norms, st, pfx, rnd, grp.first, grp.count, grp.length, d,
        2.0 * params.t_p / (params.granularity * d * n), norm_limit(params), norm_floor(params),
        R=sh.R, C=sh.C, R1=sh.R1, BN=sh.BN, PREC=PRECISION, FORM=FORM, FIRST=COLS_FIRST,
        DEV_ROUND=on_dev, num_warps=NUM_WARPS_COLS)


def decode_group(values, grp, max_norms, n: int, params, round_: int, out, st, table=None):
    """Both decode passes of one group (see :func:`decode_rows`, :func:`decode_cols`)."""
    decode_cols(decode_rows(values, grp, n, params, st, table), grp, max_norms, n, params,
                round_, out, st)
