"""One packet trace (loss, duplicates, reordering, stale and foreign packets) through the
software aggregator and through BMv2: every worker must receive identical datagrams."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from thc.codec.packing import pack_bits
from thc.wire import protocol as P
from tests.bmv2.packets import datagram, exchange, random_indices

pytestmark = pytest.mark.bmv2
_ids = itertools.count(700)


def make_trace(job, rng, chunks=24, window=6):
    """(worker, datagram) in send order: workers keep ``window`` chunks in flight, packets
    are lost (resent later), duplicated and reordered; a few MAX rounds and bad packets."""
    trace = []
    for seq in range(chunks):
        for w in range(job.n_workers):
            idx = random_indices(rng, job)
            d = datagram(job, w, seq, pack_bits(idx, P.INDEX_BITS).tobytes())
            trace.append((seq + rng.uniform(0, window), w, d))
            if rng.random() < 0.15:            # duplicate, later
                trace.append((seq + rng.uniform(0, 2 * window), w, d))
            if rng.random() < 0.05:            # stale: a chunk two pool cycles old
                old = seq - 2 * job.pool_size
                if old >= 0:
                    trace.append((seq + rng.uniform(0, window), w, datagram(
                        job, w, old, pack_bits(idx, P.INDEX_BITS).tobytes())))
    for seq in range(chunks, chunks + 3):
        for w in range(job.n_workers):
            vals = rng.integers(0, 1 << 31, P.MAX_LANES, dtype=np.uint32).astype(">u4")
            trace.append((seq + rng.uniform(0, 2), w,
                          datagram(job, w, seq, vals.tobytes(), pkt_type=P.PktType.MAX)))
    # wrong length, wrong worker id, unknown type
    trace.append((3.5, 0, datagram(job, 0, 3, bytes(job.lanes // 2 - 1))))
    trace.append((5.5, 1, datagram(job, job.n_workers, 5, bytes(job.lanes // 2))))
    trace.append((7.5, 2, b"\x7f" + datagram(job, 2, 7, bytes(job.lanes // 2))[1:]))
    trace.sort(key=lambda t: t[0])
    return [(w, d) for _, w, d in trace]


EPOCH = slice(P.HEADER_BYTES - 4, P.HEADER_BYTES)
"""The epoch field: each aggregator draws its own, so traces compare without it."""


def without_epoch(d: bytes) -> bytes:
    return d[:EPOCH.start] + bytes(4) + d[EPOCH.stop:]


@pytest.mark.parametrize("n_workers", [3, 9], ids=["8-bit sums", "16-bit sums"])
def test_same_trace_same_results_as_the_software_aggregator(bmv2, n_workers):
    from thc.net.aggregator import Aggregator
    rng = np.random.default_rng(30)
    # all workers on one switch port: BMv2 then sees the packets in send order
    job = bmv2.make_job(next(_ids), n_workers, pool_size=8, ports=[0] * n_workers)
    assert job.sum_bits == (8 if n_workers == 3 else 16)
    bmv2.install(job)
    trace = make_trace(job, rng)

    agg = Aggregator([job])
    soft = {w.id: [] for w in job.workers}
    addr_to_worker = {(w.ip, w.port): w.id for w in job.workers}
    replies_to = []     # the workers each datagram of the trace is answered at, in order
    for w, d in trace:
        src = (job.worker(w).ip, job.worker(w).port)
        replies_to.append([])
        for out, dst in agg.handle(d, src):
            soft[addr_to_worker[dst]].append(bytes(out))
            replies_to[-1].append(addr_to_worker[dst])

    before = bmv2.drops()
    eps = {w.id: bmv2.endpoint(job, w.id) for w in job.workers}
    hard = exchange(bmv2, [(eps[w], d, dsts) for (w, d), dsts in zip(trace, replies_to)], eps)
    assert sum(map(len, soft.values())) > 3 * 20
    epochs = {bytes(d[EPOCH]) for got in hard.values() for d in got}
    assert len(epochs) == 1 and epochs != {bytes(4)}, "one nonzero epoch from the switch"
    for w in soft:
        assert len(hard[w]) == len(soft[w]), f"worker {w}: {len(hard[w])} vs {len(soft[w])}"
        assert ([without_epoch(d) for d in hard[w]] == [without_epoch(d) for d in soft[w]]), \
            f"worker {w}: datagrams differ"
    after = bmv2.drops()
    assert {k: after[k] - before[k] for k in after} == agg.counters()["drops"]
    assert bmv2.job_counters(job) == agg.counters()["jobs"][job.job_id]
