"""Workers, jobs and inputs that the all-reduce tests (tests/test_allreduce*.py) share."""
from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from thc.codec.params import THCParams
from thc.collective.allreduce import THCAllReduce
from thc.net.aggregator import Aggregator
from thc.net.client import AggregationClient
from thc.testing.clusters import free_port_block, local_job


PARAMS = THCParams(seed=7)


def _vectors(n, numel, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(n)]


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


def assert_each_round_its_own(res: dict) -> None:
    """Every round of :func:`_threads_on_one_group_worker` ended: close to its own mean, or
    refused as unlike where the ranks' threads took the group in unlike orders (never
    another reducer's sums, never without an outcome)."""
    for rank in (0, 1):
        assert set(res[rank]) == {"A", "B"}, res
        for n, got in res[rank].items():
            assert isinstance(got, str) and "differ" in got or got < 0.3, (rank, n, got)
