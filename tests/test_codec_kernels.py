"""The codec's counter-based generator and its Triton kernels against the reference path.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here before
the kernel module is imported); only where triton is missing or the interpreter was not asked
for are the kernel tests skipped, with the reason.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from thc.codec import rng, thc
from thc.codec.hadamard import fwht
from thc.codec.thc import ErrorFeedback, THCCodec, THCParams

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEV = "cuda" if CUDA else "cpu"


def _kernel_skip_reason():
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not installed ({e}); pip install the test extra"
    if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        return "no CUDA device and TRITON_INTERPRET is not 1 (the interpreter was not asked for)"
    return None   # a kernel that fails where triton runs fails its tests, never skips them


SKIP = _kernel_skip_reason()
kernels = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
if SKIP:
    print(f"test_codec_kernels: kernel tests skipped: {SKIP}")
elif not CUDA:
    # Triton decides at a kernel's definition whether the interpreter runs it: defined now,
    # under TRITON_INTERPRET=1, once for the process. Defined first under a test that unsets
    # it (a refusal's test), they would be GPU kernels, and every later test's launch fail.
    from thc.codec import triton_kernels  # noqa: F401,E402
    from thc.collective import round_kernels  # noqa: F401,E402


def nmse(x, est):
    x = x.double().cpu()
    return float(((est.double().cpu() - x) ** 2).sum() / (x ** 2).sum())


def _mix32(x):
    """mix32 from docs/protocol.md, in Python integers: an independent statement of it."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2 ** 32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2 ** 32
    return x ^ (x >> 16)


def _documented_key(stream, seed, rnd, sl):
    """A slice's (k0, k1) from docs/protocol.md's text: the words absorbed into (h, g)."""
    h = g = 0
    for w in (stream, seed % 2 ** 32, seed >> 32, rnd % 2 ** 32, rnd >> 32, sl):
        h = _mix32(((h ^ w) + 0x9E3779B9) % 2 ** 32)
        g = _mix32(g ^ h)
        h = _mix32(((h ^ g) + 0x85EBCA6B) % 2 ** 32)
    return h, g


def test_generator_follows_the_documented_definition():
    seed, rnd, sl = 2 ** 40 + 7, 2 ** 33 + 5, 9
    k0, k1 = _documented_key(rng.SIGN_STREAM, seed, rnd, sl)
    assert rng.slice_key(seed, rnd, sl, rng.SIGN_STREAM) == (k0, k1)
    want = []
    for i in range(100):
        word = _mix32(_mix32((i // 32) ^ k0) ^ k1)
        want.append(-1.0 if (word >> (i % 32)) & 1 else 1.0)
    assert rng.signs(100, seed, rnd, sl).tolist() == want
    u0 = rng.slice_key(seed, rnd, sl, rng.UNIFORM_STREAM)
    assert rng.uniforms(3, seed, rnd, sl).tolist() == [
        (_mix32(_mix32(i ^ u0[0]) ^ u0[1]) >> 8) * 2.0 ** -24 for i in range(3)]


def test_generator_identical_in_numpy_and_torch_integer_arithmetic():
    """numpy uint32 and torch int64 (the CUDA path's arithmetic, here on the CPU) agree."""
    for impl_args in [(5000, 3, 7, [0, 1, 2 ** 31 + 5]), (33, 2 ** 63, 1, [4])]:
        n, seed, rnd, slices = impl_args
        a = rng.signs(n, seed, rnd, slices)
        b = rng.signs(n, seed, rnd, slices, like=torch.zeros(1), impl="torch")
        assert np.array_equal(a, b.numpy())
        ua = rng.uniforms(n, seed, rnd, slices)
        ub = rng.uniforms(n, seed, rnd, slices, like=torch.zeros(1), impl="torch")
        assert np.array_equal(ua, ub.numpy())
        assert ua.min() >= 0 and ua.max() < 1


def test_no_two_slices_of_a_job_share_a_key():
    """Every (round, slice) of a job draws under its own key: rounds in step, pipeline pieces
    (round + k 2^40) and slices alike. 2^14 rounds of four pieces and 64 slices give 2^24
    keys, of which a 32-bit schedule xoring the slice into its round's prefix shares about
    2000 (whole rounds paired, their slices permuted: 1472 at this seed)."""
    keys = np.concatenate([
        rng.slice_keys(11, r + piece * 2 ** 40, range(64), rng.SIGN_STREAM)
        for r in range(2 ** 14) for piece in range(4)])
    packed = keys[:, 0].astype(np.uint64) << np.uint64(32) | keys[:, 1].astype(np.uint64)
    assert np.unique(packed).size == packed.size


def test_generator_statistics_and_key_separation():
    s = rng.signs(1 << 16, 0, 0, [0, 1])
    assert abs(s.mean()) < 5 / 2 ** 8
    assert abs(np.mean(s[0] * s[1])) < 5 / 2 ** 8      # slices independent
    assert abs(np.mean(s[0, 1:] * s[0, :-1])) < 5 / 2 ** 8  # neighbours independent
    u = rng.uniforms(1 << 16, 0, 0, 0)
    assert abs(u.mean() - 0.5) < 0.01 and abs(u.var() - 1 / 12) < 0.005
    assert not np.array_equal(rng.signs(64, 0, 1, 0), rng.signs(64, 0, 0, 1))
    assert not np.array_equal(rng.signs(64, 1, 0, 0), rng.signs(64, 2 ** 32 + 1, 0, 0))
    pfx = rng.key_prefix(5, 2 ** 40 + 3, rng.SIGN_STREAM)
    assert rng.key_from_prefix(pfx, 9) == rng.slice_key(5, 2 ** 40 + 3, 9, rng.SIGN_STREAM)
    with pytest.raises(ValueError, match="slice"):
        rng.slice_key(0, 0, 2 ** 32, 0)
    with pytest.raises(ValueError, match="seed"):
        rng.slice_key(-1, 0, 0, 0)
    with pytest.raises(ValueError, match="round"):
        rng.slice_key(0, 2 ** 64, 0, 0)


@kernels
@pytest.mark.parametrize("slice_log,extra", [(8, 0), (10, 300), (12, 4096 + 1000), (16, 0)])
def test_kernels_match_reference(slice_log, extra):
    """Same rotation, same uniforms (an int generator): the same indices up to the rare
    coordinate that the transform's float rounding moves across a rounding threshold."""
    p = THCParams(slice_size=1 << slice_log)
    n = 2 * (1 << slice_log) + extra
    x = torch.randn(n, generator=torch.Generator().manual_seed(slice_log)).to(DEV)
    m = thc.slice_norms(x, p)
    a = thc.encode(x, m, p, 5, 77, backend="triton")
    b = thc.encode(x.cpu(), m.cpu(), p, 5, 77, backend="reference")
    assert a.dtype == torch.uint8 and a.shape == b.shape
    assert (a.cpu() != b).float().mean() < 1e-4
    packed = thc.encode_packed(x, m, p, 5, 77, backend="triton")
    assert torch.equal(packed.cpu(), thc.pack_bits(a.cpu(), 4))
    prep = thc.prepare(x, p, 5, backend="triton")       # norms from encode pass 1's read
    assert torch.allclose(prep.norms.cpu(), m.cpu(), rtol=1e-5)
    assert torch.equal(thc.encode_prepared(prep, m, p, 77), packed)
    assert torch.equal(thc.encode_prepared(prep, m, p, 77, pack=False), a)
    sums = thc.aggregate([a, a, a], p)
    da = thc.decode(sums, 3, m, n, p, 5, backend="triton")
    db = thc.decode(sums.cpu(), 3, m.cpu(), n, p, 5, backend="reference")
    assert da.dtype == torch.float32 and da.shape == (n,)
    assert torch.allclose(da.cpu(), db, atol=1e-5)
    for narrow in (torch.uint8, torch.int16, torch.int64)[: 3 if slice_log < 16 else 0]:
        assert torch.equal(thc.decode(sums.to(narrow), 3, m, n, p, 5, backend="triton"), da)
    own = thc.decode_indices(a, m, n, p, 5, backend="triton")
    assert torch.allclose(own.cpu(), db, atol=1e-5)


def _unmix32(x):
    """mix32's inverse (each step is one-to-one)."""
    def unshift(y, k):
        z = y
        for _ in range(32 // k + 1):
            z = y ^ (z >> k)
        return z
    x = unshift(x, 16) * pow(0x846CA68B, -1, 2 ** 32) % 2 ** 32
    x = unshift(x, 15) * pow(0x7FEB352D, -1, 2 ** 32) % 2 ** 32
    return unshift(x, 16)


def _tail_to_a_32_bit_state(state):
    """Two words, low | high << 32, whose absorbs into ``state`` leave g = 0 and h >= 2^31:
    a state whose int fits 32 bits unsigned, not signed (absorb's g is mix32(g ^ h1), 0 where
    h1 = g, and h1 = mix32((h ^ w) + GOLDEN) is solved for the word)."""
    for low in range(64):
        s = rng.absorb(state, low)
        high = ((_unmix32(s >> 32) - 0x9E3779B9) % 2 ** 32) ^ (s % 2 ** 32)
        if rng.absorb(s, high) >= 2 ** 31:
            return high << 32 | low


@kernels
def test_kernels_take_a_prefix_that_fits_32_bits():
    """A key prefix below 2^32 (a chance of 2^-32 a key, made here on purpose) reaches the
    kernels as an int that fits 32 bits, as passed and, for a round read on the device, as
    the seed's state: the same indices and decode as the reference."""
    rnd = _tail_to_a_32_bit_state(rng.seed_state(5, rng.SIGN_STREAM))
    seed = _tail_to_a_32_bit_state(rng.absorb(0, rng.SIGN_STREAM))
    assert 2 ** 31 <= rng.key_prefix(5, rnd, rng.SIGN_STREAM) < 2 ** 32
    assert 2 ** 31 <= rng.seed_state(seed, rng.SIGN_STREAM) < 2 ** 32
    x = torch.randn(512, generator=torch.Generator().manual_seed(0))
    for p, r, given in ((THCParams(slice_size=256, seed=5), rnd, rnd),
                        (THCParams(slice_size=256, seed=seed), 3, torch.tensor([3]).to(DEV))):
        m = thc.slice_norms(x, p)
        want = thc.encode(x, m, p, r, 7, backend="reference")
        assert torch.equal(thc.encode(x.to(DEV), m.to(DEV), p, given, 7, backend="triton").cpu(),
                           want)
        sums = thc.aggregate([want], p)
        got = thc.decode(sums.to(DEV), 1, m.to(DEV), 512, p, given, backend="triton")
        assert torch.allclose(got.cpu(), thc.decode(sums, 1, m, 512, p, r, backend="reference"),
                              atol=1e-5)


@kernels
@pytest.mark.parametrize("kw", [dict(bits=2, granularity=3), dict(bits=4, granularity=31),
                                dict(bits=6, granularity=200), dict(table_kind="uniform")])
def test_kernels_match_reference_on_other_tables(kw):
    """Tables other than the default's: an odd g puts the sums' centre at n x g / 2, half a
    step off any integer, and a wider or uniform table takes other lookup steps."""
    p = THCParams(slice_size=1 << 10, **kw)
    n = 2 * (1 << 10) + 300
    x = torch.randn(n, generator=torch.Generator().manual_seed(p.granularity)).to(DEV)
    m = thc.slice_norms(x, p)
    a = thc.encode(x, m, p, 4, 21, backend="triton")
    b = thc.encode(x.cpu(), m.cpu(), p, 4, 21, backend="reference")
    assert int((a.cpu() != b).sum()) <= 2, kw
    assert torch.equal(thc.encode_packed(x, m, p, 4, 21, backend="triton").cpu(),
                       thc.pack_bits(a.cpu(), p.bits))
    sums = thc.aggregate([b, b, b], p)
    db = thc.decode(sums, 3, m.cpu(), n, p, 4, backend="reference")
    da = thc.decode(sums.to(DEV), 3, m, n, p, 4, backend="triton")
    assert torch.allclose(da.cpu(), db, atol=1e-5), kw
    own = thc.decode_indices(b.to(DEV), m, n, p, 4, backend="triton")
    assert torch.allclose(own.cpu(), db, atol=1e-5), kw


@kernels
def test_kernels_pack_around_short_tail_slices():
    """Tails of 1 and 3 coordinates take the reference path inside a kernel encode; the
    packed bytes stay aligned (an odd padded length ends in half a byte)."""
    p = THCParams(slice_size=256)
    for n in (513, 259):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(DEV)
        m = thc.slice_norms(x, p)
        idx = thc.encode(x, m, p, 2, 6, backend="triton")
        assert idx.numel() == thc.layout(n, p).total_padded
        packed = thc.encode_packed(x, m, p, 2, 6, backend="triton")
        assert torch.equal(packed.cpu(), thc.pack_bits(idx.cpu(), 4))
        assert torch.equal(idx.cpu(), thc.encode(x.cpu(), m.cpu(), p, 2, 6, backend="reference"))


@kernels
def test_encode_on_one_backend_decode_on_another():
    """Kernels -> reference, reference -> kernels, numpy -> kernels: the NMSE of all-reference
    (b=4, g=30, p=1/32: 0.0204 +- 5% for one Gaussian worker)."""
    p = THCParams(slice_size=1 << 12)
    n = 1 << 16
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    xd = x.to(DEV)
    m = thc.slice_norms(x, p)
    results = {}
    idx = thc.encode(xd, m, p, 1, 11, backend="triton")
    results["kernels->reference"] = thc.decode(thc.aggregate([idx.cpu()], p), 1, m, n, p, 1,
                                               backend="reference")
    idx = thc.encode(x, m, p, 1, 11, backend="reference")
    results["reference->kernels"] = thc.decode(thc.aggregate([idx.to(DEV)], p), 1, m.to(DEV),
                                               n, p, 1, backend="triton")
    idx = thc.encode(x.numpy(), m.numpy(), p, 1, 11)
    results["numpy->kernels"] = thc.decode(torch.from_numpy(
        thc.aggregate([idx], p).astype(np.int32)).to(DEV), 1, m, n, p, 1, backend="triton")
    idx = thc.encode(x, m, p, 1, 11, backend="reference")
    ref = nmse(x, thc.decode(thc.aggregate([idx], p), 1, m, n, p, 1, backend="reference"))
    assert ref == pytest.approx(0.0204, rel=0.05)
    for name, est in results.items():
        assert nmse(x, est) == pytest.approx(ref, rel=0.01), name


@kernels
def test_kernels_nmse_and_unbiased():
    """64 slices that each hold the same vector get their own signs and uniforms: 64
    independent estimates in one call. Each is unbiased for its truncated rotation (what the
    reference computes without rounding), so their mean converges to the mean of those."""
    d, k = 1 << 10, 64
    p = THCParams(slice_size=d)
    v = torch.randn(d, generator=torch.Generator().manual_seed(9))
    x = v.repeat(k).to(DEV)
    m = thc.slice_norms(x, p)
    est = thc.decode_indices(thc.encode(x, m, p, 0, 5, backend="triton"), m, d * k, p, 0,
                             backend="triton").cpu().reshape(k, d)
    per = [nmse(v, e) for e in est]
    assert np.mean(per) == pytest.approx(0.0204, rel=0.05)
    g, t, mk = p.granularity, p.t_p, float(m[0])
    signs = torch.from_numpy(rng.signs(d, p.seed, 0, range(k)))
    u = (fwht(v * signs, scale=g / (2 * t * mk)) + g / 2).clamp(0, g)
    truncated = signs * fwht(u - g / 2, scale=2 * t * mk / (g * d))
    assert nmse(v, truncated.mean(0)) < 0.1 * np.mean(per)    # truncation's small bias
    assert nmse(truncated.mean(0), est.mean(0)) < 2 * np.mean(per) / k


@kernels
def test_kernels_refuse_nan_and_inf():
    p = THCParams(slice_size=256)
    x = torch.randn(1000, device=DEV)
    m = thc.slice_norms(x, p)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[700] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            thc.encode(y, m, p, 0, 1, backend="triton")
        with pytest.raises(ValueError, match="NaN or Inf"):
            thc.slice_norms(y, p)
        with pytest.raises(ValueError, match="NaN or Inf"):
            thc.prepare(y, p, 0, backend="triton")


@kernels
@pytest.mark.parametrize("scale", [1e-25, 1e20])
def test_kernel_norms_take_what_the_reference_takes(scale):
    """Squares of 1e-25 underflow float32 and those of 1e20 overflow it, where their norms do
    not: the kernels' pass 1 (and its short tail of 100, the reference path) sums squares in
    float64 as the reference does, so the norms agree and the slices encode. A slice whose
    norm is beyond float32 is refused alike, naming it."""
    p = THCParams(slice_size=256)
    x = torch.randn(612, generator=torch.Generator().manual_seed(5)).to(DEV) * scale
    want = thc.slice_norms(x.cpu(), p)
    assert bool((want > 0).all()) and bool(want.isfinite().all())
    prep = thc.prepare(x, p, 2, backend="triton")
    torch.testing.assert_close(prep.norms.cpu(), want, rtol=1e-6, atol=0)
    idx = thc.encode_prepared(prep, want.to(DEV), p, 7, pack=False)
    est = thc.decode_indices(idx, want.to(DEV), 612, p, 2, backend="triton").cpu()
    assert nmse(x.cpu(), est) < 0.1
    for at in (300, 600):   # a slice of the kernels, the short tail
        y = x.clone()
        y[at - 40: at] = 1e38   # each square overflows float32, so does the norm
        with pytest.raises(ValueError, match=f"slice norm beyond .*, in slice {at // 256}"):
            thc.prepare(y, p, 2, backend="triton")
        with pytest.raises(ValueError, match="slice norm beyond"):
            thc.slice_norms(y.cpu(), p)


@kernels
def test_every_backend_refuses_the_same_norms_at_the_limit():
    """The limit as float32 (what a float32 norm is compared with): the reference refused a
    slice of that norm and the kernels, comparing float64 norms, took it. One float32 step
    below, every backend takes it."""
    from thc.codec.common import norm_limit
    p = THCParams(slice_size=256)
    at = torch.tensor(norm_limit(p), dtype=torch.float32)
    below = torch.nextafter(at, torch.tensor(0.0))
    for value, refused in ((at, True), (below, False)):
        for where in (5, 600):   # a slice of the kernels, the short tail
            x = torch.zeros(612)
            x[where] = value
            for backend in ("reference", "compiled", "triton"):
                dev = DEV if backend == "triton" else "cpu"
                try:
                    thc.prepare(x.to(dev), p, 0, backend=backend)
                    got = False
                except ValueError as e:
                    assert "slice norm beyond" in str(e)
                    got = True
                assert got == refused, (float(value), where, backend)


@pytest.mark.parametrize("tiny", [1e-39, 1.1754944e-38, 1e-45])
def test_a_slice_below_float32s_reach_encodes_as_zeros_on_every_backend(tiny):
    """Its scale g / (2 t M) overflows float32: unguarded, the CPU backends would refuse the
    input as NaN or Inf (naming the healthy slice too) and the kernels encode all-extreme
    indices (decoding 2e-39 for 1e-39). Every backend encodes it as a zero slice, the same
    indices."""
    p = THCParams(slice_size=256)
    x = torch.randn(512, generator=torch.Generator().manual_seed(3))
    x[256:] = 0.0
    x[300] = tiny
    m = torch.from_numpy(thc.slice_norms(x.numpy(), p))   # float64 sums: no underflow to 0
    assert m[1] > 0
    got = {}
    for backend in ("reference", "compiled", "triton"):
        if backend == "triton" and SKIP:
            continue
        dev = DEV if backend == "triton" else "cpu"
        idx = thc.encode(x.to(dev), m.to(dev), p, 0, 9, backend=backend).cpu()
        est = thc.decode(thc.aggregate([idx], p), 1, m, 512, p, 0, backend="reference")
        assert nmse(x[:256], est[:256]) < 0.1, backend
        assert float(est[256:].abs().max()) < 1e-37, backend
        got[backend] = idx
    for backend, idx in got.items():
        assert torch.equal(idx[256:], got["reference"][256:]), backend


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_bad_max_norms_refused_on_every_backend(backend):
    """The kernels keep device-side max norms on the device and check them in the wait they
    already have; bad ones are refused the same way as on the host."""
    if backend == "triton" and SKIP:
        pytest.skip(SKIP)
    p = THCParams(slice_size=256)
    x = torch.randn(1000, device=DEV)
    m = thc.slice_norms(x, p)
    idx = thc.encode(x, m, p, 0, 1, backend=backend)
    sums = thc.aggregate([idx], p)
    for bad in (float("nan"), float("inf"), -1.0):
        mb = m.clone()
        mb[2] = bad
        with pytest.raises(ValueError, match="max norms must be finite"):
            thc.encode(x, mb, p, 0, 1, backend=backend)
        with pytest.raises(ValueError, match="max norms must be finite"):
            thc.decode(sums, 1, mb, 1000, p, 0, backend=backend)
    with pytest.raises(ValueError, match="expected 4 max norms"):
        thc.encode(x, m[:3], p, 0, 1, backend=backend)
    with pytest.raises(ValueError, match="expected 4 max norms"):
        thc.decode(sums, 1, m[:3], 1000, p, 0, backend=backend)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_input_conversion_and_refusals(backend):
    """Non-contiguous and non-float32 inputs are converted (to contiguous float32); complex
    and bool are refused; tensors on another device than the codec's state are refused."""
    if backend == "triton" and SKIP:
        pytest.skip(SKIP)
    p = THCParams(slice_size=256)
    base = torch.randn(600, 2, generator=torch.Generator().manual_seed(1)).to(DEV)
    x = base[:, 0]                          # a strided view
    assert not x.is_contiguous()
    m = thc.slice_norms(x, p)
    ref = thc.encode(x.contiguous(), m, p, 0, 3, backend=backend)
    assert torch.equal(thc.encode(x, m, p, 0, 3, backend=backend), ref)
    assert torch.equal(thc.encode(x.double(), m, p, 0, 3, backend=backend), ref)
    assert torch.equal(thc.encode(x.half().float(), m, p, 0, 3, backend=backend),
                       thc.encode(x.half(), m, p, 0, 3, backend=backend))
    with pytest.raises(TypeError, match="real tensor"):
        thc.encode(x.to(torch.complex64), m, p, 0, 3, backend=backend)
    with pytest.raises(TypeError, match="real tensor"):
        thc.encode(x > 0, m, p, 0, 3, backend=backend)
    sums = thc.aggregate([ref], p)
    with pytest.raises(TypeError, match="integer"):
        thc.decode(sums.float(), 1, m, 600, p, 0, backend=backend)
    meta = torch.empty(600, device="meta")
    with pytest.raises(ValueError, match="out is on meta"):
        thc.decode(sums, 1, m, 600, p, 0, out=meta, backend=backend)
    with pytest.raises(ValueError, match="index vector is on meta"):
        thc.aggregate([ref, torch.empty(ref.shape, dtype=torch.uint8, device="meta")], p)
    ef = ErrorFeedback(p)
    ef.residual = meta
    with pytest.raises(ValueError, match="residual is on meta"):
        ef.compensate(x)
    with pytest.raises(ValueError, match="index 16 outside"):
        thc.decode_indices(torch.full_like(ref, 16), m, 600, p, 0, backend=backend)


@pytest.mark.parametrize("as_numpy", [True, False])
def test_prepare_then_encode_on_the_reference_path(as_numpy):
    p = THCParams(slice_size=256)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    x = x.numpy() if as_numpy else x
    prep = THCCodec(p).prepare(x, 3)
    assert np.array_equal(np.asarray(prep.norms), np.asarray(thc.slice_norms(x, p)))
    want = thc.encode_packed(x, prep.norms, p, 3, 8)
    got = THCCodec(p).encode_prepared(prep, prep.norms, 8)
    assert np.array_equal(np.asarray(got), np.asarray(want))


def test_cpu_install_without_triton(monkeypatch):
    """Without triton the reference path serves everything; asking for the kernels says why
    not. On the CPU the kernels also need the interpreter to have been asked for."""
    import sys

    monkeypatch.delitem(sys.modules, "thc.codec.triton_kernels", raising=False)
    monkeypatch.delattr(sys.modules["thc.codec"], "triton_kernels", raising=False)
    monkeypatch.setitem(sys.modules, "triton", None)
    p = THCParams(slice_size=256)
    x = torch.randn(600)
    c = THCCodec(p)
    m = c.norms(x)
    assert c.decode(c.aggregate([c.encode(x, m, 0)]), 1, m, 600, 0).shape == (600,)
    with pytest.raises(RuntimeError, match="needs the triton package"):
        thc.encode(x, m, p, backend="triton")
    monkeypatch.undo()
    if SKIP is None and not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            thc.encode(x, m, p, backend="triton")


def test_backend_argument_checked():
    p = THCParams(slice_size=256)
    x = np.ones(10, np.float32)
    with pytest.raises(ValueError, match="backend must be one of"):
        thc.encode(x, thc.slice_norms(x, p), p, backend="gpu")
    with pytest.raises(TypeError, match="torch tensors"):
        thc.encode(x, thc.slice_norms(x, p), p, backend="triton")
    with pytest.raises(ValueError, match="backend must be one of"):
        THCCodec(p, backend="cuda")


@pytest.mark.skipif(not CUDA, reason="no CUDA device: the automatic choice of the kernels "
                                      "for CUDA tensors needs one")
def test_cuda_tensors_take_the_kernels(monkeypatch):
    from thc.codec import triton_kernels
    calls = []
    orig = triton_kernels.encode_cols
    monkeypatch.setattr(triton_kernels, "encode_cols",
                        lambda *a, **k: calls.append(1) or orig(*a, **k))
    c = THCCodec()
    x = torch.randn(1 << 20, device="cuda")
    m = c.norms(x)
    est = c.decode(c.aggregate([c.encode(x, m, 0)]), 1, m, x.numel(), 0)
    assert calls and nmse(x, est) == pytest.approx(0.0204, rel=0.05)
    with pytest.raises(ValueError, match="generator"):
        c.encode(x, m, 0, torch.Generator())


@kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_read_half_types_as_they_are(dtype):
    """float16 and bfloat16 reach the kernels without a float32 copy and encode exactly as
    their float32 values do."""
    p = THCParams(slice_size=1 << 10)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(5)).to(DEV).to(dtype)
    m = thc.slice_norms(x.float(), p)
    prep = thc.prepare(x, p, 4, backend="triton")
    assert prep.flat.dtype == dtype
    assert torch.allclose(prep.norms, m, rtol=1e-5)
    want = thc.encode_packed(x.float(), m, p, 4, 9, backend="triton")
    assert torch.equal(thc.encode_prepared(prep, m, p, 9), want)
    assert torch.equal(thc.encode_packed(x, m, p, 4, 9, backend="triton"), want)


def _interpreter_reads_bf16_subnormals_wrong() -> bool:
    """Triton's interpreter (3.9) converts bfloat16 values below float32's smallest normal
    wrongly (2.9e-39 reads as 0): a kernel run there cannot show what a GPU reads."""
    if CUDA:
        return False
    import triton
    import triton.language as tl

    @triton.jit
    def widen(x, y, N: tl.constexpr):
        o = tl.arange(0, N)
        tl.store(y + o, tl.load(x + o).to(tl.float32))

    x = torch.tensor([2.9e-39, 1e-38], dtype=torch.bfloat16)
    y = torch.empty(2)
    widen[(1,)](x, y, N=2)
    return not torch.equal(y, x.float())


@kernels
def test_kernels_read_bf16_subnormals_as_their_float32_values():
    """bfloat16 shares float32's exponent: values below its smallest normal are read exactly,
    so the slice norms and indices are those of the float32 copy."""
    if _interpreter_reads_bf16_subnormals_wrong():
        pytest.skip("Triton's interpreter widens bfloat16 subnormals wrongly (2.9e-39 to 0): "
                    "this runs on a GPU")
    p = THCParams(slice_size=1 << 10)
    x = (torch.randn(2048, generator=torch.Generator().manual_seed(6)) * 1e-38)
    x = x.to(DEV).to(torch.bfloat16)
    m = thc.slice_norms(x.float(), p)
    prep = thc.prepare(x, p, 2, backend="triton")
    assert torch.allclose(prep.norms, m, rtol=1e-5, atol=0)
    want = thc.encode_packed(x.float(), m, p, 2, 9, backend="triton")
    assert torch.equal(thc.encode_prepared(prep, m, p, 9), want)

@kernels
def test_a_round_held_on_the_device_gives_the_int_rounds_results():
    """The kernels read a round from an int64 tensor (what a CUDA graph replays) and finish
    the keys from it: the same indices and decodes as the int round, past 2^32 too; where the
    tensor cannot be read on the device, it is refused."""
    p = THCParams(slice_size=512)
    c = THCCodec(p, backend="triton", deferred_checks=True)
    x = torch.randn(2048 + 300, generator=torch.Generator().manual_seed(1)).to(DEV)
    m = c.norms(x)
    for r in (0, 7, (1 << 33) + 5):
        rt = torch.tensor([r], dtype=torch.int64, device=DEV)
        a = c.encode_prepared(c.prepare(x, r), m, 11, pack=False)
        assert torch.equal(a, c.encode_prepared(c.prepare(x, rt), m, 11, pack=False))
        assert torch.equal(c.encode_packed(x, m, r, 11), c.encode_packed(x, m, rt, 11))
        s = c.aggregate([a, a])
        assert torch.equal(c.decode(s, 2, m, x.numel(), r), c.decode(s, 2, m, x.numel(), rt))
        assert torch.equal(c.decode_own(a, m, x.numel(), r), c.decode_own(a, m, x.numel(), rt))
    c.check()
    rt = torch.zeros(1, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="every slice in the kernels"):
        c.prepare(torch.randn(2048 + 100, device=DEV), rt)
    with pytest.raises(TypeError, match="one int64"):
        c.prepare(x, rt.int())
    with pytest.raises(TypeError, match="kernels only"):
        THCCodec(p, backend="reference").encode(x, m, rt, 1)


@kernels
@pytest.mark.parametrize("slice_log,cols_log", [(13, 12), (16, 0), (16, 12)])
def test_both_forms_of_the_products_give_the_reference(monkeypatch, slice_log, cols_log):
    """FORM="sandwich" (H_K1 X H_K2, batched products, no transposes) and "transpose" give
    the reference's indices and decodes, on splits whose rows and columns both take two
    factors (2^16 as 256 x 256) and whose rows are batched (2^13 as 32 x 256)."""
    from thc.codec import triton_kernels as tk
    monkeypatch.setattr(tk, "COLS_LOG", cols_log)
    p = THCParams(slice_size=1 << slice_log)
    n = (1 << slice_log) + 700
    x = torch.randn(n, generator=torch.Generator().manual_seed(slice_log)).to(DEV)
    m = thc.slice_norms(x, p)
    ref = thc.encode(x.cpu(), m.cpu(), p, 5, 77, backend="reference")
    sums = thc.aggregate([ref, ref], p)
    want = thc.decode(sums, 2, m.cpu(), n, p, 5, backend="reference")
    for form in tk.FORMS:
        monkeypatch.setattr(tk, "FORM", form)
        a = thc.encode(x, m, p, 5, 77, backend="triton")
        assert (a.cpu() != ref).float().mean() < 1e-4, form
        got = thc.decode(sums.to(DEV), 2, m, n, p, 5, backend="triton")
        assert torch.allclose(got.cpu(), want, atol=1e-5), form


@kernels
@pytest.mark.parametrize("tiles", [2, 3, 8])
def test_programs_of_several_row_tiles_give_what_one_tile_gives(monkeypatch, tiles):
    """Row passes whose programs run several tiles, loading the next before transforming the
    current, give one tile a program's indices and decodes bit for bit, with a ragged last
    slice, and its norms to float32 rounding (they are added up in another order). A setting
    that is not a power of two runs the power of two below it: every tile is covered."""
    from thc.codec import triton_kernels as tk
    monkeypatch.setattr(tk, "TILE", 512)
    monkeypatch.setattr(tk, "MIN_PROGRAMS", 1)
    p = THCParams(slice_size=1 << 12)
    n = 3 * (1 << 12) + 1000
    x = torch.randn(n, generator=torch.Generator().manual_seed(tiles)).to(DEV)
    got = []
    for t in (1, tiles):
        monkeypatch.setattr(tk, "ROW_TILES", t)
        assert tk.Shape(1 << 12).tiles(3) == 1 << (t.bit_length() - 1)
        prep = thc.prepare(x, p, 5, backend="triton")
        m = thc.slice_norms(x, p)
        idx = thc.encode_prepared(prep, m, p, 77, pack=False)
        sums = thc.aggregate([idx, idx], p)
        got.append((prep.norms.cpu(), idx.cpu(),
                    thc.decode(sums, 2, m, n, p, 5, backend="triton").cpu(),
                    thc.decode_indices(idx, m, n, p, 5, backend="triton").cpu()))
    (n1, i1, d1, o1), (nt, it, dt, ot) = got
    assert torch.allclose(nt, n1, rtol=1e-6)
    assert torch.equal(it, i1) and torch.equal(dt, d1) and torch.equal(ot, o1)


def test_encode_prepared_refuses_other_parameters():
    """The kernels' scratch holds one seed's signs: encoded under another seed it gave 93%
    wrong indices and no error."""
    from dataclasses import replace
    p = THCParams(slice_size=256)
    x = torch.randn(512, generator=torch.Generator().manual_seed(1))
    for backend in ("reference", "compiled", "triton"):
        if backend == "triton" and SKIP:
            continue
        y = x.to(DEV) if backend == "triton" else x
        prep = thc.prepare(y, p, 0, backend=backend)
        assert thc.encode_prepared(prep, prep.norms, p, 3).numel() == 256
        with pytest.raises(ValueError, match="prepared under other THC parameters"):
            thc.encode_prepared(prep, prep.norms, replace(p, seed=1), 3)


@kernels
def test_a_granularity_beyond_the_kernels_tables_is_refused_before_the_max_round():
    """The kernels' per-step tables of g entries were built in encode, after the MAX round
    (where a reducer that fails abandons its group), and at g = 2^30 took 8 GiB. Below the
    limit, above the reference's own (2^20), they still run as the reference."""
    from thc.codec.kernels import KERNEL_GRANULARITY
    from thc.collective.graphed import GraphedAllReduce
    p = THCParams(slice_size=256, granularity=KERNEL_GRANULARITY + 1, table_kind="uniform")
    codec = THCCodec(p, backend="triton")
    with pytest.raises(ValueError, match="Triton kernels take a granularity of at most"):
        codec.prepare(torch.ones(256, device=DEV), round=0)
    ones = torch.ones(256, device=DEV)   # called on their own, encode and decode refuse it too
    with pytest.raises(ValueError, match="Triton kernels take a granularity of at most"):
        codec.encode(ones, torch.ones(1, device=DEV), round=0)
    with pytest.raises(ValueError, match="Triton kernels take a granularity of at most"):
        codec.decode(torch.zeros(256, dtype=torch.int32, device=DEV), 2,
                     torch.ones(1, device=DEV), 256, round=0)

    class Transport:
        packed, lanes, stream_ordered, rank = False, None, True, 0

        def check(self, params):
            pass
    with pytest.raises(ValueError, match="Triton kernels take a granularity of at most"):
        GraphedAllReduce(Transport(), p)
    p = THCParams(slice_size=256, granularity=1 << 21, table_kind="uniform")
    x = torch.randn(512, generator=torch.Generator().manual_seed(2)).to(DEV)
    m = thc.slice_norms(x, p)
    a = thc.encode(x, m, p, 5, 77, backend="triton")
    assert (a.cpu() != thc.encode(x.cpu(), m.cpu(), p, 5, 77, backend="reference")).sum() <= 2



NO_LAUNCH = {"empty", "empty_strided", "new_empty", "view", "_unsafe_view", "slice", "select",
             "alias", "detach", "reshape", "as_strided", "lift_fresh", "scalar_tensor"}
"""Operations that launch nothing on a GPU: allocations, views, a Python number made a
tensor."""


class Launches:
    """What a block puts on the device, in order: the Triton kernels named (``kernels``:
    (module, name) pairs, recorded by name) and every torch operation outside them and
    outside the ``quiet`` methods ((object, name) pairs: a test's transport), but those of
    :data:`NO_LAUNCH`. Under the interpreter a kernel's own copies are inside
    it."""

    def __init__(self, monkeypatch, kernels=(), quiet=()):
        from torch.utils._python_dispatch import TorchDispatchMode
        self.seen, inside = [], []

        def wrap(fn, name):
            def run(*args, **kw):
                if name:
                    self.seen.append(name)
                inside.append(1)
                try:
                    return fn(*args, **kw)
                finally:
                    inside.pop()
            return run

        class Kernel:
            def __init__(self, kernel, name):
                self.kernel, self.name = kernel, name

            def __getitem__(self, grid):
                return wrap(self.kernel[grid], self.name)

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(mode, func, types, args=(), kwargs=None):
                name = func.__name__.split(".")[0]
                if not inside and name not in NO_LAUNCH:
                    self.seen.append(name)
                return func(*args, **(kwargs or {}))

        for module, name in kernels:
            monkeypatch.setattr(module, name, Kernel(getattr(module, name), name))
        for obj, name in quiet:
            monkeypatch.setattr(obj, name, wrap(getattr(obj, name), None))
        self.mode = Ops()

    def of(self, run):
        """(what ``run()`` put on the device, its result)."""
        self.seen.clear()
        with self.mode:
            got = run()
        return list(self.seen), got


CODEC_KERNELS = ("_encode_rows", "_finish_norms", "_encode_cols", "_decode_rows",
                 "_decode_cols")


@kernels
def test_a_buckets_round_on_the_kernels_launches_the_kernels_alone(monkeypatch):
    """A small bucket's time is mostly launches (docs/results.md): the prepare, encode and
    decode of a one-slice bucket launch their kernels and no small torch operation between
    them (the slice norms' finish after pass 1 took seventeen)."""
    from thc.codec import triton_kernels as tk
    seen = Launches(monkeypatch, [(tk, name) for name in CODEC_KERNELS])
    n = 1 << 12
    p = THCParams(slice_size=n)
    x = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(DEV)
    codec = THCCodec(p, backend="triton", deferred_checks=True)
    m = codec.norms(x)
    sums = codec.aggregate([codec.encode(x, m, 0, 5)] * 4).to(torch.int16)
    out = torch.empty(n, device=DEV)
    steps = {}
    steps["prepare"], prep = seen.of(lambda: codec.prepare(x, 1))
    steps["encode"], _ = seen.of(lambda: codec.encode_prepared(prep, m, 5))
    steps["decode"], _ = seen.of(lambda: codec.decode(sums, 4, m, n, 1, out=out))
    assert steps == {"prepare": ["_encode_rows", "_finish_norms"], "encode": ["_encode_cols"],
                     "decode": ["_decode_rows", "_decode_cols"]}
    codec.check()
    torch.testing.assert_close(prep.norms.cpu(), thc.slice_norms(x.cpu(), p), rtol=1e-6, atol=0)


def test_slice_numbers_from_2_32_are_refused_for_many_slices_too():
    """slice_keys casts the slices to uint32: slice 2^32 would wrap to slice 0 and reuse its
    rotation and draws. One slice is refused by key_from_prefix; a list must be too."""
    with pytest.raises(ValueError, match="slices"):
        rng.slice_keys(0, 0, [2 ** 32], rng.SIGN_STREAM)
    with pytest.raises(ValueError, match="slices"):
        rng.signs(8, 0, 0, [0, 2 ** 32])
    assert rng.slice_keys(0, 0, [2 ** 32 - 1], 0).tolist() == [
        list(rng.slice_key(0, 0, 2 ** 32 - 1, 0))]


def test_rounding_draws_are_keyed_by_stream_word_1():
    """The documented stream words: 0 for the signs, 1 for the draws (a backend that derives
    its keys from the definition, not from rng's constants, must meet the same draws; one
    stream for both would make the draws a function of the signs' bits)."""
    seed, rnd, sl = 7, 3, 2
    h, g = _documented_key(1, seed, rnd, sl)
    assert rng.uniforms(4, seed, rnd, sl).tolist() == [
        (_mix32(_mix32(i ^ h) ^ g) >> 8) * 2.0 ** -24 for i in range(4)]
    assert rng.slice_key(seed, rnd, sl, 1) == (h, g) != rng.slice_key(seed, rnd, sl, 0)


@pytest.mark.parametrize("kind,backend", [
    ("numpy", "reference"), ("numpy", "compiled"), ("torch", "reference"),
    ("torch", "compiled"), pytest.param("torch", "triton", marks=kernels)])
def test_an_out_over_the_sums_decodes_as_a_fresh_one(kind, backend):
    """An ``out`` over the sums' bytes, the layout with a tail slice (a group of its own):
    the reference and the kernels wrote a group's floats over the tail's sums before they
    read them, a wrong decode (by 1.3 for unit norms) with no error."""
    params = THCParams(slice_size=16)
    numel, m = 40, np.ones(3, np.float32)
    sums = np.random.default_rng(0).integers(0, 256, numel).astype(np.uint8)
    want = thc.decode(sums.copy(), 9, m, numel, params, backend="reference")
    buf = np.zeros(4 * numel, np.uint8)
    buf[:numel] = sums
    if kind == "torch":
        buf = torch.from_numpy(buf)
    got = thc.decode(buf[:numel], 9, m, numel, params, 0, out=buf.view(np.float32 if kind ==
                     "numpy" else torch.float32), backend=backend)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-6)


def test_the_interpreter_asked_for_after_triton_was_imported_is_refused_by_name():
    """TRITON_INTERPRET=1 set after ``import triton``: the codec read the variable, took the
    kernels for interpreted, and Triton raised from inside itself ("Cannot call @triton.jit'd
    outside of the scope of a kernel")."""
    pytest.importorskip("triton")
    code = ("import os, triton\nos.environ['TRITON_INTERPRET'] = '1'\nimport torch\n"
            "from thc.codec import thc\np = thc.THCParams(slice_size=256)\n"
            "x = torch.randn(512)\n"
            "thc.encode(x, thc.slice_norms(x, p), p, 0, 1, backend='triton')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode != 0
    assert ("RuntimeError: the triton backend runs CPU tensors only under Triton's "
            "interpreter: set TRITON_INTERPRET=1 before importing it") in done.stderr, \
        done.stderr[-2000:]
