"""The reference codec: numpy arrays and torch tensors through the same whole-array
operations (signs, GEMM-based transform, rounding, table lookups), slices in batches of about
2^20 elements so that each batch's temporaries stay in cache. The readable definition that
the compiled codec and the kernels are checked against, and their fallback. Its checks raise
at once (``status``, the kernels' deferred status word, is not used here)."""
from __future__ import annotations

import numpy as np

from thc.codec import rng
from thc.codec.common import (GROUP_ELEMENTS, WHOLE, Prepared, check_finite, check_generator,
                               check_norms, check_sums, decode_live, encode_coef, norm_array,
                               view)
from thc.codec.hadamard import fwht, is_torch, random_signs
from thc.codec.packing import pack_bits
from thc.codec.params import THCParams
from thc.codec.quantize import resolve_generator, stochastic_round, uniforms

NAME = "reference"


def rows(flat, group):
    """The group's slices as a (count, padded) float32 matrix, zero-padded when needed."""
    v = view(flat, group)
    if group.padded == group.length:
        return v
    if is_torch(flat):
        import torch
        return torch.nn.functional.pad(v, (0, group.padded - group.length))
    out = np.zeros((group.count, group.padded), dtype=np.float32)
    out[:, : group.length] = v
    return out


def norms(flat, params: THCParams, lay):
    """Per-slice L2 norms (float32) from float64 sums of squares, so that a slice whose
    squares underflow float32 (values below ~1e-23) still encodes, and one whose squares
    overflow it but whose norm does not is taken: torch's norm for tensors (on a GPU one call
    for all equal slices, not one per cache-sized batch), einsum for numpy."""
    if is_torch(flat):
        import torch
        batch = WHOLE if flat.device.type == "cuda" else GROUP_ELEMENTS
        parts = [torch.linalg.vector_norm(view(flat, grp), dim=1, dtype=torch.float64).float()
                 for grp in lay.groups(batch)]
        out = torch.cat(parts) if parts else flat.new_zeros(0)
        check_norms(out, params)
        return out
    parts = []
    for grp in lay.groups(GROUP_ELEMENTS):
        r = view(flat, grp)
        parts.append(np.sqrt(np.einsum("ij,ij->i", r, r, dtype=np.float64)))
    out = np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)
    check_norms(out, params)
    return out


def prepare(flat, params: THCParams, lay, round: int, backend: str,
            status=None) -> Prepared:
    return Prepared(flat, round, norms(flat, params, lay), {}, backend, params)


def round_group(flat, grp, c, params: THCParams, round: int, table, draw, out) -> None:
    """Rotate, scale and stochastically round one group of slices into ``out`` (count,
    padded) uint8; ``draw(u, slices)`` gives the rounding uniforms."""
    g = params.granularity
    c = c.astype(np.float32)
    r = rows(flat, grp)
    idx = range(grp.first, grp.first + grp.count)
    w = r * random_signs(grp.padded, params.seed, round, idx, like=flat)
    if grp.count == 1:
        y = fwht(w, scale=float(c[0]), overwrite_input=True)
    else:
        if is_torch(flat):
            import torch
            w *= torch.from_numpy(c).to(flat.device)[:, None]
        else:
            w *= c[:, None]
        y = fwht(w, scale=1.0, overwrite_input=True)
    check_finite(y, grp)
    y += np.float32(g / 2.0)
    u = y.clamp_(0.0, float(g)) if is_torch(flat) else np.clip(y, 0.0, g, out=y)
    stochastic_round(u, table, draw(u, idx), out=out)


def encode(flat, lay, max_norms, params: THCParams, round: int, generator, pack: bool,
           scratch=None, status=None, norms=None):
    """``norms``: the input's own slice norms where known (:func:`prepare`'s), which a backend
    may use to skip a check they make needless; this one checks every coordinate anyway."""
    m = norm_array(max_norms, lay.n_slices, params)
    table = tuple(int(v) for v in params.table)
    torch_in = is_torch(flat)
    if torch_in:
        check_generator(generator, flat)
    if isinstance(generator, (int, np.integer)):
        counter = int(generator)
        draw = lambda u, idx: rng.uniforms(u.shape[1], counter, round, idx,  # noqa: E731
                                           like=flat)
    else:
        gen = resolve_generator(generator, flat)
        draw = lambda u, idx: uniforms(u.shape, flat, gen)  # noqa: E731
    if torch_in:
        import torch
        out = torch.empty(lay.total_padded, dtype=torch.uint8, device=flat.device)
    else:
        out = np.empty(lay.total_padded, dtype=np.uint8)
    coef = encode_coef(m, params)
    for grp in lay.groups(GROUP_ELEMENTS):
        dst = out[grp.padded_start: grp.padded_start + grp.count * grp.padded]
        round_group(flat, grp, coef[grp.first: grp.first + grp.count], params, round, table,
                    draw, dst.reshape(grp.count, grp.padded))
    if pack:
        return pack_bits(out, params.bits)
    return out


def decode_group(s, grp, alpha, centre: float, params: THCParams, round: int, dst,
                 own_table=None) -> None:
    """x = D H ((S - n g/2) alpha) of one group of slices, written into ``dst``; with
    ``own_table`` the sums are one worker's indices, mapped through it first."""
    d = grp.padded
    torch_in = is_torch(s)
    if own_table is not None:
        import torch
        s = own_table.index_select(0, s.to(torch.int32))
    s = s.reshape(grp.count, d)
    # H unnormalized. S - n g/2 is exact in float32 and centred, so the transform's partial
    # sums stay small (S itself has a large mean that would cost precision wherever the
    # Hadamard signs do not cancel it).
    if torch_in:
        import torch
        # convert, then subtract: torch's mixed int/float subtraction is 7x slower
        w = s.to(torch.float32)
        w = w.sub_(centre) if w is not s else w - centre
    else:
        w = np.subtract(s, np.float32(centre), dtype=np.float32)
    if grp.count == 1:
        y = fwht(w, scale=float(alpha[0]), overwrite_input=True)
    else:
        w *= torch.from_numpy(alpha).to(w.device)[:, None] if torch_in else alpha[:, None]
        y = fwht(w, scale=1.0, overwrite_input=True)
    signs = random_signs(d, params.seed, round, range(grp.first, grp.first + grp.count),
                         like=y)
    dst = dst.reshape(grp.count, grp.length)
    if grp.length == d:
        if torch_in:
            torch.mul(y, signs, out=dst)
        else:
            np.multiply(y, signs, out=dst)
    else:
        dst[...] = (y * signs)[:, : grp.length]


def alphas(m, grp, params: THCParams, n: int):
    """2 t_p M / (g d n) per slice of the group: the decode's scale (0 under the floor)."""
    m = m[grp.first: grp.first + grp.count]
    return 2.0 * params.t_p * m * decode_live(m, params) / (params.granularity * grp.padded * n)


def _extremes(sums) -> tuple[int, int]:
    """The least and largest sum; torch has no min or max of its unsigned types wider than
    8 bits, which numpy reads as they are."""
    if is_torch(sums) and str(sums.dtype) in ("torch.uint16", "torch.uint32", "torch.uint64"):
        sums = sums.cpu().numpy()
    return int(sums.min()), int(sums.max())


def decode(sums, n: int, max_norms, lay, params: THCParams, round: int, out,
           own_table=None, status=None):
    m = norm_array(max_norms, lay.n_slices, params)
    centre = n * params.granularity / 2.0
    if own_table is None and lay.total_padded:
        check_sums(*_extremes(sums), n, params)
    for grp in lay.groups(GROUP_ELEMENTS):
        s = sums[grp.padded_start: grp.padded_start + grp.count * grp.padded]
        dst = out[grp.start: grp.start + grp.count * grp.length]
        decode_group(s, grp, alphas(m, grp, params, n).astype(np.float32), centre, params,
                     round, dst, own_table)
    return out
