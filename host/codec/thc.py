"""THC codec: what a worker sends, what the switch adds, and how the sum decodes.

One round, for n workers holding vectors x_1..x_n (after error feedback):

1. ``slice_norms(x_i)`` per worker; ``agree_max`` of them is the preliminary MAX round, so
   that every worker uses the same per-slice scale sqrt(d) / max_norm.
2. ``encode(x_i, max_norms, params, round)``: rotate each slice (RHT with the shared diagonal
   of (seed, round, slice)), scale, truncate at ±t_p, round stochastically onto the table.
   Output: one uint8 index per padded coordinate (``pack_bits`` makes the wire form).
3. ``aggregate``: the switch's job, S = Σ_i T[index_i] (integers).
4. ``decode(S, n, max_norms, numel, params, round)``: mean_z = (S/n - g/2)·2t_p/g, unscale,
   inverse RHT, drop padding: an unbiased estimate of the mean of the (truncated) x_i.

Backends (``backend="auto"`` picks one per input). The reference code runs numpy arrays and
torch tensors through the same whole-array operations, slices in batches of about 2^20
elements so that each batch's temporaries stay in cache. CPU arrays and tensors take the
compiled codec of host/codec/fastcodec.py instead (``"compiled"``; THC_CODEC_CPU=reference in
the environment makes ``auto`` keep the reference code on the CPU), CUDA tensors the fused
Triton kernels of host/codec/triton_kernels.py (``"triton"``, which on CPU tensors needs
Triton's interpreter, TRITON_INTERPRET=1); ``"reference"`` forces the reference code. All
compute the same rotation and, for an int generator, the same rounding draws
(host/codec/rng.py), so indices encoded on one backend decode on any other and agree up to
the transform's float rounding.

Input: any real array or tensor of any shape; it is flattened and converted to float32 (a
copy when it is not contiguous float32 already: converted, never refused). Refused with a
clear error: complex or bool input, NaN or Inf in the input (ValueError), a torch generator,
an ``out`` buffer or error-feedback residual on another device than the input (ValueError).
Max norms may come as numpy or as a tensor on any device (they are a few floats, copied).

Edge cases: an empty tensor gives empty indices and an empty decode; a slice whose max norm
is 0 encodes every coordinate at g/2 (stochastically between the two middle entries) and
decodes to exactly 0.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from host.codec import fastcodec, rng
from host.codec.hadamard import SliceLayout, fwht, is_torch, random_signs
from host.codec.packing import pack_bits, unpack_bits
from host.codec.params import THCParams
from host.codec.quantize import resolve_generator, stochastic_round, uniforms

__all__ = ["SliceLayout", "THCParams", "THCCodec", "ErrorFeedback", "layout", "slice_norms",
           "agree_max", "encode", "encode_packed", "prepare", "encode_prepared", "Prepared",
           "table_values", "aggregate", "decode", "decode_indices",
           "sum_dtype", "pack_bits", "unpack_bits"]

GROUP_ELEMENTS = 1 << 20
"""Elements per batch of slices (4 MiB of float32: stays in L2/L3 through the pipeline)."""


def layout(numel: int, params: THCParams) -> SliceLayout:
    return SliceLayout(int(numel), params.slice_size)


def _flat(x, what: str = "x"):
    """x as a flat float32 vector of its own backend (a view when possible)."""
    if is_torch(x):
        import torch
        if not (x.is_floating_point() or x.dtype in (torch.int8, torch.int16, torch.int32,
                                                      torch.int64, torch.uint8)):
            raise TypeError(f"{what} must be a real tensor, got {x.dtype}")
        f = x.detach().reshape(-1)
        return f if f.dtype == torch.float32 else f.float()
    a = np.asarray(x)
    if a.dtype.kind not in "fiu":
        raise TypeError(f"{what} must be a real array, got dtype {a.dtype}")
    return a.reshape(-1).astype(np.float32, copy=False)


BACKENDS = ("auto", "reference", "compiled", "triton")
CPU_ENV = "THC_CODEC_CPU"
"""Environment variable: what ``auto`` runs on the CPU, ``compiled`` (default) or
``reference``."""
_KERNELS_MISSING: list = []
_COMPILED_MISSING: list = []


def compiled_for(x, backend: str = "auto") -> bool:
    """Whether ``x`` (a flat array or tensor) takes the compiled CPU codec. ``auto``: numpy
    arrays and CPU tensors, unless THC_CODEC_CPU=reference, when the extension is built (else
    the reference path, with one warning saying why); ``compiled``: always, or a clear error
    saying why not."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "compiled":
        if not fastcodec.on_cpu(x):
            raise ValueError(f"the compiled backend runs on the CPU, the input is on {x.device}")
        if not fastcodec.available():
            raise RuntimeError(fastcodec.UNAVAILABLE)
        return True
    if backend != "auto" or not fastcodec.on_cpu(x):
        return False
    choice = os.environ.get(CPU_ENV, "compiled")
    if choice not in ("compiled", "reference"):
        raise ValueError(f"{CPU_ENV} must be 'compiled' or 'reference', got {choice!r}")
    if choice == "reference":
        return False
    if not fastcodec.available():
        if not _COMPILED_MISSING:
            _COMPILED_MISSING.append(fastcodec.UNAVAILABLE)
            import warnings
            warnings.warn(f"THC on the CPU: {fastcodec.UNAVAILABLE}; reference path, slower",
                          RuntimeWarning, stacklevel=3)
        return False
    return True


def kernels_for(x, backend: str = "auto"):
    """The Triton kernel module when ``x`` (a flat float32 or integer tensor) should use it,
    else None. ``auto``: CUDA tensors, when triton imports (else the reference path, with one
    warning); ``triton``: always, or a clear error saying why not."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend in ("reference", "compiled") or not is_torch(x):
        if backend == "triton":
            raise TypeError("the triton backend takes torch tensors, not numpy arrays")
        return None
    if backend == "auto" and x.device.type != "cuda":
        return None
    try:
        from host.codec import triton_kernels
    except ImportError as e:
        if backend == "triton":
            raise RuntimeError(f"the triton backend needs the triton package: {e}") from None
        if not _KERNELS_MISSING:
            _KERNELS_MISSING.append(e)
            import warnings
            warnings.warn(f"THC on {x.device} without triton ({e}): reference path, slower",
                          RuntimeWarning, stacklevel=3)
        return None
    if x.device.type == "cpu":
        import os
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the triton backend runs CPU tensors only under Triton's "
                               "interpreter: set TRITON_INTERPRET=1 before importing it")
    return triton_kernels


def _same_place(a, b) -> bool:
    """Devices equal, reading an index-less "cuda" as any CUDA device."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _same_device(what: str, t, x) -> None:
    if is_torch(t) and is_torch(x) and not _same_place(t.device, x.device):
        raise ValueError(f"{what} is on {t.device} but the input is on {x.device}: move one "
                         f"of them (THC never copies them across devices behind your back)")


def _uniform_seed(generator, flat) -> int:
    """The 64-bit key of the kernels' rounding uniforms: an int generator as given (the same
    draws as the reference path's), else a fresh draw from the generator (or torch's)."""
    if isinstance(generator, (int, np.integer)):
        return int(generator)
    if isinstance(generator, np.random.Generator):
        return int(generator.integers(0, 1 << 62))
    import torch
    if generator is None:
        return int(torch.randint(0, 1 << 62, (1,)).item())
    return int(torch.randint(0, 1 << 62, (1,), generator=generator,
                             device=generator.device).item())


def _norm_array(max_norms, n_slices: int) -> np.ndarray:
    m = max_norms.detach().cpu().numpy() if is_torch(max_norms) else np.asarray(max_norms)
    m = np.asarray(m, dtype=np.float64).reshape(-1)
    if m.size != n_slices:
        raise ValueError(f"expected {n_slices} max norms (one per slice), got {m.size}")
    if not np.all(np.isfinite(m)) or np.any(m < 0):
        raise ValueError(f"max norms must be finite and >= 0, got {m}")
    return m


def _device_norms(max_norms, n_slices: int, groups, kern, x):
    """Max norms kept on x's device, with their check as a device flag, where every group runs
    in the kernels: a host copy here would stall the stream once per call. None elsewhere
    (then :func:`_norm_array` checks them on the host)."""
    if kern is None or not is_torch(max_norms) or not _same_place(max_norms.device, x.device) \
            or not all(kern.supports(grp.padded) for grp in groups):
        return None
    import torch
    m = max_norms.detach().reshape(-1)
    if m.numel() != n_slices:
        raise ValueError(f"expected {n_slices} max norms (one per slice), got {m.numel()}")
    m = m.to(torch.float64)
    return m, torch.isfinite(m).all() & (m >= 0).all()


def _raise_bad_norms(m) -> None:
    raise ValueError(f"max norms must be finite and >= 0, got {m.detach().cpu().numpy()}")


def _view(flat, group):
    """The group's slices as a (count, length) view of the flat tensor."""
    n = group.count * group.length
    return flat[group.start: group.start + n].reshape(group.count, group.length)


def _rows(flat, group):
    """The group's slices as a (count, padded) float32 matrix, zero-padded when needed."""
    view = _view(flat, group)
    if group.padded == group.length:
        return view
    if is_torch(flat):
        import torch
        return torch.nn.functional.pad(view, (0, group.padded - group.length))
    out = np.zeros((group.count, group.padded), dtype=np.float32)
    out[:, : group.length] = view
    return out


def slice_norms(x, params: THCParams, backend: str = "auto"):
    """Per-slice L2 norms of x (float32; numpy for numpy input, a tensor on x's device for
    torch): the input of the preliminary MAX round. Raises ValueError on NaN/Inf. numpy
    arrays on the compiled path sum the squares in C (in float64, as the reference does);
    tensors keep torch's norm."""
    flat = _flat(x)
    lay = layout(flat.shape[0], params)
    if not is_torch(flat) and compiled_for(flat, backend):
        norms = np.sqrt(fastcodec.sumsq(np.ascontiguousarray(flat), params.slice_size)) \
            .astype(np.float32)
        if not np.all(np.isfinite(norms)):
            raise ValueError("input contains NaN or Inf (or overflows float32 in its norm)")
        return norms
    if is_torch(flat):
        import torch
        parts = [torch.linalg.vector_norm(_view(flat, grp), dim=1)
                 for grp in lay.groups(GROUP_ELEMENTS)]
        norms = torch.cat(parts) if parts else flat.new_zeros(0)
        if not bool(torch.isfinite(norms).all()):
            raise ValueError("input contains NaN or Inf (or overflows float32 in its norm)")
        return norms
    parts = []
    for grp in lay.groups(GROUP_ELEMENTS):
        rows = _view(flat, grp)
        parts.append(np.sqrt(np.einsum("ij,ij->i", rows, rows, dtype=np.float64)))
    norms = np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)
    if not np.all(np.isfinite(norms)):
        raise ValueError("input contains NaN or Inf (or overflows float32 in its norm)")
    return norms


def agree_max(norm_vectors: Sequence):
    """Elementwise max of the workers' norm vectors: what the MAX round computes."""
    norm_vectors = list(norm_vectors)
    if not norm_vectors:
        raise ValueError("agree_max needs at least one norm vector")
    if is_torch(norm_vectors[0]):
        import torch
        return torch.stack([v.reshape(-1) for v in norm_vectors]).amax(dim=0)
    sizes = {np.asarray(v).size for v in norm_vectors}
    if len(sizes) != 1:
        raise ValueError(f"norm vectors differ in length: {sorted(sizes)}")
    return np.max(np.stack([np.asarray(v, dtype=np.float32).reshape(-1)
                            for v in norm_vectors]), axis=0)


def encode(x, max_norms, params: THCParams, round: int = 0, generator=None,
           backend: str = "auto"):
    """THC indices (uint8, one per padded coordinate) of x under the agreed max norms.

    ``generator``: np.random.Generator, torch.Generator, int seed or None (see
    :func:`host.codec.quantize.resolve_generator`); an int keys the counter-based rounding
    uniforms (host/codec/rng.py) by (int, round, slice, index), so numpy, torch, the compiled
    codec and the kernels draw the same numbers and give the same indices up to the
    transform's rounding. The compiled codec and the kernels take one such key from any
    other generator; the reference path draws every uniform from it.
    ``backend``: see :func:`compiled_for` and :func:`kernels_for`.
    """
    return _encode(x, max_norms, params, round, generator, backend, pack=False)


def encode_packed(x, max_norms, params: THCParams, round: int = 0, generator=None,
                  backend: str = "auto"):
    """The wire form of :func:`encode` (b-bit indices packed MSB first); at b = 4 the kernels
    write the packed bytes directly."""
    return _encode(x, max_norms, params, round, generator, backend, pack=True)


@dataclass
class Prepared:
    """A tensor after the part of encoding that needs no max norms: its slice norms (for the
    MAX round) and, on the kernels, the signed row-transformed scratch of encode pass 1, so
    that norms + encode read x once and the scratch once (two passes) instead of three."""

    flat: object
    round: int
    norms: object
    scratch: dict = field(default_factory=dict)   # first slice of a group -> its scratch
    backend: str = "auto"


def prepare(x, params: THCParams, round: int = 0, backend: str = "auto") -> Prepared:
    """Slice norms of x and, on the kernels, encode pass 1 from the same read. Then
    ``encode_prepared(prep, agree_max(...))``; x must not change in between."""
    flat = _flat(x)
    kern = kernels_for(flat, backend)
    if kern is None:
        return Prepared(flat, round, slice_norms(flat, params, backend), {}, backend)
    import torch
    flat = flat.contiguous()
    parts, scratch = [], {}
    for grp in layout(flat.shape[0], params).groups(1 << 62):
        if kern.supports(grp.padded):
            scratch[grp.first], nrm = kern.encode_rows(flat, grp, params.seed, round)
        else:
            view = _view(flat, grp)
            nrm = torch.linalg.vector_norm(view, dim=1)
        parts.append(nrm)
    norms = torch.cat(parts) if parts else flat.new_zeros(0)
    if not bool(torch.isfinite(norms).all()):
        raise ValueError("input contains NaN or Inf (or overflows float32 in its norm)")
    return Prepared(flat, round, norms, scratch, backend)


def encode_prepared(prep: Prepared, max_norms, params: THCParams, generator=None,
                    pack: bool = True):
    """Finish :func:`prepare`'s encode under the agreed max norms: packed wire form by
    default, uint8 indices with ``pack=False``."""
    return _encode(prep.flat, max_norms, params, prep.round, generator, prep.backend, pack,
                   prep.scratch)


def _encode(x, max_norms, params, round, generator, backend, pack, scratch=None):
    flat = _flat(x)
    lay = layout(flat.shape[0], params)
    if compiled_for(flat, backend):
        return _encode_compiled(flat, lay, max_norms, params, round, generator, pack)
    kern = kernels_for(flat, backend)
    groups = list(lay.groups(1 << 62 if kern is not None else GROUP_ELEMENTS))
    on_device = _device_norms(max_norms, lay.n_slices, groups, kern, flat)
    m = None if on_device else _norm_array(max_norms, lay.n_slices)
    g, t = params.granularity, params.t_p
    table = tuple(int(v) for v in params.table)
    torch_in = is_torch(flat)
    if torch_in:
        import torch
        if isinstance(generator, torch.Generator) and not _same_place(generator.device,
                                                                      flat.device):
            raise ValueError(f"the torch generator is on {generator.device} but the input is "
                             f"on {flat.device}: use a generator of the input's device")
    # packed groups start on whole bytes when slices have an even length
    fused = kern is not None and pack and params.bits == 4 and params.slice_size >= 2
    if kern is not None:
        flat = flat.contiguous()
        useed = _uniform_seed(generator, flat)
    counter = int(generator) if isinstance(generator, (int, np.integer)) else None
    gen = None if counter is not None else resolve_generator(generator, flat)
    if torch_in:
        out = torch.empty((lay.total_padded + 1) // 2 if fused else lay.total_padded,
                          dtype=torch.uint8, device=flat.device)
    else:
        out = np.empty(lay.total_padded, dtype=np.uint8)
    # c = g / (2 t M): maps H D x (unnormalized H) straight onto u - g/2; the sqrt(d) of the
    # scale cancels the 1/sqrt(d) of the normalized transform.
    if on_device:
        md, norms_ok = on_device
        coef = torch.where(md > 0, g / (2.0 * t * torch.where(md > 0, md, 1.0)), 0.0) \
            .to(torch.float32)
    else:
        coef = np.where(m > 0, g / (2.0 * t * np.where(m > 0, m, 1.0)), 0.0)
    for grp in groups:
        c = coef[grp.first: grp.first + grp.count]
        if kern is not None and kern.supports(grp.padded):
            a, n = (grp.padded_start // 2, grp.count * grp.padded // 2) if fused else \
                (grp.padded_start, grp.count * grp.padded)
            tmp = scratch.get(grp.first) if scratch else None
            if tmp is None:
                tmp, _ = kern.encode_rows(flat, grp, params.seed, round)
            first = kern.encode_cols(tmp, grp, c, table, round, useed, out[a: a + n], fused)
            if on_device:
                # one wait for the norms' and the input's checks together
                if not bool(torch.isfinite(first).all() & norms_ok):
                    if not bool(norms_ok):
                        _raise_bad_norms(md)
                    _check_finite(first, grp)
            else:
                _check_finite(first, grp)
            continue
        c = c.astype(np.float32)
        rows = _rows(flat, grp)
        idx = range(grp.first, grp.first + grp.count)
        w = rows * random_signs(grp.padded, params.seed, round, idx, like=flat)
        if grp.count == 1:
            y = fwht(w, scale=float(c[0]), overwrite_input=True)
        else:
            w *= torch.from_numpy(c).to(flat.device)[:, None] if torch_in else c[:, None]
            y = fwht(w, scale=1.0, overwrite_input=True)
        _check_finite(y[:, 0], grp)
        y += np.float32(g / 2.0)
        u = y.clamp_(0.0, float(g)) if torch_in else np.clip(y, 0.0, g, out=y)
        if kern is not None:
            rand = rng.uniforms(grp.padded, useed, round, idx, like=flat)
        elif counter is not None:
            rand = rng.uniforms(grp.padded, counter, round, idx, like=flat)
        else:
            rand = uniforms(u.shape, flat, gen)
        if fused:
            dst = torch.empty((grp.count, grp.padded), dtype=torch.uint8, device=flat.device)
            stochastic_round(u, table, rand, out=dst)
            a = grp.padded_start // 2
            out[a: a + (dst.numel() + 1) // 2] = pack_bits(dst, 4)
            continue
        dst = out[grp.padded_start: grp.padded_start + grp.count * grp.padded]
        stochastic_round(u, table, rand, out=dst.reshape(grp.count, grp.padded))
    if pack and not fused:
        return pack_bits(out, params.bits)
    return out


def _compiled_key(generator, flat) -> int:
    """The counter key of the compiled path's rounding draws: an int generator as given (the
    reference path's draws), else one draw from the generator (see host/codec/fastcodec.py)."""
    if isinstance(generator, (int, np.integer)):
        return int(generator)
    if isinstance(generator, np.random.Generator):
        return int(generator.integers(0, 1 << 62))
    if generator is None and not is_torch(flat):
        return int(np.random.default_rng().integers(0, 1 << 62))
    import torch
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be an int, a numpy or torch Generator or None, got "
                        f"{type(generator).__name__}")
    if not is_torch(flat) and generator is not None:
        raise TypeError("numpy inputs need a numpy Generator (or an int seed, or None)")
    if generator is not None and not _same_place(generator.device, flat.device):
        raise ValueError(f"the torch generator is on {generator.device} but the input is "
                         f"on {flat.device}: use a generator of the input's device")
    return int(torch.randint(0, 1 << 62, (1,), generator=generator).item())


def _encode_compiled(flat, lay, max_norms, params, round, generator, pack):
    """:func:`_encode` in host/codec/fastcodec.py's C code: one call for all slices."""
    m = _norm_array(max_norms, lay.n_slices)
    g, t = params.granularity, params.t_p
    coef = np.where(m > 0, g / (2.0 * t * np.where(m > 0, m, 1.0)), 0.0).astype(np.float32)
    key = _compiled_key(generator, flat)
    # the C code packs whole bytes per slice: 4-bit indices, slices of even length
    packed = pack and params.bits == 4 and (params.slice_size % 2 == 0 or lay.n_slices <= 1)
    out, first = fastcodec.encode(fastcodec.as_numpy(flat), params.slice_size, coef,
                                  params.seed, round, key, params.table, packed)
    bad = np.flatnonzero(~np.isfinite(first))
    if bad.size:
        raise ValueError(f"input contains NaN or Inf (or values so large that the rotation "
                         f"overflows float32) in slices {bad[0]}..{bad[-1]}")
    if pack and not packed:
        out = pack_bits(out, params.bits)
    if is_torch(flat):
        import torch
        return torch.from_numpy(out)
    return out


def _check_finite(first_coords, grp) -> None:
    """Every rotated coordinate depends on every input one, so a NaN/Inf anywhere in a slice
    shows up in its first rotated coordinate: checking those is O(slices), not O(d)."""
    if is_torch(first_coords):
        import torch
        ok = bool(torch.isfinite(first_coords).all())
    else:
        ok = bool(np.all(np.isfinite(first_coords)))
    if not ok:
        raise ValueError(f"input contains NaN or Inf (or values so large that the rotation "
                         f"overflows float32) in slices {grp.first}..{grp.first + grp.count - 1}")


def sum_dtype(n_workers: int, params: THCParams, torch_backend: bool = False):
    """Integer type wide enough for the sum of n workers' table values (at most n*g)."""
    top = int(n_workers) * params.granularity
    if torch_backend:
        import torch
        return torch.int32 if top < 2 ** 31 else torch.int64
    return np.uint16 if top <= 0xFFFF else np.int64


_TORCH_TABLES: dict = {}


def _torch_table(params: THCParams, device):
    """The table as a tensor on ``device`` (uint8 when g <= 255, else int32), cached."""
    import torch
    dt = np.uint8 if params.granularity <= 255 else np.int32
    key = (tuple(params.table), device)
    t = _TORCH_TABLES.get(key)
    if t is None:
        t = _TORCH_TABLES[key] = torch.from_numpy(params.table.astype(dt)).to(device)
    return t


def _check_indices(i, params: THCParams) -> None:
    if i.numel() if is_torch(i) else i.size:
        if int(i.max()) >= params.levels:
            raise ValueError(f"index {int(i.max())} outside the {params.levels}-entry table")


def table_values(indices, params: THCParams):
    """T[index] per coordinate: what a worker contributes to the switch's sum (uint8 when
    g <= 255, else int32)."""
    if is_torch(indices):
        import torch
        i = indices.reshape(-1)
        _check_indices(i, params)
        return _torch_table(params, indices.device).index_select(0, i.to(torch.int32))
    i = np.asarray(indices).reshape(-1)
    _check_indices(i, params)
    dt = np.uint8 if params.granularity <= 255 else np.int32
    return params.table.astype(dt)[i]


def aggregate(index_vectors: Sequence, params: THCParams):
    """The switch's reference model: S = Σ_workers T[index] (numpy uint16/int64, torch
    int32/int64), elementwise over equally long index vectors."""
    index_vectors = list(index_vectors)
    if not index_vectors:
        raise ValueError("aggregate needs at least one index vector")
    sizes = {int(v.shape[0]) for v in index_vectors}
    if len(sizes) != 1:
        raise ValueError(f"index vectors differ in length: {sorted(sizes)}")
    n = len(index_vectors)
    first = index_vectors[0]
    for v in index_vectors[1:]:
        _same_device("an index vector", v, first)
    if is_torch(first):
        import torch
        s = torch.zeros(first.shape[0], dtype=sum_dtype(n, params, True), device=first.device)
        for v in index_vectors:
            s += table_values(v, params)
        return s
    s = np.zeros(first.shape[0], dtype=sum_dtype(n, params))
    for v in index_vectors:
        s += table_values(v, params)
    return s


def decode(sums, n_workers: int, max_norms, numel: int, params: THCParams, round: int = 0,
           out=None, backend: str = "auto"):
    """Estimate of the workers' mean vector (flat float32, ``numel`` long) from the sums.

    ``out``: optional flat float32 buffer of ``numel`` elements to write into (saves the
    allocation and its page faults when decoding every round into the same buffer).
    ``backend``: see :func:`kernels_for`."""
    return _decode(sums, n_workers, max_norms, numel, params, round, out, backend, None)


def _decode(sums, n_workers, max_norms, numel, params, round, out, backend, own_table):
    """decode; with ``own_table`` (the table as a tensor) ``sums`` are one worker's indices."""
    if int(n_workers) < 1:
        raise ValueError(f"n_workers must be >= 1, got {n_workers}")
    lay = layout(numel, params)
    size = int(sums.shape[0]) if getattr(sums, "ndim", 1) else 1
    if getattr(sums, "ndim", 1) != 1 or size != lay.total_padded:
        raise ValueError(f"expected {lay.total_padded} sums (padded length of {numel} "
                         f"elements in slices of {params.slice_size}), got shape "
                         f"{tuple(sums.shape)}")
    g, t, n = params.granularity, params.t_p, int(n_workers)
    torch_in = is_torch(sums)
    if torch_in:
        import torch
        if sums.is_floating_point() or sums.is_complex() or sums.dtype == torch.bool:
            raise TypeError(f"sums must be an integer tensor, got {sums.dtype}")
        if out is None and compiled_for(sums, backend):
            # numpy's allocator asks for huge pages: a fresh 64 MB buffer faults 32 times,
            # not 16384 (the tensor shares the array's memory)
            out = torch.from_numpy(np.empty(lay.numel, dtype=np.float32))
        elif out is None:
            out = torch.empty(lay.numel, dtype=torch.float32, device=sums.device)
        _same_device("out", out, sums)
    else:
        sums = np.asarray(sums)
        if sums.dtype.kind not in "iu":
            raise TypeError(f"sums must be integers, got dtype {sums.dtype}")
        if out is None:
            out = np.empty(lay.numel, dtype=np.float32)
    if tuple(out.shape) != (lay.numel,) or is_torch(out) != torch_in \
            or str(out.dtype) not in ("float32", "torch.float32"):
        raise ValueError(f"out must be a flat float32 buffer of {lay.numel} elements like the "
                         f"sums, got {type(out).__name__} {tuple(out.shape)} {out.dtype}")
    if compiled_for(sums, backend):
        return _decode_compiled(sums, n, max_norms, lay, params, round, out,
                                own_table is not None)
    kern = kernels_for(sums, backend)
    if kern is not None:
        sums = sums.contiguous()
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
    groups = list(lay.groups(1 << 62 if kern is not None else GROUP_ELEMENTS))
    on_device = _device_norms(max_norms, lay.n_slices, groups, kern, sums)
    m = on_device[0] if on_device else _norm_array(max_norms, lay.n_slices)
    centre = n * g / 2.0
    for grp in groups:
        d = grp.padded
        alpha = 2.0 * t * m[grp.first: grp.first + grp.count] / (g * d * n)
        alpha = alpha.to(torch.float32) if on_device else alpha.astype(np.float32)
        s = sums[grp.padded_start: grp.padded_start + grp.count * d]
        dst = out[grp.start: grp.start + grp.count * grp.length]
        if kern is not None and kern.supports(d):
            kern.decode_group(s, grp, alpha, centre, params.seed, round, dst, own_table)
            continue
        if own_table is not None:
            s = own_table.index_select(0, s.to(torch.int32))
        s = s.reshape(grp.count, d)
        # x = D H ((S - n g/2) alpha) with H unnormalized. S - n g/2 is exact in float32 and
        # centred, so the transform's partial sums stay small (S itself has a large mean
        # that would cost precision wherever the Hadamard signs do not cancel it).
        if torch_in:
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
    if on_device and not bool(on_device[1]):
        _raise_bad_norms(on_device[0])
    return out


def _decode_compiled(sums, n, max_norms, lay, params, round, out, indices: bool):
    """:func:`_decode` in host/codec/fastcodec.py's C code; with ``indices`` the sums are one
    worker's indices, mapped through the table on the fly."""
    m = _norm_array(max_norms, lay.n_slices)
    g, t = params.granularity, params.t_p
    d = np.full(lay.n_slices, float(params.slice_size))
    if lay.tail:
        d[-1] = lay.tail_padded
    alpha = (2.0 * t * m / (g * d * n)).astype(np.float32)
    s = fastcodec.as_numpy(sums)
    if indices:
        s, kind = np.ascontiguousarray(s, np.uint8), "index"
    else:
        s, kind = fastcodec.sums_kind(s)
    dst = fastcodec.as_numpy(out) if is_torch(out) else out
    direct = dst.flags.c_contiguous and dst.flags.writeable and \
        (not is_torch(out) or dst.ctypes.data == out.data_ptr())
    if not direct:
        dst = np.empty(lay.numel, np.float32)
    fastcodec.decode(s, kind, lay.numel, params.slice_size, alpha, n * g / 2.0, params.seed,
                     round, dst, params.table if indices else None)
    if not direct:
        if is_torch(out):
            import torch
            out.copy_(torch.from_numpy(dst))
        else:
            out[...] = dst
    return out


def decode_indices(indices, max_norms, numel: int, params: THCParams, round: int = 0,
                   backend: str = "auto"):
    """One worker's own reconstruction (decode with n = 1): what error feedback subtracts.
    The kernels and the compiled path map indices through the table themselves (no
    table-value pass)."""
    if compiled_for(indices, backend):
        i = indices.reshape(-1)
        _check_indices(i, params)
        return _decode(i, 1, max_norms, numel, params, round, None, backend, params.table)
    if is_torch(indices) and kernels_for(indices, backend) is not None:
        _check_indices(indices.reshape(-1), params)
        return _decode(indices.reshape(-1), 1, max_norms, numel, params, round, None, backend,
                       _torch_table(params, indices.device))
    return decode(table_values(indices, params), 1, max_norms, numel, params, round,
                  backend=backend)


@dataclass
class ErrorFeedback:
    """A worker's residual e, kept in the un-rotated domain.

    Per round: ``y = ef.compensate(x)`` (x + e), norms/encode y, then
    ``ef.update(y, own_indices, max_norms, round)`` sets e <- y - decode(own indices, n=1),
    which absorbs both truncation and rounding error.
    """

    params: THCParams = field(default_factory=THCParams)
    residual: object = None

    def compensate(self, x):
        if self.residual is None:
            return x
        if int(np.prod(tuple(x.shape))) != int(self.residual.shape[0]):
            raise ValueError(f"error feedback holds {int(self.residual.shape[0])} elements, "
                             f"got a tensor of {int(np.prod(tuple(x.shape)))}")
        if is_torch(x) != is_torch(self.residual):
            raise TypeError("error feedback holds a residual of another backend (numpy vs "
                            "torch) than this input")
        _same_device("the error-feedback residual", self.residual, x)
        return x + self.residual.reshape(x.shape)

    def update(self, x_plus_e, own_indices, max_norms, round: int = 0, backend: str = "auto"):
        flat = _flat(x_plus_e)
        _same_device("the own indices", own_indices, flat)
        est = decode_indices(own_indices, max_norms, flat.shape[0], self.params, round,
                             backend)
        self.residual = flat - est
        return self.residual

    def reset(self) -> None:
        self.residual = None


class THCCodec:
    """The codec bound to one set of parameters (all workers of a job share them)."""

    def __init__(self, params: THCParams | None = None, backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.params = params or THCParams()
        self.backend = backend

    def layout(self, numel: int) -> SliceLayout:
        return layout(numel, self.params)

    def norms(self, x):
        return slice_norms(x, self.params, self.backend)

    def encode(self, x, max_norms, round: int = 0, generator=None):
        return encode(x, max_norms, self.params, round, generator, self.backend)

    def encode_packed(self, x, max_norms, round: int = 0, generator=None):
        """Encode straight to the wire form (fused on the kernels at b = 4)."""
        return encode_packed(x, max_norms, self.params, round, generator, self.backend)

    def prepare(self, x, round: int = 0) -> Prepared:
        """Norms and, on the kernels, encode pass 1 from one read of x (see :func:`prepare`)."""
        return prepare(x, self.params, round, self.backend)

    def encode_prepared(self, prep: Prepared, max_norms, generator=None, pack: bool = True):
        return encode_prepared(prep, max_norms, self.params, generator, pack)

    def aggregate(self, index_vectors: Sequence):
        return aggregate(index_vectors, self.params)

    def decode(self, sums, n_workers: int, max_norms, numel: int, round: int = 0, out=None):
        return decode(sums, n_workers, max_norms, numel, self.params, round, out, self.backend)

    def decode_own(self, indices, max_norms, numel: int, round: int = 0):
        return decode_indices(indices, max_norms, numel, self.params, round, self.backend)

    def pack(self, indices):
        """Wire form: b-bit indices packed MSB first (two per byte at b = 4)."""
        return pack_bits(indices, self.params.bits)

    def unpack(self, packed, count: int):
        return unpack_bits(packed, self.params.bits, count)

    def error_feedback(self) -> ErrorFeedback:
        return ErrorFeedback(self.params)

    def simulate(self, xs: Sequence, round: int = 0, generator=None):
        """A whole in-memory round for vectors xs (one per worker, same size): MAX round,
        encode, switch sum, decode. Returns the estimate of their mean (flat float32)."""
        xs = list(xs)
        if not xs:
            raise ValueError("simulate needs at least one vector")
        numel = int(np.prod(tuple(xs[0].shape)))
        gen = resolve_generator(generator, xs[0])
        m = agree_max([self.norms(x) for x in xs])
        idx = [self.encode(x, m, round, gen) for x in xs]
        return self.decode(self.aggregate(idx), len(xs), m, numel, round)

    def wire_bytes(self, numel: int, n_workers: int = 1) -> dict:
        """Bytes per round for ``numel`` coordinates: uplink indices, downlink sums (at the
        narrowest whole-bit width that holds n*g) and the MAX round's float32 norms."""
        lay = self.layout(numel)
        sum_bits = max(1, math.ceil(math.log2(n_workers * self.params.granularity + 1)))
        return {"padded": lay.total_padded,
                "uplink": (lay.total_padded * self.params.bits + 7) // 8,
                "downlink": (lay.total_padded * sum_bits + 7) // 8,
                "norms": 4 * lay.n_slices}
