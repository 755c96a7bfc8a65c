"""The Triton backend: thc.py's operations on the fused kernels of
host/codec/triton_kernels.py, one group per run of equal slices; a slice length the kernels
do not take goes through the reference code with the kernels' rounding draws. The kernel
module comes as an argument: importing it needs triton, and thc.py decides whether it can.

No operation here waits for the device when the caller passes a status word (``status``,
see :func:`thc.codec.common.status_word`): the max norms stay on the device, the kernels
read them and flag bad input into the word, and the caller reads it when it already waits
(``THCCodec(deferred_checks=True)``, then ``check()``). Without one, each call reads its own
word once at its end and raises at once. A short tail slice the kernels do not take still
reads the max norms on the host.
"""
from __future__ import annotations

import numpy as np

from thc.codec import reference, rng
from thc.codec.common import (BAD_SUM, INDEX_CAP, WHOLE, Prepared, check_generator,
                               check_indices, check_norm_type, encode_coef, flag, norm_array,
                               raise_status, rounding_key, same_place, status_word, view,
                               wide_norms)
from thc.codec.hadamard import is_torch
from thc.codec.packing import pack_bits
from thc.codec.params import THCParams

NAME = "triton"


def device_norms(max_norms, n_slices: int, device, params: THCParams):
    """The agreed max norms as a flat tensor on ``device`` for the kernels to read: a
    tensor already there is used as it is (checked in the kernels), anything else is
    checked on the host and copied."""
    import torch
    if is_torch(max_norms) and same_place(max_norms.device, device):
        m = max_norms.detach().reshape(-1)
        check_norm_type(not (m.is_complex() or m.dtype == torch.bool), m.dtype)
        if m.numel() != n_slices:
            raise ValueError(f"expected {n_slices} max norms (one per slice), got {m.numel()}")
        return (m if m.is_floating_point() else m.float()).contiguous()
    m = norm_array(max_norms, n_slices, params)
    return torch.from_numpy(m.astype(np.float32)).to(device)


def _host_norms(kern, groups, md, lay, params: THCParams):
    """The max norms checked on the host, where a group goes through the reference code:
    read before any kernel runs, so a call that raises here has flagged nothing."""
    if all(kern.supports(grp.padded) for grp in groups):
        return None
    return norm_array(md, lay.n_slices, params)


def _device_round(kern, groups, round) -> None:
    """A round held on the device (an int64 tensor the kernels read, so that a CUDA graph
    replays each round with the device's number) needs every slice in the kernels: the
    reference code a short tail slice takes would read it on the host."""
    if is_torch(round) and not all(kern.supports(grp.padded) for grp in groups):
        raise ValueError("a round held on the device needs every slice in the kernels "
                         "(2^8 or more coordinates): pad a short tail slice")


def _settle(word, status, params: THCParams, max_norms=None) -> None:
    """Without a caller's status word, read this call's own now: one wait, errors at once."""
    if status is None:
        raise_status(word.tolist(), params, max_norms)


KERNEL_GRANULARITY = 1 << 24
"""The largest g the kernels take: they round through per-step tables of g entries on the
device (quantize.segments, 12 bytes an entry there: 192 MiB at this g)."""


def check_granularity(params: THCParams) -> None:
    """Refuse a g beyond :data:`KERNEL_GRANULARITY` before a round's MAX round, not in its
    encode after it (where tables of gigabytes would be built); encode and decode called
    on their own refuse it too."""
    if params.granularity > KERNEL_GRANULARITY:
        raise ValueError(f"the Triton kernels take a granularity of at most "
                         f"{KERNEL_GRANULARITY} (got {params.granularity}); the CPU codecs "
                         f"take any")


def prepare(kern, flat, params: THCParams, lay, round: int, backend: str,
            status=None) -> Prepared:
    """Norms and encode pass 1 from one read of x."""
    import torch
    check_granularity(params)
    flat = flat.contiguous()
    word = status if status is not None else status_word(flat.device)
    scratch = {}
    groups = list(lay.groups(WHOLE))
    _device_round(kern, groups, round)
    norms = torch.empty(lay.n_slices, dtype=torch.float32, device=flat.device)
    for grp in groups:
        mine = norms[grp.first: grp.first + grp.count]
        if kern.supports(grp.padded):
            scratch[grp.first], part = kern.encode_rows(flat, grp, params.seed, round, word)
            kern.finish_norms(part, grp, params, word, mine)
        else:
            nrm = torch.linalg.vector_norm(view(flat, grp), dim=1, dtype=torch.float64)
            mine.copy_(wide_norms(nrm, word, grp.first, params))
    _settle(word, status, params)
    return Prepared(flat, round, norms, scratch, backend, params)


def encode(kern, flat, lay, max_norms, params: THCParams, round: int, generator, pack: bool,
           scratch=None, status=None, norms=None):
    import torch
    check_granularity(params)
    flat = flat.contiguous()
    check_generator(generator, flat)
    word = status if status is not None else status_word(flat.device)
    md = device_norms(max_norms, lay.n_slices, flat.device, params)
    # packed groups start on whole bytes when slices have an even length
    fused = pack and params.bits == 4 and params.slice_size >= 2
    groups = list(lay.groups(WHOLE))
    _device_round(kern, groups, round)
    m = _host_norms(kern, groups, md, lay, params)
    key = rounding_key(generator, flat)   # drawn once the call cannot refuse its input
    out = torch.empty((lay.total_padded + 1) // 2 if fused else lay.total_padded,
                      dtype=torch.uint8, device=flat.device)
    for grp in groups:
        if kern.supports(grp.padded):
            a, n = (grp.padded_start // 2, grp.count * grp.padded // 2) if fused else \
                (grp.padded_start, grp.count * grp.padded)
            tmp = scratch.get(grp.first) if scratch else None
            own = norms   # the norms prepare made from this scratch
            if tmp is None:
                tmp, own = kern.encode_rows(flat, grp, params.seed, round, word)[0], None
            kern.encode_cols(tmp, grp, md, params, round, key, out[a: a + n], fused, word,
                             own)
            continue
        _encode_short(flat.float(), grp, m, params, round, key, out, fused)
    _settle(word, status, params, md)
    if pack and not fused:
        return pack_bits(out, params.bits)
    return out


def _encode_short(flat, grp, m, params: THCParams, round: int, key: int, out, fused: bool):
    """A group the kernels do not take, through the reference code (with the max norms ``m``
    read on the host; raises at once)."""
    import torch
    c = encode_coef(m, params)[grp.first: grp.first + grp.count]
    table = tuple(int(v) for v in params.table)
    draw = lambda u, idx: rng.uniforms(u.shape[1], key, round, idx, like=flat)  # noqa: E731
    if fused:
        dst = torch.empty((grp.count, grp.padded), dtype=torch.uint8, device=flat.device)
        reference.round_group(flat, grp, c, params, round, table, draw, dst)
        a = grp.padded_start // 2
        out[a: a + (dst.numel() + 1) // 2] = pack_bits(dst, 4)
        return
    dst = out[grp.padded_start: grp.padded_start + grp.count * grp.padded]
    reference.round_group(flat, grp, c, params, round, table, draw,
                          dst.reshape(grp.count, grp.padded))


def _flag_sums(word, s, top: int) -> None:
    """Flag sums of a slice the kernels do not take that lie beyond 0..``top``, as the
    kernels flag theirs (the largest, or a negative one), without a wait."""
    import torch
    w = s.to(torch.int64)
    bad = (w < 0) | (w > top)
    seen = torch.where(bad, w.clamp(-1, INDEX_CAP), -2).max()
    flag(word, seen != -2, BAD_SUM, seen + 2)


def decode(kern, sums, n: int, max_norms, lay, params: THCParams, round: int, out,
           own_table=None, status=None):
    check_granularity(params)
    sums = sums.contiguous()
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    word = status if status is not None else status_word(sums.device)
    md = device_norms(max_norms, lay.n_slices, sums.device, params)
    groups = list(lay.groups(WHOLE))
    _device_round(kern, groups, round)
    m = _host_norms(kern, groups, md, lay, params)
    short = [g for g in groups if not kern.supports(g.padded)]
    if own_table is not None:
        for grp in short:
            check_indices(sums[grp.padded_start: grp.padded_start + grp.count * grp.padded],
                          params)
    for grp in groups:
        s = sums[grp.padded_start: grp.padded_start + grp.count * grp.padded]
        dst = out[grp.start: grp.start + grp.count * grp.length]
        if kern.supports(grp.padded):
            kern.decode_group(s, grp, md, n, params, round, dst, word, own_table)
            continue
        if own_table is None:
            _flag_sums(word, s, n * params.granularity)
        alpha = reference.alphas(m, grp, params, n).astype(np.float32)
        reference.decode_group(s, grp, alpha, n * params.granularity / 2.0, params, round,
                               dst, own_table)
    _settle(word, status, params, md)
    return out
