"""Graphed THC rounds (thc.collective.graphed) against the eager all-reduce, the reference:
the same estimates bit for bit with the same int key, the same refusals, the residual kept
through a refused round. On the CPU the rounds run their steps eagerly under Triton's
interpreter (see test_codec_kernels.py, imported first for that); tests/test_graphed_gpu.py
captures and replays them on a GPU."""

import re

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.procs import gloo_pair
from tests.test_codec_kernels import CODEC_KERNELS, DEV, Launches, kernels
from thc.codec import thc
from thc.codec.thc import THCParams
from thc.codec.common import NORM_MARK
from thc.collective import agreement
from thc.collective.allreduce import THCAllReduce
from thc.collective import graphed
from thc.collective.graphed import GraphedAllReduce
from thc.testing.clusters import free_tcp_port

P = THCParams(slice_size=256)


def tagged(norms, rnd, deferred=False):
    """A peer's MAX vector for a round of 1024 elements under P decoded on the kernels, its
    fingerprint included (a graphed reducer's with deferred checks where ``deferred``)."""
    steps = "sum, raised later" if deferred else "sum"
    return agreement.tagged(norms, rnd, agreement.fingerprint(P, 1024, 1024, backend="triton",
                                                                  steps=steps))


class _Peer:
    """The other worker of two, in this process, stream-ordered like NCCL: its MAX vector is
    given (fmax drops a NaN, the worst a collective may do), its indices equal this one's.
    Tests change that vector between rounds, so their rounds are not captured on a GPU."""
    stream_ordered, packed, lanes, short_chunks, n_workers, rank = True, False, None, None, 2, 0

    def __init__(self, other):
        self.other, self.bytes_sent, self.sent, self.summed = other, 0, [], []
        self.abandoned = None

    def check(self, params):
        pass

    def abandon(self, why, summed=False):
        self.abandoned = self.abandoned or why

    def max(self, vector):
        if vector.numel() == agreement.TAG_LANES:   # a new size's check: a peer like this one
            return vector
        self.sent.append(vector.clone())
        return torch.fmax(vector, self.other)

    def sum(self, indices, count, params, classes=None):
        self.summed.append(indices.clone())
        vals = 2 * thc.table_values(indices, params, checked=False).to(torch.int32)
        self.bytes_sent += vals.numel()
        return vals, None


def _graphed(other, key):
    return GraphedAllReduce(_Peer(other), P, generator=key, capture=False)


def _group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_rounds_equal_the_eager_allreduce(dtype):
    """Three rounds with error feedback through torch.distributed: the same estimates, bit
    for bit; the round number lives on the device."""
    _group()
    try:
        eager = THCAllReduce.through_torch_distributed(params=P, generator=11,
                                                       backend="triton")
        graphed = GraphedAllReduce.through_torch_distributed(params=P, generator=11)
        gen = torch.Generator().manual_seed(1)
        for r in range(3):
            x = torch.randn(3 * 256 + 200, generator=gen).to(DEV, dtype)
            a, b = eager(x), graphed(x)
            assert b.dtype == dtype and b.shape == x.shape
            assert torch.equal(a, b), r
        assert graphed.round == 3 and int(graphed._bufs.round) == 3
        # a ring all-reduce of one worker sends nothing (2 (p - 1) / p of each tensor)
        assert graphed.transport.bytes_sent == eager.transport.bytes_sent == 0
    finally:
        dist.destroy_process_group()


@kernels
def test_a_float64_input_beyond_float32s_range_is_refused_as_such():
    """Cast to float32 first, it was refused as "NaN or Inf", which it does not hold."""
    _group()
    try:
        graphed = GraphedAllReduce.through_torch_distributed(params=P, generator=11)
        x = torch.ones(3 * 256, dtype=torch.float64, device=DEV)
        x[7] = 1e300
        with pytest.raises(ValueError, match="beyond float32's range") as err:
            graphed(x)
        assert "NaN" not in str(err.value)
    finally:
        dist.destroy_process_group()


@kernels
@pytest.mark.parametrize("deferred", [False, True], ids=["waited", "deferred"])
def test_a_float16_estimate_past_its_range_is_held_to_it_as_the_eager_rounds(deferred):
    """Finite float16 inputs (+-60000) whose estimate passes 65504: waited for or deferred,
    the graphed round returns the eager round's finite float16 values, not Inf."""
    _group()
    try:
        eager = THCAllReduce.through_torch_distributed(params=P, generator=5,
                                                       backend="triton")
        graphed = GraphedAllReduce.through_torch_distributed(params=P, generator=5,
                                                             deferred_checks=deferred)
        sign = torch.randint(0, 2, (3 * 256,), generator=torch.Generator().manual_seed(4))
        x = ((sign * 2 - 1) * 60000.0).to(DEV, torch.float16)
        a, b = eager(x), graphed(x)
        assert b.dtype == torch.float16 and torch.isfinite(b).all()
        assert (a.abs() == 65504).any(), "no estimate held to float16's range"
        assert torch.equal(a, b)
    finally:
        dist.destroy_process_group()


@kernels
@pytest.mark.parametrize("kind", ["eager", "waited", "deferred"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_what_a_half_estimates_cast_moved_stays_in_the_residual(kind, dtype):
    """Error feedback keeps what was not applied: the applied estimates plus the residual
    add up to the inputs. The hold at float16's +-65504 (inputs of +-60000) and a half
    type's rounding were not kept, and the next rounds subtracted the held part again
    (0.12% of the inputs' mass lost here in float16, 0.16% in bfloat16). Eager and graphed
    rounds alike."""
    _group()
    try:
        if kind == "eager":
            ar = THCAllReduce.through_torch_distributed(params=P, generator=5,
                                                        backend="triton")
        else:
            ar = GraphedAllReduce.through_torch_distributed(
                params=P, generator=5, deferred_checks=kind == "deferred")
        gen = torch.Generator().manual_seed(4)
        total = applied = torch.zeros(3 * 256, dtype=torch.float64)
        held = False
        for _ in range(4):
            sign = torch.randint(0, 2, (3 * 256,), generator=gen) * 2 - 1
            x = (sign * torch.rand(3 * 256, generator=gen) * 60000.0).to(dtype)
            out = ar(x.to(DEV)).cpu()
            held |= bool((out.abs() == 65504).any())
            total = total + x.double()
            applied = applied + out.double()
        # a round of zeros: a deferred round's refusal would be raised by the next call
        applied = applied + ar(torch.zeros(3 * 256, dtype=dtype, device=DEV)).cpu().double()
        kept = applied + ar.kept_residual[:3 * 256].cpu().double()
        assert float((kept - total).abs().sum() / total.abs().sum()) < 1e-6
        assert held or dtype != torch.float16, "no estimate held to float16's range"
    finally:
        dist.destroy_process_group()


@kernels
def test_a_padded_tail_carries_its_residual_as_the_eager_round_of_the_padded_tensor():
    """With error feedback the padding is part of the round's input: its residual is added
    to it as to every coordinate, so three rounds equal, bit for bit, an eager reducer's on
    the tensor padded with zeros, residuals too (a rescale to signed zeros between: the sum
    with the padding's zeros makes -0.0 0.0)."""
    _group()
    try:
        graphed = GraphedAllReduce.through_torch_distributed(params=P, generator=4)
        eager = THCAllReduce.through_torch_distributed(params=P, generator=4,
                                                       backend="triton")
        gen = torch.Generator().manual_seed(6)
        for r in range(3):
            x = torch.randn(2 * 256 + 40, generator=gen).to(DEV)
            padded = torch.cat([x, torch.zeros(216, device=DEV)])
            assert torch.equal(graphed(x), eager(padded)[:x.numel()]), r
            mine, theirs = graphed._bufs.residual, eager.feedback.residual
            assert torch.equal(mine.view(torch.int32), theirs.view(torch.int32)), r
            if r == 0:
                assert mine[x.numel():].any()
                graphed.rescale_residual(1e-45)
                eager.rescale_residual(1e-45)
    finally:
        dist.destroy_process_group()


@kernels
def test_a_short_tail_is_padded_into_the_kernels():
    """A tail slice under 2^8 coordinates is padded with zeros (the kernels take every slice);
    the estimate keeps its size and is as close to the input as the eager one's."""
    _group()
    try:
        graphed = GraphedAllReduce.through_torch_distributed(params=P, generator=3)
        eager = THCAllReduce.through_torch_distributed(params=P, generator=3,
                                                       backend="triton")
        x = torch.randn(2 * 256 + 40, generator=torch.Generator().manual_seed(2)).to(DEV)
        b, a = graphed(x), eager(x)
        assert b.shape == x.shape and graphed._bufs.x.numel() == 3 * 256
        err = lambda e: float((e - x).norm() / x.norm())  # noqa: E731
        assert err(b) < 0.2 and abs(err(b) - err(a)) < 0.05
        with pytest.raises(ValueError, match="serves one tensor"):
            graphed(x[:-1])
    finally:
        dist.destroy_process_group()


@kernels
def test_a_bad_gradient_is_refused_by_both_workers_and_the_residual_kept():
    """A NaN on one worker: it raises naming its slice, its peer raises on the mark, neither
    changes its residual, both stay in step, and the next round is the eager one's."""
    x = torch.randn(1024, generator=torch.Generator().manual_seed(4)).to(DEV)
    bad = x.clone()
    bad[300] = float("nan")                                         # slice 1
    peer = _graphed(tagged(torch.zeros(4, device=DEV), 0), 5)
    eager = THCAllReduce(_Peer(tagged(torch.zeros(4, device=DEV), 0)), P, generator=5,
                         backend="triton")
    assert torch.equal(peer(x), eager(x))
    kept = peer._bufs.residual.clone()
    worker = _graphed(tagged(torch.zeros(4, device=DEV), 1), 5)
    worker._buffers(x, x.shape).round.fill_(1)
    worker.round = 1
    with pytest.raises(ValueError, match="NaN or Inf .* in slice 1"):
        worker(bad)
    peer.transport.other = eager.transport.other = tagged(torch.full((4,), 1e36,
                                                                     device=DEV), 1)
    peer.transport.other[agreement.TAG_LANES + 1] = 3.4028234663852886e38   # the bad worker's mark
    with pytest.raises(ValueError, match=r"max norms must be finite.*slice 1"):
        peer(x)
    with pytest.raises(ValueError, match=r"max norms must be finite.*slice 1"):
        eager(x)
    assert torch.equal(peer._bufs.residual, kept)
    assert peer.round == eager.round == worker.round == 2
    peer.transport.other = eager.transport.other = tagged(torch.zeros(4, device=DEV), 2)
    assert torch.equal(peer(x), eager(x))
    assert torch.equal(peer._bufs.residual, eager.feedback.residual)


@kernels
def test_workers_out_of_step_refuse_the_round():
    x = torch.randn(1024, generator=torch.Generator().manual_seed(5)).to(DEV)
    ar = _graphed(tagged(torch.zeros(4, device=DEV), 1), 1)
    with pytest.raises(RuntimeError, match="different rounds"):
        ar(x)                                   # this worker is in round 0, the other in 1
    assert not ar._bufs.residual.any()          # nothing kept from a refused round
    ar.transport.other = tagged(torch.zeros(4, device=DEV), 1)
    assert torch.isfinite(ar(x)).all() and ar._bufs.residual.any()


@kernels
@pytest.mark.parametrize("where", ["max", "sum"])
def test_a_round_that_fails_after_its_max_round_left_abandons_the_group(where):
    """An error once the MAX round may have left (inside the MAX all-reduce, or in the sum):
    nothing more is sent for that round (an owed MAX would pair with a peer's sum), the
    transport is abandoned, and the device's round number still moves on with the host's."""
    x = torch.randn(1024, generator=torch.Generator().manual_seed(6)).to(DEV)
    ar = _graphed(tagged(torch.zeros(4, device=DEV), 0), 1)
    ar(x)   # the first round (after its size check)
    ar.transport.other = tagged(torch.zeros(4, device=DEV), 1)
    real = getattr(ar.transport, where)

    def fails_after(*a, **k):
        real(*a, **k)
        raise ConnectionError("peer gone")
    setattr(ar.transport, where, fails_after)
    with pytest.raises(ConnectionError):
        ar(x)
    assert len(ar.transport.sent) == 2 and len(ar.transport.summed) == 1 + (where == "sum")
    assert "round 1 failed between its MAX round and its sum" in ar.transport.abandoned
    delattr(ar.transport, where)
    ar.transport.other = tagged(torch.zeros(4, device=DEV), 2)
    assert torch.isfinite(ar(x)).all() and ar.round == 3 and int(ar._bufs.round) == 3


def _eager(other, key):
    return THCAllReduce(_Peer(other), P, generator=key, backend="triton")


@kernels
@pytest.mark.parametrize("kind", ["graphed", "eager"])
@pytest.mark.parametrize("where", ["decode", "residual"])
def test_a_round_that_fails_after_its_sum_abandons_the_group(kind, where):
    """An error of this worker's own after its sum went out (in its decode, or in keeping its
    residual): its peers' round went well and they go on to their next collective (a DDP
    hook's FP32 spans, the next round), which would pair with this worker's next; so the
    transport is abandoned (a peer's FP32 span summed the next round's tag lanes)."""
    x = torch.randn(1024, generator=torch.Generator().manual_seed(6)).to(DEV)
    ar = (_graphed if kind == "graphed" else _eager)(tagged(torch.zeros(4, device=DEV), 0), 1)
    ar(x)
    ar.transport.other = tagged(torch.zeros(4, device=DEV), 1)
    if where == "decode":
        target, name = ar.codec, "decode"
    elif kind == "graphed":
        from thc.collective import round_kernels as target
        name = "keep_residual"
    else:
        target, name = ar.feedback, "keep"
    real = getattr(target, name)
    setattr(target, name, lambda *a, **k: (_ for _ in ()).throw(MemoryError("oom")))
    try:
        with pytest.raises(MemoryError):
            ar(x)
    finally:
        setattr(target, name, real)
    assert len(ar.transport.summed) == 2
    assert re.search(r"round 1 failed (after its sum|after its MAX round) \(MemoryError",
                     ar.transport.abandoned), ar.transport.abandoned


class _Unreadable(torch.Tensor):
    def tolist(self):
        raise MemoryError("out of host memory")


@kernels
def test_a_graphed_round_whose_report_cannot_be_read_abandons_the_group():
    """The read after the round (its report to the host) is this worker's own step after its
    sum: where it fails the group is abandoned, as for a failure in the round."""
    x = torch.randn(1024, generator=torch.Generator().manual_seed(6)).to(DEV)
    ar = _graphed(tagged(torch.zeros(4, device=DEV), 0), 1)
    ar(x)
    ar.transport.other = tagged(torch.zeros(4, device=DEV), 1)
    ar._bufs.report = ar._bufs.report.as_subclass(_Unreadable)
    with pytest.raises(MemoryError):
        ar(x)
    assert "round 1 failed after its sum (MemoryError: out of host memory)" in \
        ar.transport.abandoned


@kernels
@pytest.mark.parametrize("kind", ["graphed", "eager"])
def test_a_refusal_every_worker_reaches_after_the_sum_abandons_nothing(kind):
    """Workers out of step, or a peer's mark, refuse the round on every worker alike after
    their sums: nothing pairs wrongly, so the group stays usable and the next round in step
    runs."""
    x = torch.randn(1024, generator=torch.Generator().manual_seed(5)).to(DEV)
    ar = (_graphed if kind == "graphed" else _eager)(tagged(torch.zeros(4, device=DEV), 1), 1)
    with pytest.raises(RuntimeError, match="different rounds"):
        ar(x)
    marked = tagged(torch.zeros(4, device=DEV), 1)
    marked[agreement.TAG_LANES + 1] = 3.4028234663852886e38
    ar.transport.other = marked
    with pytest.raises(ValueError, match="max norms must be finite"):
        ar(x)
    assert ar.transport.abandoned is None and len(ar.transport.summed) == 2
    ar.transport.other = tagged(torch.zeros(4, device=DEV), 2)
    assert torch.isfinite(ar(x)).all() and ar.round == 3


@kernels
def test_a_worker_that_fails_before_its_max_round_still_lets_its_peers_refuse_it(monkeypatch):
    """Out of memory in its own steps or for its buffers (first call), a tensor of another
    size, a sparse one (no flat view: raising again while owing the round would leave the
    round unsent) or a numpy array (raising before taking its round): the worker
    still sends its MAX round, every slice marked, and a sum of zeros (its peers' rounds
    sum without a host check), counts the round, and the next round is in step."""
    x = torch.randn(1024, generator=torch.Generator().manual_seed(7)).to(DEV)
    ar = _graphed(tagged(torch.zeros(4, device=DEV), 0), 2)
    ar(x)
    real = ar.codec.prepare
    ar.codec.prepare = lambda *a, **k: (_ for _ in ()).throw(MemoryError("out of memory"))
    assert ar.transport.abandoned is None
    for bad_call in (lambda: ar(x), lambda: ar(x[:-1]), lambda: ar(x.to_sparse()),
                     lambda: ar(x.cpu().numpy())):
        n = len(ar.transport.sent)
        with pytest.raises((MemoryError, ValueError, RuntimeError, TypeError)):
            bad_call()
        marks, zeros = ar.transport.sent[n], ar.transport.summed[-1]
        assert len(ar.transport.sent) == n + 1 and (marks[agreement.TAG_LANES:] == NORM_MARK).all()
        assert marks[0] == ar.round - 1 and zeros.numel() == 1024 and not zeros.any()
        ar.codec.prepare = real
    ar.transport.other = tagged(torch.zeros(4, device=DEV), 5)
    assert torch.isfinite(ar(x)).all() and ar.round == 6 and ar.transport.abandoned is None
    first = _graphed(tagged(torch.zeros(4, device=DEV), 1), 2)
    with monkeypatch.context() as m:        # out of memory for the buffers, first call
        m.setattr(graphed, "_Buffers", lambda *a: (_ for _ in ()).throw(MemoryError("oom")))
        with pytest.raises(MemoryError):
            first(x)
    sent = first.transport.sent[0]
    assert (sent[agreement.TAG_LANES:] == NORM_MARK).all() and sent[0] == 0
    assert first.transport.summed[0].numel() == 1024
    assert torch.isfinite(first(x)).all() and int(first._bufs.round) == 2


@kernels
def test_round_lanes_are_compared_as_exactly_on_the_device_as_on_the_host():
    """A lane off by less than float32's step at 2^20: the host refuses the round, and the
    device keeps the residual as it was."""
    x = torch.randn(1024, generator=torch.Generator().manual_seed(8)).to(DEV)
    other = tagged(torch.zeros(4, device=DEV), 0)
    other[0] += 0.03
    ar = _graphed(other, 1)
    with pytest.raises(RuntimeError, match="different rounds"):
        ar(x)
    assert not ar._bufs.residual.any()


@kernels
@pytest.mark.parametrize("error_feedback", [False, True])
def test_a_graphed_round_launches_its_kernels_and_little_else(monkeypatch, error_feedback):
    """What a replay runs besides the transport's collectives: the status word's clearing,
    the codec's kernels and the round's own (thc.collective.round_kernels; with error
    feedback, the decode of its own indices and the residual kept). Its small torch
    operations were thirty-four launches (three more with error feedback), each a graph
    node whose latency is a small bucket's time; the input plus the residual is added by
    the call, in the launch that copies the tensor in."""
    from thc.codec import triton_kernels as tk
    from thc.collective import round_kernels as rk
    x = torch.randn(1024, generator=torch.Generator().manual_seed(8)).to(DEV)
    m = thc.slice_norms(x, P)
    peer = _Peer(tagged(m, 0))
    red = GraphedAllReduce(peer, P, generator=1, capture=False, error_feedback=error_feedback)
    red(x)
    peer.other = tagged(m, 1)
    seen = Launches(monkeypatch, [(tk, name) for name in CODEC_KERNELS]
                    + [(rk, "_tagged"), (rk, "_settle"), (rk, "_keep")],
                    [(peer, "max"), (peer, "sum")])
    got, _ = seen.of(lambda: red._step(red._bufs))
    own = ["_decode_rows", "_decode_cols"] if error_feedback else []
    assert got == ["zero_", "_encode_rows", "_finish_norms", "_tagged", "_encode_cols",
                   "_decode_rows", "_decode_cols"] + own + ["_settle"] + ["_keep"] * error_feedback
    assert int(red._bufs.round) == 2 and bool(red._bufs.clean)


@kernels
def test_what_a_graphed_round_refuses_up_front():
    with pytest.raises(TypeError, match="fixed int"):
        GraphedAllReduce(_Peer(None), P, generator=torch.Generator())
    packed = _Peer(None)
    packed.packed = True
    with pytest.raises(ValueError, match="aggregator"):
        GraphedAllReduce(packed, P)
    ar = GraphedAllReduce(_Peer(None), P, capture=True)
    with pytest.raises(ValueError, match="DLCP"):
        ar(torch.zeros(4), position=torch.zeros(4))
    if DEV == "cpu":
        with pytest.raises(ValueError, match="CUDA graph captures a round of CUDA tensors"):
            ar(torch.zeros(256))


def join_gloo(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)


def gloo_inputs(rank, calls):
    """Each call's tensor on one of the two Gloo workers: worker 0's second holds an Inf."""
    gen = torch.Generator().manual_seed(rank)
    for call in range(calls):
        x = torch.randn(700, generator=gen).to(DEV)
        if rank == 0 and call == 1:
            x[10] = float("inf")
        yield x


def _worker(rank, port, q):
    join_gloo(rank, port)
    graphed = GraphedAllReduce.through_torch_distributed(params=P, generator=rank)
    eager = THCAllReduce.through_torch_distributed(params=P, generator=rank, backend="triton")
    out = []
    for x in gloo_inputs(rank, 3):
        got = []
        for ar in (graphed, eager):
            try:
                got.append(ar(x).cpu().numpy())   # memory that outlives this process
            except ValueError as e:
                got.append(str(e))
        out.append(got)
    q.put((rank, out))
    dist.destroy_process_group()


def _position_worker(rank, port, q):
    join_gloo(rank, port)
    ar = GraphedAllReduce.through_torch_distributed(params=P, generator=rank, timeout=30)
    x = torch.ones(1024, device=DEV)
    out = []
    for position in ([0.5] * 1024 if rank == 0 else None, None):
        try:
            out.append(float(ar(x, position).mean()))
        except ValueError as e:
            out.append(str(e))
    q.put((rank, out))
    dist.destroy_process_group()


@kernels
def test_layer_positions_on_one_worker_are_refused_on_every_worker():
    """The refusal was raised before the round, on the worker given positions alone: its
    peer waited in the round's collectives until the group's timeout."""
    res = gloo_pair(_position_worker)
    assert "DLCP priority classes" in res[0][0] and "mark of a worker" in res[1][0], res
    assert res[0][1] == res[1][1] == pytest.approx(1.0, abs=0.05), res


@kernels
def test_two_gloo_workers_agree_with_the_eager_allreduce():
    """Two processes: every round's estimate equals the eager all-reduce's and the peer's;
    an Inf on one worker makes both refuse that round, and the next one is clean."""
    res = gloo_pair(_worker)
    for r in (0, 2):
        for rank in (0, 1):
            np.testing.assert_array_equal(res[rank][r][0], res[rank][r][1])
        np.testing.assert_array_equal(res[0][r][0], res[1][r][0])
    assert "NaN or Inf" in res[0][1][0] and "NaN or Inf" in res[0][1][1]
    assert "mark of a worker" in res[1][1][0] and "mark of a worker" in res[1][1][1]


def _empty_worker(rank, port, q):
    join_gloo(rank, port)
    ar = GraphedAllReduce.through_torch_distributed(params=P, generator=rank,
                                                    error_feedback=False)
    a = torch.full((512,), 1.0).to(DEV)
    out = []
    for x in (a, torch.empty(0, device=DEV) if rank == 0 else a, a):
        try:
            y = ar(x)
            out.append(float(y.mean()) if y.numel() else None)
        except RuntimeError as e:
            out.append(str(e))
    q.put((rank, (out, ar.round, int(ar._bufs.round))))
    dist.destroy_process_group()


def _default_key_worker(rank, port, q):
    join_gloo(rank, port)
    ar = GraphedAllReduce.through_torch_distributed(params=P, error_feedback=False)
    x = torch.full((512,), 0.3).to(DEV)
    q.put((rank, (ar.key, float(ar(x).mean()))))
    dist.destroy_process_group()


@kernels
def test_workers_draw_apart_by_default():
    """Every worker keyed its rounding draws 0 unless told otherwise: alike draws round alike
    and the mean gets noisier. The default key holds the worker's rank."""
    res = gloo_pair(_default_key_worker)
    assert res[0][0] != res[1][0]
    assert res[0][1] == res[1][1] == pytest.approx(0.3, abs=0.05)


@kernels
def test_an_empty_tensor_on_one_gloo_worker_is_refused_by_both():
    """Worker 0's empty tensor sent the four-lane agreement while its peer's round began with
    its MAX round: Gloo aborted worker 0 on the unlike lengths. Over Gloo every round agrees
    first, and every worker counts the round, on the host and on the device."""
    res = gloo_pair(_empty_worker)
    for rank in (0, 1):
        (first, refused, last), rounds, on_device = res[rank]
        assert "differ in their THC parameters" in refused, res
        assert first == pytest.approx(1.0, abs=0.1) and last == pytest.approx(1.0, abs=0.1)
        assert rounds == on_device == 3, res


@kernels
def test_a_peer_with_another_fingerprint_refuses_the_round():
    """A peer with other THC parameters or another tensor length: refused, nothing kept."""
    x = torch.randn(1024, generator=torch.Generator().manual_seed(5)).to(DEV)
    ar = _graphed(agreement.tagged(torch.zeros(4, device=DEV), 0, 12345), 1)
    with pytest.raises(RuntimeError, match="differ in their THC parameters"):
        ar(x)
    assert not ar._bufs.residual.any()
    ar.transport.other = tagged(torch.zeros(4, device=DEV), 1)
    assert torch.isfinite(ar(x)).all() and ar._bufs.residual.any()


@kernels
def test_a_refused_first_round_does_not_check_the_size_again():
    """A first call refused before its buffers exist (an integer tensor) still went out as
    an owed round: the next call must not send the size check again, which its peers (past
    their first round) would pair with their MAX round."""
    x = torch.randn(1024, generator=torch.Generator().manual_seed(5)).to(DEV)
    ar = _graphed(tagged(torch.zeros(4, device=DEV), 0), 1)
    lengths = []
    real = ar.transport.max

    def recorded(vector):
        lengths.append(vector.numel())
        return real(vector)
    ar.transport.max = recorded
    with pytest.raises(TypeError, match="floating-point tensors, got torch.int32"):
        ar(torch.ones(1024, dtype=torch.int32, device=DEV))
    ar.transport.other = tagged(torch.zeros(4, device=DEV), 1)
    assert torch.isfinite(ar(x)).all()
    assert lengths == [agreement.TAG_LANES, 4 + agreement.TAG_LANES, 4 + agreement.TAG_LANES]


@kernels
def test_a_captured_round_does_not_replay_on_an_abandoned_group():
    """A replay's collectives run without Python: once the group is abandoned, the reducer
    refuses the round before replaying, owes nothing, and the reason stays the first one."""
    x = torch.randn(1024, generator=torch.Generator().manual_seed(6)).to(DEV)
    ar = _graphed(tagged(torch.zeros(4, device=DEV), 0), 1)
    ar(x)
    replays = []

    class Graph:
        def replay(self):
            replays.append(1)
    ar.graph = Graph()
    peer = ar.transport
    peer.abandon("round 0 failed between its MAX round and its sum")

    def usable():   # as DistTransport's: every later collective refused
        raise RuntimeError(f"abandoned: {peer.abandoned}")
    real_max = peer.max
    peer.usable = usable
    peer.max = lambda v: (usable(), real_max(v))[1]
    n = len(peer.sent)
    with pytest.raises(RuntimeError, match="abandoned: round 0 failed"):
        ar(x)
    assert not replays and len(ar.transport.sent) == n
    assert ar.transport.abandoned == "round 0 failed between its MAX round and its sum"
    assert ar.round == int(ar._bufs.round) == 2


def _padded_peer_worker(rank, port, q):
    join_gloo(rank, port)
    p = THCParams(slice_size=1024)
    x = torch.randn(1024 + 100, generator=torch.Generator().manual_seed(rank)).to(DEV)
    ar = GraphedAllReduce.through_torch_distributed(params=p, generator=rank) if rank == 0 \
        else THCAllReduce.through_torch_distributed(params=p, generator=rank, backend="triton")
    try:
        ar(x)
        q.put((rank, "returned"))
    except Exception as e:  # noqa: BLE001 - the test reads what each worker raised
        q.put((rank, str(e)))
    dist.destroy_process_group()


@kernels
def test_a_graphed_peer_that_pads_a_tail_and_an_eager_one_refuse():
    """A tail of 100 (below the kernels' shortest slice) is padded by the graphed reducer
    alone: its sums are 1280 lanes, the eager one's 1152. Equal fingerprints would pair sums
    of unlike lengths (Gloo aborts a process); both refuse."""
    res = gloo_pair(_padded_peer_worker)
    assert all("differ in" in res[rank] for rank in (0, 1)), res


def _graphed_or_eager(rank):
    return GraphedAllReduce.through_torch_distributed(params=P, generator=rank) if rank == 0 \
        else THCAllReduce.through_torch_distributed(params=P, generator=rank, backend="triton")


def one_round_worker(rank, port, q, make=_graphed_or_eager):
    """A round of ones through ``make(rank)``: its mean, or what it raised."""
    join_gloo(rank, port)
    ar = make(rank)
    try:
        q.put((rank, float(ar(torch.ones(1024).to(DEV)).mean())))
    except RuntimeError as e:
        q.put((rank, str(e)))
    dist.destroy_process_group()


@kernels
def test_a_graphed_and_an_eager_worker_on_gloo_refuse_each_other():
    """On Gloo a refused eager round stops after its MAX round while a graphed one goes on
    into its sum: the two shared a fingerprint, and a refused round left the graphed worker
    in a sum its peer skipped (a Gloo abort, "collective mismatch")."""
    res = gloo_pair(one_round_worker)
    assert all("how a refused round ends" in str(res[r]) for r in (0, 1)), res


def test_a_hook_that_wants_priority_classes_refuses_a_graphed_reducer():
    """A graphed round takes no DLCP classes; a hook asked for them that raised at its first
    round would do so outside the round's accounting, its peers waiting in their agreement.
    Its reducer's build fails, and the build's agreement fails every rank at once."""
    from thc.collective.ddp import THCHook
    _group()
    try:
        hook = THCHook(torch.nn.Linear(4, 4), lambda group: _graphed(
            tagged(torch.zeros(4, device=DEV), 0), 5), priorities=True, overlap=False)
        with pytest.raises(ValueError, match="priorities=True marks chunks with DLCP classes"):
            hook.reduce("bucket", torch.ones(1024, device=DEV), [1024],
                        position=torch.zeros(1024))
    finally:
        dist.destroy_process_group()


def test_a_hook_that_wants_priority_classes_refuses_a_reducer_over_torch_distributed():
    """An eager reducer over torch.distributed has no chunks to mark: priorities=True did
    nothing, unsaid."""
    from thc.collective.allreduce import THCAllReduce
    from thc.collective.ddp import THCHook
    _group()
    try:
        hook = THCHook(torch.nn.Linear(4, 4), lambda group: THCAllReduce.through_torch_distributed(
            group, params=P), priorities=True, overlap=False)
        with pytest.raises(ValueError, match=r"this reducer's \(DistTransport\) carries none"):
            hook.reduce("bucket", torch.ones(1024), [1024], position=torch.zeros(1024))
    finally:
        dist.destroy_process_group()


@kernels
def test_a_graphed_reducer_holds_its_group_for_its_round_as_an_eager_one_does(monkeypatch):
    """A graphed reducer beside an eager one on one group, each on a thread of its own
    (tests/allreduce_cases.py's schedule): it took no round lock, and each rank paired one's
    sums with the other's (relative error about 1 on both, no error). The schedule's
    tensors are on the CPU, where the kernels run under the interpreter, also on a GPU host."""
    import functools
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    from tests.allreduce_cases import _threads_on_one_group_worker, assert_each_round_its_own
    assert_each_round_its_own(gloo_pair(functools.partial(_threads_on_one_group_worker,
                                                          kind="graphed")))
