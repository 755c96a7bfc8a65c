"""The compiled CPU codec against the reference path, for the same randomness.

What "identical" means (host/codec/fastcodec.py): the rotation signs and the rounding draws
are the same integers; the transform is butterflies instead of GEMMs, so rotated values
differ by float rounding, and an index differs only where its draw lies within that rounding
of the threshold (at most 1e-5 of the coordinates here, about 1e-6 measured), by one step.
Where every partial sum is exact (small integers, a power-of-two scale) indices and decode
are bit for bit the reference's. Decoded values agree within 32 float32 ulps of the slice's
scale M / sqrt(d); a sparse gradient's, whose sums are coherent, within the worst-case
rounding bound of both paths (the reference's summation order is its BLAS kernel's, which
differs by CPU). The statistical checks (NMSE 0.0204, unbiasedness) run in
tests/test_codec.py, on both paths.
"""
from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
import torch

from thc.codec import backends, fastcodec, hadamard, settings
from thc.codec import thc as codec
from thc.codec.packing import pack_bits, unpack_bits
from thc.codec.table import expected_nmse
from thc.codec.thc import THCCodec, THCParams

pytestmark = pytest.mark.skipif(not fastcodec.available(),
                                reason=f"compiled codec skipped: {fastcodec.UNAVAILABLE}")

P = THCParams()
EPS = float(np.finfo(np.float32).eps)


def data(n, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def same_indices(a, b, what=""):
    """Equal but for near-ties: at most 1e-5 of the coordinates, each by one step."""
    a, b = np.asarray(a).astype(np.int64), np.asarray(b).astype(np.int64)
    diff = np.flatnonzero(a != b)
    assert diff.size <= max(2, 1e-5 * a.size), f"{what}: {diff.size} of {a.size} differ"
    assert np.all(np.abs(a[diff] - b[diff]) == 1), what
    return diff.size


def close_decode(got, ref, m, params, numel, what=""):
    """Within 32 ulps of each slice's scale M / sqrt(d)."""
    lay = codec.layout(numel, params)
    m = np.repeat(np.asarray(m, np.float64), lay.lengths)
    bound = 32 * EPS * m / np.sqrt(np.repeat(lay.padded, lay.lengths))
    err = np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64))
    assert np.all(err <= bound + 1e-30), f"{what}: {np.max(err / (bound + 1e-30))} of the bound"


def rounding_depth(levels):
    """Roundings on the longest chain of each path's decode of 2^levels coordinates: the
    scale's product, then one per butterfly level (compiled) or k - 1 per Kronecker factor
    of k terms, summed in whatever order the BLAS kernel chooses (reference)."""
    factors = hadamard._factor_bits(levels)
    return (1 + levels) + (1 + sum((1 << k) - 1 for k in factors))


LAYOUTS = [(P, 2 ** 20 + 12345),                  # a slice of 2^20 and a padded tail
           (THCParams(slice_size=2 ** 14), 3 * 2 ** 14 + 1),   # a tail of one coordinate
           (THCParams(slice_size=2 ** 16), 2 ** 16),           # one two-pass slice
           (THCParams(slice_size=256), 1000),                  # one-pass slices
           (THCParams(slice_size=4), 11),                      # slices under a vector
           (THCParams(slice_size=1), 3)]                       # odd: packed in Python


@pytest.mark.parametrize("params,n", LAYOUTS)
def test_encode_and_decode_match_the_reference(params, n):
    x = data(n, n)
    m = codec.slice_norms(x, params, "reference")
    assert np.array_equal(codec.slice_norms(x, params, "compiled"), m)
    ref = codec.encode(x, m, params, 5, 77, "reference")
    got = codec.encode(x, m, params, 5, 77, "compiled")
    same_indices(got, ref, f"slices of {params.slice_size}")
    assert np.array_equal(codec.encode_packed(x, m, params, 5, 77, "compiled"),
                          pack_bits(got, 4))
    assert np.array_equal(codec.encode(torch.from_numpy(x), m, params, 5, 77, "compiled")
                          .numpy(), got)
    sums = codec.aggregate([ref, ref, got], params)
    dref = codec.decode(sums, 3, m, n, params, 5, backend="reference")
    dgot = codec.decode(sums, 3, m, n, params, 5, backend="compiled")
    close_decode(dgot, dref, m, params, n, "decode")
    own_ref = codec.decode_indices(got, m, n, params, 5, "reference")
    close_decode(codec.decode_indices(got, m, n, params, 5, "compiled"), own_ref, m, params, n)


@pytest.mark.parametrize("log", [10, 14, 20])
def test_a_sparse_gradient_decodes_within_the_tolerance(log):
    """Two coordinates hold the slice's norm, so the decode's sums are coherent: each
    rounding is of the size of the output M, not M / sqrt(d), and the worst case is
    reached in any summation order (a BLAS kernel picks its own, by CPU). The bound is
    the worst case of the two paths: gamma_T * sum |w| for T roundings on a chain."""
    p = THCParams(slice_size=1 << log)
    x = np.zeros(1 << log, np.float32)
    x[12345 % (1 << log)], x[7] = 3.0, -1.0
    m = codec.slice_norms(x, p, "reference")
    s = codec.aggregate([codec.encode(x, m, p, 0, 11, "reference")] * 4, p)
    want = codec.decode(s, 4, m, x.size, p, 0, backend="reference")
    got = codec.decode(s, 4, m, x.size, p, 0, backend="compiled")
    alpha = 2 * p.t_p * float(m[0]) / (p.granularity * x.size * 4)
    mass = alpha * np.abs(s.astype(np.float64) - 4 * p.granularity / 2).sum()
    t = rounding_depth(log) * EPS / 2
    bound = t / (1 - t) * mass
    err = np.abs(got.astype(np.float64) - want)
    assert err.max() <= bound, f"{err.max() / bound} of the bound"
    assert np.abs(got[[7, 12345 % x.size]] - [-1.0, 3.0]).max() < 0.05


def test_misaligned_arrays_reach_the_c_code_aligned():
    """Arrays over another buffer at an odd offset went to the C code as they were, read and
    written through float and int32 pointers (undefined behaviour); they are copied to
    aligned ones, and decode writes a misaligned ``out`` through one."""
    p = THCParams(slice_size=2 ** 12)
    n = 3 * 2 ** 12 + 5
    x = np.ndarray(n, np.float32, buffer=bytearray(4 * n + 1), offset=1)
    x[...] = data(n, 3)
    assert not x.flags.aligned and fastcodec.as_numpy(x).flags.aligned
    m = codec.slice_norms(x, p)
    idx = codec.encode(x, m, p, 1, 5, "compiled")
    assert np.array_equal(idx, codec.encode(x.copy(), m, p, 1, 5, "compiled"))
    sums = codec.aggregate([idx, idx], p).astype(np.int32)
    odd = np.ndarray(sums.size, np.int32, buffer=bytearray(4 * sums.size + 2), offset=2)
    odd[...] = sums
    assert fastcodec.sums_kind(odd)[0].flags.aligned
    out = np.ndarray(n, np.float32, buffer=bytearray(4 * n + 3), offset=3)
    codec.decode(odd, 2, m, n, p, 1, out=out, backend="compiled")
    assert np.array_equal(out, codec.decode(sums, 2, m, n, p, 1, backend="compiled"))
    # a CPU tensor over a misaligned buffer too (the C code refuses one as it is)
    t = torch.frombuffer(bytearray(b"\0" + x.tobytes()), dtype=torch.float32, offset=1,
                         count=n)
    assert torch.equal(t, torch.from_numpy(x.copy()))
    assert np.array_equal(codec.encode(t, m, p, 1, 5, "compiled"), idx)


def test_exact_inputs_are_bit_identical():
    """Small integers and a power-of-two scale: every partial sum of either transform is
    exact, so indices, wire bytes and decode equal the reference's bit for bit."""
    params = THCParams(slice_size=2 ** 15)
    n = 2 * 2 ** 15 + 3000
    x = np.random.default_rng(4).integers(-3, 4, n).astype(np.float32)
    m = np.full(3, params.granularity / (2 * params.t_p) * 2 ** 7)
    ref = codec.encode(x, m, params, 3, 9, "reference")
    assert np.array_equal(codec.encode(x, m, params, 3, 9, "compiled"), ref)
    assert np.array_equal(codec.encode_packed(x, m, params, 3, 9, "compiled"),
                          codec.encode_packed(x, m, params, 3, 9, "reference"))
    sums = codec.aggregate([ref, ref], params)
    assert np.array_equal(codec.decode(sums, 2, m, n, params, 3, backend="compiled"),
                          codec.decode(sums, 2, m, n, params, 3, backend="reference"))


@pytest.mark.parametrize("kw", [dict(bits=2, granularity=3), dict(bits=3, granularity=30),
                                dict(bits=4, granularity=31), dict(bits=4, granularity=100),
                                dict(bits=6, granularity=200), dict(table_kind="uniform")])
def test_other_tables(kw):
    """Tables of 4..64 entries, g over 31 (the lookup by counting) and the scalar rounding
    of more than 16 entries."""
    params = THCParams(slice_size=2 ** 14, **kw)
    n = 2 ** 15 + 999
    x = data(n, 1)
    m = codec.slice_norms(x, params)
    got = codec.encode(x, m, params, 2, 5, "compiled")
    same_indices(got, codec.encode(x, m, params, 2, 5, "reference"), str(kw))
    assert np.array_equal(codec.encode_packed(x, m, params, 2, 5, "compiled"),
                          pack_bits(got, params.bits))
    sums = codec.aggregate([got] * 3, params)
    close_decode(codec.decode(sums, 3, m, n, params, 2, backend="compiled"),
                 codec.decode(sums, 3, m, n, params, 2, backend="reference"), m, params, n)
    est = codec.decode_indices(got, m, n, params, 2, "compiled")
    assert np.sum((est - x) ** 2) / np.sum(x ** 2) < 2 * expected_nmse(
        params.table, params.p, params.granularity) + 0.01


def test_paths_interoperate():
    """Indices of either path decode on the other to the same accuracy."""
    n = 2 ** 18
    xs = [data(n, s) for s in range(4)]
    m = codec.agree_max([codec.slice_norms(x, P) for x in xs])
    model = expected_nmse(P.table, P.p, P.granularity) / 4
    for enc, dec in (("compiled", "reference"), ("reference", "compiled")):
        idx = [codec.encode(x, m, P, 1, 10 + i, enc) for i, x in enumerate(xs)]
        est = codec.decode(codec.aggregate(idx, P), 4, m, n, P, 1, backend=dec)
        mean = np.mean(xs, axis=0)
        nmse = np.sum((est - mean) ** 2) / np.mean([np.sum(x * x) for x in xs])
        assert nmse == pytest.approx(model, rel=0.1), (enc, dec)


def test_sum_types_and_output_buffers():
    n = 40000
    params = THCParams(slice_size=2 ** 13)
    x = data(n, 3)
    m = codec.slice_norms(x, params)
    idx = codec.encode(x, m, params, 0, 1)
    sums = codec.aggregate([idx, idx], params)
    want = codec.decode(sums, 2, m, n, params, backend="compiled")
    for s in (sums.astype(np.int8), sums.astype(np.int16), sums.astype(np.uint32),
              sums.astype(np.int64), sums.astype(np.uint64), sums.astype(">u2"),
              sums[::-1].copy()[::-1], torch.from_numpy(sums.astype(np.int32)),
              torch.from_numpy(sums.astype(np.int64))):
        got = codec.decode(s, 2, m, n, params, backend="compiled")
        assert np.array_equal(np.asarray(got), want), getattr(s, "dtype", None)
    buf = np.zeros(2 * n, np.float32)[::2]
    assert codec.decode(sums, 2, m, n, params, out=buf, backend="compiled") is buf
    assert np.array_equal(buf, want)
    tbuf = torch.zeros(2 * n)[::2]
    codec.decode(torch.from_numpy(sums.astype(np.int32)), 2, m, n, params, out=tbuf,
                 backend="compiled")
    assert np.array_equal(tbuf.numpy(), want)
    own = codec.decode_indices(idx, m, n, params, 0, "compiled")
    assert np.array_equal(own, codec.decode(codec.table_values(idx, params), 1, m, n, params,
                                            backend="compiled"))


def test_an_output_over_the_sums_or_under_autograd_is_written_as_the_references():
    """The compiled decode writes its output slice by slice, straight into ``out``: an
    ``out`` over the sums' bytes overwrote the sums of later slices before it read them (a
    wrong decode, or a refusal of sums no worker sent), and a tensor's values changed behind
    torch's back (a tensor autograd had saved gave a wrong gradient; a leaf that requires
    grad and an inference tensor were written). Both paths now end alike."""
    params = THCParams(slice_size=64)
    numel, m = 256, np.ones(4, np.float32)
    sums = np.random.default_rng(0).integers(0, 256, numel).astype(np.uint8)
    for backend in ("reference", "compiled"):
        want = codec.decode(sums.copy(), 9, m, numel, params, backend=backend)
        buf = np.zeros(4 * numel, np.uint8)
        buf[:numel] = sums
        got = codec.decode(buf[:numel], 9, m, numel, params, 0, out=buf.view(np.float32),
                           backend=backend)
        assert np.array_equal(got, want), backend
    t_sums = torch.from_numpy(sums.astype(np.int32))
    for backend in ("reference", "compiled"):
        w = torch.ones(numel, requires_grad=True)
        saved = torch.zeros(numel)
        loss = (w * saved).sum()
        codec.decode(t_sums, 9, m, numel, params, 0, out=saved, backend=backend)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        with pytest.raises(RuntimeError, match="requires grad"):
            codec.decode(t_sums, 9, m, numel, params, 0,
                         out=torch.zeros(numel, requires_grad=True), backend=backend)
        # a tensor autograd tracks: its values are the decode's, and no gradient passes
        # back through the values it overwrote (not 512 of them to w)
        w = torch.ones(numel, requires_grad=True)
        tracked = w * 2.0
        if backend == "compiled":   # the reference's out= refuses a tensor that needs grad
            codec.decode(t_sums, 9, m, numel, params, 0, out=tracked, backend=backend)
            assert torch.equal(tracked.detach(), torch.from_numpy(
                codec.decode(sums.copy(), 9, m, numel, params, backend=backend)))
            tracked.sum().backward()
            assert torch.equal(w.grad, torch.zeros(numel))
        with torch.inference_mode():
            inference = torch.zeros(numel)
        with pytest.raises(RuntimeError, match="inference tensor"):
            codec.decode(t_sums, 9, m, numel, params, 0, out=inference, backend=backend)


def test_a_table_past_float32s_integers_encodes_as_the_reference():
    """g = 2^31 - 1: a table value that float32 rounds down (T[m] > float32(T[m])). A rotated
    value landing on float32(T[m]) lies below T[m]: the reference rounds it in [T[m-1],
    T[m]), the C code compared it with float32(T[m]) and took [T[m], T[m+1]), and the
    indices differed wherever the draw passed the reference's q. A one-hot slice rotates to
    that value exactly on both paths."""
    p = THCParams(bits=8, granularity=2 ** 31 - 1, table_kind="uniform", slice_size=2 ** 12)
    t, f32 = p.table.astype(np.int64), np.float32
    ghalf = f32(p.granularity / 2.0)
    m = next(k for k in range(1, len(t)) if int(f32(t[k])) < t[k]
             and 0 < f32(t[k]) - ghalf < 0.2 * p.granularity)
    y = f32(t[m]) - ghalf
    c = f32(p.granularity / (2.0 * p.t_p))   # the encode's scale at max norm 1
    a = f32(np.float64(y) / np.float64(c))
    while f32(a * c) < y:
        a = np.nextafter(a, f32(np.inf))
    while f32(a * c) > y:
        a = np.nextafter(a, f32(0))
    x = np.zeros(p.slice_size, np.float32)
    x[0] = a
    for key in range(8):
        assert np.array_equal(codec.encode(x, [1.0], p, 0, key, "compiled"),
                              codec.encode(x, [1.0], p, 0, key, "reference")), key


def test_generators():
    """An int keys the draws as on the reference path; a generator gives one key: the same
    draws as that key as an int."""
    x = data(5000, 6)
    m = codec.slice_norms(x, P)
    key = int(np.random.default_rng(5).integers(0, 1 << 62))
    got = codec.encode(x, m, P, 0, np.random.default_rng(5), "compiled")
    assert np.array_equal(got, codec.encode(x, m, P, 0, key, "compiled"))
    same_indices(got, codec.encode(x, m, P, 0, key, "reference"))
    t = torch.from_numpy(x)
    tkey = int(torch.randint(0, 1 << 62, (1,), generator=torch.Generator().manual_seed(3)))
    got = codec.encode(t, m, P, 0, torch.Generator().manual_seed(3), "compiled")
    assert torch.equal(got, codec.encode(t, m, P, 0, tkey, "compiled"))
    torch.manual_seed(8)
    a = codec.encode(t, m, P, 0, None, "compiled")
    torch.manual_seed(8)
    assert torch.equal(a, codec.encode(t, m, P, 0, None, "compiled"))
    assert np.mean(codec.encode(x, m, P, 0, None, "compiled") ==
                   codec.encode(x, m, P, 0, None, "compiled")) < 0.9
    with pytest.raises(TypeError, match="numpy inputs need"):
        codec.encode(x, m, P, 0, torch.Generator(), "compiled")
    with pytest.raises(ValueError, match=r"must lie in \[0, 2\^64\), got -1"):
        codec.encode(x, m, P, 0, -1, "compiled")


def test_bad_input_gets_the_reference_errors():
    params = THCParams(slice_size=1024)
    x = data(3000, 7)
    x[1500] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.slice_norms(x, params, "compiled")
    with pytest.raises(ValueError, match=r"NaN or Inf .* in slices 1\.\.1"):
        codec.encode(x, [1.0, 1.0, 1.0], params, backend="compiled")
    x[1500] = 3e38
    with pytest.raises(ValueError, match="overflows float32"):
        codec.encode(x, [1.0, 1.0, 1.0], params, backend="compiled")
    # finite once scaled, two values whose rotation overflows where their signs agree: the
    # first coordinate shows it only in some rounds, the scan of every coordinate in all
    from thc.codec.common import encode_coef
    big = np.zeros(1024, np.float32)
    big[5] = big[700] = 2e38 / float(encode_coef(np.array([1.0]), params)[0])
    for rnd in range(8):
        for backend in ("reference", "compiled"):
            with pytest.raises(ValueError, match="NaN or Inf"), \
                    np.errstate(over="ignore", invalid="ignore"):
                codec.encode(big, [1.0], params, rnd, 3, backend=backend)
    with pytest.raises(ValueError, match="outside the 16-entry table"):
        codec.decode_indices(np.full(3072, 16, np.uint8), [1.0] * 3, 3000, params,
                             backend="compiled")
    with pytest.raises(ValueError, match="expected 3072 sums"):
        codec.decode(np.zeros(3071, np.uint16), 1, [1.0] * 3, 3000, params,
                     backend="compiled")
    with pytest.raises(ValueError, match="finite"):
        codec.encode(data(3000), [1.0, np.inf, 1.0], params, backend="compiled")
    with pytest.raises(ValueError, match="needs"):   # the C code checks buffer sizes itself
        fastcodec._fastcodec.encode(data(100), 100, 64, np.ones(2, np.float32), 0, 0,
                                    np.asarray(P.table, np.int32), np.empty(10, np.uint8),
                                    False, np.empty(2, np.float32), True)
    with pytest.raises(ValueError, match="bad layout"):   # numel * 4 would wrap to 0
        fastcodec._fastcodec.sumsq(np.ones(4, np.float32), 1 << 62, 1 << 62,
                                   np.zeros(1, np.float64))


def _odd(a: np.ndarray, offset: int = 1) -> np.ndarray:
    """``a``'s values in an array over another buffer, ``offset`` bytes off its alignment."""
    out = np.ndarray(a.shape, a.dtype, buffer=bytearray(a.nbytes + offset), offset=offset)
    out[...] = a
    return out


def test_the_c_code_refuses_misaligned_buffers_itself():
    """A direct caller's misaligned buffer is a ValueError, not a read through a float pointer
    that the buffer does not align (the wrappers copy such arrays, above)."""
    n, ss, table = 100, 64, np.asarray(P.table, np.int32)
    args = [data(n), n, ss, np.ones(2, np.float32), 0, 0, table, np.empty(128, np.uint8),
            False, np.empty(2, np.float32), True]
    fastcodec._fastcodec.encode(*args)
    for at, name in ((0, "x"), (3, "coef"), (6, "table"), (9, "first")):
        bad = list(args)
        bad[at] = _odd(args[at])
        with pytest.raises(ValueError, match=f"{name} is not aligned to 4 bytes"):
            fastcodec._fastcodec.encode(*bad)
    sums, alpha, out = np.zeros(128, np.int16), np.ones(2, np.float32), np.empty(n, np.float32)
    fastcodec._fastcodec.decode(sums, "i2", n, ss, alpha, 0.0, 0, table, out)
    with pytest.raises(ValueError, match="sums is not aligned to 2 bytes"):
        fastcodec._fastcodec.decode(_odd(sums), "i2", n, ss, alpha, 0.0, 0, table, out)
    with pytest.raises(ValueError, match="out is not aligned to 4 bytes"):
        fastcodec._fastcodec.decode(sums, "i2", n, ss, alpha, 0.0, 0, table, _odd(out, 2))
    with pytest.raises(ValueError, match="out is not aligned to 8 bytes"):
        fastcodec._fastcodec.sumsq(data(n), n, ss, _odd(np.zeros(2, np.float64), 4))


def test_the_c_lookup_of_an_index_past_a_16_entry_table_reads_its_zero_entries():
    """Indices of 16 and up map through the 256-entry table's zeros in the vector loop as in
    its scalar tail (the public path refuses them before)."""
    n, ss = 64, 64
    table = np.zeros(256, np.float32)
    table[:16] = np.arange(1, 17)
    idx = np.arange(n, dtype=np.uint8) * 7
    out = np.empty(n, np.float32)
    fastcodec._fastcodec.decode(idx, "index", n, ss, np.ones(1, np.float32), 0.0, 0, table, out)
    want = np.empty(n, np.float32)
    fastcodec._fastcodec.decode(table[idx].astype(np.int32), "i4", n, ss,
                                np.ones(1, np.float32), 0.0, 0, table, want)
    assert (idx >= 16).sum() > 40 and np.array_equal(out, want)


@pytest.mark.parametrize("ss,max_norm", [(16, 1e-37), (1024, 1e-36), (1 << 14, 1e-34)])
def test_a_max_norm_far_below_the_slices_own_encodes_as_the_reference(ss, max_norm):
    """Finite rotated values that add up beyond float32's range (a max norm 1e37 below the
    slice's own, legal) are clamped as the reference clamps them, not refused as NaN or Inf:
    the check looks at each value, not at their sum."""
    p = THCParams(slice_size=ss)
    x = np.zeros(ss, np.float32)
    x[0] = 1.0
    m = np.array([max_norm], np.float32)
    want = codec.encode(x, m, p, 0, 7, "reference")
    np.testing.assert_array_equal(codec.encode(x, m, p, 0, 7, "compiled"), want)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_torch_unsigned_sums_decode_and_are_checked_on_both_paths(dtype):
    """torch has no min or max of these types; the reference path reads them through numpy."""
    p = THCParams(slice_size=64)
    x = torch.randn(100, generator=torch.Generator().manual_seed(0))
    m = codec.slice_norms(x, p)
    s = codec.aggregate([codec.encode(x, m, p, 0, 1)] * 2, p).to(torch.int64)
    bad = s.clone()
    bad[5] = 2 * p.granularity + 1
    for backend in ("reference", "compiled"):
        got = codec.decode(s.to(dtype), 2, m, 100, p, 0, backend=backend)
        torch.testing.assert_close(got, codec.decode(s, 2, m, 100, p, 0, backend=backend))
        with pytest.raises(ValueError, match="outside what the workers' table values"):
            codec.decode(bad.to(dtype), 2, m, 100, p, 0, backend=backend)


def test_path_selection(monkeypatch):
    x = data(100)
    monkeypatch.setattr(settings, "_CURRENT", [])
    monkeypatch.delenv(codec.CPU_ENV, raising=False)
    assert codec.compiled_for(x) and codec.compiled_for(torch.from_numpy(x))
    assert not codec.compiled_for(x, "reference")
    settings.use(settings.Settings(codec_cpu="reference"))
    assert not codec.compiled_for(x) and codec.compiled_for(x, "compiled")
    assert not THCCodec().choice(x).name == "compiled"
    assert THCCodec(cpu="compiled").choice(x).name == "compiled"
    monkeypatch.setenv(codec.CPU_ENV, "fast")
    with pytest.raises(ValueError, match="THC_CODEC_CPU"):
        settings.Settings.from_env()
    monkeypatch.delenv(codec.CPU_ENV)
    settings.reset()
    monkeypatch.setattr(fastcodec, "UNAVAILABLE", "the compiled CPU codec is not built (test)")
    monkeypatch.setattr(backends, "_COMPILED_MISSING", [])
    with pytest.warns(RuntimeWarning, match="not built .test.*reference path"):
        idx = THCCodec().encode(x, codec.slice_norms(x, P), 0, 1)
    assert idx.shape == (128,)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        codec.compiled_for(x)            # warned once only
    with pytest.raises(RuntimeError, match="not built .test"):
        codec.encode(x, [1.0], P, backend="compiled")


def test_threads_run_side_by_side():
    """The C code holds no GIL and no shared state: concurrent calls give the same bytes."""
    x = data(2 ** 20 + 77, 9)
    m = codec.slice_norms(x, P)
    want = codec.encode_packed(x, m, P, 4, 3, "compiled")
    got = [None] * 4

    def work(i):
        got[i] = codec.encode_packed(x, m, P, 4, 3, "compiled")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(np.array_equal(g, want) for g in got)
    assert np.array_equal(unpack_bits(want, 4, want.size * 2)[: 2 ** 20],
                          codec.encode(x, m, P, 4, 3, "compiled")[: 2 ** 20])
