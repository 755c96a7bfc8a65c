"""Whole THC all-reduces through the software aggregator and through torch.distributed: the
estimate every worker gets, the sums against the codec's reference, and the wider sums and
pipelined rounds. Refusals every worker agrees on: tests/test_allreduce_agreement.py; a worker
that fails or is refused mid-round: tests/test_allreduce_failures.py."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

from thc.codec.common import wire_sum_dtype
from thc.codec.params import THCParams
from thc.codec.thc import THCCodec, aggregate, decode, table_values
from thc.collective.allreduce import THCAllReduce
from thc.net.aggregator import Aggregator
from thc.net.client import AggregationClient
from thc.testing.clusters import free_port_block, free_tcp_port, local_job
from tests.allreduce_cases import PARAMS, _vectors
from tests import procs
from tests.procs import gloo_pair
from tests.test_graphed import join_gloo


def _through_aggregator(xs, rounds=1, error_feedback=True):
    n = len(xs)
    job = local_job(1, n, free_port_block(n), pool_size=32, granularity=PARAMS.granularity,
                    table=PARAMS.table)
    out = [None] * n
    errors = []
    with Aggregator([job]) as agg:
        addr = agg.start()

        def work(w):
            try:
                with AggregationClient(job, w, addr, run=1) as c:
                    ar = THCAllReduce.through_aggregator(c, PARAMS, error_feedback=error_feedback,
                                                         generator=torch.Generator().manual_seed(w))
                    out[w] = [ar(xs[w]) for _ in range(rounds)]
                    # every round counted: the size agreement, MAX and DATA packets
                    assert ar.transport.bytes_sent == c.stats.bytes_sent > 0
            except Exception as e:  # surfaced below
                errors.append(e)

        ts = [threading.Thread(target=work, args=(w,)) for w in range(n)]
        [t.start() for t in ts]
        [t.join() for t in ts]
    assert not errors, errors
    return out


def test_estimate_is_identical_on_every_worker_and_close_to_the_mean():
    xs = _vectors(4, 50_000)
    out = _through_aggregator(xs)
    for w in range(1, 4):
        torch.testing.assert_close(out[w][0], out[0][0], rtol=0, atol=0)
    mean = torch.stack(xs).mean(0)
    nmse = float(((out[0][0] - mean) ** 2).sum() / torch.stack([(x ** 2).sum() for x in xs]).mean())
    # One Gaussian worker gives ~0.02; four average to ~0.005. Far above means a broken path.
    assert 0.001 < nmse < 0.01, nmse


def test_aggregator_sums_equal_the_codec_reference():
    """Same indices in, the network's sums decode exactly like the in-memory reference."""
    xs = _vectors(3, 3000, seed=1)
    codec = THCCodec(PARAMS)
    m = np.max(np.stack([codec.norms(x.numpy()) for x in xs]), axis=0)
    idx = [codec.encode(x.numpy(), m, round=0, generator=w) for w, x in enumerate(xs)]
    ref = decode(aggregate(idx, PARAMS), 3, m, 3000, PARAMS)
    job = local_job(1, 3, free_port_block(3), table=PARAMS.table)
    from thc.codec.packing import pack_bits
    from thc.wire import protocol as P
    sums = [None] * 3
    with Aggregator([job]) as agg:
        addr = agg.start()

        def work(w):
            with AggregationClient(job, w, addr, run=1) as c:
                i = np.concatenate([idx[w], np.zeros((-idx[w].size) % job.lanes, np.uint8)])
                sums[w] = c.aggregate(pack_bits(i, P.INDEX_BITS))[: idx[w].size]

        ts = [threading.Thread(target=work, args=(w,)) for w in range(3)]
        [t.start() for t in ts]
        [t.join() for t in ts]
    for w in range(3):   # every worker's (a thread that raised leaves None)
        assert sums[w] is not None, f"worker {w} got no sums"
        np.testing.assert_array_equal(sums[w], aggregate(idx, PARAMS))
        np.testing.assert_array_equal(decode(sums[w], 3, m, 3000, PARAMS), ref)


def test_error_feedback_makes_repeated_rounds_converge():
    """With a fixed input, the running average of EF estimates approaches the true mean as
    1/rounds^2 (each round re-sends the last one's error), where unbiased estimates without
    EF average only as 1/rounds: 12 rounds leave the EF average's error below a fortieth of
    one round's, and at least five times below the average without EF."""
    xs = _vectors(2, 4096, seed=2)
    mean = torch.stack(xs).mean(0)

    def errors(error_feedback: bool) -> tuple[float, float]:
        out = _through_aggregator(xs, rounds=12, error_feedback=error_feedback)
        return (float(((out[0][0] - mean) ** 2).sum()),
                float(((torch.stack(out[0]).mean(0) - mean) ** 2).sum()))

    err_first, err_avg = errors(True)
    _, without = errors(False)
    assert err_avg < err_first / 40, (err_avg, err_first)
    assert err_avg < without / 5, (err_avg, without)


def _dist_worker(rank, world, port, xs, q):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    ar = THCAllReduce.through_torch_distributed(params=PARAMS,
                                                generator=torch.Generator().manual_seed(rank))
    q.put((rank, ar(xs[rank]).numpy(), ar.transport.bytes_sent))
    dist.destroy_process_group()


def test_torch_distributed_transport_gloo():
    world = 3
    xs = _vectors(world, 20_000, seed=3)
    q = procs.queue()
    port = free_port_block(1)
    ps = [procs.start(_dist_worker, r, world, port, xs, q) for r in range(world)]
    res = dict((r, (t, b)) for r, t, b in (q.get(timeout=120) for _ in ps))
    [p.join(30) for p in ps]
    for r in range(1, world):
        np.testing.assert_array_equal(res[r][0], res[0][0])
    mean = torch.stack(xs).mean(0)
    power = torch.stack([(x ** 2).sum() for x in xs]).mean()
    nmse = float(((torch.from_numpy(res[0][0]) - mean) ** 2).sum() / power)
    assert 0.001 < nmse < 0.015, nmse
    # counted as a ring all-reduce sends, 2 (p-1)/p of each tensor: uint8 sums (a byte per
    # padded coordinate, 32768 for 20000 elements), the MAX round (one norm and eight tag
    # lanes) and the size agreement (eight tag lanes), float32
    ring = [2 * (world - 1) * nbytes // world for nbytes in (32768, 9 * 4, 8 * 4)]
    assert res[0][1] == sum(ring) == 43780


WIDE = THCParams(granularity=150, slice_size=256)
"""Two workers' sums reach 300: 16-bit sums, which Gloo cannot all-reduce as int16."""


def _wide_sums_worker(rank, port, q):
    join_gloo(rank, port)
    from thc.collective.transports import DistTransport
    idx = [torch.randint(0, WIDE.levels, (1001,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(r)) for r in range(2)]
    t = DistTransport()
    sums, _ = t.sum(idx[rank], idx[rank].numel(), WIDE)
    want = sum(table_values(i, WIDE).long() for i in idx)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(rank))
    est = THCAllReduce.through_torch_distributed(
        params=WIDE, generator=torch.Generator().manual_seed(rank))(x)
    q.put((rank, (sums.dtype, torch.equal(sums.long(), want), int(want.max()), t.bytes_sent,
                  est.numpy())))
    dist.destroy_process_group()


def test_sums_wider_than_a_byte_cross_gloo_exactly():
    """n g = 300 > 255: the sums are 16-bit, two lanes an int32 word on the wire (1002 lanes,
    2004 bytes, all of which a two-worker ring sends: 2 (p-1)/p); before, every round failed
    with Gloo's "Invalid scalar type" and left the group unusable."""
    res = gloo_pair(_wide_sums_worker)
    for rank in range(2):
        dtype, exact, top, sent, _ = res[rank]
        assert dtype == torch.int16 and exact and top > 255
        assert sent == 1002 * 2
    np.testing.assert_array_equal(res[0][4], res[1][4])
    xs = [torch.randn(3000, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    mean = (xs[0] + xs[1]) / 2
    assert float(((torch.from_numpy(res[0][4]) - mean) ** 2).sum() / (mean ** 2).sum()) < 0.05


HUGE = THCParams(granularity=(1 << 30) + 1, table_kind="uniform", slice_size=256)
"""Two workers' sums pass 2^31: they wrapped in int32 lanes, a wrong mean on every worker."""


def _huge_sums_worker(rank, port, q):
    join_gloo(rank, port)
    x = torch.randn(2048, generator=torch.Generator().manual_seed(0))   # alike on both
    est = THCAllReduce.through_torch_distributed(params=HUGE, generator=rank,
                                                 error_feedback=False)(x)
    q.put((rank, (wire_sum_dtype(2, HUGE), float(((est - x) ** 2).sum() / (x ** 2).sum()))))
    dist.destroy_process_group()


def test_sums_beyond_int32_cross_gloo_exactly():
    res = gloo_pair(_huge_sums_worker)
    for rank in range(2):
        dtype, nmse = res[rank]
        assert dtype == torch.int64 and nmse < 0.05, res


def test_pipelined_path_matches_accuracy_and_agrees_across_workers():
    """Tensors longer than pipeline_elements stream piece by piece; the result is the same
    kind of estimate, identical on every worker."""
    params = THCParams(seed=7, slice_size=1 << 12)
    xs = _vectors(3, 5 * (1 << 12) + 123, seed=4)
    n = len(xs)
    job = local_job(1, n, free_port_block(n), pool_size=32, table=params.table)
    out, errors = [None] * n, []
    with Aggregator([job]) as agg:
        addr = agg.start()

        def work(w):
            try:
                with AggregationClient(job, w, addr, run=1) as c:
                    ar = THCAllReduce.through_aggregator(
                        c, params, generator=torch.Generator().manual_seed(w),
                        pipeline_elements=2 << 12)
                    out[w] = [ar(xs[w]) for _ in range(3)]
                    assert ar.feedback.residual.shape == xs[w].shape
            except Exception as e:
                errors.append(e)

        ts = [threading.Thread(target=work, args=(w,)) for w in range(n)]
        [t.start() for t in ts]
        [t.join() for t in ts]
    assert not errors, errors
    for w in range(1, n):
        torch.testing.assert_close(out[w][2], out[0][2], rtol=0, atol=0)
    mean = torch.stack(xs).mean(0)
    nmse = float(((out[0][0] - mean) ** 2).sum() / torch.stack([(x ** 2).sum() for x in xs]).mean())
    assert 0.001 < nmse < 0.015, nmse


def test_training_runs_the_fused_encode_to_wire_path(monkeypatch):
    """The all-reduce encodes through prepare/encode_prepared (the path ``thc bench codec``
    measures), never encode-then-pack, and its estimate is the in-memory codec's."""
    calls = []
    prepare, encode_prepared = THCCodec.prepare, THCCodec.encode_prepared

    def refuse(*a, **k):
        raise AssertionError("the all-reduce encoded without the fused path")

    monkeypatch.setattr(THCCodec, "prepare",
                        lambda self, *a, **k: calls.append("prepare") or prepare(self, *a, **k))
    monkeypatch.setattr(THCCodec, "encode_prepared",
                        lambda self, prep, m, gen=None, pack=True:
                        calls.append(("encode_prepared", pack))
                        or encode_prepared(self, prep, m, gen, pack))
    monkeypatch.setattr(THCCodec, "encode", refuse)
    monkeypatch.setattr(THCCodec, "encode_packed", refuse)
    xs = _vectors(2, 20_000, seed=5)
    out = _through_aggregator(xs, error_feedback=False)
    assert calls.count("prepare") == 2 and calls.count(("encode_prepared", True)) == 2
    monkeypatch.undo()
    codec = THCCodec(PARAMS)
    m = torch.stack([codec.norms(x) for x in xs]).amax(0)
    idx = [codec.encode(x, m, 0, torch.Generator().manual_seed(w)) for w, x in enumerate(xs)]
    ref = codec.decode(codec.aggregate(idx), 2, m, 20_000, 0)
    torch.testing.assert_close(out[0][0], ref, rtol=0, atol=0)


def test_a_stand_in_is_built_where_the_domain_takes_tensors():
    """A non-tensor's stand-in: on the CPU for a domain that is no process group (an
    aggregator's client, which torch.distributed does not know), sized as the input, and
    empty where zeros of its size cannot be had."""
    from thc.collective import agreement
    from thc.collective.worker import device_of
    t, err = agreement.input_of(np.ones(5, np.float32), device_of(object()))
    assert t.device.type == "cpu" and t.numel() == 5 and isinstance(err, TypeError)
    t, err = agreement.input_of(np.broadcast_to(np.float32(0), (1 << 20, 1 << 20)))
    assert t.numel() == 0 and "got ndarray" in str(err)


def test_a_reducers_error_feedback_telescopes():
    """One worker's estimates plus its last residual add up to its inputs: what a round's
    rounding drops is sent in the next. A residual kept from the round's input alone (not
    the input plus the last residual) dropped the earlier rounds' errors, and the rounds'
    outputs still looked right one by one."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        ar = THCAllReduce.through_torch_distributed(params=PARAMS, generator=5)
        gen = torch.Generator().manual_seed(4)
        sent = got = torch.zeros(3000, dtype=torch.float64)
        for r in range(6):
            x = torch.randn(3000, generator=gen) * (r + 1)
            got = got + ar(x).double()
            sent = sent + x.double()
    finally:
        dist.destroy_process_group()
    left = ar.feedback.residual.double()
    assert float(left.norm()) > 1e-3 * float(sent.norm())   # something was carried
    torch.testing.assert_close(got + left, sent, rtol=0, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e5m2, torch.float8_e4m3fn])
def test_an_estimate_past_its_narrow_types_range_comes_back_finite(dtype):
    """Finite inputs at a narrow type's edge (float16's +-60000): the estimate of a
    coordinate may pass its largest value (t_p times the slice's max norm), where the cast
    alone gave Inf (float8_e4m3fn: NaN) on every worker. It is held to that value, which
    only moves it towards the mean; the rest equals the float32 round's."""
    top = torch.finfo(dtype).max
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        sign = torch.randint(0, 2, (4096,), generator=torch.Generator().manual_seed(2)) * 2 - 1
        x = (sign * min(60000.0, top)).to(dtype)
        wide = THCAllReduce.through_torch_distributed(params=PARAMS, generator=3)(x.float())
        got = THCAllReduce.through_torch_distributed(params=PARAMS, generator=3)(x)
    finally:
        dist.destroy_process_group()
    assert (wide.abs() > top).any(), "no estimate past the type's range: nothing is tested"
    assert got.dtype == dtype and torch.isfinite(got.float()).all()
    assert torch.equal(got.float(), wide.clamp(-top, top).to(dtype).float())


def test_each_piece_of_a_round_draws_its_own_rotation_and_rounding(alone):
    """Each piece's slices restart at index 0: under one codec round, equal pieces came out
    equal (every piece's slice k drew slice k's rotation and rounding, their errors
    correlated). Piece k draws under round + k * 2^40; piece 0 as a whole tensor does."""
    params = THCParams(slice_size=256)
    half = torch.randn(256, generator=torch.Generator().manual_seed(5))
    x = torch.cat([half, half])
    make = lambda pieces: THCAllReduce.through_torch_distributed(  # noqa: E731
        params=params, generator=3, error_feedback=False, pipeline_elements=pieces)
    piecewise, whole = make(256)(x), make(512)(x)
    assert not torch.equal(piecewise[:256], piecewise[256:])
    assert torch.equal(piecewise[:256], whole[:256])
