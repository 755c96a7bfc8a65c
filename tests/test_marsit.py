"""Marsit: the merged bit is unbiased for the mean sign; the ring all-reduce in real Gloo groups."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from host.collective import marsit
from host.testing.clusters import free_port_block

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
    assert float((est - mean_sign).abs().mean()) < 3 * math.sqrt(1 / trials)
    with pytest.raises(ValueError, match="at least one"):
        marsit.merge(signs[0], signs[1], 0)


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
    try:
        ar(torch.full((3,), float("nan")))
        nan_error = ""
    except ValueError as e:
        nan_error = str(e)
    # numpy copies: a tensor put on the queue shares memory with a process that exits
    q.put((rank, *(t.numpy().copy() for t in (grad, first, second, ar.residual)),
           ar.bytes_sent, nan_error))
    dist.destroy_process_group()


def test_ring_allreduce_in_gloo_agrees_on_every_rank():
    world = 3
    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    port = free_port_block(1, tcp=True)
    procs = [ctx.Process(target=_worker, args=(r, world, port, q)) for r in range(world)]
    for pr in procs:
        pr.start()
    out = sorted((q.get(timeout=120) for _ in procs), key=lambda t: t[0])
    out = [(o[0], *(torch.from_numpy(a) for a in o[1:5]), *o[5:]) for o in out]
    for pr in procs:
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
        assert nbytes == 2 * 2 * (world - 1) * math.ceil(d / (8 * world)) + 2 * (2 * 2 * 4 // 3)
        assert "NaN or Inf" in err
