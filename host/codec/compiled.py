"""The compiled CPU backend: thc.py's operations on host/codec/fastcodec.py's C code, one
call for all slices. Slice norms of tensors keep torch's norm (the reference's). Its checks
raise at once (``status``, the kernels' deferred status word, is not used here)."""
from __future__ import annotations

import numpy as np

from thc.codec import fastcodec, reference
from thc.codec.common import (NonFiniteInput, Prepared, check_norms, check_sums, decode_live,
                              encode_coef, norm_array, rounding_key)
from thc.codec.hadamard import is_torch
from thc.codec.packing import pack_bits
from thc.codec.params import THCParams

NAME = "compiled"


def norms(flat, params: THCParams, lay):
    """numpy arrays: sums of squares in C (in float64, as the reference's)."""
    if is_torch(flat):
        return reference.norms(flat, params, lay)
    out = np.sqrt(fastcodec.sumsq(fastcodec.as_numpy(flat), params.slice_size)) \
        .astype(np.float32)
    check_norms(out, params)
    return out


def prepare(flat, params: THCParams, lay, round: int, backend: str,
            status=None) -> Prepared:
    return Prepared(flat, round, norms(flat, params, lay), {}, backend, params)


EXACT_TABLE = 1 << 24
"""The largest g whose table values float32 holds exactly, as the C code compares them with
the rotated values: past it, a value float32 rounds down takes another interval than the
reference's exact one, so such a table encodes on the reference."""


def encode(flat, lay, max_norms, params: THCParams, round: int, generator, pack: bool,
           scratch=None, status=None, norms=None):
    if params.granularity > EXACT_TABLE:
        return reference.encode(flat, lay, max_norms, params, round, generator, pack,
                                scratch, status, norms)
    m = norm_array(max_norms, lay.n_slices, params)
    coef = encode_coef(m, params).astype(np.float32)
    # max norms of at least half the slices' own norms keep every scaled value within g / t_p,
    # so no coordinate can overflow and the first rotated coordinate still shows a NaN or Inf
    # of the input: the scan of every coordinate is left out (a few percent of an encode)
    own = None if norms is None else np.asarray(
        norms.detach().cpu().numpy() if is_torch(norms) else norms, np.float64).reshape(-1)
    check = own is None or own.shape != m.shape or not bool(np.all(2.0 * m >= own))
    key = rounding_key(generator, flat)
    # the C code packs whole bytes per slice: 4-bit indices, slices of even length
    packed = pack and params.bits == 4 and (params.slice_size % 2 == 0 or lay.n_slices <= 1)
    out, first = fastcodec.encode(fastcodec.as_numpy(flat), params.slice_size, coef,
                                  params.seed, round, key, params.table, packed, check)
    bad = np.flatnonzero(~np.isfinite(first))
    if bad.size:
        raise NonFiniteInput(f"input contains NaN or Inf (or values so large for the max norms "
                             f"given that the rotation overflows float32) in slices "
                             f"{bad[0]}..{bad[-1]}")
    if pack and not packed:
        out = pack_bits(out, params.bits)
    if is_torch(flat):
        import torch
        return torch.from_numpy(out)
    return out


def decode(sums, n: int, max_norms, lay, params: THCParams, round: int, out,
           own_table=None, status=None):
    """With ``own_table`` the sums are one worker's indices, mapped through the table on the
    fly."""
    indices = own_table is not None
    m = norm_array(max_norms, lay.n_slices, params)
    g, t = params.granularity, params.t_p
    d = np.full(lay.n_slices, float(params.slice_size))
    if lay.tail:
        d[-1] = lay.tail_padded
    alpha = (2.0 * t * m * decode_live(m, params) / (g * d * n)).astype(np.float32)
    s = fastcodec.as_numpy(sums)
    if indices:
        s, kind = np.require(s, np.uint8, "CA"), "index"
    else:
        s, kind = fastcodec.sums_kind(s)
    dst = fastcodec.as_numpy(out) if is_torch(out) else out
    # a tensor autograd tracks takes the decode through torch's own copy, which it records
    # (an ``out`` over the sums: thc.decode gives a copy of them)
    direct = dst.flags.c_contiguous and dst.flags.writeable and dst.flags.aligned and \
        (not is_torch(out) or (dst.ctypes.data == out.data_ptr() and not out.requires_grad))
    if direct and is_torch(out):
        # the C code writes behind torch's back: an in-place op on none of it refuses what
        # torch refuses (an inference tensor) and counts the write for autograd, which then
        # refuses a backward through the values it overwrites (a tensor it saved)
        out.view(-1)[:0].zero_()
    if not direct:
        dst = np.empty(lay.numel, np.float32)
    seen = fastcodec.decode(s, kind, lay.numel, params.slice_size, alpha, n * g / 2.0,
                            params.seed, round, dst, params.table if indices else None)
    if seen is not None and not indices and (seen[0] < 0 or seen[1] > n * g):
        check_sums(int(s.min()), int(s.max()), n, params)   # exact where uint64 wraps
    if not direct:
        if is_torch(out):
            import torch
            out.copy_(torch.from_numpy(dst))
        else:
            out[...] = dst
    return out
