"""What every codec backend shares: input checks, slice views, the scale factors and the key
of the rounding draws. Kept below thc.py and the backends so that none of them imports back
into the dispatcher."""
from __future__ import annotations

import functools
import math
import numbers
import operator
from dataclasses import dataclass, field

import numpy as np

from thc.codec.hadamard import SliceLayout, is_torch
from thc.codec.packing import comparable
from thc.codec.params import THCParams

GROUP_ELEMENTS = 1 << 20
"""Elements per batch of slices (4 MiB of float32: stays in L2/L3 through the pipeline)."""

WHOLE = 1 << 62
"""A batch size no input reaches: one group per run of equal slices (the kernels' batching)."""


def near_int(product: float) -> int | None:
    """The integer a product of a fraction and a count is within floating point's own error
    of (a few units in its last place), else None: 0.29 x 100 is 28.999999999999996 and
    0.07 x 100 is 7.000000000000001, where the fraction as written gives 29 and 7. The error
    is the product's own: 1e-16 x 1 is no 0."""
    near = round(product)
    return int(near) if abs(product - near) <= 4 * math.ulp(product) else None


def layout(numel: int, params: THCParams) -> SliceLayout:
    """The slices of ``numel`` elements; a count that is no integer is refused (a decode of
    1000.9 elements was cut to 1000)."""
    try:
        n = operator.index(numel)
    except TypeError:
        n = -1
    if isinstance(numel, bool) or n < 0:
        raise ValueError(f"numel must be an integer >= 0, got {numel!r}")
    return SliceLayout(n, params.slice_size)


def flat(x, what: str = "x", keep_half: bool = False):
    """x as a flat float32 vector of its own backend (a view when possible); with
    ``keep_half`` float16 and bfloat16 tensors stay as they are (the kernels read them)."""
    if is_torch(x):
        import torch
        if not (x.is_floating_point() or x.dtype in (torch.int8, torch.int16, torch.int32,
                                                      torch.int64, torch.uint8)):
            raise TypeError(f"{what} must be a real tensor, got {x.dtype}")
        with_values(what, x)
        f = x.detach().resolve_neg().reshape(-1)   # a lazily negated view has no numpy()
        keep = (torch.float32, torch.float16, torch.bfloat16) if keep_half else (torch.float32,)
        return f if f.dtype in keep else f.float()
    a = np.asarray(x)
    if a.dtype.kind not in "fiu":
        raise TypeError(f"{what} must be a real array, got dtype {a.dtype}")
    return a.reshape(-1).astype(np.float32, copy=False)


def with_values(what: str, *tensors) -> None:
    """Refuse a meta tensor (a size, no values), which torch lets through to the first read
    of a value, with its own words."""
    if any(is_torch(t) and t.is_meta for t in tensors):
        raise ValueError(f"{what} is a meta tensor (a size, no values): THC needs values")


def same_place(a, b) -> bool:
    """Devices equal, reading an index-less "cuda" as any CUDA device."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def same_device(what: str, t, x) -> None:
    if is_torch(t) and is_torch(x) and not same_place(t.device, x.device):
        raise ValueError(f"{what} is on {t.device} but the input is on {x.device}: move one "
                         f"of them (THC never copies them across devices behind your back)")


def rounding_key(generator, flat) -> int:
    """The 64-bit counter key of the compiled codec's and the kernels' rounding draws: an int
    generator as given (the reference path's draws), else one draw from the generator (numpy's
    or torch's). None: fresh entropy for a numpy input, torch's global generator for a tensor
    (so workers that seeded torch alike draw alike: give each worker its own key)."""
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
    check_generator(generator, flat)
    if generator is None:
        return int(torch.randint(0, 1 << 62, (1,)).item())
    return int(torch.randint(0, 1 << 62, (1,), generator=generator,
                             device=generator.device).item())


def check_key(generator) -> None:
    """What :func:`rounding_key` takes, checked before any round: an int in [0, 2^64), a
    numpy or torch Generator, or None."""
    if isinstance(generator, bool):
        raise TypeError("generator must be an int, a numpy or torch Generator or None, "
                        "got a bool")
    if isinstance(generator, (int, np.integer)):
        if not 0 <= int(generator) < 1 << 64:
            raise ValueError(f"an int generator keys the rounding draws: it must lie in "
                             f"[0, 2^64), got {int(generator)}")
        return
    if generator is None or isinstance(generator, np.random.Generator):
        return
    import torch
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be an int, a numpy or torch Generator or None, got "
                        f"{type(generator).__name__}")


def check_float(flat) -> None:
    """THC averages real floating-point values: a complex, bool or integer tensor would be
    cast, losing its imaginary part or coming back rounded, and is refused instead."""
    if not flat.is_floating_point():
        raise TypeError(f"THC averages floating-point tensors, got {flat.dtype}")


def as_float32(flat):
    """A float input (tensor or array) in float32, where the codecs round it: a float64 one's
    finite value beyond float32's range would become Inf there and be refused as "NaN or
    Inf", which the input does not hold (narrower types fit: no check)."""
    if is_torch(flat):
        import torch
        out, wide, finite = flat.float(), flat.dtype == torch.float64, torch.isfinite
    else:
        flat = np.asarray(flat)
        with np.errstate(over="ignore"):
            out = flat.astype(np.float32, copy=False)
        wide, finite = flat.dtype == np.float64, np.isfinite
    if wide and not bool(finite(out).all()) and bool(finite(flat).all()):
        raise ValueError(f"input holds finite values beyond float32's range (largest "
                         f"magnitude {float(abs(flat).max()):.3g}), in which the gradient "
                         f"exchange computes")
    return out


def check_generator(generator, flat) -> None:
    """A torch generator must live where the input does."""
    import torch
    if isinstance(generator, torch.Generator) and not same_place(generator.device,
                                                                 flat.device):
        raise ValueError(f"the torch generator is on {generator.device} but the input is "
                         f"on {flat.device}: use a generator of the input's device")


def check_norm_type(real: bool, dtype) -> None:
    """Max norms are real numbers: a cast would drop a complex norm's imaginary part, or
    read a bool as 1.0."""
    if not real:
        raise TypeError(f"max norms are real numbers, got {dtype}")


def norm_array(max_norms, n_slices: int, params: THCParams) -> np.ndarray:
    """The agreed max norms on the host as float64, checked: a max norm at or beyond
    :func:`norm_limit` (the mark among them) is refused, as no worker's slice norm reaches
    it and a decode under it could overflow float32."""
    if is_torch(max_norms):   # widened first: numpy has no bfloat16
        t = max_norms.detach()
        m = (t.double() if t.is_floating_point() else t).cpu().numpy()
    else:
        m = np.asarray(max_norms)
    check_norm_type(m.dtype.kind in "fiuO", m.dtype)   # objects: numbers, converted below
    m = np.asarray(m, dtype=np.float64).reshape(-1)
    if m.size != n_slices:
        raise ValueError(f"expected {n_slices} max norms (one per slice), got {m.size}")
    if not np.all(np.isfinite(m)) or np.any(m < 0):
        raise ValueError(f"max norms must be finite and >= 0, got {m}")
    if np.any(m >= OVERFLOW_MARK):
        raise ValueError(f"slice {int(np.argmax(m >= OVERFLOW_MARK))}'s max norm is the mark of a "
                         f"worker whose input holds NaN or Inf there (or a slice norm THC "
                         f"cannot take) or was refused")
    limit = norm_limit(params)
    beyond = m.astype(np.float32) >= limit   # as sent: norm_limit is a float32 value
    if beyond.any():
        first = int(np.argmax(beyond))
        raise ValueError(f"slice {first}'s max norm {m[first]:.3g} is beyond {limit:.3g}, the "
                         f"largest slice norm THC takes (its transform or decode could overflow "
                         f"float32)")
    return m


def encode_coef(m: np.ndarray, params: THCParams) -> np.ndarray:
    """c = g / (2 t M) per slice: maps H D x (unnormalized H) straight onto u - g/2; the
    sqrt(d) of the scale cancels the 1/sqrt(d) of the normalized transform. 0 for a max
    norm below :func:`norm_floor`."""
    g, t = params.granularity, params.t_p
    live = _above_floor(m, params)
    return np.where(live, g / (2.0 * t * np.where(live, m, 1.0)), 0.0)


def decode_live(m: np.ndarray, params: THCParams) -> np.ndarray:
    """1.0 for the slices a decode scales by their max norm, 0.0 for those it writes as
    zeros (max norm below :func:`norm_floor`: encoded as zero slices)."""
    return _above_floor(m, params).astype(np.float64)


def _above_floor(m: np.ndarray, params: THCParams) -> np.ndarray:
    """Max norms at or above :func:`norm_floor`, compared as float32, as the kernels do."""
    return m.astype(np.float32) >= norm_floor(params)


def view(flat, group):
    """The group's slices as a (count, length) view of the flat tensor."""
    n = group.count * group.length
    return flat[group.start: group.start + n].reshape(group.count, group.length)


def scale_factor(factor) -> float:
    """A loss scale's change (new scale / old), checked: the factor a residual kept in the old
    scale's units is multiplied by, so that it adds to gradients in the new one's."""
    if hasattr(factor, "numel") and factor.numel() == 1:
        factor = factor.item()   # a one-element tensor
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) \
            or not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"a scale factor must be a finite number > 0, got {factor!r}")
    return float(factor)


def cast_estimate(est, dtype, copy: bool = False):
    """An estimate of a mean of ``dtype`` values (a float32 torch tensor) as ``dtype``; as
    float16 or a float8 type, held to its finite range: the mean of finite values lies in
    that range, so this only moves a coordinate towards it (an estimate may carry its
    compensation past it: the reducers' residuals take back what the hold cuts off).
    The cast alone made an estimate past 65504 (THC's reaches t_p times its slice's max
    norm) an Inf from finite inputs. An
    estimate is never Inf otherwise (non-finite input is refused, or NaN under
    ``nonfinite="propagate"``). bfloat16 keeps float32's exponent, which the norm limit
    keeps estimates within. NaN stays NaN; ``copy``: a new tensor even where the dtype is
    the estimate's."""
    import torch
    if dtype in (torch.float32, torch.float64, torch.bfloat16):
        return est.to(dtype, copy=copy)
    top = torch.finfo(dtype).max
    if dtype != torch.float16:                  # float8: no nan_to_num, and an e4m3fn
        return est.clamp(-top, top).to(dtype)   # overflow is NaN
    return est.to(dtype, copy=copy).nan_to_num_(nan=float("nan"), posinf=top, neginf=-top)


def cast_moved(est, out):
    """What :func:`cast_estimate` moved ``est`` by to give ``out`` (float16's hold, a half
    type's rounding), flat in float32, for an error-feedback residual to keep: it is not
    applied. None where the cast is exact (float32, float64)."""
    import torch
    if out.dtype in (torch.float32, torch.float64):
        return None
    return est.reshape(-1) - out.reshape(-1).float()


class NonFiniteInput(ValueError):
    """The input holds NaN or Inf, or a slice norm beyond :func:`norm_limit`: an overflow,
    which a reducer may hand on (``nonfinite="propagate"``), where any other error is a
    failure."""


def check_finite(rotated, grp) -> None:
    """Every rotated coordinate must be finite: a NaN or Inf of the input reaches them all,
    and one that the transform makes (values too large for the max norms given) stays in
    the coordinates it reaches (inf - inf is NaN), whichever those are."""
    if is_torch(rotated):
        import torch
        ok = bool(torch.isfinite(rotated).all())
    else:
        ok = bool(np.all(np.isfinite(rotated)))
    if not ok:
        raise NonFiniteInput(f"input contains NaN or Inf (or values beyond float32's range, "
                             f"which the codec computes in, or so large for the max norms "
                             f"given that the rotation overflows float32) in slices "
                             f"{grp.first}..{grp.first + grp.count - 1}")


BAD_INPUT, BAD_NORMS, BAD_INDEX, BAD_SUM = 1, 2, 4, 8
"""Flags of the kernels' status word."""
STATUS_WORDS = 5
"""Length of the status word: the flags, then one value per flag."""
NORM_MARK = float(np.finfo(np.float32).max)
"""The slice norm a worker that failed sends into the MAX round (every slice, whatever its
input): above any real norm (a finite float32 norm is below 2^64), so every worker refuses
that max norm."""
OVERFLOW_MARK = float(np.nextafter(np.float32(NORM_MARK), np.float32(0)))
"""The slice norm a worker sends for a slice whose input holds NaN or Inf (or a norm beyond
:func:`norm_limit`): a mark too, one step below :data:`NORM_MARK`, so that a round's max
norms tell an overflow alone (which a reducer may hand on as NaN, non-finite as an
all-reduce of the floats would be) from a failure, which dominates it."""
INDEX_CAP = 1 << 30
"""The largest bad index the status word records as it is (larger ones as this)."""


def status_word(device):
    """The kernels' status word on ``device``: flags, then the last slice with a NaN or Inf
    or a norm beyond :func:`norm_limit` + 1 (the reference path names the first), the last
    slice with a bad max norm + 1, the largest bad index + 2 (1: negative;
    0: none), the largest sum beyond n g + 2 (1: a negative sum; 0: none)."""
    import torch
    return torch.zeros(STATUS_WORDS, dtype=torch.int32, device=device)


def flag(word, bad, which: int, value) -> None:
    """Flag ``which`` (one of the BAD_ flags) into ``word`` where the device boolean ``bad``
    holds, with ``value`` (an int, or an int tensor on the device) in the flag's word,
    without waiting for the device."""
    import torch
    slot = {BAD_INPUT: 1, BAD_NORMS: 2, BAD_INDEX: 3, BAD_SUM: 4}[which]
    b = bad.to(torch.int32)
    word[0:1].bitwise_or_(b * which)
    value = value.to(torch.int32) if isinstance(value, torch.Tensor) else int(value)
    torch.maximum(word[slot: slot + 1], b * value, out=word[slot: slot + 1])


@functools.lru_cache(maxsize=64)
def norm_limit(params: THCParams) -> float:
    """The largest slice norm THC takes, a float32 value, so that every check (host, device,
    kernels) draws the same line. Below it, in float32: an estimate (t_p times its max
    norm), the error-feedback residual (one max norm more), and each coordinate of the
    unnormalized transform of a slice (up to sqrt(d) times its norm), which the kernels
    hold between their two passes before the scale."""
    grow = max(1.0 + params.t_p, math.sqrt(params.slice_size))
    return float(np.float32(NORM_MARK / (1.01 * grow)))


@functools.lru_cache(maxsize=64)
def norm_floor(params: THCParams) -> float:
    """The smallest max norm (a float32 value) whose encode scale g / (2 t_p M) float32
    holds: about 2e-38 g/30, below float32's normal range at the default g = 30, 1.1e-32
    at g = 2^24 and 1.5e-30 at 2^31 - 1, where slices of normal values fall under it. A
    slice under it encodes as a zero slice does and decodes as zeros, on every backend: the
    same float32 comparison."""
    g, t = params.granularity, params.t_p
    m = np.float32(g / (2.0 * t * NORM_MARK))
    while g / (2.0 * t * float(m)) > NORM_MARK:
        m = np.nextafter(m, np.float32(np.inf))
    while (below := np.nextafter(m, np.float32(0))) > 0 and g / (2.0 * t * float(below)) \
            <= NORM_MARK:
        m = below
    return float(m)


BAD_INPUT_TEXT = ("input contains NaN or Inf (or values beyond float32's range, which the "
                  "codec computes in, or a slice norm beyond {limit:.3g}, or values so large "
                  "for the max norms given that the rotation overflows float32)")
"""What a refused input holds (a norm beyond :func:`norm_limit`: its estimate or residual
could overflow float32; with error feedback, the input plus the residual)."""


def wide_norms(norms, word, first: int, params: THCParams):
    """float32 slice norms of the float64 ones of a group of slices (a tensor) whose first
    is ``first``, without a wait: one that is not finite or beyond :func:`norm_limit` is
    flagged as bad input and sent as :data:`OVERFLOW_MARK`, so every worker refuses the round."""
    import torch
    bad = ~(norms.float() < norm_limit(params))   # as sent, and as check_norms compares
    flag(word, bad.any(), BAD_INPUT, first + 1 + bad.to(torch.int32).argmax())
    return torch.where(bad, OVERFLOW_MARK, norms).float()


def raise_status(values, params: THCParams, max_norms=None) -> None:
    """Raise the error a status word's ``values`` (a list of its ints) name, if any."""
    flags = values[0]
    if flags & BAD_INPUT:
        raise NonFiniteInput(BAD_INPUT_TEXT.format(limit=norm_limit(params))
                             + f", in slice {values[1] - 1}")
    if flags & BAD_NORMS:
        got = f", got {max_norms.detach().cpu().numpy()}" if max_norms is not None else ""
        raise ValueError(f"max norms must be finite, >= 0 and below {norm_limit(params):.3g} "
                         f"(slice {values[2] - 1}'s is not, or is the mark of a worker whose "
                         f"input holds NaN or Inf there or was refused){got}")
    if flags & BAD_INDEX:
        top = values[3] - 2
        what = "a negative index" if top < 0 else f"index {top}" + (
            " or larger" if top >= INDEX_CAP else "")
        raise ValueError(f"{what} outside the {params.levels}-entry table")
    if flags & BAD_SUM:
        top = values[4] - 2
        raise ValueError(SUM_TEXT.format(what="a negative sum" if top < 0 else f"sum {top}" + (
            " or larger" if top >= INDEX_CAP else "")))


SUM_TEXT = ("{what} outside what the workers' table values add up to (0..n g for n workers): "
            "decode with the number of workers whose values were summed")


def check_sums(lo: int, hi: int, n: int, params: THCParams) -> None:
    """Refuse sums (least ``lo``, largest ``hi``) outside 0..n g, which ``n`` workers'
    table values cannot add up to: decoded with the wrong worker count they give a wrong
    mean, silently. A sum inside the range that no ``n`` table values make (1 or 2 with the
    default table) is not refused: the check is one comparison a lane."""
    bad = lo if lo < 0 else hi if hi > n * params.granularity else None
    if bad is not None:
        raise ValueError(SUM_TEXT.format(what=f"sum {bad}") + f" ({n} workers here, g = "
                         f"{params.granularity})")


def check_indices(i, params: THCParams) -> None:
    """Indices into the table: integers (a float one would be truncated: 3.7 read T[3]) in
    its range."""
    kind = ("f" if i.is_floating_point() or i.is_complex() else "i") if is_torch(i) else \
        i.dtype.kind
    if kind in "fc":
        raise TypeError(f"table indices are integers, got {i.dtype}")
    if is_torch(i):
        i = comparable(i)
    if i.numel() if is_torch(i) else i.size:
        if int(i.max()) >= params.levels:
            raise ValueError(f"index {int(i.max())} outside the {params.levels}-entry table")
        if int(i.min()) < 0:
            raise ValueError(f"a negative index outside the {params.levels}-entry table")


_TORCH_TABLES: dict = {}


def torch_table(params: THCParams, device):
    """The table as a tensor on ``device`` (uint8 when g <= 255, else int32), cached."""
    import torch
    dt = np.uint8 if params.granularity <= 255 else np.int32
    key = (tuple(params.table), device)
    t = _TORCH_TABLES.get(key)
    if t is None:
        t = _TORCH_TABLES[key] = torch.from_numpy(params.table.astype(dt)).to(device)
    return t


def wire_sum_bits(n_workers: int, granularity: int) -> int:
    """The width of :func:`wire_sum_dtype` (what the performance model charges THC over
    all-reduce), without torch."""
    top = int(n_workers) * granularity
    return 8 if top <= 255 else 16 if top < 1 << 15 else 32 if top < 1 << 31 else 64


def wire_sum_dtype(n_workers: int, params: THCParams):
    """The narrowest torch integer type that holds the sum of ``n_workers``' table values:
    what a torch.distributed all-reduce of them carries (int16 as two lanes an int32 word,
    thc.collective.transports.paired)."""
    import torch
    return {8: torch.uint8, 16: torch.int16, 32: torch.int32,
            64: torch.int64}[wire_sum_bits(n_workers, params.granularity)]


def accumulator_dtype(n_workers: int, params: THCParams, torch_backend: bool = False):
    """Integer type wide enough for the sum of n workers' table values (at most n*g)."""
    top = int(n_workers) * params.granularity
    if torch_backend:
        import torch
        return torch.int32 if top < 2 ** 31 else torch.int64
    return np.uint16 if top <= 0xFFFF else np.int64


def check_norms(norms, params: THCParams) -> None:
    """Raise unless every slice norm (float32) is finite and within :func:`norm_limit`."""
    limit = norm_limit(params)
    bad = ~(norms < limit)
    if bool(bad.any()):
        first = int(bad.nonzero()[0][0]) if is_torch(bad) else int(np.argmax(bad))
        raise NonFiniteInput(BAD_INPUT_TEXT.format(limit=limit) + f", in slice {first}")


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
    params: object = None
    """The THCParams it was prepared under: its norms and scratch hold for those only."""
