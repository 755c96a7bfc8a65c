"""The Triton backend: thc.py's operations on the fused kernels of
host/codec/triton_kernels.py, one group per run of equal slices; a slice length the kernels
do not take goes through the reference code with the kernels' rounding draws. The kernel
module comes as an argument: importing it needs triton, and thc.py decides whether it can."""
from __future__ import annotations

import numpy as np

from thc.codec import reference, rng
from thc.codec.common import (WHOLE, Prepared, check_finite, check_generator,
                               check_norms_finite, encode_coef, norm_array, raise_bad_norms,
                               rounding_key, same_place, view)
from thc.codec.hadamard import is_torch
from thc.codec.packing import pack_bits
from thc.codec.params import THCParams

NAME = "triton"


def device_norms(max_norms, n_slices: int, groups, kern, x):
    """Max norms kept on x's device, with their check as a device flag, where every group runs
    in the kernels: a host copy here would stall the stream once per call. None elsewhere
    (then :func:`thc.codec.common.norm_array` checks them on the host)."""
    if not is_torch(max_norms) or not same_place(max_norms.device, x.device) \
            or not all(kern.supports(grp.padded) for grp in groups):
        return None
    import torch
    m = max_norms.detach().reshape(-1)
    if m.numel() != n_slices:
        raise ValueError(f"expected {n_slices} max norms (one per slice), got {m.numel()}")
    m = m.to(torch.float64)
    return m, torch.isfinite(m).all() & (m >= 0).all()


def prepare(kern, flat, params: THCParams, lay, round: int, backend: str) -> Prepared:
    """Norms and encode pass 1 from one read of x."""
    import torch
    flat = flat.contiguous()
    parts, scratch = [], {}
    for grp in lay.groups(WHOLE):
        if kern.supports(grp.padded):
            scratch[grp.first], nrm = kern.encode_rows(flat, grp, params.seed, round)
        else:
            nrm = torch.linalg.vector_norm(view(flat, grp), dim=1)
        parts.append(nrm)
    norms = torch.cat(parts) if parts else flat.new_zeros(0)
    check_norms_finite(norms)
    return Prepared(flat, round, norms, scratch, backend)


def encode(kern, flat, lay, max_norms, params: THCParams, round: int, generator, pack: bool,
           scratch=None):
    import torch
    groups = list(lay.groups(WHOLE))
    on_device = device_norms(max_norms, lay.n_slices, groups, kern, flat)
    m = None if on_device else norm_array(max_norms, lay.n_slices)
    g, t = params.granularity, params.t_p
    table = tuple(int(v) for v in params.table)
    check_generator(generator, flat)
    # packed groups start on whole bytes when slices have an even length
    fused = pack and params.bits == 4 and params.slice_size >= 2
    flat = flat.contiguous()
    key = rounding_key(generator, flat)
    out = torch.empty((lay.total_padded + 1) // 2 if fused else lay.total_padded,
                      dtype=torch.uint8, device=flat.device)
    if on_device:
        md, norms_ok = on_device
        coef = torch.where(md > 0, g / (2.0 * t * torch.where(md > 0, md, 1.0)), 0.0) \
            .to(torch.float32)
    else:
        coef = encode_coef(m, params)
    draw = lambda u, idx: rng.uniforms(u.shape[1], key, round, idx, like=flat)  # noqa: E731
    for grp in groups:
        c = coef[grp.first: grp.first + grp.count]
        if kern.supports(grp.padded):
            a, n = (grp.padded_start // 2, grp.count * grp.padded // 2) if fused else \
                (grp.padded_start, grp.count * grp.padded)
            tmp = scratch.get(grp.first) if scratch else None
            if tmp is None:
                tmp, _ = kern.encode_rows(flat, grp, params.seed, round)
            first = kern.encode_cols(tmp, grp, c, table, round, key, out[a: a + n], fused)
            if on_device:
                # one wait for the norms' and the input's checks together
                if not bool(torch.isfinite(first).all() & norms_ok):
                    if not bool(norms_ok):
                        raise_bad_norms(md)
                    check_finite(first, grp)
            else:
                check_finite(first, grp)
            continue
        if fused:
            dst = torch.empty((grp.count, grp.padded), dtype=torch.uint8, device=flat.device)
            reference.round_group(flat, grp, c, params, round, table, draw, dst)
            a = grp.padded_start // 2
            out[a: a + (dst.numel() + 1) // 2] = pack_bits(dst, 4)
            continue
        dst = out[grp.padded_start: grp.padded_start + grp.count * grp.padded]
        reference.round_group(flat, grp, c, params, round, table, draw,
                              dst.reshape(grp.count, grp.padded))
    if pack and not fused:
        return pack_bits(out, params.bits)
    return out


def decode(kern, sums, n: int, max_norms, lay, params: THCParams, round: int, out,
           own_table=None):
    import torch
    sums = sums.contiguous()
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    groups = list(lay.groups(WHOLE))
    on_device = device_norms(max_norms, lay.n_slices, groups, kern, sums)
    m = on_device[0] if on_device else norm_array(max_norms, lay.n_slices)
    centre = n * params.granularity / 2.0
    for grp in groups:
        alpha = reference.alphas(m, grp, params, n)
        alpha = alpha.to(torch.float32) if on_device else alpha.astype(np.float32)
        s = sums[grp.padded_start: grp.padded_start + grp.count * grp.padded]
        dst = out[grp.start: grp.start + grp.count * grp.length]
        if kern.supports(grp.padded):
            kern.decode_group(s, grp, alpha, centre, params.seed, round, dst, own_table)
        else:
            reference.decode_group(s, grp, alpha, centre, params, round, dst, own_table)
    if on_device and not bool(on_device[1]):
        raise_bad_norms(on_device[0])
    return out
