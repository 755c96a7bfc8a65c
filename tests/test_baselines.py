"""Baseline schemes behind the common interface."""
import math

import numpy as np
import pytest
import torch

from thc.codec.baselines import FP16, QSGD, SCHEMES, THC, UHC, SignSGD, TernGrad, TopK, make_scheme


def nmse(x, est):
    est = est.numpy() if isinstance(est, torch.Tensor) else est
    return float(np.sum((np.asarray(x, np.float64) - est) ** 2) / np.sum(np.asarray(x) ** 2))


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_interface_round_trip(name, backend):
    x = np.random.default_rng(0).standard_normal((40, 25)).astype(np.float32)
    inp = x if backend == "numpy" else torch.from_numpy(x)
    s = make_scheme(name)
    payload = s.compress(inp, generator=1)
    out = s.decompress(payload)
    assert type(out) is type(inp) and tuple(out.shape) == x.shape
    other = make_scheme(name).decompress(make_scheme(name).compress(x, generator=1))
    np.testing.assert_allclose(np.asarray(out), other, rtol=1e-6, atol=1e-6)
    mean = s.aggregate_mean([inp, inp * 2], rng=np.random.default_rng(1))
    assert type(mean) is type(inp) and tuple(mean.shape) == x.shape
    assert 0 < s.bits_per_coord(1000) <= 32.1


def _rel_error(x, out) -> float:
    return float(np.sum((np.asarray(out, np.float64) - x) ** 2) / np.sum(x.astype(np.float64) ** 2))


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_each_scheme_decodes_as_its_definition_says(name):
    """Each scheme's decoded vector and payload size against what its definition gives,
    computed here in numpy: exact for the deterministic ones, the set of values a
    stochastic coordinate may take and the expected error for QSGD and TernGrad, the
    independent reference figure for THC and UHC (an independent numpy implementation,
    Gaussian vectors)."""
    x = np.random.default_rng(11).standard_normal(2 ** 14).astype(np.float32)
    d, ax = x.size, np.abs(x).astype(np.float64)
    s = make_scheme(name)
    payload = s.compress(x, generator=1)
    out = s.decompress(payload)
    err = _rel_error(x, out)
    if name == "fp32":
        np.testing.assert_array_equal(out, x)
        assert payload.nbytes == 4 * d
    elif name == "fp16":
        np.testing.assert_array_equal(out, x.astype(np.float16).astype(np.float32))
        assert payload.nbytes == 2 * d
    elif name == "sign":
        np.testing.assert_allclose(out, np.where(x < 0, -1.0, 1.0) * ax.mean(), rtol=1e-6)
        assert payload.nbytes == d // 8 + 4
    elif name == "topk":
        k = math.ceil(0.1 * d)
        kept = np.argsort(-ax)[:k]
        want = np.zeros_like(x)
        want[kept] = x[kept]
        np.testing.assert_array_equal(out, want)
        assert payload.nbytes == k * (4 + 8)   # float32 values, int64 positions
    elif name in ("qsgd", "terngrad"):
        levels = 7 if name == "qsgd" else 1
        step = ax.max() / levels
        lo = np.floor(ax / step)
        frac = ax / step - lo
        mag = np.abs(np.asarray(out, np.float64)) / step
        assert np.all(np.isclose(mag, lo, atol=1e-4) | np.isclose(mag, lo + 1, atol=1e-4))
        assert np.all((np.sign(out) == np.sign(x)) | (out == 0))
        expected = float(np.sum(step ** 2 * frac * (1 - frac)) / np.sum(ax ** 2))
        assert err == pytest.approx(expected, rel=0.1), (err, expected)
        assert payload.nbytes == d + 4    # one int8 a coordinate and a float32 scale
    else:
        # the reference is a mean over rotations; one rotation's NMSE at d = 2^14 is within
        # 3% of it (one standard deviation)
        reference = {"thc": 0.0204, "uhc": 0.0206}[name]
        assert err == pytest.approx(reference, rel=0.1), err
        assert d // 2 <= payload.nbytes <= d // 2 + 64   # 4 bits a coordinate, a few scalars


def test_a_float64_input_beyond_float32s_range_is_refused_as_such():
    """It was cast to float32 first and refused as "NaN or Inf", which it does not hold."""
    for x in (torch.tensor([1.0, 1e300], dtype=torch.float64), np.array([1.0, 1e300])):
        with pytest.raises(ValueError, match="beyond float32's range") as err:
            TopK(0.5).compress(x)
        assert "NaN" not in str(err.value)
    np.testing.assert_array_equal(TopK(0.5).decompress(TopK(0.5).compress(
        np.array([1.0, 3.0]))), [0.0, 3.0])


def test_topk_sends_the_ratio_as_written():
    """0.07 of 100 is 7.000000000000001 in floating point, and TopK sent 8 values, where the
    window's loss budget takes such a product as its integer; a ratio off an integer by more
    than its rounding error still rounds up."""
    assert [TopK(0.07).k(n) for n in (100, 200, 300)] == [7, 14, 21]
    assert TopK(0.29).k(100) == 29 and TopK(0.1).k(101) == 11 and TopK(0.5).k(0) == 0
    assert TopK(1.0).k(7) == 7 and TopK(1e-9).k(10) == 1
    assert [TopK(r).k(n) for r, n in ((1e-16, 1), (1e-17, 10), (5e-17, 4))] == [1, 1, 1]


def test_bits_per_coord():
    d = 2 ** 18
    assert THC().bits_per_coord(d) == pytest.approx(4.0, abs=0.01)
    assert QSGD(7).bits_per_coord(d) == pytest.approx(4.0, abs=0.01)
    assert QSGD(15).bits_per_coord(d) == pytest.approx(5.0, abs=0.01)
    assert TopK(0.1).bits_per_coord(d) == pytest.approx(6.4, abs=0.01)
    assert SignSGD().bits_per_coord(d) == pytest.approx(1.0, abs=0.01)
    assert FP16().bits_per_coord(d) == 16


@pytest.mark.parametrize("s", [127, 255, 1000, 40000])
@pytest.mark.parametrize("top", [1.0, 1e-38])
def test_qsgd_keeps_every_level_and_tiny_scales(s, top):
    """Levels above 127 wrapped in int8 (s = 255 decoded 1.0 as -0.004), and a scale below
    s / float32's largest rounded every coordinate to the top level: each level in
    [-s, s] and the quantization step are exact, so a coordinate decodes within one step."""
    x = torch.tensor([1.0, -1.0, 0.6, 0.25, 0.0]) * top
    scheme = QSGD(s)
    est = scheme.decompress(scheme.compress(x, generator=torch.Generator().manual_seed(0)))
    # plus s subnormal quanta (1.4e-45) where the step scale / s is itself subnormal
    assert float((est - x).abs().max()) <= top / s * 1.0001 + s * 1.5e-45
    assert float(est[0]) == pytest.approx(top) and float(est[1]) == pytest.approx(-top)


@pytest.mark.parametrize("scheme", [QSGD(7), TernGrad(), THC(p=1e-9)])
def test_unbiased_schemes_average_out(scheme):
    """The mean of K independent compressions converges like 1/K in MSE."""
    d, k = 2048, 64
    x = np.random.default_rng(2).standard_normal(d).astype(np.float32)
    gen = torch.Generator().manual_seed(3)
    ests = np.stack([scheme.decompress(scheme.compress(x, generator=gen)) for _ in range(k)])
    sigma2 = np.mean(np.sum((ests - x) ** 2, axis=1))
    ratio = np.sum((ests.mean(axis=0) - x) ** 2) * k / sigma2
    assert abs(ratio - 1) < 6 * math.sqrt(2 / d) + 0.05


def test_accuracy_ordering_at_four_bits():
    """THC's 4 bits beat QSGD's 4 bits on Gaussian vectors: about 4x at d = 2^18 (the
    reference figures), less at smaller d, where the L-inf scale max|x| ~ sqrt(2 ln d) is
    smaller."""
    x = np.random.default_rng(4).standard_normal(2 ** 16).astype(np.float32)
    rng = np.random.default_rng(5)
    thc = nmse(x, THC().aggregate_mean([x], rng))
    uhc = nmse(x, UHC().aggregate_mean([x], rng))
    qsgd = nmse(x, QSGD(7).aggregate_mean([x], rng))
    sign = nmse(x, SignSGD().aggregate_mean([x], rng))
    fp16 = nmse(x, FP16().aggregate_mean([x], rng))
    print(f"NMSE thc {thc:.4f} uhc {uhc:.4f} qsgd {qsgd:.4f} sign {sign:.4f} fp16 {fp16:.2e}")
    assert thc < uhc * 1.02 and 2.5 * thc < qsgd
    assert sign == pytest.approx(1 - 2 / math.pi, rel=0.03)
    assert fp16 < 1e-6


def test_qsgd_levels_and_scale():
    x = torch.tensor([0.0, 1.0, -2.0, 3.5])
    p = QSGD(7).compress(x, generator=0)
    lv = p.data["levels"]
    assert lv.dtype == torch.int8 and int(lv.abs().max()) <= 7
    assert float(p.data["scale"]) == 3.5
    assert int(lv[3]) == 7 and int(lv[0]) == 0 and int(lv[2]) in (-4, -5)


def test_topk_payload_is_gatherable_and_combines():
    rng = np.random.default_rng(6)
    xs = [torch.from_numpy(rng.standard_normal(1000).astype(np.float32)) for _ in range(3)]
    s = TopK(0.1, error_feedback=False)
    payloads = [s.compress(x) for x in xs]
    for x, p in zip(xs, payloads):
        assert p.values.shape == (100,) and p.indices.shape == (100,)
        assert p.indices.dtype == torch.int64
        kept = x.abs()[p.indices]
        assert float(kept.min()) >= float(x.abs().sort(descending=True).values[99])
    vals = torch.stack([p.values for p in payloads])
    idx = torch.stack([p.indices for p in payloads])
    combined = TopK.combine(vals, idx, 1000)
    dense = sum(s.decompress(p) for p in payloads) / 3
    assert torch.allclose(combined, dense)
    assert torch.allclose(s.aggregate_mean(xs), dense)


def test_topk_error_feedback_sends_everything_eventually():
    x = torch.randn(500)
    s = TopK(0.1)
    sent = torch.zeros(500)
    for _ in range(10):
        sent += s.decompress(s.compress(x, key="w"))
        sent_total = sent
    assert torch.allclose(sent_total + s.residuals["w"], 10 * x, atol=1e-4)
    s.compress(x, key="b")
    assert set(s.residuals) == {"w", "b"}
    with pytest.raises(ValueError, match="holds 500"):
        s.compress(torch.randn(10), key="w")
    s.reset()
    assert s.residuals == {}


def test_sign_error_feedback():
    x = torch.randn(256)
    s = SignSGD(error_feedback=True)
    p = s.compress(x, key=0)
    out = s.decompress(p)
    assert torch.allclose(out.abs(), x.abs().mean().expand(256))
    assert torch.allclose(out + s.residuals[0], x, atol=1e-6)
    assert p.data["signs"].numel() == 32


def test_thc_scheme_matches_codec():
    from thc.codec.thc import THCCodec
    x = np.random.default_rng(7).standard_normal(3000).astype(np.float32)
    s = make_scheme("thc:bits=3:granularity=14:p=1/64")
    assert (s.params.bits, s.params.granularity, s.params.p) == (3, 14, 1 / 64)
    est = s.aggregate_mean([x], rng=5)
    gen = torch.Generator().manual_seed(0)
    direct = THCCodec(s.params).simulate([torch.from_numpy(x)], 0, gen)
    assert est.shape == direct.shape and nmse(x, est) == pytest.approx(nmse(x, direct), rel=0.3)
    assert make_scheme("uhc").params.table_kind == "uniform"


def test_make_scheme_errors_and_options():
    assert make_scheme("topk:ratio=0.01:error_feedback=false").error_feedback is False
    assert make_scheme("qsgd:s=15").s == 15
    with pytest.raises(ValueError, match="unknown scheme"):
        make_scheme("zip")
    with pytest.raises(ValueError, match="key=value"):
        make_scheme("qsgd:15")
    with pytest.raises(ValueError, match="bad options"):
        make_scheme("qsgd:levels=3")
    with pytest.raises(ValueError, match="granularity"):
        make_scheme("thc:bits=5")
    # a misspelt boolean was true, a fraction of levels cut to a whole number
    for spec in ("topk:error_feedback=flase", "thc:error_feedback=treu", "sign:error_feedback=1"):
        with pytest.raises(ValueError, match="error_feedback is true or false"):
            make_scheme(spec)
    with pytest.raises(ValueError, match="whole number"):
        make_scheme("qsgd:s=7.9")
    # float32 counts the levels: past 2^24 the clamp rounded s up, and the largest
    # coordinate's level wrapped to -2^31 (its sign flipped)
    assert make_scheme(f"qsgd:s={2 ** 24}").decompress(make_scheme(f"qsgd:s={2 ** 24}").compress(
        torch.tensor([1.0, -0.5, 0.25]), generator=1)).tolist() == [1.0, -0.5, 0.25]
    for big in (2 ** 24 + 1, 2 ** 31 - 1):
        with pytest.raises(ValueError, match="1 <= s <= 2\\^24"):
            make_scheme(f"qsgd:s={big}")
    # defaults give way to the spec's options, with spaces around them or not
    for spec in ("thc:p=1/64", "thc: p = 1/64", " thc :p=1/64"):
        assert make_scheme(spec, {"p": 1 / 32, "bits": 4}).params.p == 1 / 64, spec


@pytest.mark.parametrize("name", ["qsgd", "topk", "sign", "fp16", "thc"])
def test_nan_rejected(name):
    x = torch.ones(100)
    x[3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        make_scheme(name).compress(x)


def test_zero_vector_is_fine():
    z = torch.zeros(300)
    for name in SCHEMES:
        out = make_scheme(name).aggregate_mean([z], rng=0)
        assert torch.equal(out, torch.zeros(300)), name


@pytest.mark.parametrize("spec", ["thc:error_feedback=true", "topk", "sign:error_feedback=true",
                                  "qsgd:error_feedback=true"])
def test_error_feedback_telescopes(spec):
    """Σ decompressed + residual = Σ inputs, per key, whatever the scheme."""
    s = make_scheme(spec)
    rng = np.random.default_rng(8)
    xs = [rng.standard_normal(777).astype(np.float32) for _ in range(5)]
    sent = sum(s.decompress(s.compress(x, key="k", generator=i)) for i, x in enumerate(xs))
    assert np.allclose(sent + s.residuals["k"].numpy(), np.sum(xs, axis=0), atol=1e-4)


def test_a_residual_that_overflows_the_input_is_refused_and_kept():
    """The residual is added before the NaN/Inf check: checked before it, a finite 2e38
    plus its residual 2e38 would go out as Inf (then NaN in every later residual), on
    every worker's model."""
    s = TopK(ratio=0.5)
    s.compress(torch.tensor([3e38, 2e38]), key="b")          # keeps 3e38, residual 2e38
    kept = s.residuals["b"].clone()
    with pytest.raises(ValueError, match="plus its error-feedback residual contains NaN"):
        s.compress(torch.tensor([3e38, 2e38]), key="b")
    assert torch.equal(s.residuals["b"], kept)


def test_means_of_large_values_do_not_overflow():
    """Sums before the division overflowed float32 where the mean did not: TopK's combine
    and aggregate_mean gave Inf for two workers' 2e38, SignSGD a scale of Inf."""
    mean = TopK.combine([torch.tensor([2e38]), torch.tensor([2e38])],
                        [torch.tensor([0]), torch.tensor([0])], 1)
    assert mean.tolist() == [pytest.approx(2e38, rel=1e-6)]
    assert math.isfinite(float(SignSGD().aggregate_mean([torch.full((2,), 3e38)] * 2)[0]))
    assert math.isfinite(float(FP16().aggregate_mean([torch.full((2,), 6e4)] * 2)[0]))
    est = TopK(ratio=1.0, error_feedback=False).aggregate_mean([torch.tensor([3e38])] * 2)
    assert est.tolist() == [pytest.approx(3e38, rel=1e-6)]


def test_inputs_a_scheme_would_misread_are_refused_or_held():
    """A complex input lost its imaginary part, vectors of unlike lengths were broadcast into
    a mean, and FP16 turned a finite 1e5 into Inf, whose residual (-Inf) then refused every
    later step of its key."""
    z = torch.tensor([1 + 2j, 3 - 4j])
    for name in ("fp32", "topk", "qsgd", "fp16"):
        with pytest.raises(TypeError, match="floating-point"):
            make_scheme(name).aggregate_mean([z, z])
    with pytest.raises(TypeError, match="floating-point"):
        make_scheme("fp32").aggregate_mean([np.array([1, 2]), np.array([3, 4])])
    with pytest.raises(ValueError, match="one length, got \\[1, 4\\]"):
        make_scheme("fp32").aggregate_mean([torch.ones(4), torch.tensor([3.0])])
    x = torch.tensor([1e5, 1.0])
    assert make_scheme("fp16").aggregate_mean([x, x]).tolist() == [65504.0, 1.0]
    ef = make_scheme("fp16:error_feedback=true")
    first = ef.decompress(ef.compress(x, key="k"))
    assert first.tolist() == [65504.0, 1.0] and ef.residuals["k"].tolist() == [1e5 - 65504, 0]
    assert torch.isfinite(ef.decompress(ef.compress(torch.ones(2), key="k"))).all()
