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
an ``out`` buffer or error-feedback residual on another device than the input (ValueError),
a max norm that is negative, NaN, or at or beyond :func:`thc.codec.common.norm_limit`
(ValueError). Max norms may come as numpy or as a tensor on any device (a few floats).

Edge cases: an empty tensor gives empty indices and an empty decode; a slice whose max norm
is 0, or below :func:`thc.codec.common.norm_floor` (about 2e-38 g/30), encodes every
coordinate at g/2 (stochastically between the two middle entries) and decodes to exactly 0.
"""
from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from thc.codec import backends, settings
from thc.codec.backends import BACKENDS, Choice, kernels_for
from thc.codec.common import (Prepared, accumulator_dtype, check_indices, check_key,
                               flat as _flat, layout, raise_status, same_device, scale_factor,
                               status_word, torch_table, with_values)
from thc.codec.hadamard import SliceLayout, is_torch
from thc.codec.packing import pack_bits, unpack_bits
from thc.codec.params import THCParams
from thc.codec.quantize import resolve_generator
from thc.codec.table import expected_nmse

__all__ = ["SliceLayout", "THCParams", "THCCodec", "ErrorFeedback", "layout", "slice_norms",
           "agree_max", "encode", "encode_packed", "prepare", "encode_prepared", "Prepared",
           "table_values", "aggregate", "decode", "decode_indices", "compiled_for",
           "kernels_for", "BACKENDS", "accumulator_dtype", "pack_bits", "unpack_bits"]

CPU_ENV = settings.ENV["codec_cpu"]
"""Environment variable: what ``auto`` runs on the CPU, ``compiled`` (default) or
``reference`` (read once, into :func:`thc.codec.settings.current`)."""


def _cpu() -> str:
    return settings.current().codec_cpu


def compiled_for(x, backend: str = "auto") -> bool:
    """Whether ``x`` takes the compiled CPU codec (see :func:`thc.codec.backends.compiled_for`)."""
    return backends.compiled_for(x, backend, _cpu())


def _choice(backend) -> Choice:
    """A codec's :class:`Choice` as given, or one made for this call from a backend name."""
    return backend if isinstance(backend, Choice) else Choice(backend, _cpu())


def slice_norms(x, params: THCParams, backend="auto"):
    """Per-slice L2 norms of x (float32; numpy for numpy input, a tensor on x's device for
    torch): the input of the preliminary MAX round. Raises ValueError on NaN/Inf. numpy
    arrays on the compiled path sum the squares in C (in float64, as the reference does);
    tensors keep torch's norm (the backend's ``norms``)."""
    flat = _flat(x)
    return _choice(backend)(flat).norms(flat, params, layout(flat.shape[0], params))


def agree_max(norm_vectors: Sequence):
    """Elementwise max of the workers' norm vectors: what the MAX round computes."""
    norm_vectors = list(norm_vectors)
    if not norm_vectors:
        raise ValueError("agree_max needs at least one norm vector")
    sizes = {v.numel() if is_torch(v) else np.asarray(v).size for v in norm_vectors}
    if len(sizes) != 1:
        raise ValueError(f"norm vectors differ in length: {sorted(sizes)}")
    if is_torch(norm_vectors[0]):
        import torch
        return torch.stack([v.reshape(-1) for v in norm_vectors]).amax(dim=0)
    return np.max(np.stack([np.asarray(v, dtype=np.float32).reshape(-1)
                            for v in norm_vectors]), axis=0)


def encode(x, max_norms, params: THCParams, round: int = 0, generator=None,
           backend="auto", status=None):
    """THC indices (uint8, one per padded coordinate) of x under the agreed max norms.

    ``max_norms``: each slice's max over the workers, so at least x's own slice norm. A
    smaller one is not refused unless the rotation overflows: the slice's coordinates are
    clipped to the table's range, and its estimate is wrong (the backends may then differ
    too: the kernels transform before they scale). The rounds never give one: a max over
    the workers holds each one's own, and a client refuses a ``MAX_RESULT`` lane below its
    own value.
    ``generator``: np.random.Generator, torch.Generator, int seed or None (see
    :func:`thc.codec.quantize.resolve_generator`); an int keys the counter-based rounding
    uniforms (host/codec/rng.py) by (int, round, slice, index), so numpy, torch, the compiled
    codec and the kernels draw the same numbers and give the same indices up to the
    transform's rounding. The compiled codec and the kernels take one such key from any
    other generator; the reference path draws every uniform from it.
    ``backend``: see :func:`compiled_for` and :func:`kernels_for`.
    ``round``: an int, or on the kernels a one-element int64 tensor on x's device that the
    kernels read there (so a CUDA graph that captured the call replays each round with the
    number the tensor holds then; every slice must then run in the kernels).
    """
    return _encode(x, max_norms, params, round, generator, backend, False, status=status)


def encode_packed(x, max_norms, params: THCParams, round: int = 0, generator=None,
                  backend="auto", status=None):
    """The wire form of :func:`encode` (b-bit indices packed MSB first); at b = 4 the kernels
    write the packed bytes directly."""
    return _encode(x, max_norms, params, round, generator, backend, True, status=status)


def prepare(x, params: THCParams, round: int = 0, backend="auto", status=None) -> Prepared:
    """Slice norms of x and, on the kernels, encode pass 1 from the same read. Then
    ``encode_prepared(prep, agree_max(...))``; x must not change in between. ``status``: see
    :class:`THCCodec`'s ``deferred_checks``."""
    flat, impl = _input(x, _choice(backend))
    _round(round, impl, flat)
    return impl.prepare(flat, params, layout(flat.shape[0], params), round, backend,
                        status=status)


def encode_prepared(prep: Prepared, max_norms, params: THCParams, generator=None,
                    pack: bool = True, status=None):
    """Finish :func:`prepare`'s encode under the agreed max norms: packed wire form by
    default, uint8 indices with ``pack=False``."""
    if prep.params is not None and prep.params != params:
        raise ValueError(f"prepared under other THC parameters ({prep.params}), encoded under "
                         f"{params}: its norms and scratch hold for those only; prepare again")
    return _encode(prep.flat, max_norms, params, prep.round, generator, prep.backend, pack,
                   prep.scratch, status, prep.norms)


def _input(x, choice: Choice):
    """x flattened, and the backend that runs it: float16 and bfloat16 tensors reach the
    kernels as they are (no float32 copy), every other path gets float32."""
    flat = _flat(x, keep_half=True)
    impl = choice(flat)
    if impl.name != "triton" and is_torch(flat) and str(flat.dtype) != "torch.float32":
        flat = flat.float()
    return flat, impl


def _round(round, impl, like):
    """A round is an int, or on the kernels an int64 tensor of one element on the input's
    device: the kernels read it there (a CUDA graph replays with the round it holds then),
    as an unsigned 64-bit number (-1 is round 2^64 - 1: unchecked, as a check would wait for
    the device)."""
    if not is_torch(round):
        return
    import torch
    if impl.name != "triton":
        raise TypeError(f"a round held in a tensor runs on the kernels only, not on the "
                        f"{impl.name} backend: pass an int")
    if round.dtype != torch.int64 or round.numel() != 1:
        raise TypeError(f"a round tensor must hold one int64, got {round.dtype} "
                        f"{tuple(round.shape)}")
    same_device("the round tensor", round, like)


def _encode(x, max_norms, params, round, generator, backend, pack, scratch=None, status=None,
            norms=None):
    check_key(generator)
    with_values("max_norms", max_norms)
    flat, impl = _input(x, _choice(backend))
    _round(round, impl, flat)
    return impl.encode(flat, layout(flat.shape[0], params), max_norms, params, round,
                       generator, pack, scratch, status=status, norms=norms)


def table_values(indices, params: THCParams, checked: bool = True):
    """T[index] per coordinate: what a worker contributes to the switch's sum (uint8 when
    g <= 255, else int32). ``checked=False`` skips the range check (which waits for a GPU)
    for indices this codec's encode wrote itself."""
    if is_torch(indices):
        import torch
        with_values("an index vector", indices)
        i = indices.reshape(-1)
        if checked:
            check_indices(i, params)
        return torch_table(params, indices.device).index_select(0, i.to(torch.int32))
    i = np.asarray(indices).reshape(-1)
    if i.dtype == bool:   # numpy would read it as a mask, not as indices 0 and 1 (as torch)
        i = i.astype(np.uint8)
    check_indices(i, params)
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
        same_device("an index vector", v, first)
    if is_torch(first):
        import torch
        s = torch.zeros(first.shape[0], dtype=accumulator_dtype(n, params, True),
                        device=first.device)
        for v in index_vectors:
            s += table_values(v, params)
        return s
    s = np.zeros(first.shape[0], dtype=accumulator_dtype(n, params))
    for v in index_vectors:
        # int32 values (g > 255) into uint16 sums: n x g fits, which the dtype was chosen for
        np.add(s, table_values(v, params), out=s, casting="unsafe")
    return s


def decode(sums, n_workers: int, max_norms, numel: int, params: THCParams, round: int = 0,
           out=None, backend="auto", status=None):
    """Estimate of the workers' mean vector (flat float32, ``numel`` long) from the sums.

    ``out``: optional flat float32 buffer of ``numel`` elements to write into (saves the
    allocation and its page faults when decoding every round into the same buffer); what
    it holds after a call that raises, or whose deferred checks flag, is undefined.
    ``backend``: see :func:`kernels_for`."""
    return _decode(sums, n_workers, max_norms, numel, params, round, out, backend, False,
                   status)


def _decode(sums, n_workers, max_norms, numel, params, round, out, backend, own: bool,
            status=None):
    """decode; with ``own`` the ``sums`` are one worker's indices, which the backend maps
    through the table itself."""
    try:
        count = operator.index(n_workers)   # 4.7 workers was taken as 4
    except TypeError:
        count = 0
    if isinstance(n_workers, bool) or count < 1:
        raise ValueError(f"n_workers must be an integer >= 1, got {n_workers!r}")
    if count * params.granularity >= 1 << 63:   # the kernels read sums as int64
        raise ValueError(f"n_workers {count} x granularity {params.granularity} is 2^63 or "
                         f"more: no sums the codec takes hold that (64-bit signed sums)")
    n_workers = count
    lay = layout(numel, params)
    if not is_torch(sums):
        sums = np.asarray(sums)   # a list as encode takes one
    size = int(sums.shape[0]) if getattr(sums, "ndim", 1) else 1
    if getattr(sums, "ndim", 1) != 1 or size != lay.total_padded:
        raise ValueError(f"expected {lay.total_padded} sums (padded length of {numel} "
                         f"elements in slices of {params.slice_size}), got shape "
                         f"{tuple(sums.shape)}")
    torch_in = is_torch(sums)
    with_values("sums", sums)
    with_values("max_norms", max_norms)
    if torch_in:
        import torch
        if sums.is_floating_point() or sums.is_complex() or sums.dtype == torch.bool:
            raise TypeError(f"sums must be an integer tensor, got {sums.dtype}")
        impl = _choice(backend)(sums)
        if out is None and impl is backends.COMPILED:
            # numpy's allocator asks for huge pages: a fresh 64 MB buffer faults 32 times,
            # not 16384 (the tensor shares the array's memory)
            out = torch.from_numpy(np.empty(lay.numel, dtype=np.float32))
        elif out is None:
            out = torch.empty(lay.numel, dtype=torch.float32, device=sums.device)
        same_device("out", out, sums)
    else:
        sums = np.asarray(sums)
        if sums.dtype.kind not in "iu":
            raise TypeError(f"sums must be integers, got dtype {sums.dtype}")
        impl = _choice(backend)(sums)
        if out is None:
            out = np.empty(lay.numel, dtype=np.float32)
    if tuple(out.shape) != (lay.numel,) or is_torch(out) != torch_in \
            or str(out.dtype) not in ("float32", "torch.float32"):
        raise ValueError(f"out must be a flat float32 buffer of {lay.numel} elements like the "
                         f"sums, got {type(out).__name__} {tuple(out.shape)} {out.dtype}")
    if _overlap(out, sums):
        # every backend writes ``out`` a group (or a slice) at a time: one over the sums
        # overwrote later groups' sums before it read them, a wrong decode
        sums = sums.clone() if torch_in else sums.copy()
    _round(round, impl, sums)
    table = impl.own_table(params, sums.device if torch_in else None) if own else None
    return impl.decode(sums, int(n_workers), max_norms, lay, params, round, out, table,
                       status=status)


def _overlap(a, b) -> bool:
    """Whether two arrays, or two tensors, may share bytes (a strided tensor: its storage's)."""
    if not is_torch(a):
        return bool(np.may_share_memory(a, b))
    if a.device != b.device:
        return False

    def span(t):
        if t.is_contiguous():
            return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        store = t.untyped_storage()
        return store.data_ptr(), store.data_ptr() + store.nbytes()
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def decode_indices(indices, max_norms, numel: int, params: THCParams, round: int = 0,
                   backend="auto", status=None):
    """One worker's own reconstruction (decode with n = 1): what error feedback subtracts.
    The kernels and the compiled path map indices through the table themselves (no
    table-value pass; the kernels check the indices on the device)."""
    if is_torch(indices):
        import torch
        if indices.dtype == torch.bool:
            indices = indices.byte()   # indices 0 and 1, as table_values reads them
    else:
        indices = np.asarray(indices)
        if indices.dtype == bool:
            indices = indices.astype(np.uint8)
    impl = _choice(backend)(indices)
    if impl.own_table is not None:
        i = indices.reshape(-1)
        if impl.name != "triton":
            check_indices(i, params)
        return _decode(i, 1, max_norms, numel, params, round, None, backend, True, status)
    return decode(table_values(indices, params), 1, max_norms, numel, params, round,
                  backend=backend)


@functools.lru_cache(maxsize=64)
def feedback_gain(params: THCParams) -> float:
    """How far error feedback's residual (e <- y - C(y), sent in y = x + e next) can grow a
    round, in the energy of the slice's max norm M: the larger of one worker's expected NMSE
    under the table when it holds M (rotated coordinates near N(0, 1)), and the rounding
    variance of a coordinate in the table's widest gap (a worker whose own norm is small
    next to M keeps about that much of M^2 a coordinate). At 1 or more the residual grows
    round after round."""
    table = np.asarray(params.table, dtype=np.float64)
    widest = float(np.max(np.diff(table))) * params.t_p / params.granularity
    return max(expected_nmse(table, params.p, params.granularity), widest * widest)


def check_feedback(params: THCParams) -> None:
    """Refuse error feedback on a table whose rounding loses more than it keeps (a 1-bit
    table at p = 1/32 loses 3.7 times the input's energy: the residual doubled each round
    until its norms overflowed and every round was refused)."""
    gain = feedback_gain(params)
    if gain >= 1:
        raise ValueError(
            f"error feedback diverges with this table: a worker's rounding error reaches "
            f"{gain:.2f} times the slice's max norm squared (bits={params.bits}, "
            f"p={params.p:g}, granularity={params.granularity}), so the residual grows every "
            f"round; build the reducer with error_feedback=False, or take more bits or a "
            f"larger p")


@dataclass
class ErrorFeedback:
    """A worker's residual e, kept in the un-rotated domain.

    Per round: ``y = ef.compensate(x)`` (x + e), norms/encode y, then
    ``ef.update(y, own_indices, max_norms, round)`` sets e <- y - decode(own indices, n=1),
    which absorbs both truncation and rounding error.
    """

    params: THCParams = field(default_factory=THCParams)
    residual: object = None

    def __post_init__(self):
        check_feedback(self.params)

    def compensate(self, x):
        if self.residual is None:
            return x
        if int(np.prod(tuple(x.shape))) != int(self.residual.shape[0]):
            raise ValueError(f"error feedback holds {int(self.residual.shape[0])} elements, "
                             f"got a tensor of {int(np.prod(tuple(x.shape)))}")
        if is_torch(x) != is_torch(self.residual):
            raise TypeError("error feedback holds a residual of another backend (numpy vs "
                            "torch) than this input")
        same_device("the error-feedback residual", self.residual, x)
        return x + self.residual.reshape(x.shape)

    def update(self, x_plus_e, own_indices, max_norms, round: int = 0, backend: str = "auto"):
        flat = _flat(x_plus_e)
        same_device("the own indices", own_indices, flat)
        est = decode_indices(own_indices, max_norms, flat.shape[0], self.params, round,
                             backend)
        return self.keep(flat, est)

    def keep(self, x_plus_e, own_estimate):
        """e <- (x + e) - own estimate, where the caller decoded its own contribution
        itself (piece by piece, or with workers missing from a short round)."""
        self.residual = x_plus_e - own_estimate
        return self.residual

    def reset(self) -> None:
        self.residual = None

    def rescale(self, factor: float) -> None:
        """Multiply the residual by ``factor``: the gradients' scale changed (a loss scaler's
        step), and the residual must add in the new one's units."""
        factor = scale_factor(factor)
        if self.residual is not None:
            self.residual = self.residual * factor


class THCCodec:
    """The codec bound to one set of parameters (all workers of a job share them)."""

    def __init__(self, params: THCParams | None = None, backend: str = "auto",
                 cpu: str | None = None, deferred_checks: bool = False):
        """``backend``: see :mod:`thc.codec.backends`; ``cpu``: what ``auto`` runs on the
        CPU, ``compiled`` or ``reference`` (default: :func:`thc.codec.settings.current`).

        ``deferred_checks``: on the kernels, no call waits for the device (so a stream of
        calls runs back to back, and can be captured in a CUDA graph); bad input (NaN or Inf,
        bad max norms, an index outside the table) is flagged in a status word on the device
        and raised by the next :meth:`check`. The CPU paths still raise at once."""
        self.params = params or THCParams()
        self.choice = Choice(backend, _cpu() if cpu is None else cpu)
        self.backend = backend
        self.deferred_checks = deferred_checks
        self._words: dict = {}

    def _status(self, x):
        """The status word the kernels flag into for x's device (deferred checks only)."""
        if not self.deferred_checks or not is_torch(x):
            return None
        word = self._words.get(x.device)
        if word is None:
            word = self._words[x.device] = status_word(x.device)
        return word

    def status(self, x):
        """The status word the kernels flag into for x's device (int32: flags, then where),
        for a caller that reads it itself; None without deferred checks."""
        return self._status(x)

    def check(self) -> None:
        """Raise what the kernels flagged since the last check (one wait for each device
        used; the first device's first flag when several are set), and clear every flag;
        nothing to do without deferred checks."""
        flagged = []
        for word in self._words.values():
            values = word.tolist()
            if values[0]:
                word.zero_()
                flagged.append(values)
        if flagged:
            raise_status(flagged[0], self.params)

    def discard_checks(self) -> None:
        """Forget what the kernels flagged (a caller abandoning its round after an error), so
        that it is not blamed on the next one."""
        for word in self._words.values():
            word.zero_()

    def layout(self, numel: int) -> SliceLayout:
        return layout(numel, self.params)

    def norms(self, x):
        return slice_norms(x, self.params, self.choice)

    def encode(self, x, max_norms, round: int = 0, generator=None):
        return encode(x, max_norms, self.params, round, generator, self.choice,
                      self._status(x))

    def encode_packed(self, x, max_norms, round: int = 0, generator=None):
        """Encode straight to the wire form (fused on the kernels at b = 4)."""
        return encode_packed(x, max_norms, self.params, round, generator, self.choice,
                             self._status(x))

    def prepare(self, x, round: int = 0) -> Prepared:
        """Norms and, on the kernels, encode pass 1 from one read of x (see :func:`prepare`)."""
        return prepare(x, self.params, round, self.choice, self._status(x))

    def encode_prepared(self, prep: Prepared, max_norms, generator=None, pack: bool = True):
        return encode_prepared(prep, max_norms, self.params, generator, pack,
                               self._status(prep.flat))

    def aggregate(self, index_vectors: Sequence):
        return aggregate(index_vectors, self.params)

    def decode(self, sums, n_workers: int, max_norms, numel: int, round: int = 0, out=None):
        return decode(sums, n_workers, max_norms, numel, self.params, round, out, self.choice,
                      self._status(sums))

    def decode_own(self, indices, max_norms, numel: int, round: int = 0):
        return decode_indices(indices, max_norms, numel, self.params, round, self.choice,
                              self._status(indices))

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
        sizes = {int(np.prod(tuple(x.shape))) for x in xs}
        if len(sizes) > 1:   # their padded lengths may agree: 100 and 101 pad alike
            raise ValueError(f"simulate's vectors differ in length: {sorted(sizes)}")
        numel = sizes.pop()
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
