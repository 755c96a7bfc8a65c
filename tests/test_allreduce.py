"""Whole THC all-reduces through the software aggregator and through torch.distributed."""
from __future__ import annotations

import functools
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from thc.codec.common import wire_sum_dtype
from thc.codec.params import THCParams
from thc.codec.thc import THCCodec, aggregate, decode, table_values
from thc.collective.allreduce import THCAllReduce
from thc.net.aggregator import Aggregator
from thc.net.client import AggregationClient, AggregationTimeout
from thc.testing.clusters import free_port_block, free_tcp_port, local_job
from tests import procs
from tests.oom import NoMemory
from tests.procs import gloo_pair
from tests.test_graphed import _Peer, join_gloo

PARAMS = THCParams(seed=7)


def _vectors(n, numel, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(n)]


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


def workers_through_aggregator(n: int, params, each, **kw) -> dict:
    """``each(w, ar)`` on n workers in threads, each with a THCAllReduce (``kw``) through one
    software aggregator: {worker: what it returned, or the ValueError it raised}. No worker
    may be left waiting."""
    job = local_job(1, n, free_port_block(n), pool_size=32, granularity=params.granularity,
                    table=params.table)
    got: dict = {}
    with Aggregator([job]) as agg:
        addr = agg.start()

        def work(w):
            with AggregationClient(job, w, addr, run=1) as c:
                try:
                    got[w] = each(w, THCAllReduce.through_aggregator(c, params, **kw))
                except ValueError as e:
                    got[w] = e

        ts = [threading.Thread(target=work, args=(w,)) for w in range(n)]
        [t.start() for t in ts]
        [t.join(120) for t in ts]
    assert not any(t.is_alive() for t in ts)
    return got


def test_a_nan_on_one_worker_fails_every_worker_and_none_waits():
    """The worker with NaN in its gradient still sends its MAX packets, marked: its peers
    refuse the round too, at once, and nobody is left waiting for a sum."""
    xs = _vectors(3, 5000, seed=4)
    xs[1][123] = float("nan")
    got = workers_through_aggregator(3, PARAMS, lambda w, ar: ar(xs[w]))
    assert "NaN or Inf" in str(got[1])
    for w in (0, 2):
        assert isinstance(got[w], ValueError) and "mark of a worker" in str(got[w]), got[w]


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
    """With a fixed input, the running average of EF estimates approaches the true mean."""
    xs = _vectors(2, 4096, seed=2)
    out = _through_aggregator(xs, rounds=12)
    mean = torch.stack(xs).mean(0)
    err_first = float(((out[0][0] - mean) ** 2).sum())
    err_avg = float(((torch.stack(out[0]).mean(0) - mean) ** 2).sum())
    assert err_avg < err_first / 4


def _two_workers_calling(calls_of, deadline: float) -> dict:
    """Two workers (threads) through a software aggregator, worker w calling each tensor of
    ``calls_of(w)``: per worker, each call's mean (None for an empty result) or the error
    it raised, then the reducer's round count."""
    p = THCParams(slice_size=256, seed=7)
    job = local_job(1, 2, free_port_block(2), pool_size=32, table=p.table)
    out = {0: [], 1: []}
    with Aggregator([job]) as agg:
        addr = agg.start()

        def work(w):
            with AggregationClient(job, w, addr, run=1, deadline=deadline) as c:
                ar = THCAllReduce.through_aggregator(c, p, generator=w, error_feedback=False)
                for x in calls_of(w):
                    try:
                        y = ar(x)
                        out[w].append(float(y.mean()) if y.numel() else None)
                    except (RuntimeError, AggregationTimeout) as e:
                        out[w].append(e)
                out[w].append(ar.round)

        ts = [threading.Thread(target=work, args=(w,)) for w in range(2)]
        [t.start() for t in ts]
        [t.join(60) for t in ts]
    return out


@pytest.mark.parametrize("odd", ["empty", "new size"])
def test_a_call_one_worker_makes_alone_is_refused_by_both_and_they_stay_in_step(odd):
    """Worker 0 hands in an empty tensor, or a size new to it where worker 1 calls a size it
    knows (each one MAX chunk). Both refuse that call; the agreement took no round number on
    one worker while its peer's MAX round took one, so every later round was refused as
    'different rounds'."""
    a = torch.full((1024,), 0.01)
    other = torch.empty(0) if odd == "empty" else torch.full((2048,), 0.01)
    out = _two_workers_calling(lambda w: (a, other if w == 0 else a, a, a), deadline=2.0)
    for w in (0, 1):
        first, refused, *later, rounds = out[w]
        assert "differ in their THC parameters" in str(refused), out
        assert all(r == pytest.approx(0.01, abs=0.002) for r in [first] + later), out
        assert rounds == 4, out


def test_workers_calling_known_sizes_in_different_orders_refuse_through_an_aggregator():
    """Both workers know 4- and 8-slice tensors; then worker 0 calls the short one while
    worker 1 calls the long one. The tag lanes sat after the norms, so each read them from a
    different lane: worker 0 took a mean of the two calls' tensors without an error."""
    # norms below the round lanes: read as tags, they passed as the peer's
    short, long_ = torch.full((1024,), 0.01), torch.full((2048,), 0.1)
    out = _two_workers_calling(lambda w: (short, long_, short if w == 0 else long_),
                               deadline=1.0)
    for w in (0, 1):
        assert out[w][0] == pytest.approx(0.01, abs=0.002), out
        assert out[w][1] == pytest.approx(0.1, abs=0.02), out
    assert "differ in their THC parameters" in str(out[0][2]), out
    assert isinstance(out[1][2], (RuntimeError, AggregationTimeout)), out


@pytest.mark.parametrize("pipeline_elements", [0, -(1 << 20), 1.5 * (1 << 20)])
def test_a_pipeline_length_that_cuts_nothing_is_refused_when_built(pipeline_elements):
    """0 and negative multiples of the slice size passed the check, then failed the first
    call with range()'s or an index error, before any collective: peers waited."""
    with pytest.raises(ValueError, match="pipeline_elements .* positive multiple"):
        THCAllReduce(object(), params=THCParams(slice_size=1 << 10),
                     pipeline_elements=pipeline_elements)
    ar = THCAllReduce(_Peer(None), params=THCParams(slice_size=1 << 10),
                      pipeline_elements=np.int64(1 << 20))
    assert ar.pipeline_elements == 1 << 20 and type(ar.pipeline_elements) is int


@pytest.mark.parametrize("kind", ["eager", "graphed"])
def test_a_table_that_cannot_be_made_fails_the_reducers_build_not_a_round(monkeypatch, kind):
    """A codec's lookup table is made on first use: on a transport that compares none, in
    round 0's fingerprint, before its MAX round. A failure there (out of memory) left the
    worker's peers waiting in a round it owed them, and its next call paired with theirs:
    every later round refused as out of step, the failure unnamed. Made when the reducer
    is built, it fails there, before any round."""
    import thc.codec.params as params_module
    from thc.collective.graphed import GraphedAllReduce

    def no_memory(*args):
        raise MemoryError("out of memory making the table")
    monkeypatch.setattr(params_module, "optimal_table", no_memory)
    build = THCAllReduce if kind == "eager" else GraphedAllReduce
    with pytest.raises(MemoryError, match="making the table"):
        build(_Peer(None), params=THCParams(slice_size=1 << 10))


def test_mismatched_table_is_refused():
    job = local_job(1, 2, free_port_block(2), table=list(range(0, 32, 2)))
    with AggregationClient(job, 0, ("127.0.0.1", 9), run=1) as c:
        with pytest.raises(ValueError, match="lookup table"):
            THCAllReduce.through_aggregator(c, PARAMS)


def _dist_worker(rank, world, port, xs, q):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    ar = THCAllReduce.through_torch_distributed(params=PARAMS,
                                                generator=torch.Generator().manual_seed(rank))
    q.put((rank, ar(xs[rank]).numpy(), ar.transport.bytes_sent))
    dist.destroy_process_group()


def _nan_worker(rank, port, q):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(rank))
    if rank == 0:
        x[2000] = float("inf")
    try:
        THCAllReduce.through_torch_distributed(params=PARAMS)(x)
        q.put((rank, "returned"))
    except ValueError as e:
        q.put((rank, str(e)))
    dist.destroy_process_group()


def test_torch_distributed_a_bad_worker_fails_its_peer_too():
    res = gloo_pair(_nan_worker, port=free_port_block(1))
    assert "NaN or Inf" in res[0]
    assert "mark of a worker" in res[1]


def _outsider_worker(rank, port, q):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=3)
    group = dist.new_group([0, 2])
    try:
        ar = THCAllReduce.through_torch_distributed(group=group, params=PARAMS)
        out = float(ar(torch.ones(1024)).mean())
    except ValueError as e:
        out = str(e)
    q.put((rank, out))
    dist.destroy_process_group()


def test_a_reducer_built_outside_its_group_is_refused_naming_that():
    """A process outside the group took torch's rank -1 and world size -1 there, and failed
    on "Invalid process group specified", which did not say whose."""
    res = gloo_pair(_outsider_worker, world=3)
    assert res[0] == res[2] == pytest.approx(1.0, abs=0.05), res
    assert "not a member of the process group" in res[1], res


def _unlike_worker(rank, port, q):
    """Rounds whose workers differ in one thing each, then one where they agree."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    f32, half = torch.float32, (torch.float16, torch.bfloat16)
    cases = [(THCParams(slice_size=256, seed=rank), 1024, f32),                # the rotation
             (THCParams(slice_size=256, granularity=30 + 30 * rank), 1024, f32),  # the table
             (THCParams(slice_size=256), 1000 + 24 * rank, f32),               # the length
             (THCParams(slice_size=256), 1024 + 1024 * rank, f32),             # slice count
             (THCParams(slice_size=256), 1024, half[0] if rank else f32),      # the dtype: a
             (THCParams(slice_size=256), 1024, half[1] if rank else f32),      # cast apart
             (THCParams(slice_size=256), 1024, f32)]                           # alike
    out = []
    for params, numel, dtype in cases:
        ar = THCAllReduce.through_torch_distributed(params=params, generator=rank)
        try:
            out.append(float(ar(torch.ones(numel, dtype=dtype)).mean()))
        except RuntimeError as e:
            out.append(str(e))
    q.put((rank, out))
    dist.destroy_process_group()


def test_torch_distributed_workers_with_unlike_rounds_all_refuse():
    """Two workers that differ in seed, granularity or tensor length, unchecked, would decode
    each other's indices as their own: a wrong mean, different on each worker, and no error;
    with different slice counts Gloo would abort a process on MAX rounds of different
    lengths. Workers whose tensors differ in dtype would cast the same estimate apart
    (float16 held to 65504, bfloat16 rounded): gradients that differ without an error."""
    res = gloo_pair(_unlike_worker)
    for rank in (0, 1):
        *refused, alike = res[rank]
        assert all("differ in their THC parameters" in r for r in refused), refused
        assert alike == pytest.approx(1.0, abs=0.1)


def _sized_calls(sizes, rank, port, q, every_round=True):
    """Call k's tensor is k + 1 everywhere (so is its mean), of ``sizes[rank][k]``
    elements; ``every_round=False``: rounds not agreed each time, as on NCCL."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    ar = THCAllReduce.through_torch_distributed(params=THCParams(slice_size=256),
                                                generator=rank, error_feedback=False)
    ar.transport.agree_each_round = every_round
    out = []
    for k, numel in enumerate(sizes[rank]):
        try:
            out.append(float(ar(torch.full((numel,), k + 1.0)).mean()))
        except RuntimeError as e:
            out.append(str(e))
    q.put((rank, out))
    dist.destroy_process_group()


def test_workers_out_of_step_in_their_sizes_all_refuse():
    """An empty tensor took no round: the peer's round then paired with the worker's next
    call, a mean of two calls' tensors and no error. A size new to one worker but known to
    the other paired the agreement round with a MAX round, and Gloo aborted a process."""
    # worker 0 first hands in an empty tensor, and later a size it knows where worker 1
    # calls one new to it
    res = gloo_pair(functools.partial(_sized_calls, [[0, 1024, 2048, 1024, 1024],
                                                     [1024, 1024, 2048, 4096, 1024]]))
    for rank in (0, 1):
        out = res[rank]
        assert isinstance(out[0], str) and "differ in their THC parameters" in out[0], out
        # THC's estimates of constant tensors: within 0.2 (a mean of two calls is 0.5 off)
        assert out[1] == pytest.approx(2.0, abs=0.2) and out[2] == pytest.approx(3.0, abs=0.2)
        assert "differ in their THC parameters" in out[3], out
        assert out[4] == pytest.approx(5.0, abs=0.2), out


def test_a_size_new_to_every_worker_is_agreed_where_rounds_are_not():
    """Where rounds are not agreed each time (NCCL), a size new to a worker is: two sizes
    new to both workers ran MAX rounds of unlike lengths (Gloo aborted a process; NCCL
    hangs or sums garbage). Both refuse, and the next round runs."""
    res = gloo_pair(functools.partial(_sized_calls, [[1024, 2048, 1024], [1024, 4096, 1024]],
                                      every_round=False))
    for rank in (0, 1):
        out = res[rank]
        assert out[0] == pytest.approx(1.0, abs=0.2), out
        assert isinstance(out[1], str) and "differ in their THC parameters" in out[1], out
        assert out[2] == pytest.approx(3.0, abs=0.2), out


def _backend_worker(rank, port, q):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    ar = THCAllReduce.through_torch_distributed(params=THCParams(slice_size=256),
                                                generator=rank,
                                                backend="reference" if rank else "compiled")
    try:
        q.put((rank, float(ar(torch.ones(1024)).mean())))
    except RuntimeError as e:
        q.put((rank, str(e)))
    dist.destroy_process_group()


def _missing_backend_worker(rank, port, q):
    import os
    from datetime import timedelta
    os.environ.pop("TRITON_INTERPRET", None)   # worker 0's backend cannot run its tensor
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=30))
    ar = THCAllReduce.through_torch_distributed(params=THCParams(slice_size=256),
                                                generator=rank,
                                                backend="compiled" if rank else "triton")
    t0 = time.monotonic()
    try:
        ar(torch.ones(1024))
        q.put((rank, ("returned", time.monotonic() - t0)))
    except RuntimeError as e:
        q.put((rank, (str(e), time.monotonic() - t0)))
    dist.destroy_process_group()


def test_a_worker_whose_backend_cannot_run_fails_at_once_and_so_does_its_peer():
    """Naming the backend in the fingerprint raised before anything was sent on the worker
    that lacks its backend: its peer waited out the process group's timeout."""
    res = gloo_pair(_missing_backend_worker)
    (own, t_own), (peer, t_peer) = res[0], res[1]
    assert "triton" in own and "codec backend" in peer, res
    assert t_own < 20 and t_peer < 20, res


def test_workers_decoding_on_different_backends_refuse():
    """The compiled and the reference decode differ in their last bits: workers on different
    backends returned different means of the same sums, and DDP's replicas drifted apart."""
    res = gloo_pair(_backend_worker)
    assert all("their codec backend" in str(res[r]) for r in (0, 1)), res


def _norms_join_fails_worker(rank, port, q):
    """Three rounds of four pieces over Gloo; in round 1 rank 1 runs out of memory joining
    its pieces' norms, before its MAX round, and goes on."""
    from datetime import timedelta

    import thc.collective.allreduce as allreduce_module
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=10))
    ar = THCAllReduce.through_torch_distributed(None, THCParams(seed=3, slice_size=256),
                                                pipeline_elements=256, generator=rank)
    fail = []
    allreduce_module.torch = NoMemory("cat", fail)
    out = []
    for rnd in range(3):
        if rank == 1 and rnd == 1:
            fail.append(True)
        try:
            out.append(float(ar(torch.full((1024,), float(rnd + 1))).mean()))
        except Exception as e:  # noqa: BLE001 - each round's outcome is the result
            out.append(f"{type(e).__name__}: {e}")
    q.put((rank, out))
    dist.destroy_process_group()


def test_a_worker_failing_between_its_prepare_and_its_max_round_still_sends_its_marks():
    """Joining the pieces' norms ran outside the failures that send a marked MAX round: the
    peer waited in that round, and the failed worker's next round began with the size
    agreement, which paired with it (unlike lengths: Gloo aborted a process). Its marks go
    out: both refuse the round, and the next one is summed."""
    res = gloo_pair(_norms_join_fails_worker)
    assert res[0][0] == pytest.approx(1.0, abs=0.1) and res[1][0] == res[0][0], res
    assert "out of memory" in res[1][1], res
    assert "the mark of a worker that failed before its sums" in res[0][1], res
    assert res[0][2] == pytest.approx(3.0, abs=0.2) and res[1][2] == res[0][2], res


def _refusing_worker(rank, port, q):
    """Worker 1 hands in bad layer positions, then a bool tensor, then positions torch
    cannot read (a RuntimeError); worker 0 good input."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    ar = THCAllReduce.through_torch_distributed(params=THCParams(slice_size=256),
                                                generator=rank)
    x = torch.ones(1024)
    calls = [(x, torch.full((1024,), 2.0) if rank else None),
             (x.bool() if rank else x, None), (x, [object()] * 1024 if rank else None),
             (x.to_sparse() if rank else x, None), (x.numpy() if rank else x, None),
             ([1.0, [2.0]] if rank else x, None),
             (np.broadcast_to(np.float32(0), (1 << 20, 1 << 20)) if rank else x, None),
             (torch.empty(1024, device="meta") if rank else x, None),
             (x.half().numpy() if rank else x.half(), None),
             (torch.empty(1024, device="meta", dtype=torch.bfloat16) if rank else
              x.bfloat16(), None), (x, None)]
    out = []
    for tensor, position in calls:
        try:
            out.append(float(ar(tensor, position).mean()))
        except (TypeError, ValueError, RuntimeError) as e:
            out.append(str(e))
    q.put((rank, (out, ar.round)))
    dist.destroy_process_group()


def test_a_worker_refusing_its_input_ends_its_peers_round_too():
    """Bad layer positions (checked after the MAX round) or a dtype THC cannot average (cast
    silently) must not leave the peer waiting in a collective: the refusing worker's round
    goes out marked, every worker refuses it, and the next round is good on both."""
    res = gloo_pair(_refusing_worker)
    (bad_pos, bad_dtype, unreadable, sparse, array, ragged, huge, meta, half_array, half_meta,
     good), rounds = res[1]
    assert "layer positions must lie in [0, 1]" in bad_pos
    assert "floating-point tensors, got torch.bool" in bad_dtype
    assert "Could not infer dtype" in unreadable
    # a sparse tensor has no flat view: raising before taking its round, that worker's
    # next call would be summed with its peer's current one
    assert "sparse" in sparse.lower(), sparse
    # a numpy array, or a list without a size, raised before its round: the peer waited
    assert "takes a torch.Tensor, got ndarray" in array, array
    assert "takes a torch.Tensor, got list" in ragged, ragged
    peer, rounds0 = res[0]
    assert all("mark of a worker" in r for r in peer[:5]), peer
    assert "differ" in peer[5], peer    # a list without a size stands in as empty: unlike
    # 2^40 elements in a few bytes: zeros of its size cannot be had, so it stands in as
    # empty; once its stand-in failed before the round, and every later sum was a step off
    assert "takes a torch.Tensor, got ndarray" in huge and "differ" in peer[6], (huge, peer)
    # a meta tensor has no values: Gloo "summed" it without sending, the peer was told the
    # workers were in different rounds, and every later round was refused
    assert "on the meta device" in meta and "mark of a worker" in peer[7], (meta, peer)
    # half-type peers: a float32 stand-in's key left out the dtype theirs hold, and they
    # were told the workers' settings differ instead of the refusal
    assert "got ndarray" in half_array and "on the meta device" in half_meta
    assert all("mark of a worker" in r for r in peer[8:10]), peer
    assert good == pytest.approx(1.0, abs=0.1) and peer[10] == pytest.approx(1.0, abs=0.1)
    assert rounds == rounds0 == 11


def _skipping_worker(rank, port, q, kind):
    """Two like-sized reducers, A and B, called in turn; worker 1 skipped A's first call, so
    each of its calls meets the other reducer's on worker 0."""
    from thc.collective.marsit import MarsitAllReduce
    join_gloo(rank, port)
    if kind == "thc":
        a, b = (THCAllReduce.through_torch_distributed(params=THCParams(slice_size=256),
                                                       generator=rank) for _ in "ab")
    else:
        a, b = (MarsitAllReduce(None, compensation=False) for _ in "ab")
    calls = [(a, torch.full((256,), 1.0 + rank)), (b, torch.full((256,), -100.0 - rank))] * 3
    if rank == 1:
        calls = calls[1:] + calls[:1]
    out = []
    for reducer, x in calls:
        try:
            out.append(float(reducer(x).mean()))
        except RuntimeError as e:
            out.append(str(e))
    q.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["thc", "marsit"])
def test_a_round_of_one_reducer_never_pairs_with_anothers(kind):
    """Round numbers count per reducer: A's call k on one worker and B's call k on another
    carried the same tags, and every worker took the sum of the two (THC's means near -48
    for true means 1.5 and -100.5). Each reducer's build order is now in its fingerprint."""
    res = gloo_pair(functools.partial(_skipping_worker, kind=kind))
    for rank in (0, 1):
        assert all(isinstance(r, str) and "which reducer it is" in r for r in res[rank]), res


def _named_worker(rank, port, q):
    """Reducers named alike but built in another order on each rank, and one built before
    the default group was made again."""
    join_gloo(rank, port)
    params = THCParams(slice_size=256)
    stale = THCAllReduce.through_torch_distributed(params=params, generator=rank)
    again = [free_tcp_port()]
    dist.broadcast_object_list(again)
    dist.destroy_process_group()
    join_gloo(rank, again[0])
    order = ["w1", "w2"] if rank == 0 else ["w2", "w1"]
    named = {n: THCAllReduce.through_torch_distributed(params=params, generator=rank, name=n)
             for n in order}
    out = [float(named[n](torch.full((256,), 1.0 + rank)).mean()) for n in ("w1", "w2")]
    try:
        stale(torch.ones(256))
        out.append("the stale reducer ran")
    except RuntimeError as e:
        out.append(str(e))
    q.put((rank, out))
    dist.destroy_process_group()


def test_named_reducers_pair_by_name_and_a_replaced_group_is_refused():
    """By build order alone, ranks that built their per-parameter reducers in another order
    refused every round; and a reducer built before the default group was made again took
    the same place in the order as the first one built after, and their rounds paired."""
    res = gloo_pair(_named_worker)
    for rank in (0, 1):
        *means, stale = res[rank]
        assert means == [pytest.approx(1.5, abs=0.1)] * 2, res
        assert "the process group this reducer was built on was replaced" in stale, res


@pytest.mark.parametrize("generator, error", [(-1, ValueError), (1 << 64, ValueError),
                                              (1.5, TypeError), (True, TypeError)])
def test_a_generator_the_codec_refuses_is_refused_before_any_round(generator, error):
    from thc.collective.graphed import GraphedAllReduce

    class Transport:
        packed, lanes, stream_ordered = False, None, True

        def check(self, params):
            pass

    with pytest.raises(error, match="generator"):
        THCAllReduce(Transport(), PARAMS, generator=generator)
    with pytest.raises(error, match="generator"):
        GraphedAllReduce(Transport(), PARAMS, generator=generator)


class _CudaGenerator(torch.Generator):
    """A generator that says it lives on a GPU (as torch.Generator("cuda") does), beside CPU
    tensors: the codec refuses it in encode, after the MAX round had left."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def _misplaced_generator_worker(rank, port, q):
    join_gloo(rank, port)
    gen = _CudaGenerator() if rank == 0 else torch.Generator().manual_seed(rank)
    ar = THCAllReduce.through_torch_distributed(params=PARAMS, generator=gen,
                                                backend="reference")
    t0 = time.monotonic()
    try:
        ar(torch.randn(1024, generator=torch.Generator().manual_seed(rank)))
        q.put((rank, ("returned", 0.0)))
    except Exception as e:  # noqa: BLE001 - the test reads what each worker raised
        q.put((rank, (str(e), time.monotonic() - t0)))
        time.sleep(2)   # alive while the peer finishes: its collectives must not need it


def test_a_generator_on_another_device_fails_both_workers_at_once():
    """The worker whose generator is elsewhere raised after its MAX round, in encode, and
    abandoned the group: its peer waited in the sum until the group's timeout. Refused as
    input is, its round goes out marked and both raise at once."""
    res = gloo_pair(_misplaced_generator_worker)
    assert "the torch generator is on cuda:0" in res[0][0], res
    assert "mark of a worker" in res[1][0] and res[1][1] < 20, res


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


def _a_round_then_one_failing_in_encode(ar) -> torch.Tensor:
    """A good round of ``ar``, then one whose encode runs out of memory (after its MAX
    round); returns the input."""
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    ar(x)
    ar.codec.encode_prepared = lambda *a, **k: (_ for _ in ()).throw(MemoryError("oom"))
    with pytest.raises(MemoryError):
        ar(x)
    del ar.codec.encode_prepared
    return x


def test_a_round_left_between_its_collectives_abandons_the_process_group():
    """A worker that fails after its MAX round and before its sums (here in encode) would
    pair its next collective with a peer's pending sum: its transport refuses every later
    round on that group, naming the failure; a new group is usable again."""
    from thc.testing.clusters import free_tcp_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        ar = THCAllReduce.through_torch_distributed(params=PARAMS, generator=1)
        x = _a_round_then_one_failing_in_encode(ar)
        other = THCAllReduce.through_torch_distributed(params=PARAMS, generator=2)
        for reducer in (ar, other):
            with pytest.raises(RuntimeError, match="round 1 failed after its MAX round "
                                                   r"\(MemoryError: oom.*out of step"):
                reducer(x)
    finally:
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        assert torch.isfinite(THCAllReduce.through_torch_distributed(params=PARAMS)(x)).all()
    finally:
        dist.destroy_process_group()


def test_a_round_left_after_its_max_round_fails_the_aggregator_clients_run():
    """Through an aggregator, a worker that fails after its MAX round leaves its peers' DATA
    in the slots its next round would take: its client's run takes no more rounds, naming
    the failure (its next MAX round had been refused by the aggregator as another use). One
    that fails after its sums came back (keeping its residual) goes on."""
    from thc.net.client import RunFailed
    job = local_job(1, 1, free_port_block(1), pool_size=32, table=PARAMS.table)
    with Aggregator([job]) as agg, AggregationClient(job, 0, agg.start(), run=1) as c:
        ar = THCAllReduce.through_aggregator(c, PARAMS, generator=1)
        x = _a_round_then_one_failing_in_encode(ar)
        with pytest.raises(RunFailed, match=r"round 1 failed after its MAX round "
                                            r"\(MemoryError: oom"):
            ar(x)
    # failed once its sums all came back, its sequence numbers are in step: the run goes on
    with Aggregator([job]) as agg, AggregationClient(job, 0, agg.start(), run=1) as c:
        ar = THCAllReduce.through_aggregator(c, PARAMS, generator=1)
        ar.feedback.keep = lambda *a: (_ for _ in ()).throw(MemoryError("oom"))
        with pytest.raises(MemoryError):
            ar(x)
        del ar.feedback.keep
        assert torch.isfinite(ar(x)).all()


def test_sums_no_workers_make_are_refused_alike_and_the_next_round_runs():
    """Decode on the CPU checks the sums it is given, which every worker holds alike: a sum
    outside what the table's values add to is a refusal every worker reaches, so it leaves
    the group usable and the next round runs."""
    from thc.collective.transports import DistTransport
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        ar = THCAllReduce.through_torch_distributed(params=PARAMS, generator=1)
        x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
        real = ar.transport.sum

        def outside(*a, **k):
            sums, short = real(*a, **k)
            sums = sums.clone()
            sums[0] = max(PARAMS.table) + 1
            return sums, short
        ar.transport.sum = outside
        with pytest.raises(ValueError, match="outside"):
            ar(x)
        del ar.transport.sum
        DistTransport.check_group(None)
        assert torch.isfinite(ar(x)).all()
    finally:
        dist.destroy_process_group()


@pytest.fixture
def alone():
    """A Gloo process group of this process alone, for the test's length."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_failure_right_after_the_max_round_abandons_and_keeps_the_first_reason(monkeypatch,
                                                                               alone):
    """The MAX all-reduce returned, then this worker failed before its sums (here untagging
    the result): its peers wait in a sum, so the group is abandoned; a later refusal keeps
    the first reason, and so does the hook's FP32 span."""
    from thc.collective import agreement
    from thc.collective.transports import DistTransport
    ar = THCAllReduce.through_torch_distributed(params=PARAMS, generator=1)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    with monkeypatch.context() as m:
        m.setattr(agreement, "untag", lambda v: (_ for _ in ()).throw(MemoryError("oom")))
        with pytest.raises(MemoryError):
            ar(x)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"round 0 failed .*MemoryError: oom\); its"):
            ar(x)
    with pytest.raises(RuntimeError, match="round 0 failed"):
        DistTransport.check_group(None)


@pytest.mark.parametrize("where", ["agreement", "together"])
def test_a_failure_before_a_rounds_first_collective_abandons(monkeypatch, where, alone):
    """This worker's own failure once its round number was taken and before the round's first
    collective went out (building the agreement's lanes: out of memory) abandoned nothing: its
    peers waited in that collective, and its next round paired with theirs (round numbers a
    round apart: every later round refused as out of step). The group is abandoned, named."""
    from thc.collective import agreement
    ar = THCAllReduce.through_torch_distributed(params=PARAMS, generator=1)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    with monkeypatch.context() as m:
        m.setattr(agreement, "tagged",
                  lambda *a: (_ for _ in ()).throw(MemoryError("out of memory")))
        with pytest.raises(MemoryError):
            if where == "together":
                agreement.together(None, 0, 1, "cpu")
            else:
                ar(x)
    with pytest.raises(RuntimeError, match="round 0 failed before its agreement went out "
                                           r"\(MemoryError: out of memory"):
        ar(x)


def test_a_refused_input_too_large_to_stand_in_for_takes_its_round(monkeypatch, alone):
    """A refused input's round still goes out, from zeros of its size; where they could not be
    made (out of memory, as its own conversion was) the error escaped before the round number
    moved: its next call took the same round as its peers' next, paired with their pending
    one, a sum of two rounds. It stands in as empty instead (peers with a tensor refuse it; a
    failure alike on every worker is refused alike), its round taken, the next one summed."""
    import thc.collective.allreduce as allreduce_module
    ar = THCAllReduce.through_torch_distributed(params=PARAMS, generator=1)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    with monkeypatch.context() as m:
        m.setattr(allreduce_module, "as_float32",
                  lambda t: (_ for _ in ()).throw(MemoryError("out of memory")))
        m.setattr(allreduce_module, "torch", NoMemory("zeros", sized=True))
        with pytest.raises(MemoryError, match="^out of memory$"):   # its own error
            ar(x.double())
    assert ar.round == 1
    assert float(((ar(x) - x) ** 2).sum() / (x ** 2).sum()) < 0.05


def test_an_input_whose_estimate_could_overflow_is_refused_and_the_next_round_runs():
    """An estimate reaches t_p times the max norm: a finite 3e38 came back Inf, the residual
    became -Inf, and every later round was refused as "NaN or Inf" for finite input. Such a
    norm is refused at once, the residual untouched."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port_block(1)}",
                            rank=0, world_size=1)
    try:
        ar = THCAllReduce.through_torch_distributed(params=PARAMS)
        x = torch.zeros(4096)
        x[7] = 3e38
        with pytest.raises(ValueError, match="slice norm beyond"):
            ar(x)
        assert ar.feedback.residual is None
        y = torch.randn(4096, generator=torch.Generator().manual_seed(1))
        out = ar(y)
        assert bool(torch.isfinite(out).all())
        assert float(((out - y) ** 2).sum() / (y ** 2).sum()) < 0.05
    finally:
        dist.destroy_process_group()


SMALL = THCParams(slice_size=256, seed=7)


def _huge_norm_worker(rank, port, q):
    join_gloo(rank, port)
    out = {}
    for backend in ("reference", "compiled"):
        ar = THCAllReduce.through_torch_distributed(params=SMALL, generator=rank,
                                                    backend=backend)
        x = torch.randn(700, generator=torch.Generator().manual_seed(rank))
        if rank == 0:
            x[300] = 3e38   # finite, in slice 1, its norm beyond norm_limit
        try:
            ar(x)
            out[backend] = "returned"
        except ValueError as e:
            out[backend] = str(e)
    q.put((rank, out))
    dist.destroy_process_group()


def test_a_norm_beyond_the_limit_is_named_with_its_slice_on_both_workers():
    """The worker names its slice, and its peer the same slice and the limit as a cause:
    the peer was told slice 0 and "NaN or Inf" for a finite input in slice 1."""
    res = gloo_pair(_huge_norm_worker)
    for backend in ("reference", "compiled"):
        assert "slice norm beyond" in res[0][backend] and "in slice 1" in res[0][backend]
        peer = res[1][backend]
        assert peer.startswith("slice 1's max norm is the mark") and "norm beyond" in peer


def test_a_finite_input_whose_norm_overflows_is_not_called_nan():
    """A prepare that failed for another reason than NaN or Inf marks every slice; its error
    was rewritten as "NaN or Inf in slice 0" for an input that holds neither."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port_block(1)}",
                            rank=0, world_size=1)
    try:
        ar = THCAllReduce.through_torch_distributed(params=PARAMS)
        with pytest.raises(ValueError, match="slice norm beyond") as err:
            ar(torch.full((4096,), 1e37))
        assert "NaN or Inf in slice" not in str(err.value)
    finally:
        dist.destroy_process_group()


def test_a_float64_input_beyond_float32s_range_is_not_called_nan():
    """THC rounds in float32: a finite float64 value beyond its range was refused as "NaN or
    Inf", which the input does not hold. The next round, in range, is summed."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port_block(1)}",
                            rank=0, world_size=1)
    try:
        ar = THCAllReduce.through_torch_distributed(params=PARAMS)
        x = torch.zeros(4096, dtype=torch.float64)
        x[7] = 1e300
        with pytest.raises(ValueError, match="beyond float32's range") as err:
            ar(x)
        assert "NaN or Inf" not in str(err.value)
        got = ar(torch.ones(4096, dtype=torch.float64))
        assert got.dtype == torch.float64 and torch.isfinite(got).all()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("other", [(5 + (1 << 20), 77), (5 + (1 << 39), 77),
                                   (5, 77 + (1 << 24)), (5, 77 + (1 << 47))])
def test_rounds_or_fingerprints_that_differ_only_in_high_bits_are_refused(other):
    """Rounds travelled modulo 2^20 and fingerprints (crc32) modulo 2^24: a worker 2^20
    rounds off its peer, or one whose fingerprint differed only above, passed the check and
    decoded its peer's indices under another rotation. Both now travel as two parts."""
    from thc.collective import agreement
    norms = torch.ones(3)
    mine = agreement.tagged(norms, 5, 77)
    theirs = agreement.tagged(norms, *other)
    _, tags = agreement.untag(torch.maximum(mine, theirs))
    assert not agreement.agreed(tags.tolist()) and not bool(agreement.in_step(tags))
    with pytest.raises(RuntimeError, match="different rounds" if other[1] == 77 else "differ in"):
        agreement.check_rounds(tags)
    _, same = agreement.untag(torch.maximum(mine, agreement.tagged(norms, 5, 77)))
    assert agreement.agreed(same.tolist()) and bool(agreement.in_step(same))
    rnd = torch.tensor([other[0]])   # a graphed round's number, on the device
    assert torch.equal(agreement.tagged(norms, rnd, other[1]), theirs)


class _Recorder:
    """A one-worker transport of a given rank that keeps the indices it is asked to sum."""
    packed, lanes, short_chunks, n_workers = False, None, None, 1

    def __init__(self, rank):
        self.rank, self.bytes_sent, self.summed = rank, 0, []

    def check(self, params):
        pass

    def max(self, vector):
        return vector

    def sum(self, indices, count, params, classes=None):
        self.summed.append(indices.clone())
        return table_values(indices, params).to(torch.int32), None


def test_workers_without_a_generator_draw_unlike_roundings_though_seeded_alike():
    """Training scripts seed torch alike on every rank: with no generator, every worker drew
    its rounding key from torch's global generator, the same on all, so their rounding errors
    were one error n times and the mean's did not shrink. The default key is the rank."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    reducers = [THCAllReduce(_Recorder(rank), PARAMS, error_feedback=False) for rank in (0, 1)]
    for ar in reducers:
        torch.manual_seed(0)
        ar(x)
    wires = [ar.transport.summed[0] for ar in reducers]
    assert (wires[0] != wires[1]).float().mean() > 0.05
    assert [ar.generator for ar in reducers] == [0, 1]


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


def test_two_threads_reducers_on_one_client_never_take_each_others_sums():
    """Two reducers share one client on each of two workers, each driven by a thread of its
    own (two hooks' threads, say). The client took one exchange at a time, so a round's
    exchanges could interleave with the other reducer's: here both workers' size agreements
    and MAX rounds ran A's then B's, then worker 0 sent A's DATA first and worker 1 B's, and
    each took a sum of A's tensor and B's that passed every check. A reducer now holds the
    client for its whole round: the schedule asked for cannot happen (each step of it waits
    a moment, then goes), and every sum returned is its own reducer's."""
    job = local_job(1, 2, free_port_block(2), pool_size=32)
    params = THCParams(seed=3, slice_size=256)
    order = {0: ["A max", "A max", "B max", "B max", "A sum", "B sum"],
             1: ["A max", "A max", "B max", "B max", "B sum", "A sum"]}
    turn = threading.Condition()
    done = {0: 0, 1: 0}

    def gated(w, step, call):
        def run(*a, **k):
            with turn:   # its turn in the schedule, or on after a moment
                turn.wait_for(lambda: order[w][done[w]:done[w] + 1] == [step], timeout=1.0)
            try:
                return call(*a, **k)
            finally:
                with turn:
                    done[w] = min(done[w] + 1, len(order[w]) - 1)
                    turn.notify_all()
        return run

    g = torch.Generator().manual_seed(0)
    xs = {(w, n): torch.randn(1024, generator=g) * (1 if n == "A" else 100)
          for w in (0, 1) for n in "AB"}
    out: dict = {}
    with Aggregator([job]) as agg:
        addr = agg.start()
        clients = [AggregationClient(job, w, addr, run=5, deadline=10.0) for w in (0, 1)]
        reducers = {}
        for w in (0, 1):
            for n in "AB":
                ar = THCAllReduce.through_aggregator(clients[w], params, generator=w,
                                                     error_feedback=False)
                ar.transport.max = gated(w, f"{n} max", ar.transport.max)
                ar.transport.sum = gated(w, f"{n} sum", ar.transport.sum)
                reducers[w, n] = ar

        def work(key):
            try:
                out[key] = reducers[key](xs[key])
            except Exception as e:  # noqa: BLE001 - a refusal is an outcome, a wrong sum not
                out[key] = e
        ts = [threading.Thread(target=work, args=(k,)) for k in reducers]
        [t.start() for t in ts]
        [t.join(60) for t in ts]
        [c.close() for c in clients]
    assert not any(t.is_alive() for t in ts)
    for (w, n), got in out.items():
        if isinstance(got, Exception):
            assert "different" in str(got), got   # rounds paired unlike: refused
            continue
        mean = (xs[0, n] + xs[1, n]) / 2
        assert float((got - mean).norm() / mean.norm()) < 0.3, (w, n)


def _threads_on_one_client_worker(job, addr, rank, port, q):
    """Two threads on each of two ranks, each with a reducer on a process group of its own,
    all sharing one client; rank 0 starts A's round first, rank 1 B's: how long each thread's
    round took, and how it ended."""
    from datetime import timedelta
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=20))
    groups = {n: dist.new_group() for n in "AB"}
    client = AggregationClient(job, rank, addr, run=7, deadline=5.0)
    ars = {n: THCAllReduce.through_aggregator(client, THCParams(seed=3, slice_size=256),
                                              groups[n], generator=rank) for n in "AB"}
    out = {}

    def work(n):
        start = time.monotonic()
        try:
            ars[n](torch.ones(1024))
            got = "ok"
        except RuntimeError as e:
            got = str(e)
        out[n] = (time.monotonic() - start, got)
    first, second = ("A", "B") if rank == 0 else ("B", "A")
    ts = [threading.Thread(target=work, args=(n,)) for n in (first, second)]
    ts[0].start()
    time.sleep(0.5)
    ts[1].start()
    [t.join() for t in ts]
    q.put((rank, out))


def test_rounds_on_one_client_in_unlike_orders_are_refused_at_once():
    """Each rank holds its client for a round's whole length, and its transport agreed the
    run over its group when it was built: rounds that the ranks start in unlike orders meet
    at their MAX rounds and are refused at once. (Agreed inside the round instead, each
    rank's first round held the client in an all-gather whose peer waited for its own
    client: both waited out the group's timeout, naming nothing.)"""
    job = local_job(1, 2, free_port_block(2), pool_size=32)
    with Aggregator([job]) as agg:
        res = gloo_pair(functools.partial(_threads_on_one_client_worker, job, agg.start()))
    for rank in (0, 1):
        for took, got in res[rank].values():
            assert took < 10 and "the workers' rounds differ" in got, res


def test_a_float16_estimate_past_its_range_comes_back_finite():
    """Finite float16 inputs (+-60000): the estimate of a coordinate may pass 65504 (t_p times
    the slice's max norm), where the cast alone gave Inf on every worker. It is held to
    +-65504, which only moves it towards the mean; the rest equals the float32 round's."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        sign = torch.randint(0, 2, (4096,), generator=torch.Generator().manual_seed(2)) * 2 - 1
        x = (sign * 60000.0).half()
        wide = THCAllReduce.through_torch_distributed(params=PARAMS, generator=3)(x.float())
        got = THCAllReduce.through_torch_distributed(params=PARAMS, generator=3)(x)
    finally:
        dist.destroy_process_group()
    assert (wide.abs() > 65504).any(), "no estimate past float16's range: nothing is tested"
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    assert torch.equal(got, wide.clamp(-65504, 65504).half())


def _threads_on_one_group_worker(rank, port, q, kind="thc"):
    """Two reducers of ``kind`` on one Gloo group, each driven by a thread of its own; A's
    round starts first on both ranks, and each round's exchange after its agreement waits a
    moment before it goes: rank 0 sends A's first, rank 1 B's (A: means near 100; B: near
    -100). Each round's relative error, or its refusal."""
    from datetime import timedelta

    from thc.collective.marsit import MarsitAllReduce
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=20))
    if kind in ("thc", "graphed"):   # graphed: A replays its rounds (eager off a GPU)
        from thc.collective.graphed import GraphedAllReduce
        make = {"A": GraphedAllReduce if kind == "graphed" else THCAllReduce,
                "B": THCAllReduce}
        ars = {n: make[n].through_torch_distributed(params=THCParams(slice_size=256),
                                                    generator=rank, error_feedback=False)
               for n in "AB"}
        held = {n: (ar.transport, "sum") for n, ar in ars.items()}
    else:
        ars = {n: MarsitAllReduce(compensation=False) for n in "AB"}
        held = {n: (ar, "_round") for n, ar in ars.items()}
    first = "A" if rank == 0 else "B"
    for n, (owner, name) in held.items():
        def late(*a, _real=getattr(owner, name), _wait=1.0 if n == first else 1.6, **k):
            time.sleep(_wait)
            return _real(*a, **k)
        setattr(owner, name, late)
    g = torch.Generator().manual_seed(7)
    xs = {(w, n): torch.randn(4096, generator=g) + (100.0 if n == "A" else -100.0)
          for w in (0, 1) for n in "AB"}
    out = {}

    def work(n, delay):
        time.sleep(delay)
        try:
            got = ars[n](xs[rank, n])
            mean = (xs[0, n] + xs[1, n]) / 2
            out[n] = float((got - mean).norm() / mean.norm())
        except RuntimeError as e:
            out[n] = str(e)
    ts = [threading.Thread(target=work, args=(n, d)) for n, d in (("A", 0.0), ("B", 0.3))]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    q.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["thc", "marsit"])
def test_two_threads_reducers_on_one_process_group_never_take_each_others_sums(kind):
    """THC's integer sums and Marsit's scales and ring carry no tag of their round: a
    reducer on another thread whose exchange went first on one rank paired its tensors with
    this reducer's on the other, and both decoded a wrong mean (THC: relative error about 1),
    unlike on each rank, with no error. A reducer holds the group for its whole round, as
    one over an aggregator holds its client."""
    assert_each_round_its_own(gloo_pair(functools.partial(_threads_on_one_group_worker,
                                                          kind=kind)))


def assert_each_round_its_own(res: dict) -> None:
    """Every round of :func:`_threads_on_one_group_worker` close to its own mean, or refused
    as unlike (never another reducer's sums)."""
    for rank in (0, 1):
        for n, got in res[rank].items():
            assert isinstance(got, str) and "differ" in got or got < 0.3, (rank, n, got)
