"""Datagram helpers shared by the BMv2 tests."""
from __future__ import annotations

import numpy as np

from thc.codec.packing import pack_bits
from thc.wire import protocol as P
from thc.wire.jobs import Job

RUN = 1
"""Run id the tests' workers send (any nonzero value: one run)."""


def datagram(job: Job, worker: int, seq: int, payload: bytes, pkt_type=P.PktType.DATA,
             job_id: int | None = None, slot: int | None = None, run: int = RUN,
             tag: int | None = None) -> bytes:
    """The job's configuration tag in ``bitmap`` unless ``tag`` is given."""
    s, v = P.slot_of(seq, job.pool_size)
    hdr = P.Header(pkt_type, worker, job.job_id if job_id is None else job_id,
                   s if slot is None else slot, v, 0, seq, (seq * job.lanes) % P.SEQ_MOD,
                   job.config_tag if tag is None else tag, run)
    return hdr.pack() + payload


def data(job: Job, worker: int, seq: int, idx: np.ndarray, **kw) -> bytes:
    return datagram(job, worker, seq, pack_bits(idx, P.INDEX_BITS).tobytes(), **kw)


def random_indices(rng: np.random.Generator, job: Job) -> np.ndarray:
    return rng.integers(0, 1 << P.INDEX_BITS, job.lanes).astype(np.uint8)


def result_of(d: bytes, sum_bits: int = P.SUM_WIDTHS[0]) -> tuple[P.Header, np.ndarray]:
    hdr, payload = P.decode(d)
    return hdr, np.frombuffer(bytes(payload), dtype=P.sum_dtype(sum_bits)).astype(np.int64)


def expected(job: Job, idxs) -> np.ndarray:
    table = np.asarray(job.table)
    return sum(table[i] for i in idxs)


def check_result(got: list[bytes], job: Job, seq: int, idxs, worker: int) -> None:
    assert len(got) == 1, f"worker {worker}: expected one result, got {len(got)}"
    hdr, sums = result_of(got[0], job.sum_bits)
    assert hdr.pkt_type == P.PktType.RESULT
    assert (hdr.job_id, hdr.seq, hdr.worker_id, hdr.count) == (job.job_id, seq, worker,
                                                                job.n_workers)
    assert hdr.bitmap == job.full_bitmap
    np.testing.assert_array_equal(sums, expected(job, idxs))


def round_trip(h, job: Job, seq: int, idxs, workers=None, **kw) -> dict[int, list[bytes]]:
    """``workers`` (all by default) send ``idxs`` for ``seq`` (``kw``: :func:`datagram`'s);
    every worker's replies."""
    workers = range(job.n_workers) if workers is None else workers
    for w in workers:
        h.endpoint(job, w).send(data(job, w, seq, idxs[w], **kw))
    return h.recv_each({w: h.endpoint(job, w) for w in range(job.n_workers)})


def check_round(h, job: Job, seq: int, rng: np.random.Generator) -> None:
    """Every worker sends random indices for ``seq``; each gets the exact sums once."""
    idxs = [random_indices(rng, job) for _ in range(job.n_workers)]
    got = round_trip(h, job, seq, idxs)
    for w in range(job.n_workers):
        check_result(got[w], job, seq, idxs, w)


REPLY_TIMEOUT = 10.0
"""Seconds a reply the test expects is awaited: a switch this late has failed."""


def exchange(h, steps, endpoints: dict, unanswered: int = 8) -> dict:
    """Send ``steps``, (endpoint, datagram, keys in ``endpoints`` of the workers its replies go
    to), one at a time: each datagram's replies are awaited before the next is sent, and after
    every ``unanswered`` datagrams without a reply comes the harness's barrier. So no burst
    fills BMv2's pcap ring (a few dozen frames) and no sleep paces the sends. Returns what each
    endpoint received, in arrival order, up to a final barrier (so an extra reply shows)."""
    got = {k: [] for k in endpoints}
    since_barrier = 0
    for ep, datagram, dsts in steps:
        ep.send(datagram)
        for k in dsts:
            if (reply := endpoints[k].recv(REPLY_TIMEOUT)) is not None:
                got[k].append(reply)
        if not dsts:
            since_barrier += 1
            if since_barrier == unanswered:
                h.sync()
                since_barrier = 0
    for k, more in h.recv_each(endpoints).items():
        got[k] += more
    return got
