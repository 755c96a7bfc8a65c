"""A round in which some worker's input holds NaN or Inf, handed on as NaN on every worker
(``nonfinite="propagate"``) instead of refused: what ``torch.amp.GradScaler`` needs to skip
an overflowed step on every rank. Through torch.distributed (Gloo), the software aggregator,
a stream-ordered transport and a graphed round, and under DDP with a real GradScaler."""
from __future__ import annotations

import functools
import re
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.allreduce_cases import workers_through_aggregator
from tests.test_codec_checks import _TwoWorkers
from tests.test_codec_kernels import DEV, kernels
from tests.ddp_common import _data, _model
from tests.test_graphed import _Peer, gloo_pair
from thc.codec.common import NORM_MARK, OVERFLOW_MARK, NonFiniteInput, norm_limit
from thc.codec.params import THCParams
from thc.codec.thc import table_values
from thc.collective import agreement
from thc.collective.allreduce import THCAllReduce
from thc.collective.graphed import GraphedAllReduce

P = THCParams(seed=7, slice_size=256)


def _inputs(rank, bad_call, bad_rank=0, calls=3, numel=1024):
    """Each call's tensor on ``rank``: ``bad_rank``'s call ``bad_call`` holds an Inf."""
    g = torch.Generator().manual_seed(rank)
    for call in range(calls):
        x = torch.randn(numel, generator=g)
        if rank == bad_rank and call == bad_call:
            x[300] = float("inf")
        yield x


def _outcome(ar, x):
    try:
        return ar(x)
    except (ValueError, RuntimeError, TypeError) as e:
        return e


def _marks(tag_lanes_agree=True, top=OVERFLOW_MARK):
    tags = agreement.tagged(torch.zeros(0), 3, 99)
    if not tag_lanes_agree:
        tags[0] += 1
    return torch.tensor([1.0, top, 2.0]), tags


def test_overflowed_reads_only_what_every_worker_shares():
    limit = norm_limit(P)
    assert NORM_MARK > OVERFLOW_MARK >= limit
    assert agreement.overflowed(*_marks(), limit)
    assert agreement.overflowed(*_marks(top=limit * 1.5), limit)   # a finite norm THC refuses
    assert not agreement.overflowed(*_marks(top=NORM_MARK), limit)   # a failure dominates
    assert not agreement.overflowed(*_marks(top=float("nan")), limit)
    assert not agreement.overflowed(*_marks(top=3.0), limit)
    assert not agreement.overflowed(*_marks(tag_lanes_agree=False), limit)
    for args in (_marks(), _marks(top=NORM_MARK), _marks(tag_lanes_agree=False)):
        assert bool(agreement.overflowed_on_device(*args, limit)) == \
            agreement.overflowed(*args, limit)


def test_a_worker_marks_its_bad_slices_as_overflows_and_a_failure_everywhere():
    layout = THCAllReduce(_TwoWorkers(None), P).codec.layout
    y = torch.randn(1024)
    y[600] = float("nan")
    bad = agreement.marks(y, [(0, 1024)], layout, norm_limit(P))
    assert bad.tolist() == [0.0, 0.0, OVERFLOW_MARK, 0.0]
    assert (agreement.marks(y, [(0, 1024)], layout, norm_limit(P), overflow=False)
            == NORM_MARK).all()   # failed otherwise: whatever its input holds
    ok = agreement.marks(torch.randn(1024), [(0, 1024)], layout, norm_limit(P))
    assert (ok == NORM_MARK).all()


class _Alone:
    """One worker's transport in this process: its MAX is its own vector, its sum its own
    table values."""
    stream_ordered, packed, lanes, short_chunks, n_workers = False, False, None, None, 1

    def __init__(self):
        self.sent, self.bytes_sent = [], 0

    def check(self, params):
        pass

    def max(self, vector):
        self.sent.append(vector.clone())
        return vector

    def sum(self, indices, count, params, classes=None):
        return table_values(indices, params).to(torch.int32), None


def test_a_worker_that_fails_otherwise_is_no_overflow_whatever_its_input(monkeypatch):
    """Out of memory with a NaN in the input: the failure marks every slice, and the worker
    raises its own error instead of handing the round on."""
    ar = THCAllReduce(_Alone(), P, nonfinite="propagate")
    monkeypatch.setattr(ar.codec, "prepare", lambda *a: (_ for _ in ()).throw(
        MemoryError("no room")))
    x = torch.randn(1024)
    x[5] = float("nan")
    with pytest.raises(MemoryError, match="no room"):
        ar(x)
    assert (agreement.untag(ar.transport.sent[-1])[0] == NORM_MARK).all()


def test_a_nan_max_norm_is_named_as_no_workers():
    tags = agreement.tagged(torch.zeros(0), 0, 1)
    with pytest.raises(ValueError, match="max norm is NaN, which no worker sends"):
        agreement.refuse_marked(torch.zeros(2), torch.tensor([1.0, float("nan")]), P)
    assert not agreement.overflowed(torch.tensor([OVERFLOW_MARK, float("nan")]), tags,
                                    norm_limit(P))


def _together(monkeypatch, mine, peer, peer_rnd=3):
    """``agreement.together`` on this worker (its ``failure``: ``mine``) beside one peer, whose
    MAX all-reduce lanes come from ``peer`` (None: no failure, an overflow, or another
    failure), played by a patched all-reduce. What it raises (its type and text), or 'ok'."""
    def with_peer(out, op=None, group=None):
        sent = NORM_MARK if peer == "failure" else OVERFLOW_MARK if peer == "overflow" else 0.0
        out.copy_(torch.maximum(out, agreement.tagged(torch.tensor([sent]), peer_rnd, 9)))
    monkeypatch.setattr(agreement.dist, "all_reduce", with_peer)
    monkeypatch.setattr(agreement.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(agreement.DistTransport, "check_group", lambda group: None)
    try:
        agreement.together(None, 3, 9, torch.device("cpu"), mine)
    except Exception as e:  # noqa: BLE001 - what it raised is the result
        return type(e).__name__, str(e)
    return "ok"


def test_together_hands_on_an_overflow_only_where_every_worker_sees_one(monkeypatch):
    """The schemes without tag lanes of their own (TopK, Marsit) decide from the MAX lanes
    alone: an overflow is a NonFiniteInput on both workers, whoever overflowed; a failure or
    workers out of step dominate it, so that no worker hands NaN on while its peer raises."""
    nan = NonFiniteInput("input contains NaN or Inf")
    oom = MemoryError("out of memory")
    assert _together(monkeypatch, None, None) == "ok"
    assert _together(monkeypatch, nan, None) == ("NonFiniteInput", str(nan))
    kind, text = _together(monkeypatch, None, "overflow")
    assert kind == "NonFiniteInput" and "nonfinite='propagate'" in text
    assert _together(monkeypatch, oom, "overflow") == ("MemoryError", str(oom))
    assert _together(monkeypatch, nan, "failure")[0] == "RuntimeError"
    assert _together(monkeypatch, nan, None, peer_rnd=4)[0] == "RuntimeError"
    assert _together(monkeypatch, None, "overflow", peer_rnd=4)[0] == "RuntimeError"


def _bias(rescale: bool) -> float:
    """One worker's 20 rounds of gradients sent at a loss scale S that halves after an
    overflowed round (handed on): how far what it delivered (each estimate / S) is from the
    gradients less the residual, relative to the gradients. Error feedback makes it ~0 while
    the residual stays in the scale's units."""
    ar = THCAllReduce(_Alone(), P, nonfinite="propagate", generator=0)
    gen = torch.Generator().manual_seed(1)
    scale, delivered, true = 1024.0, torch.zeros(4096, dtype=torch.float64), 0.0
    for step in range(20):
        g = torch.randn(4096, generator=gen)
        if step == 10:
            x = g * scale
            x[0] = float("inf")
            assert torch.isnan(ar(x)).all()
            scale /= 2
            if rescale:
                ar.rescale_residual(0.5)
            continue
        delivered += ar(g * scale).double() / scale
        true = true + g.double()
    left = ar.feedback.residual.double() / scale
    return float((delivered - (true - left)).norm() / true.norm())


def test_the_residual_follows_the_loss_scale():
    assert _bias(rescale=True) < 1e-5
    assert _bias(rescale=False) > 1e-3   # kept in the old scale's units, it weighs double
    with pytest.raises(ValueError, match="finite number > 0"):
        THCAllReduce(_Alone(), P).rescale_residual(0.0)
    for factor in (np.float32(0.5), np.int64(2), torch.tensor(0.5), 3):
        THCAllReduce(_Alone(), P).rescale_residual(factor)


def test_nonfinite_must_be_raise_or_propagate():
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        THCAllReduce(_TwoWorkers(None), P, nonfinite="skip")


CASES = {"propagate": (("propagate", "propagate"), 1), "raise": (("raise", "raise"), 1),
         "unlike": (("propagate", "raise"), None)}
"""Each case's modes on the two workers, and the call at which worker 0's input holds Inf."""


def _gloo_worker(rank, port, q):
    """Every case on one of two Gloo workers, a reducer each: three calls through
    torch.distributed. Per case: each call's result (an array or an error) and the residual
    after it, and the rounds handed on."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=30))
    got = {}
    for case, (modes, bad_call) in CASES.items():
        ar = THCAllReduce.through_torch_distributed(params=P, nonfinite=modes[rank])
        out = []
        for x in _inputs(rank, bad_call):
            y = _outcome(ar, x)
            res = None if ar.feedback.residual is None else ar.feedback.residual.numpy().copy()
            # arrays, not tensors: a queued tensor is read from its process, which may be gone
            out.append((y.numpy() if isinstance(y, torch.Tensor) else
                        f"{type(y).__name__}: {y}", res))
        got[case] = (out, ar.stats.overflows)
    got["failed"] = _failing_peer(rank)
    q.put((rank, got))
    dist.destroy_process_group()


@functools.lru_cache(maxsize=None)
def _gloo_cases():
    return gloo_pair(_gloo_worker)


SHARED = pytest.mark.xdist_group("nonfinite_gloo")
"""The tests that read one pair of spawned workers' cases: one pytest-xdist process runs them,
so the pair is spawned once."""


def _gloo(case):
    return {rank: got[case] for rank, got in _gloo_cases().items()}


@SHARED
def test_an_inf_on_one_worker_gives_every_worker_nan_and_keeps_the_residual():
    res = _gloo("propagate")
    for rank in (0, 1):
        (first, r0), (second, r1), (third, _), = res[rank][0]
        assert np.isfinite(first).all() and np.isnan(second).all(), rank
        np.testing.assert_array_equal(r1, r0)   # the round left no residual
        assert np.isfinite(third).all() and res[rank][1] == 1
    for call in (0, 2):
        np.testing.assert_array_equal(res[0][0][call][0], res[1][0][call][0])


@SHARED
def test_refused_without_propagate_the_error_names_the_option():
    res = _gloo("raise")
    for rank in (0, 1):
        msg = res[rank][0][1][0]
        # one type on every rank, whether its own input or a peer's overflowed
        assert isinstance(msg, str) and msg.startswith("NonFiniteInput: "), msg
        assert "NaN or Inf" in msg, msg
        assert "nonfinite='propagate'" in msg, msg
        assert np.isfinite(res[rank][0][2][0]).all()


@SHARED
def test_workers_that_differ_in_it_refuse_their_first_round():
    res = _gloo("unlike")
    for rank in (0, 1):
        msg = res[rank][0][0][0]
        assert isinstance(msg, str) and "differ in" in msg, msg


def _failing_peer(rank):
    """Worker 0's input holds NaN, worker 1's is refused (an integer tensor): a failure
    dominates the overflow, so both raise."""
    ar = THCAllReduce.through_torch_distributed(params=P, nonfinite="propagate")
    ar(torch.randn(1024))
    x = torch.randn(1024)
    x[5] = float("nan")
    got = _outcome(ar, x if rank == 0 else torch.ones(1024, dtype=torch.int32))
    return str(got) if not isinstance(got, torch.Tensor) else "returned"


@SHARED
def test_a_worker_that_failed_otherwise_makes_every_worker_raise():
    res = _gloo("failed")
    assert "NaN or Inf" in res[0] and "propagate" not in res[0], res
    assert "floating-point" in res[1], res


def test_through_the_aggregator():
    """MAX packets carry the overflow mark (float bits below the failure's) through the
    software aggregator: all three workers get NaN, then a clean round."""
    n = 3
    got = workers_through_aggregator(
        n, P, lambda w, ar: [_outcome(ar, x) for x in _inputs(w, 1, bad_rank=2, numel=5000)],
        nonfinite="propagate")
    for w in range(n):
        first, second, third = got[w]
        assert torch.isnan(second).all(), (w, second)
        assert torch.isfinite(first).all() and torch.isfinite(third).all(), w
        torch.testing.assert_close(third, got[0][2], rtol=0, atol=0)


@kernels
@pytest.mark.parametrize("mode", ["raise", "propagate"])
def test_a_stream_ordered_round_reads_the_overflow_at_its_end(mode):
    """On the kernels' deferred path the marked round still sums, and every worker reads its
    max norms at the round's end."""
    good = torch.randn(1024, generator=torch.Generator().manual_seed(3)).to(DEV)
    bad = good.clone()
    bad[300] = float("inf")
    peer = THCAllReduce(_TwoWorkers(None), P, backend="triton", nonfinite=mode)
    key = agreement.fingerprint(P, 1024, 1024, backend="triton", steps="sum", nonfinite=mode)
    worker = THCAllReduce(_TwoWorkers(agreement.tagged(peer.codec.norms(good), 0, key)),
                          P, backend="triton", nonfinite=mode)
    out = _outcome(worker, bad)
    peer.transport.other = worker.transport.sent[0]
    peer_out = _outcome(peer, good)
    assert worker.transport.sums == peer.transport.sums == 1
    if mode == "raise":
        assert "nonfinite='propagate'" in str(out) and "nonfinite='propagate'" in str(peer_out)
        return
    assert torch.isnan(out).all() and torch.isnan(peer_out).all()
    assert worker.feedback.residual is None and peer.feedback.residual is None
    peer.transport.other = agreement.tagged(worker.codec.norms(good), 1, key)
    assert torch.isfinite(peer(good)).all() and peer.round == 2


def _graphed_pair(deferred):
    """A worker whose input holds an Inf and its peer, graphed, each with the other's MAX
    vector (tests.test_graphed._Peer)."""
    key = agreement.fingerprint(P, 1024, 1024, backend="triton",
                                steps="sum, raised later" if deferred else "sum",
                                nonfinite="propagate")
    make = lambda gen: GraphedAllReduce(  # noqa: E731
        _Peer(agreement.tagged(torch.zeros(4, device=DEV), 0, key)), P, generator=gen,
        capture=False, deferred_checks=deferred, nonfinite="propagate")
    return make(5), make(5), key   # one key: _Peer sums a worker's own indices twice


@kernels
@pytest.mark.parametrize("deferred", [False, True])
def test_a_graphed_round_hands_an_overflow_on_and_raises_nothing_later(deferred):
    x = torch.randn(1024, generator=torch.Generator().manual_seed(4)).to(DEV)
    bad = x.clone()
    bad[300] = float("inf")                                          # slice 1
    worker, peer, key = _graphed_pair(deferred)
    assert torch.isnan(worker(bad)).all()
    peer.transport.other = worker.transport.sent[0]
    assert torch.isnan(peer(x)).all()
    assert not peer._bufs.residual.any() and not worker._bufs.residual.any()   # kept
    for ar in (worker, peer):
        ar.transport.other = agreement.tagged(torch.zeros(4, device=DEV), 1, key)
    outs = [ar(x) for ar in (worker, peer)]
    worker.check()
    peer.check()
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])
    assert worker.stats.overflows == peer.stats.overflows == 1


SKIPPED = (0, 4)
"""The steps at which rank 0's batch holds an Inf."""


HOOKS = ("thc", "topk", "marsit")


def _scaler_worker(rank, port, q):
    """:func:`_scaler_steps` per hook kind, without propagate, then with it."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=30))
    torch.set_num_threads(1)
    got = {(kind, mode): _scaler_steps(kind, mode, rank) for kind in HOOKS
           for mode in ("raise", "propagate")}
    got["halved"] = _halved_residuals(rank)
    q.put((rank, got))
    dist.destroy_process_group()


def _residuals(hook) -> list[torch.Tensor]:
    if hasattr(hook, "scheme"):
        return list(hook.scheme.residuals.values())
    return [ar.feedback.residual if hasattr(ar, "feedback") else ar.residual
            for ar in hook.reducers.values()]


def _halved_residuals(rank) -> dict:
    """Per hook kind with residuals: whether ``rescale_residuals(0.5)`` halved every one."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.collective.ddp import MarsitHook, THCHook, TopKHook
    hooks = {"thc": lambda m: THCHook(m, lambda g: THCAllReduce.through_torch_distributed(g)),
             "topk": lambda m: TopKHook(m), "marsit": lambda m: MarsitHook(m)}
    out = {}
    for kind, make in hooks.items():
        model = _model()
        ddp = DDP(model)
        hook = make(model).register(ddp)
        x, y = _data(rank)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        before = [r.clone() for r in _residuals(hook)]
        hook.rescale_residuals(0.5)
        after = _residuals(hook)
        out[kind] = bool(before) and all(torch.equal(a, b * 0.5) for a, b in zip(after, before))
    return out


def _scaler_steps(kind, mode, rank):
    """Eight DDP steps under a hook of ``kind`` and a GradScaler; rank 0's batch holds an Inf
    at the SKIPPED steps. Per step: the scale, whether the parameters moved, and the loss; an
    error ends the list."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from thc.collective.ddp import HookOptions, MarsitHook, THCHook, TopKHook
    model = _model()
    ddp = DDP(model)
    options = HookOptions(uncompressed=("bias",))
    if kind == "thc":
        hook = THCHook(model, lambda group: THCAllReduce.through_torch_distributed(
            group, params=THCParams(seed=3), nonfinite=mode), options)
    elif kind == "topk":
        hook = TopKHook(model, 0.25, options, nonfinite=mode)
    else:
        hook = MarsitHook(model, options, generator=torch.Generator().manual_seed(rank),
                          nonfinite=mode)
    hook.register(ddp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    x, y = _data(rank)
    log = []
    try:
        for step in range(8):
            xb = x.clone()
            if rank == 0 and step in SKIPPED:
                xb[0, 0] = float("inf")
            before = [p.detach().clone() for p in model.parameters()]
            loss = torch.nn.functional.cross_entropy(ddp(xb), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            old = scaler.get_scale()
            scaler.update()
            hook.rescale_residuals(scaler.get_scale() / old)
            opt.zero_grad(set_to_none=True)
            moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
            log.append((scaler.get_scale(), moved, float(loss)))
    except (ValueError, RuntimeError) as e:
        log.append(str(e))
    return log, [p.detach().numpy().copy() for p in model.parameters()]


@functools.lru_cache(maxsize=None)
def _scaler_runs():
    return gloo_pair(_scaler_worker)


@pytest.mark.xdist_group("nonfinite_scaler")
@pytest.mark.parametrize("kind", HOOKS)
def test_a_grad_scaler_skips_the_overflowed_steps_on_every_rank(kind):
    """Without propagate the first overflow ends training with the refusal; with it every
    rank skips exactly the overflowed steps, halves its scale, and learns on the others."""
    both = _scaler_runs()
    for rank in (0, 1):
        log = both[rank][kind, "raise"][0]
        assert len(log) == 1 and "nonfinite='propagate'" in log[0], log
        # DDP names the refusal's type; it could not cast a future's stored error to a tensor
        assert re.search(r"(ValueError|NonFiniteInput): ", log[0]), log
        assert "Unable to cast" not in log[0], log
    res = {rank: both[rank][kind, "propagate"] for rank in both}
    assert both[0]["halved"][kind] and both[1]["halved"][kind], both
    for rank in (0, 1):
        log = res[rank][0]
        assert len(log) == 8 and all(isinstance(e, tuple) for e in log), log
        assert [not moved for _, moved, _ in log] == [s in SKIPPED for s in range(8)], log
        assert [scale for scale, _, _ in log] == [2.0 ** 9] * 4 + [2.0 ** 8] * 4, log
    for a, b in zip(res[0][1], res[1][1]):
        np.testing.assert_array_equal(a, b)
    losses = [loss for _, _, loss in res[1][0]]
    assert losses[-1] < losses[0], losses


def test_together_refuses_a_mark_lane_no_worker_sends(monkeypatch):
    """A NaN in the mark lane (no worker sends one: tagged() marks a NaN as an overflow)
    comes from a broken peer or collective: every worker refuses the round, none goes on
    into its collectives as if every worker were fine."""
    def with_nan(out, op=None, group=None):
        out[agreement.TAG_LANES] = float("nan")
    monkeypatch.setattr(agreement.dist, "all_reduce", with_nan)
    monkeypatch.setattr(agreement.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(agreement.DistTransport, "check_group", lambda group: None)
    with pytest.raises(RuntimeError, match="a worker failed before this round's collectives"):
        agreement.together(None, 3, 9, torch.device("cpu"))


def test_a_float64_input_beyond_float32s_range_is_named_as_such():
    """A finite float64 value past float32's largest becomes Inf where the codec computes;
    the refusal said only "NaN or Inf", which the input does not hold."""
    import torch

    from thc.codec.params import THCParams
    from thc.codec.thc import THCCodec
    codec = THCCodec(THCParams(slice_size=256))
    x = torch.zeros(256, dtype=torch.float64)
    x[3] = 1e39
    with pytest.raises(ValueError, match="beyond float32's range"):
        codec.encode(x, codec.norms(x), round=0)
