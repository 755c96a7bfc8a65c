"""Marsit: the merged bit is unbiased for the mean sign; the ring all-reduce in real Gloo groups."""
from __future__ import annotations

import copy
import functools
import math
import re
import time
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist

from thc.collective import marsit
from thc.testing.clusters import free_port_block
from tests import procs
from tests.oom import NoMemory
from tests.procs import gloo_pair

COORDS = 20000


def biased_merge(incoming, own, merged, generator=None):
    """A plausible wrong rule (keep own with probability 1/merged): drops the first worker."""
    keep = torch.rand(own.shape, generator=generator) < 1.0 / merged
    return torch.where(keep, own, incoming)


def odd_one_out_deviation(p: int, odd: int, merge_rule) -> float:
    """Worker ``odd`` has +1 everywhere, the others -1: the mean sign is (2 - p) / p, so an
    unbiased merge gives +1 with probability 1/p. Returns |mean bit - mean sign| in sigmas."""
    gen = torch.Generator().manual_seed(1000 * p + odd)
    signs = [torch.full((COORDS,), i == odd) for i in range(p)]
    acc = signs[0]
    for k, own in enumerate(signs[1:], start=1):
        acc = merge_rule(acc, own, k, gen)
    mean_bit = float(acc.float().mean() * 2 - 1)
    mean_sign = (2 - p) / p
    sigma = math.sqrt((1 - mean_sign ** 2) / COORDS)
    return abs(mean_bit - mean_sign) / sigma


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_merged_bit_is_unbiased_for_the_mean_sign(p):
    for odd in range(p):
        assert odd_one_out_deviation(p, odd, marsit.merge) < 5.0


def test_a_biased_merge_is_caught():
    assert max(odd_one_out_deviation(5, odd, biased_merge) for odd in range(5)) > 20.0


def test_ring_merge_of_random_signs_tracks_the_mean():
    gen = torch.Generator().manual_seed(7)
    p, trials = 4, 50
    signs = [torch.rand(COORDS, generator=gen) < 0.5 + 0.1 * i for i in range(p)]
    mean_sign = sum(s.float() * 2 - 1 for s in signs) / p
    est = sum(marsit.ring_merge(signs, gen).float() * 2 - 1 for _ in range(trials)) / trials
    # the mean of ``trials`` +-1 draws of mean m is off by about sqrt(2/pi) sigma on average,
    # sigma = sqrt((1 - m^2) / trials): 0.11 here, 0.3 for a merge with the wrong weights
    expected = math.sqrt(2 / math.pi) * float(((1 - mean_sign ** 2) / trials).sqrt().mean())
    assert float((est - mean_sign).abs().mean()) < 1.25 * expected
    with pytest.raises(ValueError, match="at least one"):
        marsit.merge(signs[0], signs[1], 0)


PATTERN_COORDS = 6000
"""Coordinates per sign pattern in the ring's statistical test."""


def _pattern_worker(rank, port, q):
    """Coordinate i carries pattern i % 8: this rank's bit is bit ``rank`` of it."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=3)
    pattern = torch.arange(8 * PATTERN_COORDS) % 8
    ar = marsit.MarsitAllReduce(generator=torch.Generator().manual_seed(rank))
    q.put((rank, ar.mean_sign((pattern >> rank & 1).bool()).numpy().copy()))
    dist.destroy_process_group()


def test_the_ring_in_gloo_gives_plus_one_as_often_as_the_workers_hold_it():
    """Three workers over Gloo, every pattern of their signs in each of the ring's three
    segments (thirds, each merged along its own chain of the workers): the merged bit is +1
    with probability (workers holding +1) / 3 in every segment, whatever the workers' places
    in its chain, and every worker gets the same bits. (Over the whole vector, a ring that
    merged nothing would pass: each segment would carry one worker's bits.)"""
    res = gloo_pair(_pattern_worker, world=3)
    for r in (1, 2):
        np.testing.assert_array_equal(res[r], res[0])
    n = PATTERN_COORDS * 8 // 3
    for seg in range(3):
        bits = res[0][seg * n:(seg + 1) * n]
        for p in range(8):
            want, got = bin(p).count("1") / 3, float((bits[p::8] > 0).mean())
            sigma = math.sqrt(want * (1 - want) / (n // 8))
            assert abs(got - want) <= 5 * sigma, (seg, p, got)


def _own_coins_worker(rank, port, q):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=3)
    torch.manual_seed(5)
    global_before = torch.get_rng_state()
    grads = [torch.randn(3001, generator=torch.Generator().manual_seed(10 * rank + i))
             for i in range(3)]
    ar = marsit.MarsitAllReduce()
    ar(grads[0])
    saved = copy.deepcopy(ar.state_dict())
    went_on = ar(grads[1])
    untouched = torch.equal(torch.get_rng_state(), global_before)
    torch.manual_seed(99)      # a resumed job's training seeds the global generator anew
    restored = marsit.MarsitAllReduce()
    restored.load_state_dict(saved)
    q.put((rank, (untouched, torch.equal(restored(grads[1]), went_on))))
    dist.destroy_process_group()


def test_the_rings_coins_are_its_own_and_restored_with_it():
    """By default the ring drew its merge coins from torch's global generator, on the DDP
    hook's communication thread while the training drew from it too (runs were not
    repeatable), and a restored reducer could not go on as the one saved."""
    res = gloo_pair(_own_coins_worker, world=3)
    assert all(res[r] == (True, True) for r in range(3)), res


def test_merge_coins_of_another_device_are_refused_every_time(alone):
    """A state saved on a GPU and loaded where the gradients are on the CPU: refused, and
    refused again at the next round (the first refusal made the reducer's own coins anew,
    which the next round then took, the loaded state left unused); a state of the wrong
    form is refused when loaded."""
    saved = marsit.MarsitAllReduce().state_dict()
    assert saved["merges"] is None   # no merge yet: no coins made
    ar = marsit.MarsitAllReduce()
    ar.load_state_dict({**saved, "merges": ("cuda", torch.zeros(16, dtype=torch.uint8))})
    for _ in range(2):
        with pytest.raises(ValueError, match="a cuda generator's, the gradients are on cpu"):
            ar._merge_coins(torch.device("cpu"))
    with pytest.raises(ValueError, match="device type, a generator's uint8 state"):
        ar.load_state_dict({**saved, "merges": ("cpu", [1, 2, 3])})


def _foreign_coins_worker(rank, port, q):
    from datetime import timedelta
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=20))
    ar = marsit.MarsitAllReduce()
    saved = ar.state_dict()
    if rank == 1:
        ar.load_state_dict({**saved, "merges": ("cuda", torch.zeros(16, dtype=torch.uint8))})
    out, start = [], time.monotonic()
    try:
        ar(torch.ones(64))
        out.append("summed")
    except (ValueError, RuntimeError) as e:
        out.append(str(e))
    out.append(time.monotonic() - start)
    q.put((rank, out))
    dist.destroy_process_group()


def test_merge_coins_of_another_device_on_one_rank_are_refused_by_every_rank():
    """Raised mid-ring (once the scales were summed), the refusal of one rank's coins left
    its peer waiting on the ring's exchange until the group's timeout."""
    res = gloo_pair(_foreign_coins_worker)
    assert "a cuda generator's, the gradients are on cpu" in res[1][0], res
    assert "refused on every worker" in res[0][0], res
    assert max(res[r][1] for r in (0, 1)) < 10, res   # not the group's 20 s timeout


def _worker(rank, world, port, q):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    gen = torch.Generator().manual_seed(rank)
    ar = marsit.MarsitAllReduce(generator=gen)
    g = torch.Generator().manual_seed(100 + rank)
    grad = torch.randn(5003, generator=g) + 0.3 * rank
    first = ar(grad)
    second = ar(grad)
    residual, nbytes = ar.residual, ar.bytes_sent
    try:
        ar(torch.full_like(grad, float("nan")))
        nan_error = ""
    except ValueError as e:
        nan_error = str(e)
    # numpy copies: a tensor put on the queue shares memory with a process that exits
    q.put((rank, *(t.numpy().copy() for t in (grad, first, second, residual)),
           nbytes, nan_error))
    dist.destroy_process_group()


def test_ring_allreduce_in_gloo_agrees_on_every_rank():
    world = 3
    q = procs.queue()
    port = free_port_block(1, tcp=True)
    workers = [procs.start(_worker, r, world, port, q) for r in range(world)]
    out = sorted((q.get(timeout=120) for _ in workers), key=lambda t: t[0])
    out = [(o[0], *(torch.from_numpy(a) for a in o[1:5]), *o[5:]) for o in out]
    for pr in workers:
        pr.join(timeout=30)
        assert pr.exitcode == 0
    grads = [o[1] for o in out]
    firsts = [o[2] for o in out]
    for f in firsts[1:]:
        assert torch.equal(f, firsts[0])              # one shared estimate
    scale = sum(float(g.abs().mean()) for g in grads) / world
    assert torch.allclose(firsts[0].abs(), torch.full_like(firsts[0], scale), rtol=1e-5)
    bits = firsts[0] > 0
    assert all(bool(((g >= 0) == bits).float().mean() > 0.3) for g in grads)
    agree = sum(((g >= 0) == bits).float() for g in grads)
    assert bool((agree >= 1).all())                   # each bit is some worker's sign
    for rank, grad, first, second, residual, nbytes, err in out:
        assert torch.allclose(residual, grad + (grad - first) - second, atol=1e-5)
        d = grad.numel()
        # two calls: ring hops of sign bits, the float64 scale's all-reduce and the
        # agreement's nine float32 lanes (both counted as a ring all-reduce sends them)
        ring = 2 * (world - 1) * math.ceil(d / (8 * world))
        assert nbytes == 2 * ring + 2 * (2 * 2 * 8 // 3) + 2 * (2 * 2 * 9 * 4 // 3)
        assert "NaN or Inf" in err


def test_counts_become_the_mean_or_the_majority_sign():
    counts = torch.tensor([0, 1, 2, 3, 4])
    assert marsit.counts_to_mean_sign(counts, 4).tolist() == [-1.0, -0.5, 0.0, 0.5, 1.0]
    assert marsit.counts_to_mean_sign(counts, 4, majority=True).tolist() == [-1, -1, 0, 1, 1]
    with pytest.raises(ValueError, match="more \\+1 votes than workers counted \\(5 among 4"):
        marsit.counts_to_mean_sign(torch.tensor([5]), 4)
    # counts and voters no vote of four can make: once a mean sign of -2.5 or 1.25
    with pytest.raises(ValueError, match="-3 \\+1 votes"):
        marsit.counts_to_mean_sign(torch.tensor([-3]), 4)
    with pytest.raises(ValueError, match="5 voters among 4 workers"):
        marsit.counts_to_mean_sign(torch.tensor([5]), 4, voters=torch.tensor([5]))
    # one of four counted (a chunk closed short): the missing workers' votes count 0
    voters = torch.tensor([1, 1, 4])
    assert marsit.counts_to_mean_sign(torch.tensor([1, 0, 4]), 4, voters=voters).tolist() \
        == [0.25, -0.25, 1.0]
    assert marsit.counts_to_mean_sign(torch.tensor([1, 0, 2]), 4, majority=True,
                                      voters=voters).tolist() == [1, -1, 0]


def test_a_vote_chunk_closed_short_counts_only_its_voters():
    """A vote job with a loss bound: in the run's second round worker 1's chunk 0 never
    comes and worker 0 closes it short (not in the first: a worker closes a chunk short only
    at an aggregator it heard in an earlier round). Its one +1 vote was decoded as if the
    missing worker had voted -1 (mean 0)."""
    import socket

    from thc.net.aggregator import Aggregator
    from thc.net.client import AggregationClient
    from thc.wire import protocol as P
    from thc.wire.jobs import Job, Worker
    base = free_port_block(2)
    job = Job.vote(5, [Worker(i, "127.0.0.1", base + i) for i in range(2)], lanes=256,
                   loss_bound=0.5).validate()

    def vote(sock, addr, seq: int, offset: int) -> None:   # worker 1's +1 on 256 lanes
        slot, version = P.slot_of(seq, job.pool_size)
        sock.sendto(P.HEADER_STRUCT.pack(P.PktType.DATA, 1, 5, slot, version, 0, seq, offset,
                                         job.config_tag, 9, 77) + b"\xff" * 32, addr)

    with Aggregator([job]) as agg, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as w1:
        addr = agg.start()
        w1.bind(("127.0.0.1", base + 1))
        vote(w1, addr, 0, 0)
        vote(w1, addr, 1, 256)      # round 1: both chunks
        vote(w1, addr, 3, 256)      # round 2: chunk 1 only
        with AggregationClient(job, 0, addr, run=9, deadline=5.0) as client:
            ar = object.__new__(marsit.MarsitVoteAllReduce)   # mean_sign needs the client only
            ar.client, ar.majority, ar.bytes_sent = client, False, 0
            first = ar.mean_sign(torch.ones(512, dtype=torch.bool))
            assert client.stats.short == 0
            est = ar.mean_sign(torch.ones(512, dtype=torch.bool))
            assert client.stats.short == 1
    assert set(first.tolist()) == {1.0}
    assert set(est[:256].tolist()) == {0.5} and set(est[256:].tolist()) == {1.0}


def _vote_worker(rank, world, port, job_dict, agg, q):
    from thc.net.client import AggregationClient
    from thc.wire.jobs import Job
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    job = Job.from_dict(job_dict)
    with AggregationClient(job, rank, agg, run=7, deadline=20.0) as client:
        ar = marsit.MarsitVoteAllReduce(client)
        grad = torch.randn(1003, generator=torch.Generator().manual_seed(100 + rank)) + 0.2 * rank
        est = ar(grad, sizes=[1000, 3])
        q.put((rank, grad.numpy().copy(), est.numpy().copy(), ar.residual.numpy().copy()))
    dist.destroy_process_group()


def _through_a_vote_job(target, world: int):
    """``target(rank, world, port, job_dict, aggregator, q)`` in ``world`` spawned ranks of
    one Gloo group, every rank a worker of one vote job on a software aggregator; returns
    ({rank: what it put after its rank}, the aggregator's counters, exit codes)."""
    from thc.net.aggregator import Aggregator
    from thc.testing.clusters import local_job
    from thc.wire.jobs import Job
    base = free_port_block(world + 1, tcp=True)
    job = Job.vote(1, local_job(1, world, base, lanes=64).workers, lanes=64,
                   pool_size=8).validate()
    assert job.sum_bits == 8 and job.aggregation == "vote"
    q = procs.queue()
    with Aggregator([job]) as agg:
        addr = agg.start("127.0.0.1", 0)
        workers = [procs.start(target, r, world, base + world, job.to_dict(), addr, q)
                   for r in range(world)]
        got = [q.get(timeout=120) for _ in workers]
        for pr in workers:
            pr.join(timeout=30)
        counters = agg.counters()
    return {t[0]: t[1] if len(t) == 2 else t[1:] for t in got}, counters, \
        [pr.exitcode for pr in workers]


def test_vote_allreduce_through_the_software_aggregator_is_the_exact_mean_sign():
    """Real UDP through a vote job: every rank gets scale x (2c - n) / n, c the +1 count."""
    world = 3
    results, counters, exits = _through_a_vote_job(_vote_worker, world)
    assert exits == [0] * world
    assert counters["drops"] == {k: 0 for k in counters["drops"]}
    out = [(rank, *results[rank]) for rank in sorted(results)]
    grads = [torch.from_numpy(o[1]) for o in out]
    ests = [torch.from_numpy(o[2]) for o in out]
    for e in ests[1:]:
        assert torch.equal(e, ests[0])
    mean_sign = sum((g >= 0).float() * 2 - 1 for g in grads) / world
    for seg in (slice(0, 1000), slice(1000, 1003)):
        scale = sum(float(g[seg].abs().mean()) for g in grads) / world
        assert torch.allclose(ests[0][seg], scale * mean_sign[seg], rtol=1e-5, atol=1e-7)
    for (_, g, e, r) in out:
        assert torch.allclose(torch.from_numpy(r), torch.from_numpy(g) - torch.from_numpy(e))


def _bad_worker(rank, port, q):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    ar = marsit.MarsitAllReduce(generator=torch.Generator().manual_seed(rank))
    x = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    nan = x.clone()
    if rank == 1:
        nan[5] = float("nan")
    out = []
    for grad in (nan, x.clamp(-1, 1) * 3e38, x.clamp(-1, 1) * 3e38, x):
        try:
            est = ar(grad)
            out.append(bool(torch.isfinite(est).all()))
        except ValueError as e:
            out.append(str(e))
    q.put((rank, out))
    dist.destroy_process_group()


def test_a_nan_or_an_overflow_is_refused_by_every_worker():
    """A NaN on one worker must not raise there alone (its peer would wait in the scales'
    all-reduce); values near float32's top would overflow the scales on every worker and
    make the estimate NaN, with no error. With compensation they are refused by name (the
    next test: their residual would overflow)."""
    res = gloo_pair(_bad_worker)
    assert res[1][0].startswith("Marsit: the gradient (with its compensation) holds NaN or Inf")
    assert "nonfinite='propagate'" in res[1][0]
    assert "a worker's gradient" in res[0][0] and "refused" in res[0][0]
    for rank in (0, 1):
        huge, again, good = res[rank][1:]
        for refused in (huge, again):
            assert "magnitude of 3e+38, over 1.7e+38" in refused, refused
        assert good is True


def _opposite_worker(rank, port, q):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    out = {}
    for mode in ("raise", "propagate"):
        ar = marsit.MarsitAllReduce(generator=torch.Generator().manual_seed(rank),
                                    nonfinite=mode)
        steps = []
        for top in (3e38, 1.0, 1.6e38, 1.0):
            try:
                est = ar(torch.full((64,), top if rank == 0 else -top))
                steps.append((bool(torch.isfinite(est).all()), ar.residual is None
                              or bool(torch.isfinite(ar.residual).all())))
            except ValueError as e:
                steps.append(str(e))
        out[mode] = steps
    q.put((rank, out))
    dist.destroy_process_group()


def test_a_gradient_whose_residual_would_overflow_is_refused_and_later_rounds_go_on():
    """3e38 on one worker and -3e38 on the other: the estimate comes back finite, and the
    residual x - estimate would be Inf, every later round refused ("raise") or NaN on every
    worker for good ("propagate": a scaler then skips every step). Such a round is refused,
    or NaN, on both; just under the limit (1.6e38 against -1.6e38) the residual stays
    finite, and clamped it lets the next round of ones through."""
    res = gloo_pair(_opposite_worker)
    for rank in (0, 1):
        raised, propagated = res[rank]["raise"], res[rank]["propagate"]
        assert "over 1.7e+38" in raised[0] and "compensation residual" in raised[0], raised
        assert propagated[0] == (False, True), propagated      # NaN, the residual kept
        for steps in (raised, propagated):
            assert steps[1:] == [(True, True)] * 3, steps


def _half_worker(rank, port, q):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    ar = marsit.MarsitAllReduce(generator=torch.Generator().manual_seed(1))
    grad = torch.full((4,), 60000.0 if rank == 0 else -60000.0, dtype=torch.float16)
    outs = [ar(grad) for _ in range(4)]
    # compensation is of what was applied: the gradients' sum is the estimates' plus the
    # residual, whatever the hold to float16's range cut off
    gap = float((4 * grad.double() - sum(o.double() for o in outs)
                 - ar.residual.double()).abs().max())
    q.put((rank, ([(o.dtype, bool(torch.isfinite(o).all())) for o in outs], gap)))
    dist.destroy_process_group()


def test_a_float16_estimate_past_65504_comes_back_finite():
    """60000 on one worker and -60000 on the other, in float16: the compensated values grow
    past float16's largest, and so do the estimates; cast bare, they came back Inf from
    finite gradients. Held to float16's range, every round's is finite, and the residual
    keeps what the hold cut off."""
    res = gloo_pair(_half_worker)
    for rank in (0, 1):
        finite, gap = res[rank]
        assert finite == [(torch.float16, True)] * 4 and gap < 1e-6, res[rank]


def _unlike_worker(rank, port, q):
    from datetime import timedelta
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=20))
    ar = marsit.MarsitAllReduce(generator=torch.Generator().manual_seed(rank))
    x = torch.cat([torch.full((50,), 100.0), torch.full((50,), 1.0)])
    calls = [(torch.ones(100 + 8 * rank), None),                     # lengths differ
             (x, [50, 50] if rank == 0 else [90, 10]),               # segments differ
             (torch.full((64,), 2.0), None),                         # alike: residuals of 64
             (torch.full((72 if rank == 0 else 64,), 2.0), None),    # worker 0's residual
             (torch.full((64,), 3.0), None),                         # alike
             (torch.full((64,), 2.0), 64 if rank == 0 else None),    # worker 0: not a list
             (torch.ones(64, dtype=torch.complex64 if rank else torch.float32), None),
             (torch.ones(64).to_sparse() if rank else torch.ones(64), None),
             (torch.full((64,), 2.0), [31.5, 32.5] if rank == 0 else None),
             (torch.full((64,), 2.0).numpy() if rank else torch.full((64,), 2.0), None),
             (np.broadcast_to(np.float32(0), (1 << 20, 1 << 20)) if rank
              else torch.full((64,), 2.0), None),                    # 2^40 elements
             (torch.full((64,), 1.001, dtype=torch.bfloat16 if rank else torch.float32),
              None),                                                 # cast apart
             (torch.full((64,), 3.0), None)]                         # alike
    out = []
    for t, sizes in calls:
        try:
            out.append(ar(t, sizes).tolist())
        except (ValueError, RuntimeError, TypeError) as e:
            out.append(str(e))
    q.put((rank, out))
    dist.destroy_process_group()


def test_unlike_or_failed_calls_are_refused_by_every_worker():
    """Tensors or segments of other lengths were summed without a word (a coordinate came
    out 1.0 on one worker and 78.0 on the other), and a worker refused by its residual check
    raised before the scales' all-reduce: its peer paired that with its next call."""
    res = gloo_pair(_unlike_worker)
    for rank in (0, 1):
        out = res[rank]
        assert all("differ in the scheme's settings" in r for r in out[:2]), out
        assert isinstance(out[2], list) and isinstance(out[3], str), out
        assert isinstance(out[4], list), out
    assert "use one instance per tensor" in res[0][3] and "refused" in res[1][3]
    assert res[0][4] == res[1][4]
    # A call refused before the agreement (sizes not a list; a complex tensor, whose
    # imaginary part would be dropped; a sparse one) still takes its round: else the
    # refusing worker's next call would be paired with its peer's current one.
    assert "not iterable" in res[0][5] and "refused" in res[1][5]
    assert "floating-point tensors, got torch.complex64" in res[1][6] and "refused" in res[0][6]
    assert "sparse" in res[1][7].lower() and "refused" in res[0][7]
    # fractional segment lengths, not truncated to ones that happen to split the tensor
    assert "cannot be interpreted as an integer" in res[0][8] and "refused" in res[1][8]
    # a numpy array raised before its round, and its peer waited to the group's timeout
    assert "takes a torch.Tensor, got ndarray" in res[1][9] and "refused" in res[0][9]
    # zeros of 2^40 elements cannot be had: it stands in as empty (once a failed stand-in
    # left that worker a round behind, and every later sum was a step off)
    assert "takes a torch.Tensor, got ndarray" in res[1][10] and "refused" in res[0][10]
    # a bfloat16 rank rounded the estimate the float32 rank returned
    assert all("differ in the scheme's settings" in r[11] for r in res.values())
    assert isinstance(res[0][12], list) and res[0][12] == res[1][12]


def _zeros_worker(rank, port, q):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    ar = marsit.MarsitAllReduce(generator=torch.Generator().manual_seed(rank),
                                compensation=False)
    x = torch.cat([torch.zeros(400), torch.full((4,), 4.0)])
    out = [ar(x)[:400].tolist()]
    for t, sizes in ((x, [0, 400, 4]), (torch.zeros(0), None)):
        try:
            out.append(ar(t, sizes).tolist())
        except ValueError as e:
            out.append(str(e))
    q.put((rank, out))
    dist.destroy_process_group()


def _fails_then_refuses(monkeypatch, ar, method: str, error: Exception, rnd: int) -> None:
    """``ar``'s ``method`` raises ``error`` once: round ``rnd`` raises it, then the next round
    and the group are refused, naming it."""
    from thc.collective.transports import DistTransport
    with monkeypatch.context() as m:
        m.setattr(ar, method, lambda *a: (_ for _ in ()).throw(error))
        with pytest.raises(type(error), match=re.escape(str(error))):
            ar(torch.ones(64))
    named = re.escape(f"Marsit round {rnd} failed after its agreement "
                      f"({type(error).__name__}: {error})")
    with pytest.raises(RuntimeError, match=named):
        ar(torch.ones(64))
    with pytest.raises(RuntimeError, match=named):
        DistTransport.check_group(None)


def test_a_round_that_fails_after_its_agreement_abandons_the_group(monkeypatch):
    """A worker's own failure once its scales' all-reduce may have left (here in its signs'
    exchange): its peers wait in a collective or go on to their next, which would pair with
    its next; so the group is abandoned, and its next round refuses, naming the failure. A
    NaN's refusal, which every worker reaches alike, abandons nothing."""
    from thc.testing.clusters import free_tcp_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        ar = marsit.MarsitAllReduce(generator=torch.Generator().manual_seed(0))
        bad = torch.ones(64)
        bad[3] = float("nan")
        with pytest.raises(ValueError, match="NaN or Inf"):
            ar(bad)
        assert torch.isfinite(ar(torch.ones(64))).all()
        _fails_then_refuses(monkeypatch, ar, "mean_sign", MemoryError("oom"), 2)
    finally:
        dist.destroy_process_group()


def test_a_value_error_of_its_own_after_the_scales_abandons_the_group(monkeypatch, alone):
    """A ValueError once the scales are summed was taken for a refusal every worker reaches:
    raised by this worker alone (in its signs), its peers waited in the ring while its next
    round's agreement paired with their exchange, and both hung until Gloo's timeout. Only
    the scales' NaN is such a refusal."""
    ar = marsit.MarsitAllReduce(generator=torch.Generator().manual_seed(0))
    _fails_then_refuses(monkeypatch, ar, "_signs", ValueError("a bad sign"), 0)


class _VoteClient:
    """A vote job's client of one worker whose aggregator returns ``sums`` for each lane,
    or raises ``failure``."""
    job = types.SimpleNamespace(aggregation="vote", n_workers=1, lanes=64, job_id=1)
    stats = types.SimpleNamespace(bytes_sent=0)
    sums, failure = 1, None
    failed = None

    def fail_run(self, why):
        self.failed = why

    def reduce(self, packed):
        if self.failure is not None:
            raise self.failure
        n = len(packed) * 8
        return types.SimpleNamespace(sums=np.full(n, self.sums, dtype=np.int64),
                                     counts=np.ones(n // 64, dtype=np.int64))


def test_a_vote_refused_alike_or_its_aggregator_failing_abandons_nothing():
    """Counts out of range (the same on every worker) are a refusal every worker reaches,
    and the signs of a vote travel through the aggregator, not the group: neither leaves
    the group abandoned, and the next round runs."""
    from thc.collective.transports import DistTransport
    from thc.testing.clusters import free_tcp_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        client = _VoteClient()
        ar = marsit.MarsitVoteAllReduce(client)
        assert ar(torch.ones(64)).tolist() == [1.0] * 64
        client.sums = 2                                       # two +1 votes of one worker
        with pytest.raises(ValueError, match="more \\+1 votes than workers"):
            ar(torch.ones(64))
        client.sums, client.failure = 1, TimeoutError("the aggregator did not answer")
        with pytest.raises(TimeoutError):
            ar(torch.ones(64))
        assert "TimeoutError: the aggregator did not answer" in client.failed
        client.failure = None
        DistTransport.check_group(None)
        assert ar(torch.ones(64)).tolist() == [1.0] * 64
    finally:
        dist.destroy_process_group()


def _leaves_a_vote_worker(rank, world, port, job_dict, agg, q,
                          error=MemoryError("out of memory")):
    """Round 0: rank 0 votes +1 and fails before its signs leave (``error``), rank 1 votes
    -1. Round 1: both vote +1."""
    from thc.net.client import AggregationClient
    from thc.wire.jobs import Job
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    out = []
    with AggregationClient(Job.from_dict(job_dict), rank, agg, run=7, deadline=2.0) as client:
        ar = marsit.MarsitVoteAllReduce(client, compensation=False)
        if rank == 0:
            def fail_once(flat):
                del ar._signs   # the next round's are the class's
                raise error
            ar._signs = fail_once
        for vote in (1.0 if rank == 0 else -1.0, 1.0):
            try:
                out.append(ar(torch.full((64,), vote)).tolist())
            except Exception as e:  # noqa: BLE001 - the test reads what each round raised
                out.append(f"{type(e).__name__}: {e}")
    q.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.parametrize("error", [MemoryError("out of memory"), ValueError("a bad sign")])
def test_a_vote_worker_that_failed_after_its_scales_takes_no_later_round(error):
    """Its peer's signs of the round it left stay in the aggregator's slots, and its next
    round takes their sequence numbers, with the same offsets: its +1 votes were added to
    the peer's -1 and it returned 0.0 for a mean sign of +1, without an error (still so for
    a ValueError of its own, taken for a refusal every worker reaches). Its client's run is
    now failed: no later round of it is sent, and both workers raise."""
    results, counters, exits = _through_a_vote_job(
        functools.partial(_leaves_a_vote_worker, error=error), 2)
    assert exits == [0, 0]
    assert results[0][0] == f"{type(error).__name__}: {error}"
    assert results[0][1].startswith("RunFailed") and "Marsit round 0 failed" in results[0][1]
    assert results[1][0].startswith("AggregationTimeout") and "missing worker(s) [0]" in \
        results[1][0]
    assert results[1][1].startswith("RunFailed")
    assert counters["jobs"][1]["completions"] == 0


@pytest.mark.parametrize("nonfinite", ["raise", "propagate"])
def test_a_float64_input_beyond_float32s_range_is_refused_as_such(nonfinite):
    """Cast to float32 it became Inf: refused as "NaN or Inf", and under "propagate" every
    rank got NaN for a finite gradient (a scaler then skipped the step as an overflow)."""
    from thc.testing.clusters import free_tcp_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        ar = marsit.MarsitAllReduce(generator=torch.Generator().manual_seed(0),
                                    nonfinite=nonfinite)
        x = torch.ones(64, dtype=torch.float64)
        x[5] = 1e300
        with pytest.raises(ValueError, match="beyond float32's range"):
            ar(x)
        assert torch.isfinite(ar(torch.ones(64, dtype=torch.float64))).all()
    finally:
        dist.destroy_process_group()


def test_a_vote_fails_its_run_only_where_its_signs_did_not_come_back(monkeypatch):
    """Failed before its signs left, a vote's client takes no more rounds (its peers' signs
    hold the slots its next would take); failed after they came back, its sequence numbers
    are in step and its run goes on."""
    from thc.testing.clusters import free_tcp_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        client = _VoteClient()
        ar = marsit.MarsitVoteAllReduce(client)
        with monkeypatch.context() as m:
            m.setattr(marsit, "counts_to_mean_sign",
                      lambda *a: (_ for _ in ()).throw(MemoryError("after")))
            with pytest.raises(MemoryError):
                ar(torch.ones(64))
        assert client.failed is None
        with monkeypatch.context() as m:
            m.setattr(ar, "_signs", lambda *a: (_ for _ in ()).throw(MemoryError("before")))
            with pytest.raises(MemoryError):
                ar(torch.ones(64))
        assert "MemoryError: before" in client.failed
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["ring", "vote"])
def test_a_round_that_fails_before_its_scales_are_summed_abandons_the_group(monkeypatch, kind):
    """A worker's own failure between its agreement and the scales' all-reduce (out of memory,
    say): its peers wait in that all-reduce, which would pair with its next collective. A
    vote's did not abandon the group (its signs travel through the aggregator), nor did a
    ValueError there; both do now."""
    from thc.testing.clusters import free_tcp_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        ar = marsit.MarsitVoteAllReduce(_VoteClient()) if kind == "vote" else \
            marsit.MarsitAllReduce(generator=torch.Generator().manual_seed(0))
        assert torch.isfinite(ar(torch.ones(64))).all()
        _fails_then_refuses(monkeypatch, ar, "_scales", ValueError("no memory"), 1)
    finally:
        dist.destroy_process_group()


def test_an_exact_zero_is_a_fair_coin_and_empty_segments_are_taken():
    """A zero was sent as +1 (every dead coordinate drifted up by the scale, without
    compensation), and a zero-element parameter made every step fail with "segments [0, 12,
    3] do not split 15 elements"."""
    res = gloo_pair(_zeros_worker)
    for rank in (0, 1):
        zeros, segmented, empty = res[rank]
        up = sum(v > 0 for v in zeros) / len(zeros)
        assert 0.3 < up < 0.7 and all(v != 0 for v in zeros), up
        assert isinstance(segmented, list) and len(segmented) == 404, segmented
        assert empty == []
    assert res[0] == res[1]


def _vote_rules_worker(rank, world, port, job_dict, agg, q):
    from thc.net.client import AggregationClient
    from thc.wire.jobs import Job
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    with AggregationClient(Job.from_dict(job_dict), rank, agg, run=7, deadline=20.0) as c:
        ar = marsit.MarsitVoteAllReduce(c, majority=rank == 0)
        try:
            q.put((rank, ar(torch.ones(64) * (1 if rank == 0 else -1)).tolist()))
        except (ValueError, RuntimeError) as e:
            q.put((rank, str(e)))
    dist.destroy_process_group()


def test_ranks_with_unlike_vote_rules_refuse_the_round_together():
    """A rank taking the majority's sign beside ranks taking the mean sign returned another
    estimate than its peers (1.0 against 0.33), and nothing was raised."""
    world = 2
    out, _, _ = _through_a_vote_job(_vote_rules_worker, world)
    for rank in range(world):
        assert isinstance(out[rank], str) and "differ in the scheme's settings" in out[rank]


def _majority_hook_worker(rank, world, port, job_dict, agg, q):
    from thc.collective.ddp import MarsitVoteHook
    from thc.net.client import AggregationClient
    from thc.wire.jobs import Job
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    with AggregationClient(Job.from_dict(job_dict), rank, agg, run=7, deadline=20.0) as c:
        hook = MarsitVoteHook(torch.nn.Linear(4, 4), c, overlap=False, majority=True)
        grad = torch.randn(1003, generator=torch.Generator().manual_seed(100 + rank)) + 0.2 * rank
        est = hook.reduce("bucket", grad, [1000, 3])
        q.put((rank, grad.numpy().copy(), est.numpy().copy()))
    dist.destroy_process_group()


def test_a_vote_hook_asked_for_the_majority_gives_the_majoritys_sign():
    """MarsitVoteHook(majority=True) built its reducers with the mean sign: a coordinate two
    of three ranks held positive came back as a third of the scale, not the scale."""
    world = 3
    results, _, exits = _through_a_vote_job(_majority_hook_worker, world)
    assert exits == [0] * world
    grads = [torch.from_numpy(results[r][0]) for r in range(world)]
    ests = [torch.from_numpy(results[r][1]) for r in range(world)]
    for e in ests[1:]:
        assert torch.equal(e, ests[0])
    majority = torch.sign(sum((g >= 0).float() * 2 - 1 for g in grads))
    for seg in (slice(0, 1000), slice(1000, 1003)):
        scale = sum(float(g[seg].abs().mean()) for g in grads) / world
        assert torch.allclose(ests[0][seg], scale * majority[seg], rtol=1e-5, atol=1e-7)


def test_a_refused_input_too_large_to_stand_in_for_takes_its_round(monkeypatch):
    """A refused input still sends its round, marked, from zeros of its size; where they could
    not be made (out of memory, as the input's own conversion was) the error escaped before
    the round number moved and before any collective: its peers waited in the agreement, and
    its next call paired with it, a sum of two rounds. It stands in as empty instead."""
    from thc.testing.clusters import free_tcp_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        ar = marsit.MarsitAllReduce(None, torch.Generator().manual_seed(0))
        with monkeypatch.context() as m:
            m.setattr(marsit, "as_float32",
                      lambda t: (_ for _ in ()).throw(MemoryError("out of memory")))
            m.setattr(marsit, "torch", NoMemory("zeros", sized=True))
            with pytest.raises(MemoryError, match="^out of memory$"):   # its own error
                ar(torch.ones(64, dtype=torch.float64))
        assert ar.round == 1
        assert torch.allclose(ar(torch.ones(64)), torch.ones(64))
    finally:
        dist.destroy_process_group()


def _grad_worker(rank, port, q):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    ar = marsit.MarsitAllReduce(generator=torch.Generator().manual_seed(rank))
    w = torch.randn(64, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    ests = [ar(w * 2) for _ in range(3)]
    q.put((rank, ([e.requires_grad for e in ests], ar.residual.grad_fn is None)))
    dist.destroy_process_group()


def test_a_gradient_with_autograd_history_leaves_none_in_the_estimate_or_residual():
    """A tensor that requires grad (a gradient made under autograd) was taken as it was: the
    estimate carried a graph through the collectives, and the residual chained each round's
    graph to the next, held for good."""
    res = gloo_pair(_grad_worker)
    for rank in (0, 1):
        assert res[rank] == ([False] * 3, True), res


def _outsider_worker(rank, port, q):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=3)
    group = dist.new_group([0, 2])
    try:
        out = float(marsit.MarsitAllReduce(group=group)(torch.ones(16)).mean())
    except ValueError as e:
        out = str(e)
    q.put((rank, out))
    dist.destroy_process_group()


def test_a_reducer_built_outside_its_group_is_refused_naming_that():
    """A process outside the group took torch's rank -1 there and failed with a TypeError
    about weak references."""
    res = gloo_pair(_outsider_worker, world=3)
    assert res[0] == res[2] == pytest.approx(1.0), res
    assert "not a member of the process group" in res[1], res


def test_a_vote_job_of_another_size_than_the_group_is_refused_when_built():
    """A 2-worker vote job in a 1-rank group was taken, and its first round waited to the
    deadline for worker 1."""
    from thc.testing.clusters import free_tcp_port
    client = _VoteClient()
    client.job = types.SimpleNamespace(**{**vars(_VoteClient.job), "n_workers": 2})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="vote job of 2 workers, process group of 1"):
            marsit.MarsitVoteAllReduce(client)
    finally:
        dist.destroy_process_group()


def test_only_a_compensated_reducer_refuses_magnitudes_past_half_of_float32():
    """The limit keeps the compensation residual finite; without one a magnitude of 2e38 is
    a sign like any other."""
    from thc.testing.clusters import free_tcp_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_tcp_port()}",
                            rank=0, world_size=1)
    try:
        big = torch.full((64,), 2e38)
        out = marsit.MarsitVoteAllReduce(_VoteClient(), compensation=False)(big)
        assert torch.isfinite(out).all() and bool((out > 0).all())
        with pytest.raises(ValueError, match="half of float32's largest"):
            marsit.MarsitVoteAllReduce(_VoteClient())(big)
    finally:
        dist.destroy_process_group()


def _nonfinite_rules_worker(rank, port, q):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    ar = marsit.MarsitAllReduce(generator=torch.Generator().manual_seed(rank),
                                nonfinite="raise" if rank == 0 else "propagate")
    out = []
    for grad in (torch.ones(64), torch.full((64,), float("nan"))):
        try:
            out.append(ar(grad).tolist())
        except (ValueError, RuntimeError) as e:
            out.append(str(e))
    q.put((rank, out))
    dist.destroy_process_group()


def test_ranks_with_unlike_nonfinite_rules_refuse_every_round_together():
    """One rank raising on a NaN round and the other returning NaN would part ways (the one
    skips its step, the other's scaler skips it): built alike or refused from the first round."""
    res = gloo_pair(_nonfinite_rules_worker)
    for rank in (0, 1):
        assert all(isinstance(r, str) and "differ in the scheme's settings" in r
                   for r in res[rank]), res[rank]


def test_a_refused_round_forgets_the_compensation(alone):
    """The refusal's promise (``nonfinite="raise"``): the next round starts without the
    residual, which a residual at the clamp would otherwise push past the limit in every
    later round."""
    xs = [torch.randn(256, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    ar = marsit.MarsitAllReduce(generator=torch.Generator().manual_seed(0))
    ar(xs[0])
    assert ar.kept_residual is not None
    with pytest.raises(ValueError, match="holds NaN or Inf"):
        ar(torch.full((256,), float("nan")))
    assert ar.kept_residual is None
    fresh = marsit.MarsitAllReduce(generator=torch.Generator().manual_seed(0))
    assert torch.equal(ar(xs[1]), fresh(xs[1]))


def test_negative_segments_are_refused_before_the_round(alone):
    """[-1, 65] adds up to 64: let through, torch's split raised after the agreement, and the
    group was abandoned for a caller's mistake."""
    ar = marsit.MarsitAllReduce(generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"segments \[-1, 65\] do not split 64"):
        ar(torch.ones(64), [-1, 65])
    assert torch.isfinite(ar(torch.ones(64), [32, 32])).all()
