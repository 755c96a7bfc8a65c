"""The codec's checks on the kernels' path: flagged on the device, raised by check(),
never left behind by a call that raises, and never a mean accepted from a round whose input
was bad on any worker. Under Triton's interpreter without a GPU (see
test_codec_kernels.py, which this imports first for that)."""
import re

import numpy as np
import pytest
import torch

from tests.test_codec_kernels import DEV, SKIP, kernels
from thc.codec import rng, thc
from thc.codec.common import NORM_MARK, OVERFLOW_MARK, norm_floor, norm_limit
from thc.codec.thc import THCCodec, THCParams, table_values
from thc.collective import agreement
from thc.collective.allreduce import THCAllReduce


@kernels
def test_deferred_checks_flag_on_the_device_and_raise_at_check():
    """With deferred checks nothing raises (or waits) in the call; check() raises what the
    kernels flagged, naming the slice or index, and clears it."""
    p = THCParams(slice_size=256)
    c = THCCodec(p, backend="triton", deferred_checks=True)
    x = torch.randn(1024, generator=torch.Generator().manual_seed(2)).to(DEV)
    m = c.norms(x)
    c.check()
    y = x.clone()
    y[600] = float("nan")                      # slice 2
    c.encode_prepared(c.prepare(y, 0), m, 1)
    with pytest.raises(ValueError, match="NaN or Inf .* in slice 2"):
        c.check()
    c.check()                                  # cleared
    y[600] = float("inf")
    c.encode(y, m, 0, 1)
    with pytest.raises(ValueError, match="NaN or Inf .* in slice 2"):
        c.check()
    idx = c.encode(x, m, 0, 1)
    mb = m.clone()
    mb[3] = -1.0
    c.decode(c.aggregate([idx]), 1, mb, 1024, 0)
    with pytest.raises(ValueError, match=r"max norms must be finite, >= 0 and below \S+ \(slice 3"):
        c.check()
    c.encode(x, mb, 0, 1)
    with pytest.raises(ValueError, match=r"max norms .*slice 3"):
        c.check()
    bad = idx.clone()
    bad[5] = 16
    c.decode_own(bad, m, 1024, 0)
    with pytest.raises(ValueError, match="index 16 outside the 16-entry table"):
        c.check()
    c.decode_own(idx, m, 1024, 0)
    c.check()


class _TwoWorkers:
    """Two workers' transport in one process, stream-ordered like NCCL; its MAX drops a NaN
    as fmax does (the worst a collective may do), its sum doubles this worker's values."""
    stream_ordered, packed, lanes, short_chunks, n_workers = True, False, None, None, 2

    def __init__(self, other):
        self.other, self.sent, self.sums, self.bytes_sent = other, [], 0, 0

    def check(self, params):
        pass

    def max(self, vector):
        if vector.numel() == agreement.TAG_LANES:   # a new size's check: a peer like this one
            return vector
        self.sent.append(vector.clone())
        return torch.fmax(vector, self.other)

    def sum(self, indices, count, params, classes=None):
        self.sums += 1
        return 2 * thc.table_values(indices, params).to(torch.int32), None


def _tagged(norms, rnd, p, backend="triton"):
    """A peer's MAX vector for a round of 1024 elements under ``p`` decoded on ``backend``, its
    fingerprint included."""
    return agreement.tagged(norms, rnd, agreement.fingerprint(p, 1024, 1024, backend=backend,
                                                                  steps="sum"))


@kernels
def test_a_bad_gradient_ends_every_workers_round_in_an_error():
    """On the deferred (GPU) path a NaN in one worker's gradient goes into the MAX round as
    OVERFLOW_MARK: that worker and its peer both raise at the round's end; neither returns a
    mean, both stay in the same round, and the next round is clean."""
    p = THCParams(slice_size=256)
    good = torch.randn(1024, generator=torch.Generator().manual_seed(3)).to(DEV)
    bad = good.clone()
    bad[300] = float("nan")                    # slice 1
    peer = THCAllReduce(_TwoWorkers(None), p, backend="triton")
    worker = THCAllReduce(_TwoWorkers(_tagged(peer.codec.norms(good), 0, p)), p,
                          backend="triton")
    with pytest.raises(ValueError, match="NaN or Inf .* in slice 1"):
        worker(bad)
    sent = worker.transport.sent[0]
    norms, _ = agreement.untag(sent)
    assert norms[1] == OVERFLOW_MARK and (norms[[0, 2, 3]] < 1e6).all()
    assert worker.transport.sums == 1          # it took part in the sum: no peer waits
    peer.transport.other = sent
    with pytest.raises(ValueError, match=r"max norms must be finite.*slice 1"):
        peer(good)
    assert peer.round == worker.round == 1 and peer.feedback.residual is None
    peer.transport.other = _tagged(worker.codec.norms(good), 1, p)
    assert torch.isfinite(peer(good)).all() and peer.round == 2


@kernels
def test_workers_out_of_step_refuse_the_round():
    """The round number rides in the MAX round: a worker a round behind makes every worker
    refuse, at the round's end on a stream-ordered transport."""
    p = THCParams(slice_size=256)
    x = torch.randn(1024, generator=torch.Generator().manual_seed(5)).to(DEV)
    ar = THCAllReduce(_TwoWorkers(_tagged(torch.zeros(4, device=DEV), 1, p)), p,
                      backend="triton")
    with pytest.raises(RuntimeError, match="different rounds"):
        ar(x)                                  # this worker is in round 0, the other in 1
    ar.transport.other = _tagged(torch.zeros(4, device=DEV), 1, p)
    assert torch.isfinite(ar(x)).all()         # both in round 1 now


class _OverSums(_TwoWorkers):
    """Its sums one above what two workers' table values make: a broken peer or aggregator."""

    def sum(self, indices, count, params, classes=None):
        sums, short = super().sum(indices, count, params, classes)
        return torch.full_like(sums, 2 * params.granularity + 1), short


@kernels
@pytest.mark.parametrize("nonfinite", ["raise", "propagate"])
def test_sums_refused_at_a_stream_ordered_rounds_end_are_no_overflow(nonfinite):
    """The round's deferred checks find sums no two workers make: an error every worker
    reaches, neither handed on as NaN (as an overflow of the input is, under "propagate")
    nor told as this worker's input holding NaN or Inf."""
    from thc.codec.common import NonFiniteInput
    p = THCParams(slice_size=256)
    x = torch.randn(1024, generator=torch.Generator().manual_seed(5)).to(DEV)
    ar = THCAllReduce(_OverSums(_tagged(torch.zeros(4, device=DEV), 0, p)), p,
                      backend="triton", nonfinite=nonfinite)
    with pytest.raises(ValueError, match=r"sum 61") as err:
        ar(x)
    assert not isinstance(err.value, NonFiniteInput), err.value
    assert ar.stats.overflows == 0


def test_a_worker_that_stops_early_still_joins_a_stream_ordered_sum():
    """The reference codec raises in prepare. On a stream-ordered transport the worker still
    sends its MAX round (the bad slice marked) and a sum of zeros, so peers on the kernels
    do not wait in the sum; a peer on the reference codec refuses the marked slice the same
    way. Both stay in the same round."""
    p = THCParams(slice_size=256)
    x = torch.randn(1024, generator=torch.Generator().manual_seed(6))
    bad = x.clone()
    bad[700] = float("nan")                    # slice 2
    worker = THCAllReduce(_TwoWorkers(_tagged(torch.zeros(4), 0, p, "reference")), p,
                          backend="reference")
    with pytest.raises(ValueError, match="NaN or Inf in slice 2"):
        worker(bad)
    sent = worker.transport.sent[0]
    norms, _ = agreement.untag(sent)
    assert norms[2] == OVERFLOW_MARK and (norms[[0, 1, 3]] == 0).all()
    assert worker.transport.sums == 1 and worker.round == 1
    peer = THCAllReduce(_TwoWorkers(sent), p, backend="reference")
    with pytest.raises(ValueError, match="slice 2's max norm is the mark"):
        peer(x)
    assert peer.transport.sums == 1 and peer.round == 1


def test_a_worker_failing_for_another_reason_marks_every_slice(monkeypatch):
    """Out of memory in prepare: no slice of this worker may be summed, so all are marked
    (its peers refuse the whole round) and the error is its own."""
    p = THCParams(slice_size=256)
    ar = THCAllReduce(_TwoWorkers(_tagged(torch.zeros(4), 0, p, "reference")), p,
                      backend="reference")

    def out_of_memory(*a, **k):
        raise MemoryError("no room")
    monkeypatch.setattr(ar.codec, "prepare", out_of_memory)
    with pytest.raises(MemoryError, match="no room"):
        ar(torch.randn(1024))
    assert (agreement.untag(ar.transport.sent[0])[0] == NORM_MARK).all() and ar.transport.sums == 1


@kernels
def test_a_call_that_raises_leaves_no_flag_behind():
    """A short tail slice reads the max norms on the host before any kernel runs: the call
    raises at once and flags nothing that a later, good call's check() would report."""
    p = THCParams(slice_size=256)
    c = THCCodec(p, backend="triton", deferred_checks=True)
    x = torch.randn(1024 + 3, generator=torch.Generator().manual_seed(8)).to(DEV)
    m = c.norms(x)
    sums = c.aggregate([c.encode(x, m, 0, 1)])
    bad = m.clone()
    bad[1] = float("inf")
    for call in (lambda mm: c.decode(sums, 1, mm, x.numel(), 0),
                 lambda mm: c.encode(x, mm, 0, 1)):
        with pytest.raises(ValueError, match="max norms must be finite"):
            call(bad)
        call(m)
        c.check()


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_bool_indices_are_indices_0_and_1_not_a_mask(kind):
    """numpy read a bool index vector as a mask: [True, False] into the table [0, 1] gave
    [0] and two workers' sums [0, 0], where torch gave [1, 0] and [2, 0]."""
    from thc.codec.quantize import dequantize
    p = THCParams(bits=1, granularity=1, table_kind="uniform", slice_size=2)
    i = np.array([True, False, True])
    if kind == "torch":
        i = torch.from_numpy(i)
    assert np.asarray(thc.table_values(i, p)).tolist() == [1, 0, 1]
    assert np.asarray(thc.aggregate([i, i], p)).tolist() == [2, 0, 2]
    assert np.asarray(dequantize(i, p.table, 1.0, 1)).tolist() == [1.0, -1.0, 1.0]


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_workers_own_decode_of_bool_indices_is_alike_on_every_backend(kind):
    """Indices 0 and 1, as table_values reads them: the reference decoded them, the compiled
    path and the kernels refused them as sums."""
    p = THCParams(slice_size=256)
    x = torch.randn(512, generator=torch.Generator().manual_seed(4))
    m = THCCodec(p, backend="reference").norms(x)
    i = (torch.arange(512) % 3 == 0).numpy()
    i = torch.from_numpy(i) if kind == "torch" else i
    want = thc.decode_indices(i.astype(np.uint8) if kind == "numpy" else i.byte(), m, 512, p,
                              backend="reference")
    backends = {"reference": "cpu", "compiled": "cpu"}
    if not SKIP and kind == "torch":
        backends["triton"] = DEV
    for backend, dev in backends.items():
        got = thc.decode_indices(i if dev == "cpu" else i.to(dev), m.to(dev), 512, p,
                                 backend=backend)
        assert np.allclose(np.asarray(torch.as_tensor(got).cpu()), np.asarray(want),
                           rtol=1e-5, atol=1e-5), backend


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32])
def test_wide_unsigned_torch_indices_and_bytes_are_read_and_checked(dtype):
    """torch has no min or max of uint16 or uint32 tensors: table_values and unpack_bits
    failed on them with torch's NotImplementedError, where pack_bits widened them."""
    from thc.codec.packing import unpack_bits
    p = THCParams(slice_size=256)
    assert thc.table_values(torch.tensor([1, 2]).to(dtype), p).tolist() == \
        thc.table_values(torch.tensor([1, 2]), p).tolist()
    assert unpack_bits(torch.tensor([0x12, 0x34]).to(dtype), 4, 4).tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="index 20 outside the 16-entry table"):
        thc.table_values(torch.tensor([1, 20]).to(dtype), p)
    with pytest.raises(ValueError, match="packed bytes 1..300 are not bytes"):
        unpack_bits(torch.tensor([1, 300]).to(dtype), 4, 4)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_wide_and_negative_indices_are_refused(backend):
    """An index is compared at its own width: 2^32 + 5 does not wrap to 5, -1 is no entry."""
    if backend == "triton" and SKIP:
        pytest.skip(SKIP)
    p = THCParams(slice_size=256)
    c = THCCodec(p, backend=backend, deferred_checks=True)
    x = torch.randn(512, generator=torch.Generator().manual_seed(9)).to(DEV)
    m = c.norms(x)
    idx = c.encode(x, m, 0, 1).to(torch.int64)
    for value, what in ((2 ** 32 + 5, "index 1073741824 or larger" if backend == "triton"
                         else "index 4294967301"), (-1, "a negative index")):
        wrong = idx.clone()
        wrong[5] = value
        with pytest.raises(ValueError, match=what + " outside the 16-entry table"):
            c.decode_own(wrong, m, 512, 0)
            c.check()
    c.decode_own(idx, m, 512, 0)
    c.check()



@pytest.mark.parametrize("backend", ["reference", "compiled", "triton"])
def test_sums_no_n_workers_can_make_are_refused(backend):
    """Four workers' sums decoded as two workers' gave a mean twice too large, silently; a
    negative sum and a fractional worker count (4.7 was taken as 4) went through too. The
    kernels flag it (a slice too short for them, 2^7, goes through the reference code on
    the device and is flagged there alike); the CPU backends raise at once."""
    if backend == "triton" and SKIP:
        pytest.skip(SKIP)
    p = THCParams(slice_size=256)
    c = THCCodec(p, backend=backend, deferred_checks=backend == "triton")
    numel = 512 + 128
    dev = DEV if backend == "triton" else "cpu"
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(w)).to(dev)
          for w in range(4)]
    m = torch.stack([c.norms(x) for x in xs]).amax(0)
    sums = c.aggregate([c.encode(x, m, 0, w) for w, x in enumerate(xs)]).to(torch.int64)
    good = c.decode(sums, 4, m, numel)
    c.check()
    top = int(sums.max())
    assert top > 2 * p.granularity
    short = sums.clone()
    short[:512] = 0   # the slices the kernels take hold nothing beyond 2 g: the tail does
    for wrong, n, what in ((sums, 2, f"sum {top}"), (short, 2, f"sum {int(short.max())}"),
                           (sums - 200, 4, r"sum -\d+|a negative sum")):
        with pytest.raises(ValueError, match=f"({what}) outside what the workers' table"):
            c.decode(wrong, n, m, numel)
            c.check()
    with pytest.raises(ValueError, match="n_workers must be an integer"):
        c.decode(sums, 4.7, m, numel)
    for count in (numel + 0.9, str(numel), True):   # 640.9 elements were cut to 640
        with pytest.raises(ValueError, match="numel must be an integer"):
            c.decode(sums, 4, m, count)
    for n in (10 ** 38, (1 << 63) // p.granularity + 1):   # past what 64-bit signed sums hold
        with pytest.raises(ValueError, match="is 2\\^63 or more"):
            c.decode(sums, n, m, numel)
    if backend != "triton":   # uint64 sums past int64's range: named as they are
        wide = sums.numpy().astype(np.uint64)
        wide[3] = 2 ** 64 - 1
        with pytest.raises(ValueError, match=f"sum {2 ** 64 - 1} outside"):
            c.decode(wide, 4, m, numel)
    again = c.decode(sums, 4, m, numel)
    c.check()
    assert torch.equal(again, good)


@pytest.mark.parametrize("backend", ["reference", "compiled", "triton"])
def test_a_max_norm_beyond_the_limit_is_refused_and_one_below_decodes_finite(backend):
    """No worker's slice norm reaches norm_limit, so a max norm at or beyond it (given
    directly) is refused, by encode and decode: under one of F32MAX / t_p or more, the
    extreme indices decoded to Inf. Just below the limit they decode finite."""
    if backend == "triton" and SKIP:
        pytest.skip(SKIP)
    p = THCParams(slice_size=256)
    limit = norm_limit(p)
    dev = DEV if backend == "triton" else "cpu"
    c = THCCodec(p, backend=backend)
    top = torch.full((256,), p.levels - 1, dtype=torch.uint8, device=dev)
    x = torch.randn(256, generator=torch.Generator().manual_seed(4)).to(dev)
    for m in (limit, NORM_MARK / 2):
        over = torch.tensor([m], dtype=torch.float32, device=dev)
        for call in (lambda: c.decode_own(top, over, 256, 0), lambda: c.encode(x, over, 0, 1)):
            with pytest.raises(ValueError, match=r"max norm.*(beyond|below) "
                                                 + re.escape(f"{limit:.3g}")):
                call()
    below = torch.tensor([np.nextafter(np.float32(limit), np.float32(0))], device=dev)
    out = c.decode_own(top, below, 256, 0)
    assert torch.isfinite(out).all() and float(out.abs().max()) > limit


def _widest(p: THCParams, norm: float, dev) -> torch.Tensor:
    """A slice of the given norm whose signed coordinates are all alike: every partial sum
    of the unnormalized transform is as large as it gets (sqrt(d) times the norm)."""
    d = p.slice_size
    s = torch.from_numpy(rng.signs(d, p.seed, 0, 0).astype(np.float32))
    return (s * np.float32(norm / np.sqrt(d))).to(dev)


@pytest.mark.parametrize("backend", ["reference", "compiled", "triton"])
def test_a_slice_just_below_the_limit_encodes_as_the_reference_does(backend):
    """The kernels hold the unnormalized row transform before the scale: a slice within the
    old limit (F32MAX / (1.01 (1 + t_p))) overflowed there, and its largest coordinates came
    back as index 0, the sign flipped, without an error. The limit now keeps sqrt(d) times
    the norm finite, and every backend agrees with the reference."""
    if backend == "triton" and SKIP:
        pytest.skip(SKIP)
    p = THCParams(slice_size=4096, p=0.5)
    limit = norm_limit(p)
    dev = DEV if backend == "triton" else "cpu"
    x = _widest(p, 0.999 * limit, dev)
    m = torch.tensor([float(torch.linalg.vector_norm(x.double()))], dtype=torch.float32)
    assert float(m[0]) < limit
    want = thc.encode(x.cpu(), m, p, 0, 5, "reference")
    got = THCCodec(p, backend=backend).encode(x, m.to(dev), 0, 5).cpu()
    assert int((got.int() - want.int()).abs().max()) <= 1


@pytest.mark.parametrize("backend", ["reference", "compiled", "triton"])
def test_values_too_large_for_the_max_norms_given_are_refused(backend):
    """Max norms far below a slice's own norm (given directly: the MAX round never does)
    make the scaled transform overflow past its first coordinate, the only one checked: the
    reference failed with an IndexError, the compiled codec and the kernels returned
    indices."""
    if backend == "triton" and SKIP:
        pytest.skip(SKIP)
    dev = DEV if backend == "triton" else "cpu"
    p = THCParams(slice_size=4)
    s = rng.signs(4, p.seed, 0, 0)
    cases = [(THCParams(slice_size=4),
              torch.from_numpy((s * np.float32([1, -1, -1, 1]) * np.float32(1e30))
                               .astype(np.float32)), 3.5e-8),
             (THCParams(slice_size=256),
              torch.randn(256, generator=torch.Generator().manual_seed(1)) * 1e30, 1e-8)]
    for p, x, m in cases:
        c = THCCodec(p, backend=backend)
        with pytest.raises(ValueError, match="so large for the max norms given"):
            c.encode(x.to(dev), torch.tensor([m], device=dev), 0, 1)


def _refused(codec, x, m: float, prepared: bool = True) -> bool:
    mt = torch.tensor([m], device=x.device)
    try:
        if prepared:
            codec.encode_prepared(codec.prepare(x, 0), mt, 1)
        else:
            codec.encode(x, mt, 0, 1)
    except ValueError as e:
        assert "so large for the max norms given" in str(e)
        return True
    return False


@pytest.mark.parametrize("backend", ["reference", "compiled", "triton"])
def test_a_prepared_encode_refuses_an_overflow_where_a_direct_one_does(backend):
    """The kernels' encode pass 2 skips its check of every coordinate where the slice's own
    norm, from prepare, bounds them all (triton_kernels.REACH) after the scale: across the
    max norm where the scale first makes a coordinate infinite, a prepared encode is refused
    exactly where a direct one, which checks every coordinate, is (with a bound too small the
    kernels took them), and as the reference is away from that line (the reference scales
    before its transform, whose partial sums can overflow a few percent earlier)."""
    if backend == "triton" and SKIP:
        pytest.skip(SKIP)
    p = THCParams(slice_size=256)
    x = torch.randn(256, generator=torch.Generator().manual_seed(1)) * 1e30
    c = THCCodec(p, backend=backend)
    xd = x.to(DEV if backend == "triton" else "cpu")
    lo, hi = 1e-30, float(torch.linalg.vector_norm(x.double()))
    assert _refused(c, xd, lo, False) and not _refused(c, xd, hi, False)
    while hi / lo > 1 + 1e-5:   # where a direct encode stops refusing, by bisection
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if _refused(c, xd, mid, False) else (lo, mid)
    ref = THCCodec(p, backend="reference")
    for factor in (1e-6, 0.5, 0.99, 0.999, 1.001, 1.01, 2.0, 1e3, 1e6):
        m = hi * factor
        assert _refused(c, xd, m) == _refused(c, xd, m, False) == (factor < 1), factor
        if not 0.9 < factor < 1.1:
            assert _refused(ref, x, m) == (factor < 1), factor


@pytest.mark.parametrize("backend", ["reference", "compiled", "triton"])
def test_a_max_norm_under_the_floor_decodes_as_zeros_on_every_backend(backend):
    """A max norm whose encode scale overflows float32 encodes the slice as zeros; its
    decode still scaled the sums' noise by that norm (an estimate uncorrelated with the
    input), and the kernels drew the line one float32 value off the host. A float64 max norm
    is compared as the float32 the kernels take."""
    if backend == "triton" and SKIP:
        pytest.skip(SKIP)
    p = THCParams(slice_size=256)
    dev = DEV if backend == "triton" else "cpu"
    c = THCCodec(p, backend=backend)
    floor = np.float32(norm_floor(p))
    base = torch.randn(256, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    below64 = float(floor) * (1 - 1e-9)   # under the floor in float64, at it in float32
    assert below64 < float(floor) and np.float32(below64) == floor
    for m, live in ((floor, True), (np.nextafter(floor, np.float32(0)), False),
                    (below64, True)):
        x = (base / base.norm() * float(m) * 0.999).float().to(dev)
        mt = torch.tensor([float(m)], dtype=torch.float64).to(dev)
        idx = c.encode(x, mt, 0, 3)
        est = c.decode_own(idx, mt, 256, 0).cpu()
        if live:
            assert float(est.abs().max()) > 0
            assert len(set(idx.cpu().tolist())) > 2
        else:
            assert len(set(idx.cpu().tolist())) <= 2        # the two middle entries
            assert torch.equal(est, torch.zeros(256))


class _Gathered(_TwoWorkers):
    """:class:`_TwoWorkers` whose max norms reach the host before the sum (as on Gloo or
    the aggregator): a marked round is refused right after its MAX round."""
    stream_ordered = False


@kernels
def test_a_worker_whose_own_input_is_bad_is_told_so_first():
    """Deferred checks, max norms read on the host: this worker's NaN (slice 2) and a peer's
    overflow mark (slice 0) both refuse the round, and the worker is told of its own input
    first (refuse_marked), not only of a peer's mark."""
    p = THCParams(slice_size=256)
    good = torch.randn(1024, generator=torch.Generator().manual_seed(3)).to(DEV)
    bad = good.clone()
    bad[600] = float("nan")                    # slice 2
    other = THCAllReduce(_TwoWorkers(None), p, backend="triton").codec.norms(good).clone()
    other[0] = OVERFLOW_MARK                   # the peer's slice 0
    peer = agreement.tagged(other, 0, agreement.fingerprint(p, 1024, 1024, backend="triton",
                                                            steps="check"))
    worker = THCAllReduce(_Gathered(peer), p, backend="triton")
    with pytest.raises(ValueError, match=r"input contains NaN or Inf .*, in slice 2"):
        worker(bad)
    assert worker.transport.sums == 0 and worker.round == 1


@kernels
def test_a_nan_in_a_tail_too_short_for_the_kernels_is_marked_and_flagged():
    """A tail slice of 100 (padded to 128, below the kernels' shortest) has its norm taken by
    torch on the device: a NaN there is sent as OVERFLOW_MARK and flagged, as in the slices
    the kernels take."""
    p = THCParams(slice_size=256)
    c = THCCodec(p, backend="triton", deferred_checks=True)
    x = torch.randn(512 + 100, generator=torch.Generator().manual_seed(2)).to(DEV)
    x[550] = float("nan")                      # slice 2, the tail
    prep = c.prepare(x, 0)
    assert float(prep.norms[2]) == OVERFLOW_MARK and bool((prep.norms[:2] < 1e6).all())
    with pytest.raises(ValueError, match="NaN or Inf .* in slice 2"):
        c.check()


@pytest.mark.parametrize("backend", ["reference", "compiled", "triton"])
def test_the_sum_bound_is_exactly_n_times_g(backend):
    """n g is the largest sum n workers' table values make: it decodes, and one more,
    decoded as n workers' sums, is refused on every backend (a wrong worker count gives
    such sums, and a wrong mean)."""
    if backend == "triton" and SKIP:
        pytest.skip(SKIP)
    p = THCParams(slice_size=256)
    c = THCCodec(p, backend=backend, deferred_checks=backend == "triton")
    numel, g = 512 + 128, p.granularity
    dev = DEV if backend == "triton" else "cpu"
    m = c.norms(torch.randn(numel, generator=torch.Generator().manual_seed(1)).to(dev))
    for lane in (7, 600):   # in a slice the kernels take, and in the tail
        sums = torch.full((c.layout(numel).total_padded,), g, dtype=torch.int64, device=dev)
        sums[lane] = 2 * g
        c.decode(sums, 2, m, numel)
        c.check()
        sums[lane] = 2 * g + 1
        with pytest.raises(ValueError, match=f"sum {2 * g + 1} outside what the workers"):
            c.decode(sums, 2, m, numel)
            c.check()


@pytest.mark.parametrize("backend", ["reference", "compiled"])
def test_a_max_norm_float32_rounds_up_to_the_limit_is_refused(backend):
    """Max norms travel and are compared as float32 (norm_limit is a float32 value): a
    float64 max norm just below the limit that float32 rounds up to it is refused, as the
    limit itself is, not taken because it is below in float64."""
    p = THCParams(slice_size=256)
    limit = norm_limit(p)
    m = np.array([1.0, np.nextafter(limit, 0.0)])
    assert np.float32(m[1]) == np.float32(limit) and m[1] < limit
    c = THCCodec(p, backend=backend)
    with pytest.raises(ValueError, match="beyond"):
        c.decode(np.full(512, 15, np.int64), 1, m, 512)


@pytest.mark.parametrize("backend", ["reference", "compiled", "triton"])
def test_lax_arguments_are_refused_not_cast(backend):
    """A bool generator ran as key 1; a complex max norm lost its imaginary part and a bool
    one read as 1.0; pack_bits truncated float indices (3.7 packed as 3) and ran 4.5 or True
    bits as 4 or 1. Each is refused now, on every backend."""
    from thc.codec.packing import pack_bits
    if backend == "triton" and SKIP:
        pytest.skip(SKIP)
    dev = DEV if backend == "triton" else "cpu"
    c = THCCodec(THCParams(slice_size=256), backend=backend)
    x = torch.randn(512, generator=torch.Generator().manual_seed(3)).to(dev)
    m = c.norms(x)
    with pytest.raises(TypeError, match="got a bool"):
        c.encode(x, m, 0, True)
    for bad in (m + 5j, torch.ones(2, dtype=torch.bool, device=dev), (m.cpu() + 5j).numpy()):
        with pytest.raises(TypeError, match="max norms are real numbers"):
            c.encode(x, bad, 0, 1)
        with pytest.raises(TypeError, match="max norms are real numbers"):
            c.decode_own(c.encode(x, m, 0, 1), bad, 512)
    idx = c.encode(x, m, 0, 1)
    assert torch.equal(c.encode(x, m.double(), 0, 1), idx)   # any real dtype is fine
    # bfloat16 too, which numpy has not: the CPU backends failed converting it
    coarse = m.bfloat16()
    assert torch.equal(c.encode(x, coarse, 0, 1), c.encode(x, coarse.float(), 0, 1))
    assert torch.equal(c.decode_own(idx, coarse, 512), c.decode_own(idx, coarse.float(), 512))
    for floats in (torch.tensor([3.7, 15.9]), np.array([3.7, 15.9])):
        with pytest.raises(TypeError, match="table indices are integers"):
            pack_bits(floats, 4)
    for bits in (4.5, True, "4"):
        with pytest.raises(ValueError, match="bits must be an integer in 1..8"):
            pack_bits(np.array([1, 2]), bits)
    assert pack_bits(np.array([1, 2]), np.int64(4)).tolist() == [0x12]
    assert pack_bits([], 4).tolist() == []   # np.asarray([]) is float64, and holds nothing
    assert torch.equal(c.encode(x, np.array(m.tolist(), dtype=object), 0, 1), idx)


@pytest.mark.parametrize("x", [np.ones(4, bool), torch.ones(4, dtype=torch.bool)],
                         ids=["numpy", "torch"])
def test_a_bool_input_is_refused_not_read_as_ones(x):
    """THC averages real values: a bool array would be cast to 0.0/1.0, as a bool tensor is
    refused for."""
    with pytest.raises(TypeError, match="must be a real"):
        thc.slice_norms(x, THCParams(slice_size=4))


@pytest.mark.parametrize("backend", ["reference", "compiled", "triton"])
def test_a_meta_tensor_anywhere_is_refused_in_the_codecs_words(backend):
    """A meta tensor has a size and no values: the CPU paths raised torch's own error from
    deep inside ("Tensor.item() cannot be called on meta tensors", "Cannot copy out of meta
    tensor"), the kernels' path Triton's ("0 active drivers")."""
    if backend == "triton" and SKIP:
        pytest.skip(SKIP)
    dev = DEV if backend == "triton" else "cpu"
    p = THCParams(slice_size=256)
    x = torch.randn(512, generator=torch.Generator().manual_seed(3)).to(dev)
    m = thc.slice_norms(x, p)
    idx = thc.encode(x, m, p, 0, 1, backend=backend)
    sums = thc.aggregate([idx], p)

    def meta(t):
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    for what, call in [("x", lambda: thc.slice_norms(meta(x), p, backend=backend)),
                       ("x", lambda: thc.encode(meta(x), m, p, 0, 1, backend=backend)),
                       ("x", lambda: thc.prepare(meta(x), p, backend=backend)),
                       ("max_norms", lambda: thc.encode(x, meta(m), p, 0, 1, backend=backend)),
                       ("an index vector", lambda: thc.aggregate([meta(idx)], p)),
                       ("sums", lambda: thc.decode(meta(sums), 1, m, 512, p, backend=backend)),
                       ("max_norms", lambda: thc.decode(sums, 1, meta(m), 512, p,
                                                        backend=backend))]:
        with pytest.raises(ValueError, match=f"^{what} is a meta tensor"):
            call()


def test_an_int_rounding_key_of_2_64_is_refused():
    """The key is 64 bits: 2^64 would run as key 0 (its low 64 bits) on the counter-based
    backends, drawing as generator=0 does."""
    p = THCParams(slice_size=4)
    x = np.ones(4, np.float32)
    m = thc.slice_norms(x, p)
    with pytest.raises(ValueError, match="an int generator keys the rounding draws"):
        thc.encode(x, m, p, 0, 2 ** 64)
    assert thc.encode(x, m, p, 0, 2 ** 64 - 1).shape == (4,)


@pytest.mark.parametrize("slice_size", [1, 4, 16, 1 << 20])
def test_the_norm_limit_leaves_room_for_the_estimate_and_residual_on_any_slice_size(slice_size):
    """Below norm_limit, t_p M (an estimate) plus M (the residual) and sqrt(d) M (the
    unnormalized transform) stay below float32's largest value with a margin for float32
    rounding; on short slices (sqrt(d) < 1 + t_p) the estimate is the larger bound."""
    p = THCParams(slice_size=slice_size)
    limit = norm_limit(p)
    for grow in (1 + p.t_p, np.sqrt(slice_size)):
        assert limit * grow * 1.005 < NORM_MARK


def test_a_scale_factor_of_0_is_refused():
    """A factor of 0 would zero every residual kept in the old scale's units: refused as a
    negative one is."""
    from thc.codec.common import scale_factor
    for bad in (0, 0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="finite number > 0"):
            scale_factor(bad)
    assert scale_factor(torch.tensor(0.5)) == 0.5


def test_an_index_less_device_is_the_same_place_as_any_of_its_kind():
    """"cuda" is any CUDA device, on either side of the comparison."""
    from thc.codec.common import same_place
    cuda, cuda1 = torch.device("cuda"), torch.device("cuda:1")
    assert same_place(cuda, cuda1) and same_place(cuda1, cuda)
    assert not same_place(torch.device("cuda:0"), cuda1)
    assert not same_place(torch.device("cpu"), cuda)


def test_a_float64_nan_is_not_called_a_value_beyond_float32():
    """Only finite float64 values that float32 makes Inf are refused here: NaN or Inf in
    the input pass on to the finite checks, which raise NonFiniteInput (a reducer may hand
    that on under nonfinite="propagate")."""
    from thc.codec.common import as_float32
    for x in (np.array([1.0, np.nan]), torch.tensor([1.0, float("inf")], dtype=torch.float64)):
        out = as_float32(x)
        assert out.dtype in (np.float32, torch.float32) and not np.isfinite(float(out[1]))
    with pytest.raises(ValueError, match="beyond float32's range"):
        as_float32(np.array([1e300]))


def test_a_granularity_of_256_keeps_its_top_table_value_on_torch():
    """Table values up to 255 fit uint8; g = 256's top value would wrap to 0 there."""
    p = THCParams(bits=8, granularity=256, table_kind="uniform")
    assert table_values(torch.tensor([0, 255]), p).tolist() == [0, 256]


def test_a_float8_estimate_is_held_to_its_finite_range():
    """The mean of finite values is finite: float8_e5m2 casts 1e6 to Inf, so the estimate
    is held to its largest finite value (57344) first."""
    from thc.codec.common import cast_estimate
    got = cast_estimate(torch.tensor([1e6, -1e6, 3.0]), torch.float8_e5m2).float()
    assert got.tolist() == [57344.0, -57344.0, 3.0]
