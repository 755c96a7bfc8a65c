"""Truncation and unbiased stochastic rounding onto the lookup table (packing: packing.py).

Works on numpy arrays and torch tensors with the same sequence of float32 operations, so
equal inputs and equal uniform draws give equal indices on both backends.

Stochastic rounding: for u between neighbours T[j] <= u <= T[j+1] the index is j + 1 with
probability (u - T[j]) / (T[j+1] - T[j]), else j, which makes E[T[index]] = u (unbiased).
Table values are integers, so the neighbours are fixed on each [k, k+1) and are looked up by
floor(u) in tables of g entries: no search per coordinate. Above :data:`LUT_LIMIT` (a uniform
table's g may reach 2^31 - 1) such tables would take gigabytes: floor(u) is then searched in
the table itself (at most 256 values), which gives the same neighbours.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from thc.codec.hadamard import is_torch


def to_grid(z, t_p: float, granularity: int):
    """Clamp z to ±t_p and map it onto [0, g]: u = (z + t_p) g / (2 t_p)."""
    g = float(granularity)
    u = z * np.float32(g / (2.0 * t_p))
    u += np.float32(g / 2.0)
    return _clamp_(u, 0.0, g)


def _clamp_(x, lo: float, hi: float):
    if is_torch(x):
        return x.clamp_(lo, hi)
    return np.clip(x, lo, hi, out=x)


LUT_LIMIT = 1 << 20
"""The largest g the rounding here looks up in per-unit-step tables (:func:`segments`, 9
bytes an entry); above it, it searches the table."""


@lru_cache(maxsize=64)
def segments(table: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For u in [k, k+1), k = 0..g-1: lower index j, lower value T[j], width T[j+1] - T[j]."""
    t = np.asarray(table, dtype=np.int64)
    g = int(t[-1])
    k = np.arange(g)
    j = np.clip(np.searchsorted(t, k, side="right") - 1, 0, t.size - 2)
    return (j.astype(np.uint8), t[j].astype(np.float32),
            (t[j + 1] - t[j]).astype(np.float32))


def check_table(table) -> tuple[int, ...]:
    t = tuple(int(v) for v in np.asarray(table).reshape(-1))
    if len(t) < 2 or t[0] != 0 or any(b <= a for a, b in zip(t, t[1:])) or len(t) > 256:
        raise ValueError(f"a table needs 2..256 strictly increasing integers from 0, got {t}")
    return t


def _check_pair(table, granularity: int) -> tuple[int, ...]:
    """A table and the granularity its grid is scaled to: the table ends at g (the grid's
    top), else the rounding, scaled to the table's own top, is biased."""
    t = check_table(table)
    if t[-1] != granularity:
        raise ValueError(f"a table for granularity {granularity!r} ends at it, got one "
                         f"ending at {t[-1]}")
    return t


_TORCH_LUT: dict = {}


def _lut(table: tuple[int, ...], like):
    luts = segments(table)
    if not is_torch(like):
        return luts
    key = (table, like.device)
    cached = _TORCH_LUT.get(key)
    if cached is None:
        import torch
        cached = _TORCH_LUT[key] = tuple(torch.from_numpy(a).to(like.device) for a in luts)
    return cached


def resolve_generator(generator, like):
    """Normalise a generator argument: np.random.Generator and torch.Generator are used as they
    are; an int seeds a numpy PCG64 (the same draws for numpy and torch inputs); None means
    fresh entropy for numpy inputs and torch's global generator for torch inputs."""
    if generator is None:
        return None if is_torch(like) else np.random.default_rng()
    if isinstance(generator, (int, np.integer)):
        return np.random.default_rng(int(generator))
    return generator


def uniforms(shape, like, generator):
    """float32 U[0, 1) draws shaped ``shape`` on ``like``'s backend and device.

    A numpy Generator draws on the CPU (and is copied to a torch device): identical numbers
    for numpy and torch inputs. A torch Generator or None draws with torch.
    """
    shape = tuple(int(s) for s in shape)
    if isinstance(generator, np.random.Generator):
        r = generator.random(shape, dtype=np.float32)
        if is_torch(like):
            import torch
            return torch.from_numpy(r).to(like.device)
        return r
    if not is_torch(like):
        raise TypeError("numpy inputs need a numpy Generator (or an int seed, or None)")
    import torch
    return torch.rand(shape, generator=generator, device=like.device, dtype=torch.float32)


def stochastic_round(u, table, rand, out=None):
    """Indices (uint8) of the table neighbours of u in [0, g], chosen so that E[T[i]] = u.

    ``rand``: U[0, 1) draws of u's shape. ``u`` is consumed (used as scratch space).
    The lower neighbour's index is j and the step is taken when r < (u - T[j]) / width:
    u - T[j] is exact in float32 and the division correctly rounded, so the probability is
    right to within the 2^-24 resolution of r (adding r to a float index would lose bits).
    """
    t = check_table(table)
    g = t[-1]
    if g > LUT_LIMIT:
        return _searched_round(u, t, rand, out)
    lower, base, width = _lut(t, u)
    if is_torch(u):
        import torch
        k = u.to(torch.int32).clamp_(max=g - 1).reshape(-1)
        u.sub_(base.index_select(0, k).reshape(u.shape))
        u.div_(width.index_select(0, k).reshape(u.shape))
        step = torch.lt(rand, u).reshape(-1)
        if out is None:
            j = lower.index_select(0, k)
        else:
            j = out.view(-1)
            torch.index_select(lower, 0, k, out=j)
        j.add_(step)
        return j.reshape(u.shape) if out is None else out
    k = u.astype(np.int32)
    np.minimum(k, g - 1, out=k)
    u -= np.take(base, k)
    u /= np.take(width, k)
    step = np.less(rand, u)
    if out is None:
        j = np.take(lower, k)
    else:
        j = out
        np.take(lower, k, out=j)
    j += step
    return j


def _searched_round(u, t: tuple[int, ...], rand, out):
    """:func:`stochastic_round` for g above LUT_LIMIT: j = the last index with T[j] <=
    floor(u) (at most len - 2), as :func:`segments` has it; the same float32 operations."""
    g, last = t[-1], len(t) - 2
    values = np.asarray(t, dtype=np.int64)
    base, width = values.astype(np.float32), np.diff(values).astype(np.float32)
    if is_torch(u):
        import torch
        k = u.to(torch.int64).clamp_(max=g - 1)
        on = torch.from_numpy(values).to(u.device)
        j = (torch.searchsorted(on, k, right=True) - 1).clamp_(0, last)
        u.sub_(torch.from_numpy(base).to(u.device)[j])
        u.div_(torch.from_numpy(width).to(u.device)[j])
        j = j.to(torch.uint8).add_(torch.lt(rand, u).to(torch.uint8))
        if out is None:
            return j
        out.copy_(j)
        return out
    k = np.minimum(u.astype(np.int64), g - 1)
    j = np.clip(np.searchsorted(values, k, side="right") - 1, 0, last)
    u -= np.take(base, j)
    u /= np.take(width, j)
    j = j.astype(np.uint8) + np.less(rand, u)
    if out is None:
        return j
    out[...] = j
    return out


def quantize(z, table, t_p: float, granularity: int, generator=None):
    """Truncate z at ±t_p and round it stochastically onto the table: uint8 indices."""
    _check_pair(table, granularity)
    u = to_grid(z, t_p, granularity)
    rand = uniforms(u.shape, u, resolve_generator(generator, u))
    return stochastic_round(u, table, rand)


def dequantize(idx, table, t_p: float, granularity: int):
    """The z value an index stands for: (T[i] - g/2) 2 t_p / g (float32)."""
    t = np.asarray(_check_pair(table, granularity), dtype=np.float32)
    zval = (t - np.float32(granularity / 2.0)) * np.float32(2.0 * t_p / granularity)
    if is_torch(idx):
        import torch
        return torch.from_numpy(zval).to(idx.device)[idx.long()]
    i = np.asarray(idx)
    return zval[i.astype(np.uint8) if i.dtype == bool else i]   # indices 0/1, not a mask
