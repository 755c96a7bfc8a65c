"""Compression schemes behind one interface, so benchmarks and training pick them by name.

Every scheme has ``name``, ``bits_per_coord(numel)``, ``compress(x, key=None, generator=None)
-> payload``, ``decompress(payload) -> x_hat`` (x's shape, float32) and
``aggregate_mean(xs, rng=None) -> estimate of mean(xs)`` (what the NMSE bench measures: the
mean of the decompressed payloads, or THC's homomorphic sum).

Inputs may be numpy arrays or torch tensors (any device); results come back in the same kind.
Schemes built with ``error_feedback=True`` keep a residual per ``key`` (e.g. a parameter or
bucket name): compress() adds it in and keeps what the payload failed to carry.

``SCHEMES`` maps names to factories; :func:`make_scheme` parses specs like ``qsgd:s=15`` or
``thc:bits=3:granularity=14:p=1/64``.

TopK for data-parallel training (all-gather instead of all-reduce): ``TopK.compress(t)``
returns a :class:`SparsePayload` whose ``values`` (float32) and ``indices`` (int64) both have
exactly ``k = ceil(ratio * numel)`` entries, so every worker's pair has the same shape and can
be all-gathered as-is; ``TopK.combine(values, indices, numel)`` turns the gathered (W, k)
stacks into the dense mean (scatter-add / W), and ``TopK.decompress`` does it for one payload.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from thc.codec.common import (NonFiniteInput, as_float32, cast_estimate, check_float,
                              near_int, scale_factor)
from thc.codec.hadamard import is_torch
from thc.codec.packing import pack_bits, unpack_bits
from thc.codec.params import THCParams, fraction_value
from thc.codec.thc import THCCodec, check_feedback

__all__ = ["Scheme", "THC", "UHC", "QSGD", "TernGrad", "TopK", "SignSGD", "FP16", "FP32",
           "SparsePayload", "SCHEMES", "make_scheme", "scheme_names"]


def _torch():
    import torch
    return torch


def _as_torch(x):
    """(flat float32 tensor, restore) where restore(flat) gives x's kind and shape back."""
    torch = _torch()
    if is_torch(x):
        shape = tuple(x.shape)
        flat = x.detach().reshape(-1)
        check_float(flat)   # a complex input's imaginary part would be dropped
        return as_float32(flat), lambda t: t.reshape(shape)
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"the schemes average floating-point arrays, got {a.dtype}")
    a = as_float32(a)
    shape = a.shape
    return torch.from_numpy(np.ascontiguousarray(a).reshape(-1)), \
        lambda t: t.reshape(shape).cpu().numpy()


def _torch_generator(rng, device):
    """A torch.Generator on ``device`` from an int, numpy Generator or torch Generator."""
    torch = _torch()
    if rng is None or (isinstance(rng, torch.Generator)):
        return rng
    if isinstance(rng, np.random.Generator):
        seed = int(rng.integers(0, 2 ** 62))
    else:
        seed = int(rng)
    return torch.Generator(device=device).manual_seed(seed)


def _check_finite(flat, what: str = "input") -> None:
    torch = _torch()
    if flat.numel() and not bool(torch.isfinite(flat).all()):
        raise NonFiniteInput(f"{what} contains NaN or Inf")


@dataclass
class Payload:
    """What goes on the wire: named tensors plus the metadata needed to rebuild x."""

    data: dict
    numel: int
    shape: tuple
    restore: Callable | None = None

    @property
    def nbytes(self) -> int:
        total = 0
        for v in self.data.values():
            if is_torch(v):
                total += v.numel() * v.element_size()
            elif isinstance(v, np.ndarray):
                total += v.nbytes
            else:
                total += 4
        return total


@dataclass
class SparsePayload(Payload):
    """TopK's payload: ``values`` and ``indices`` (int64 positions in the flat tensor)."""

    @property
    def values(self):
        return self.data["values"]

    @property
    def indices(self):
        return self.data["indices"]


class Scheme:
    """Base class: error feedback and numpy/torch plumbing; subclasses do the math on flat
    float32 tensors in ``_compress`` / ``_decompress``."""

    name = "scheme"
    unbiased = False

    def __init__(self, error_feedback: bool = False):
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback is true or false, got {error_feedback!r}")
        self.error_feedback = error_feedback
        self.residuals: dict = {}

    def bits_per_coord(self, numel: int = 2 ** 18) -> float:
        raise NotImplementedError

    def describe(self) -> str:
        return self.name

    def compress(self, x, key: Any = None, generator=None) -> Payload:
        flat, restore = _as_torch(x)
        _check_finite(flat)
        gen = _torch_generator(generator, flat.device)
        if self.error_feedback:
            e = self.residuals.get(key)
            if e is not None:
                if e.shape != flat.shape:
                    raise ValueError(f"error feedback for key {key!r} holds {e.numel()} "
                                     f"elements, got {flat.numel()}")
                flat = flat + e
                # finite values can overflow with their residual: refused, residual kept
                _check_finite(flat, "input plus its error-feedback residual")
        payload = self._compress(flat, gen)
        payload.numel, payload.restore = flat.numel(), restore
        payload.shape = tuple(x.shape)
        if self.error_feedback:
            self.residuals[key] = flat - self._decompress(payload)
        return payload

    def decompress(self, payload: Payload):
        return payload.restore(self._decompress(payload))

    def aggregate_mean(self, xs: Sequence, rng=None):
        """Mean of the decompressed payloads of xs (stateless: no error feedback)."""
        xs = list(xs)
        if not xs:
            raise ValueError("aggregate_mean needs at least one vector")
        flats = [_as_torch(x) for x in xs]
        sizes = {flat.numel() for flat, _ in flats}
        if len(sizes) > 1:
            raise ValueError(f"aggregate_mean takes vectors of one length, got "
                             f"{sorted(sizes)}")
        gen = _torch_generator(rng, flats[0][0].device)
        total = None
        for flat, _ in flats:
            _check_finite(flat)
            p = self._compress(flat, gen)
            p.numel = flat.numel()
            est = self._decompress(p).double()   # a float32 sum of large estimates overflows
            total = est if total is None else total + est
        return flats[0][1]((total / len(xs)).float())

    def reset(self) -> None:
        self.residuals.clear()

    def rescale(self, factor: float) -> None:
        """Multiply every residual by ``factor`` (see :meth:`ErrorFeedback.rescale`)."""
        factor = scale_factor(factor)
        for key, e in self.residuals.items():
            self.residuals[key] = e * factor

    def _compress(self, flat, gen) -> Payload:
        raise NotImplementedError

    def _decompress(self, payload: Payload):
        raise NotImplementedError


class THC(Scheme):
    """THC through this interface. ``compress`` alone uses the worker's own norms (a one-worker
    round); ``aggregate_mean`` runs the real protocol: MAX round, encode, integer sum, decode.
    The payload carries the packed b-bit indices, the per-slice norms and the round number;
    each call uses the next round, so the rotation changes from step to step."""

    name = "thc"
    unbiased = True

    def __init__(self, bits: int = 4, granularity: int = 30, p: float = 1 / 32, seed: int = 0,
                 slice_size: int = 2 ** 20, table_kind: str = "optimal",
                 error_feedback: bool = False, params: THCParams | None = None):
        super().__init__(error_feedback)
        self.params = params or THCParams(bits=bits, granularity=granularity, p=p, seed=seed,
                                          slice_size=slice_size, table_kind=table_kind)
        if error_feedback:
            check_feedback(self.params)
        self.codec = THCCodec(self.params)
        self.round = 0

    def describe(self) -> str:
        return f"{self.name}({self.params.describe()})"

    def bits_per_coord(self, numel: int = 2 ** 18) -> float:
        w = self.codec.wire_bytes(numel)
        return 8.0 * (w["uplink"] + w["norms"]) / max(1, numel)

    def _compress(self, flat, gen) -> Payload:
        m = self.codec.norms(flat)
        r = self.round
        self.round += 1
        idx = self.codec.encode(flat, m, r, gen)
        return Payload({"packed": self.codec.pack(idx), "norms": m, "round": r},
                       flat.numel(), ())

    def _decompress(self, payload: Payload):
        d = self.codec.layout(payload.numel).total_padded
        idx = self.codec.unpack(payload.data["packed"], d)
        return self.codec.decode_own(idx, payload.data["norms"], payload.numel,
                                     payload.data["round"])

    def aggregate_mean(self, xs: Sequence, rng=None):
        xs = list(xs)
        if not xs:
            raise ValueError("aggregate_mean needs at least one vector")
        flats = [_as_torch(x) for x in xs]
        gen = _torch_generator(rng, flats[0][0].device)
        est = self.codec.simulate([f for f, _ in flats], self.round, gen)
        self.round += 1
        return flats[0][1](est)


class UHC(THC):
    """THC's pipeline with a uniform table (the paper's UHC baseline)."""

    name = "uhc"

    def __init__(self, **kw):
        kw.setdefault("table_kind", "uniform")
        super().__init__(**kw)


class QSGD(Scheme):
    """QSGD with L-inf normalization: s levels per sign, unbiased stochastic rounding.
    Wire: one float32 scale plus 1 + ceil(log2(s + 1)) bits per coordinate (4 at s = 7)."""

    name = "qsgd"
    unbiased = True

    def __init__(self, s: int = 7, error_feedback: bool = False):
        super().__init__(error_feedback)
        # levels are counted in float32, whose integers are exact up to 2^24
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or not 1 <= s <= 2 ** 24:
            raise ValueError(f"QSGD needs a whole number 1 <= s <= 2^24 of levels, got {s!r}")
        self.s = int(s)

    def describe(self) -> str:
        return f"qsgd(s={self.s})"

    def bits_per_coord(self, numel: int = 2 ** 18) -> float:
        return 1 + math.ceil(math.log2(self.s + 1)) + 32.0 / max(1, numel)

    def _compress(self, flat, gen) -> Payload:
        torch = _torch()
        scale = flat.abs().amax() if flat.numel() else flat.new_zeros(())
        # |x| / scale first: s / scale overflows float32 for a scale below s / its largest
        r = flat.abs() / scale * self.s if float(scale) > 0 else torch.zeros_like(flat)
        lvl = torch.floor(r + torch.rand(r.shape, generator=gen, device=r.device))
        levels = next(t for t in (torch.int8, torch.int16, torch.int32)   # a level, a sign
                      if self.s <= torch.iinfo(t).max)
        q = (torch.sign(flat) * lvl.clamp_(max=self.s)).to(levels)
        return Payload({"levels": q, "scale": scale}, flat.numel(), ())

    def _decompress(self, payload: Payload):
        return payload.data["levels"].float() * (payload.data["scale"] / self.s)


class TernGrad(Scheme):
    """TernGrad: sign(x) * s * Bernoulli(|x| / s) with s = max|x| (unbiased). Counted as 2
    bits per coordinate (ternary values packed naively) plus the float32 scale."""

    name = "terngrad"
    unbiased = True

    def bits_per_coord(self, numel: int = 2 ** 18) -> float:
        return 2 + 32.0 / max(1, numel)

    def _compress(self, flat, gen) -> Payload:
        torch = _torch()
        scale = flat.abs().amax() if flat.numel() else flat.new_zeros(())
        prob = flat.abs() / scale if float(scale) > 0 else torch.zeros_like(flat)
        keep = torch.rand(prob.shape, generator=gen, device=prob.device) < prob
        t = (torch.sign(flat) * keep).to(torch.int8)
        return Payload({"ternary": t, "scale": scale}, flat.numel(), ())

    def _decompress(self, payload: Payload):
        return payload.data["ternary"].float() * payload.data["scale"]


class TopK(Scheme):
    """Keep the k = ceil(ratio * numel) largest-magnitude coordinates (values + int64
    indices; 64 bits each at 32-bit indices on the wire). Biased; meant to be used with error
    feedback (the default), as in the THC authors' baseline."""

    name = "topk"

    def __init__(self, ratio: float = 0.1, error_feedback: bool = True):
        super().__init__(error_feedback)
        if not 0.0 < float(ratio) <= 1.0:
            raise ValueError(f"TopK ratio must be in (0, 1], got {ratio}")
        self.ratio = float(ratio)

    def describe(self) -> str:
        return f"topk({self.ratio:g})"

    def k(self, numel: int) -> int:
        """ceil(ratio x numel), a product within floating point's error of an integer taken
        as that integer (0.07 of 100 is 7, not 8)."""
        product = self.ratio * int(numel)
        near = near_int(product)
        return min(int(numel), math.ceil(product) if near is None else near)

    def bits_per_coord(self, numel: int = 2 ** 18) -> float:
        return self.k(numel) * 64.0 / max(1, numel)

    def _compress(self, flat, gen) -> SparsePayload:
        torch = _torch()
        k = self.k(flat.numel())
        _, idx = torch.topk(flat.abs(), k, sorted=False)
        return SparsePayload({"values": flat[idx], "indices": idx}, flat.numel(), ())

    def _decompress(self, payload: Payload):
        torch = _torch()
        out = torch.zeros(payload.numel, dtype=torch.float32, device=payload.indices.device)
        out[payload.indices] = payload.values.float()
        return out

    @staticmethod
    def combine(values, indices, numel: int):
        """Dense mean of W all-gathered payloads: values/indices shaped (W, k) (or lists)."""
        torch = _torch()
        if isinstance(values, (list, tuple)):
            values, indices = torch.stack(list(values)), torch.stack(list(indices))
        w = values.shape[0] if values.ndim > 1 else 1
        # float64: a float32 sum of W large values overflows where their mean does not
        out = torch.zeros(int(numel), dtype=torch.float64, device=values.device)
        out.index_add_(0, indices.reshape(-1).long(), values.reshape(-1).double())
        return (out / w).float()


class SignSGD(Scheme):
    """One sign bit per coordinate scaled by mean|x| (the scale that minimises the L2 error of
    a constant-magnitude reconstruction). Biased; error feedback recommended (EF-signSGD)."""

    name = "sign"

    def __init__(self, error_feedback: bool = False):
        super().__init__(error_feedback)

    def bits_per_coord(self, numel: int = 2 ** 18) -> float:
        return 1 + 32.0 / max(1, numel)

    def _compress(self, flat, gen) -> Payload:
        torch = _torch()
        scale = flat.abs().double().mean().float() if flat.numel() else flat.new_zeros(())
        bits = (flat < 0).to(torch.uint8)
        return Payload({"signs": pack_bits(bits, 1), "scale": scale}, flat.numel(), ())

    def _decompress(self, payload: Payload):
        bits = unpack_bits(payload.data["signs"], 1, payload.numel).float()
        return (1.0 - 2.0 * bits) * payload.data["scale"]


class FP16(Scheme):
    """Half-precision cast: the cheap baseline every compressor has to beat."""

    name = "fp16"

    def bits_per_coord(self, numel: int = 2 ** 18) -> float:
        return 16.0

    def _compress(self, flat, gen) -> Payload:
        # held to float16's range, not Inf: error feedback keeps what the hold cuts off
        return Payload({"half": cast_estimate(flat, _torch().float16)}, flat.numel(), ())

    def _decompress(self, payload: Payload):
        return payload.data["half"].float()


class FP32(Scheme):
    """No compression (the reference in training comparisons)."""

    name = "fp32"
    unbiased = True

    def bits_per_coord(self, numel: int = 2 ** 18) -> float:
        return 32.0

    def _compress(self, flat, gen) -> Payload:
        return Payload({"float": flat.clone()}, flat.numel(), ())

    def _decompress(self, payload: Payload):
        return payload.data["float"]


SCHEMES: dict[str, Callable[..., Scheme]] = {
    "thc": THC, "uhc": UHC, "qsgd": QSGD, "terngrad": TernGrad, "topk": TopK,
    "sign": SignSGD, "fp16": FP16, "fp32": FP32,
}


def scheme_names() -> list[str]:
    return list(SCHEMES)


def _parse_value(text: str):
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return fraction_value(text)
    except ValueError:
        return text


def make_scheme(spec: str, defaults: dict | None = None, **overrides) -> Scheme:
    """Build a scheme from ``name[:key=value...]``, e.g. ``topk:ratio=0.01``, ``thc:p=1/64``;
    ``defaults``: options where the spec gives none, ``overrides``: options whatever it
    gives."""
    name, *opts = [part.strip() for part in spec.strip().split(":")]
    if name not in SCHEMES:
        raise ValueError(f"unknown scheme {name!r}; known: {', '.join(SCHEMES)}")
    kw: dict = dict(defaults or {})
    for opt in opts:
        if "=" not in opt:
            raise ValueError(f"scheme option {opt!r} in {spec!r} is not key=value")
        k, v = opt.split("=", 1)
        kw[k.strip()] = _parse_value(v.strip())
    kw.update(overrides)
    try:
        return SCHEMES[name](**kw)
    except TypeError as e:
        raise ValueError(f"bad options for scheme {name!r}: {e}") from None
