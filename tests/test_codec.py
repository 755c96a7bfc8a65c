"""The THC codec: accuracy against the reference figures, unbiasedness, aggregation,
numpy/torch agreement, edge cases, error feedback and the codec benchmark, each on both CPU
paths (the compiled codec and the reference; tests/test_fastcodec.py compares the two)."""
import argparse
import json
import math

import numpy as np
import pytest
import torch

from thc.codec import fastcodec
from thc.codec import thc as codec
from thc.codec.hadamard import rht
from thc.codec.table import expected_nmse, optimal_table, uniform_table
from thc.codec.thc import ErrorFeedback, THCCodec, THCParams

P = THCParams()


@pytest.fixture(autouse=True, params=["compiled", "reference"])
def cpu_path(request, monkeypatch):
    """What ``backend="auto"`` runs on the CPU in this test (THC_CODEC_CPU)."""
    if request.param == "compiled" and not fastcodec.available():
        pytest.skip(f"compiled codec: {fastcodec.UNAVAILABLE}")
    monkeypatch.setenv(codec.CPU_ENV, request.param)
    return request.param


def nmse(xs, est):
    est = est.numpy() if isinstance(est, torch.Tensor) else est
    xs = [np.asarray(x, dtype=np.float64).reshape(-1) for x in xs]
    mean = np.mean(xs, axis=0)
    return float(np.sum((mean - est) ** 2) / np.mean([np.sum(x * x) for x in xs]))


def run_nmse(params, n, d, trials, backend="numpy", seed=0):
    c = THCCodec(params)
    vals = []
    for trial in range(trials):
        rng = np.random.default_rng([seed, n, trial])
        xs = [rng.standard_normal(d, dtype=np.float32) for _ in range(n)]
        inp = xs if backend == "numpy" else [torch.from_numpy(x) for x in xs]
        vals.append(nmse(xs, c.simulate(inp, round=trial, generator=rng)))
    return float(np.mean(vals))


@pytest.mark.parametrize("n,reference,trials", [(1, 0.0204, 3), (10, 0.0020, 1)])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_nmse_matches_reference(n, reference, trials, backend):
    """d = 2^18 as the reference figures; one trial's NMSE varies by about 1%, the check
    allows 5%."""
    got = run_nmse(P, n, 2 ** 18, trials, backend)
    model = expected_nmse(P.table, P.p, P.granularity) / n
    print(f"THC n={n} {backend}: NMSE {got:.5f} (reference {reference}, model {model:.5f})")
    assert got == pytest.approx(reference, rel=0.05)
    assert got == pytest.approx(model, rel=0.03)


def test_optimal_table_beats_uniform_at_small_p():
    p = 1 / 1024
    thc = run_nmse(THCParams(p=p), 1, 2 ** 16, 2)
    uhc = run_nmse(THCParams(p=p, table_kind="uniform"), 1, 2 ** 16, 2)
    m_thc = expected_nmse(optimal_table(4, 30, p), p, 30)
    m_uhc = expected_nmse(uniform_table(4, 30), p, 30)
    print(f"p=1/1024: THC {thc:.5f} (model {m_thc:.5f}), UHC {uhc:.5f} (model {m_uhc:.5f})")
    assert thc < 0.85 * uhc
    assert thc == pytest.approx(m_thc, rel=0.05) and uhc == pytest.approx(m_uhc, rel=0.05)


def test_unbiased_average_error_shrinks_like_one_over_k():
    """Without truncation THC is unbiased: the average of K independent encodings has MSE
    sigma^2 / K, sigma^2 the single-encoding MSE. The ratio K * MSE_K / sigma^2 has relative
    spread about sqrt(2/d) (d independent rounding errors), so 6 of those is the tolerance;
    a bias would make it grow with K."""
    d, kmax = 4096, 512
    params = THCParams(p=1e-9)
    x = np.random.default_rng(1).standard_normal(d).astype(np.float32)
    m = codec.slice_norms(x, params)
    z = rht(x, params.seed, 0, 0) * math.sqrt(d) / m[0]
    assert np.abs(z).max() < params.t_p, "precondition: no coordinate is truncated"
    rng = np.random.default_rng(2)
    ests = np.stack([codec.decode_indices(codec.encode(x, m, params, 0, rng), m, d, params)
                     for _ in range(kmax)]).astype(np.float64)
    sigma2 = np.mean(np.sum((ests - x) ** 2, axis=1))
    tol = 6 * math.sqrt(2 / d)
    for k in (1, 8, 64, 512):
        ratio = np.sum((ests[:k].mean(axis=0) - x) ** 2) * k / sigma2
        print(f"K={k}: K*MSE/sigma^2 = {ratio:.3f}")
        assert abs(ratio - 1) < tol + (0.3 if k == 1 else 0)
    per_coord = (ests.mean(axis=0) - x) / math.sqrt(sigma2 / d / kmax)
    assert abs(per_coord.mean()) < 6 / math.sqrt(d)


def test_sum_of_workers_decodes_to_mean():
    n, d = 4, 2 ** 15
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(d).astype(np.float32) for _ in range(n)]
    m = codec.agree_max([codec.slice_norms(x, P) for x in xs])
    idx = [codec.encode(x, m, P, 7, rng) for x in xs]
    sums = codec.aggregate(idx, P)
    table = P.table
    assert sums.dtype == np.uint16
    assert np.array_equal(sums, np.sum([table[i] for i in idx], axis=0))
    assert sums.max() <= n * P.granularity
    est = codec.decode(sums, n, m, d, P, 7)
    got = nmse(xs, est)
    model = expected_nmse(P.table, P.p, P.granularity) / n
    print(f"n=4 sum decode: NMSE {got:.5f}, model {model:.5f}")
    assert got == pytest.approx(model, rel=0.1)
    t_sums = codec.aggregate([torch.from_numpy(i) for i in idx], P)
    assert t_sums.dtype == torch.int32 and np.array_equal(t_sums.numpy(), sums)


def test_numpy_and_torch_bit_identical_on_exact_inputs():
    """Integer inputs and a max norm making every scale a power of two: every step is exact,
    so indices and decode must agree bit for bit."""
    d = 4096
    x = np.random.default_rng(4).integers(-3, 4, d).astype(np.float32)
    m = np.array([P.granularity / (2 * P.t_p) * 2 ** 5])
    assert m[0] > np.linalg.norm(x)
    a = codec.encode(x, m, P, 3, np.random.default_rng(9))
    b = codec.encode(torch.from_numpy(x), m, P, 3, np.random.default_rng(9))
    assert np.array_equal(a, b.numpy())
    sa = codec.aggregate([a, a], P)
    sb = codec.aggregate([b, b], P)
    assert np.array_equal(sa, sb.numpy())
    assert np.array_equal(codec.decode(sa, 2, m, d, P, 3), codec.decode(sb, 2, m, d, P, 3).numpy())


def test_numpy_and_torch_agree_on_random_inputs():
    d = 3 * 2 ** 14 + 5
    params = THCParams(slice_size=2 ** 14)
    x = np.random.default_rng(5).standard_normal(d).astype(np.float32)
    mn = codec.slice_norms(x, params)
    mt = codec.slice_norms(torch.from_numpy(x), params)
    assert np.allclose(mn, mt.numpy(), rtol=1e-5)
    a = codec.encode(x, mn, params, 1, 11)
    b = codec.encode(torch.from_numpy(x), mn, params, 1, 11).numpy()
    assert np.mean(a == b) > 0.9999
    s = codec.aggregate([a], params)
    da = codec.decode(s, 1, mn, d, params, 1)
    db = codec.decode(torch.from_numpy(s.astype(np.int32)), 1, mn, d, params, 1).numpy()
    assert np.allclose(da, db, atol=1e-5)


def test_determinism_and_rounds():
    x = np.random.default_rng(6).standard_normal(5000).astype(np.float32)
    m = codec.slice_norms(x, P)
    a = codec.encode(x, m, P, 0, 42)
    assert np.array_equal(a, codec.encode(x, m, P, 0, 42))
    assert np.mean(a == codec.encode(x, m, P, 1, 42)) < 0.5
    assert np.mean(a == codec.encode(x, m, P.replace(seed=1), 0, 42)) < 0.5


def test_slices_scaled_independently():
    """Slices with wildly different magnitudes each keep their own relative accuracy."""
    params = THCParams(slice_size=2 ** 12)
    rng = np.random.default_rng(7)
    x = np.concatenate([1000 * rng.standard_normal(2 ** 12), 1e-3 * rng.standard_normal(2 ** 12),
                        rng.standard_normal(100)]).astype(np.float32)
    m = codec.slice_norms(x, params)
    est = codec.decode_indices(codec.encode(x, m, params, 0, rng), m, x.size, params)
    model = expected_nmse(params.table, params.p, params.granularity)
    for sl in (slice(0, 4096), slice(4096, 8192)):
        rel = np.sum((est[sl] - x[sl]) ** 2) / np.sum(x[sl] ** 2)
        assert rel == pytest.approx(model, rel=0.2)


def test_many_small_slices_batched():
    params = THCParams(slice_size=2 ** 8)
    got = run_nmse(params, 1, 2 ** 16, 2, backend="torch")
    assert got == pytest.approx(expected_nmse(params.table, params.p, 30), rel=0.05)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_empty_tensor(backend):
    x = np.zeros(0, np.float32) if backend == "numpy" else torch.zeros(0)
    m = codec.slice_norms(x, P)
    assert m.shape == (0,)
    idx = codec.encode(x, m, P)
    assert idx.shape == (0,)
    out = codec.decode(codec.aggregate([idx], P), 1, m, 0, P)
    assert out.shape == (0,)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_zero_vector_decodes_to_exact_zero(backend):
    params = THCParams(slice_size=256)
    x = np.zeros(1000, np.float32)
    x[600:] = np.random.default_rng(8).standard_normal(400)
    inp = x if backend == "numpy" else torch.from_numpy(x)
    m = codec.slice_norms(inp, params)
    assert float(m[0]) == 0.0 and float(m[1]) == 0.0
    idx = codec.encode(inp, m, params, 0, 1)
    est = codec.decode(codec.aggregate([idx], params), 1, m, 1000, params)
    est = est.numpy() if backend == "torch" else est
    assert not np.isnan(est).any()
    assert np.all(est[:512] == 0.0)
    zero = np.zeros(64, np.float32)
    mz = codec.slice_norms(zero, P)
    assert np.all(codec.decode_indices(codec.encode(zero, mz, P, 0, 2), mz, 64, P) == 0.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_nan_and_inf_are_rejected(bad, backend):
    x = np.ones(3000, np.float32)
    x[1234] = bad
    inp = x if backend == "numpy" else torch.from_numpy(x)
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.slice_norms(inp, P)
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.encode(inp, [100.0], P)


@pytest.mark.parametrize("numel", [1, 3, 1000, 1025])
def test_odd_lengths(numel):
    params = THCParams(slice_size=512)
    x = np.random.default_rng(numel).standard_normal(numel).astype(np.float32)
    m = codec.slice_norms(x, params)
    lay = codec.layout(numel, params)
    idx = codec.encode(x, m, params, 0, 3)
    assert idx.shape == (lay.total_padded,) and idx.max() < 16
    est = codec.decode(codec.aggregate([idx], params), 1, m, numel, params)
    assert est.shape == (numel,) and np.isfinite(est).all()
    if numel >= 1000:
        assert nmse([x], est) < 0.05


def test_shapes_dtypes_and_noncontiguous_input():
    t = torch.randn(33, 64).t()
    m = codec.slice_norms(t, P)
    idx = codec.encode(t, m, P, 0, 4)
    flat = t.reshape(-1)
    assert torch.equal(idx, codec.encode(flat.contiguous(), m, P, 0, 4))
    xi = np.arange(-50, 50, dtype=np.int64)
    assert codec.encode(xi, codec.slice_norms(xi, P), P).dtype == np.uint8


@pytest.mark.parametrize("view", ["neg", "conj-imag"])
def test_a_lazily_negated_view_encodes_as_its_values(view):
    """A float tensor may carry torch's negative bit (``z.conj().imag`` of a small complex
    tensor, ``_neg_view``): numpy() refuses it, and the compiled codec failed on it after
    the MAX round, where a reducer's worker must abandon its group."""
    z = torch.complex(torch.randn(1), torch.randn(1))
    t = torch.randn(1000)._neg_view() if view == "neg" else z.conj().imag
    assert t.is_neg()
    plain = t.resolve_neg()
    m = codec.slice_norms(t, P)
    assert torch.equal(m, codec.slice_norms(plain, P))
    assert torch.equal(codec.encode(t, m, P, 0, 4), codec.encode(plain, m, P, 0, 4))


@pytest.mark.parametrize("bits, p, diverges", [(1, 1 / 32, True), (1, 0.2, True),
                                               (1, 0.3, True), (1, 0.35, False),
                                               (2, 1 / 32, False)])
def test_error_feedback_is_refused_where_its_residual_grows(bits, p, diverges):
    """A 1-bit table at p = 1/32 loses 3.7 times the input's energy a round: the residual
    of a worker fed the same gradient doubled each round, the estimate 67 times the input's
    by the fifth, until its norms overflowed and every round was refused. At p = 0.21 one
    worker's loss is below 1, but a worker whose gradient is small next to its peers' keeps
    t_p^2 = 1.6 times their max norm squared: with 8 workers the residual still grew."""
    params = THCParams(bits=bits, p=p, slice_size=1 << 10)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(1 << 10, generator=gen) * scale for scale in (1.0, 1e-3, 1e-3, 1e-3)]
    if diverges:
        with pytest.raises(ValueError, match="error feedback diverges with this table"):
            ErrorFeedback(params)
        return
    c, norms = THCCodec(params), []
    efs = [ErrorFeedback(params) for _ in xs]
    for r in range(40):
        ys = [ef.compensate(x) for ef, x in zip(efs, xs)]
        m = torch.stack([c.norms(y) for y in ys]).amax(0)
        for k, (ef, y) in enumerate(zip(efs, ys)):
            ef.update(y, c.encode(y, m, round=r, generator=100 * r + k), m, r)
        norms.append(max(float(ef.residual.norm() / xs[0].norm()) for ef in efs))
    assert max(norms) < 4, norms


def test_argument_errors():
    x = np.ones(3000, np.float32)
    m = codec.slice_norms(x, P)
    idx = codec.encode(x, m, P)
    sums = codec.aggregate([idx], P)
    with pytest.raises(ValueError, match="expected 4096 sums.*got shape \\(4095,\\)"):
        codec.decode(sums[:-1], 1, m, 3000, P)
    with pytest.raises(ValueError, match="expected 1 max norms"):
        codec.encode(x, [1.0, 2.0], P)
    with pytest.raises(ValueError, match="finite"):
        codec.encode(x, [-1.0], P)
    with pytest.raises(ValueError, match="n_workers"):
        codec.decode(sums, 0, m, 3000, P)
    with pytest.raises(ValueError, match="differ in length"):
        codec.aggregate([idx, idx[:-2]], P)
    for v in (np.ones(3, np.float32), torch.ones(3)):
        with pytest.raises(ValueError, match="norm vectors differ in length"):
            codec.agree_max([v, v[:2]])
    with pytest.raises(ValueError, match="outside"):
        codec.table_values(np.array([16], np.uint8), P)
    with pytest.raises(ValueError, match="out must be"):
        codec.decode(sums, 1, m, 3000, P, out=np.empty(10, np.float32))


def test_decode_into_buffer():
    x = torch.randn(5000)
    m = codec.slice_norms(x, P)
    sums = codec.aggregate([codec.encode(x, m, P, 0)], P)
    buf = torch.empty(5000)
    assert codec.decode(sums, 1, m, 5000, P, out=buf) is buf
    assert torch.equal(buf, codec.decode(sums, 1, m, 5000, P))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_error_feedback_telescopes(backend):
    """Σ decoded + final residual = Σ inputs: nothing the codec drops is ever lost."""
    d = 3000
    ef = ErrorFeedback(P)
    rng = np.random.default_rng(9)
    total_in = np.zeros(d)
    total_out = np.zeros(d)
    for r in range(6):
        x = rng.standard_normal(d).astype(np.float32) * (r + 1)
        x = torch.from_numpy(x) if backend == "torch" else x
        y = ef.compensate(x)
        m = codec.slice_norms(y, P)
        idx = codec.encode(y, m, P, r, rng)
        e = ef.update(y, idx, m, r)
        out = codec.decode_indices(idx, m, d, P, r)
        total_in += np.asarray(x, dtype=np.float64)
        total_out += np.asarray(out, dtype=np.float64)
        assert float(np.linalg.norm(np.asarray(e))) < 0.5 * float(np.linalg.norm(np.asarray(y)))
    resid = np.asarray(ef.residual, dtype=np.float64)
    assert np.allclose(total_out + resid, total_in, atol=1e-3)
    with pytest.raises(ValueError, match="holds 3000"):
        ef.compensate(np.zeros(10, np.float32))


def test_codec_object_simulate_and_wire():
    c = THCCodec()
    rng = np.random.default_rng(10)
    xs = [rng.standard_normal(4000).astype(np.float32) for _ in range(3)]
    est = c.simulate(xs, round=2, generator=123)
    gen = np.random.default_rng(123)
    m = codec.agree_max([c.norms(x) for x in xs])
    manual = c.decode(c.aggregate([c.encode(x, m, 2, gen) for x in xs]), 3, m, 4000, 2)
    assert np.array_equal(est, manual)
    # 100 and 101 elements pad alike: the shorter one was read as zeros past its end
    with pytest.raises(ValueError, match=r"vectors differ in length: \[100, 101\]"):
        c.simulate([xs[0][:101], xs[1][:100]], generator=1)
    idx = c.encode(xs[0], m, 0, 1)
    packed = c.pack(idx)
    assert packed.size == idx.size // 2
    assert np.array_equal(packed, (idx[0::2] << 4) | idx[1::2])
    assert np.array_equal(c.unpack(packed, idx.size), idx)
    w = c.wire_bytes(4000, n_workers=8)
    assert w == {"padded": 4096, "uplink": 2048, "downlink": 4096, "norms": 4}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_round_trip():
    x = torch.randn(10000, device="cuda")
    m = codec.slice_norms(x, P)
    idx = codec.encode(x, m, P, 0, torch.Generator(device="cuda").manual_seed(0))
    est = codec.decode(codec.aggregate([idx], P), 1, m, 10000, P)
    assert est.device.type == "cuda"
    assert nmse([x.cpu().numpy()], est.cpu()) < 0.03


def test_codec_bench_quick(tmp_path, capsys):
    from thc.bench import codec as bench
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "codec.json"
    args = parser.parse_args(["--quick", "--sizes", "12,14", "--repeat", "1",
                              "--json", str(out)])
    assert bench.run(args) == 0
    res = json.loads(out.read_text())
    assert res["sizes"] == [2 ** 12, 2 ** 14] and res["device"] == "cpu"
    names = {(r["name"], r["elements"]): r for r in res["results"]}
    path = "compiled" if codec.compiled_for(np.zeros(1, np.float32)) else "reference"
    for n in res["sizes"]:
        for label in (f"cpu, {path}", "cpu, reference", f"numpy, {path}", "numpy, reference"):
            assert (f"THC encode+decode ({label})", n) in names
            assert (f"THC encode ({label})", n) in names
        assert ("fp16 round trip (x.half().float())", n) in names
        assert any(k[0].startswith("PowerSGD rank 4") and k[1] == n for k in names)
        assert names[("copy (x.clone())", n)]["speed_vs_copy"] == 1.0
    assert all(r["gb_per_s"] > 0 for r in res["results"])
    assert "of copy" in capsys.readouterr().out
    assert bench.parse_sizes("20-22,24") == [2 ** 20, 2 ** 21, 2 ** 22, 2 ** 24]
    with pytest.raises(ValueError):
        bench.parse_sizes("40")
    with pytest.raises(SystemExit) as refused:     # a device no benchmark runs on
        parser.parse_args(["--device", "tpu"])
    assert refused.value.code == 2 and "cpu, cuda or cuda:N, not 'tpu'" in \
        capsys.readouterr().err
    args = parser.parse_args(["--device", "cuda", "--backend", "compiled"])
    assert bench.run(args) == 2 and "compiled is the CPU codec" in capsys.readouterr().err


def test_numpy_sums_of_a_table_wider_than_a_byte():
    """g > 255 gives int32 table values, n x g <= 65535 uint16 sums: numpy refused to add
    one into the other, so numpy rounds of such a job failed."""
    from thc.codec import thc
    p = THCParams(bits=8, granularity=300, slice_size=256)
    x = np.random.default_rng(0).standard_normal(512).astype(np.float32)
    m = thc.slice_norms(x, p)
    idx = [thc.encode(x, m, p, 0, k) for k in (1, 2)]
    sums = thc.aggregate(idx, p)
    want = p.table.astype(np.int64)[idx[0]] + p.table.astype(np.int64)[idx[1]]
    assert sums.dtype == np.uint16 and np.array_equal(sums, want)


def test_indices_too_wide_are_refused_not_wrapped():
    from thc.codec.packing import pack_bits
    for bad in ([259, 1], [-251, 1]):
        with pytest.raises(ValueError, match="do not fit in 4 bits"):
            pack_bits(np.array(bad), 4)
        with pytest.raises(ValueError, match="do not fit in 4 bits"):
            pack_bits(torch.tensor(bad), 4)
    with pytest.raises(ValueError, match="do not fit in 8 bits"):
        pack_bits(np.array([300]), 8)
    assert pack_bits(np.array([15, 1]), 4).tolist() == [0xF1]
    for dtype in (torch.uint16, torch.uint32, torch.bool):   # no CPU min/max for the first two
        assert pack_bits(torch.tensor([1, 1], dtype=dtype), 4).tolist() == [0x11]


def test_packed_bytes_and_table_indices_are_refused_not_wrapped_or_truncated():
    """unpack_bits cast wider integers to bytes (0x1234 read as 0x34, -1 as 0xFF) and floats
    by truncation, and took a count of 7.9 as 7 and -1 as none; table_values read a float
    index 3.7 as 3. Each is refused now."""
    from thc.codec.packing import unpack_bits
    from thc.codec.thc import aggregate, table_values
    p = THCParams()
    for bad in ([0x1234, 0x56], [-1, 2]):
        for packed in (np.array(bad), torch.tensor(bad)):
            with pytest.raises(ValueError, match="are not bytes"):
                unpack_bits(packed, 4, 4)
    for packed in (np.array([18.9, 2.2]), torch.tensor([18.9, 2.2])):
        with pytest.raises(TypeError, match="packed indices are bytes"):
            unpack_bits(packed, 4, 4)
    assert unpack_bits(np.array([0x12, 0xF0], np.int64), 4, 4).tolist() == [1, 2, 15, 0]
    assert unpack_bits(torch.tensor([0x12, 0xF0]), 4, 4).tolist() == [1, 2, 15, 0]
    for count in (3.9, -1, True, "4"):
        with pytest.raises(ValueError, match="count must be an integer >= 0"):
            unpack_bits(np.array([0x12, 0xF0], np.uint8), 4, count)
    for idx in (torch.tensor([3.7, 15.9]), np.array([3.7, 15.9])):
        with pytest.raises(TypeError, match="table indices are integers"):
            table_values(idx, p)
        with pytest.raises(TypeError, match="table indices are integers"):
            aggregate([idx, idx], p)
    assert table_values(torch.tensor([3, 15]), p).tolist() == [p.table[3], p.table[15]]


def test_decode_takes_a_list_as_encode_does():
    """It read ``.shape`` before converting: an AttributeError instead of the estimate."""
    from thc.codec import thc
    p = THCParams(slice_size=256)
    x = np.random.default_rng(1).standard_normal(256).astype(np.float32)
    m = thc.slice_norms(x, p)
    sums = thc.aggregate([thc.encode(x, m, p, 0, 1)], p)
    assert np.array_equal(thc.decode(sums.tolist(), 1, m, 256, p), thc.decode(sums, 1, m, 256, p))


def test_p_may_be_a_numpy_float():
    """np.float32(0.5) is a probability as 0.5 is: it was refused as outside (0, 1)."""
    assert THCParams(p=np.float32(0.5)) == THCParams(p=0.5)
    with pytest.raises(ValueError, match=r"p must lie between 0 and 1"):
        THCParams(p=True)


@pytest.mark.parametrize("kw, why", [
    (dict(p=1e-17), r"finite, positive truncation threshold"),
    (dict(p=0.9999999999999999), r"finite, positive truncation threshold"),
    (dict(bits=2, granularity=2 ** 31 + 2, table_kind="uniform"), "at most 2\\^31 - 1"),
    (dict(granularity=5000), "optimal table's dynamic program"),
    (dict(seed=2 ** 64), r"seed must be an integer in \[0, 2\^64\)"),
    (dict(bits=1, granularity=True), "granularity must be an integer"),
    (dict(slice_size=True), "slice_size must be a power of two"),
    (dict(slice_size=2 ** 33), r"slice_size must be a power of two in \[1, 2\^32\]")])
def test_parameters_no_codec_can_run_are_refused_when_made(kw, why):
    """These were taken: p = 1e-17 failed at the first encode with the statistics module's
    "p must be in the range 0.0 < p < 1.0", p = 1 - 2^-53 divided by a t_p of 0, a
    granularity of 2^31 + 2 wrapped the table values to negative int32, an optimal table of
    g = 5000 asked for gigabytes, a seed of 2^64 was refused after the MAX round, leaving
    the process group unusable, True was taken for a granularity or slice size of 1, and a
    slice over 2^32 coordinates would wrap the compiled codec's 32-bit index within it."""
    with pytest.raises(ValueError, match=why):
        THCParams(**kw)


@pytest.mark.parametrize("round_", [1.7, True, -1, 2 ** 64])
def test_a_round_that_is_not_an_integer_in_range_is_refused(round_):
    """round=1.7 gave round 1's indices."""
    from thc.codec import thc
    p = THCParams(slice_size=64)
    x = np.ones(64, np.float32)
    with pytest.raises(ValueError, match="round must be an integer"):
        thc.encode(x, thc.slice_norms(x, p), p, round_, 1)


@pytest.mark.parametrize("scale", [1e-25, 1e20])
def test_torch_norms_reach_as_far_as_numpy_norms(scale):
    """Squares of 1e-25 underflow float32 and squares of 1e20 overflow it, though the norms
    fit: torch's float32 norm made the first slice a zero slice (its gradient lost) and
    refused the second as NaN or Inf, where numpy's float64 sums took both."""
    x = np.random.default_rng(3).standard_normal(4096).astype(np.float32) * np.float32(scale)
    want = THCCodec().norms(x)
    got = THCCodec().norms(torch.from_numpy(x))
    assert want[0] > 0 and np.isfinite(want[0])
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)


@pytest.mark.parametrize("cpu", ["compiled", "reference"])
def test_slice_norms_are_the_chosen_backends(cpu, monkeypatch):
    """The norms come from the backend the codec's choice picks, as its encode does: the
    compiled norms were chosen beside the Backend interface, not through it."""
    from dataclasses import replace

    from thc.codec import backends
    picked = []
    real = backends.pick

    def pick(x, backend="auto", cpu="compiled"):
        b = real(x, backend, cpu)
        picked.append(b.name)
        return replace(b, norms=lambda flat, params, lay: ("norms of", b.name))
    monkeypatch.setattr(backends, "pick", pick)
    x = np.ones(64, np.float32)
    got = codec.slice_norms(x, THCParams(), backends.Choice("auto", cpu))
    assert got == ("norms of", picked[0]) and picked == [cpu]


def test_the_max_round_takes_each_slices_largest_norm():
    """``agree_max`` is the MAX round of ``simulate`` and the baselines: a slice's norm from
    the worker whose slice is largest, whichever worker that is."""
    a, b = [1.0, 2.0, 0.0], [3.0, 0.5, 0.0]
    for make in (lambda v: np.array(v, np.float32), torch.tensor):
        got = codec.agree_max([make(a), make(b)])
        assert [float(v) for v in got] == [3.0, 2.0, 0.0]


@pytest.mark.parametrize("n,g", [(1, 255), (8, 32), (4, 64), (2, 128), (1, 256), (3, 10923),
                                 (1, 32767), (2, 16384), (1, 1 << 20), (2048, 1 << 20)])
def test_the_sums_wire_type_is_the_narrowest_that_holds_every_sum(n, g):
    """Sums run 0..n x g: at n x g = 256 a uint8 sum of the top values wraps to 0, a valid
    sum, so the mean would be wrong with no error."""
    from thc.codec.common import wire_sum_dtype
    dt = wire_sum_dtype(n, THCParams(granularity=g, table_kind="uniform"))
    ladder = [torch.uint8, torch.int16, torch.int32, torch.int64]
    assert torch.iinfo(dt).max >= n * g
    narrower = ladder[:ladder.index(dt)]
    assert not narrower or torch.iinfo(narrower[-1]).max < n * g
