"""Packets and rounds for the conformance tests: jobs on a harness, datagrams of the wire
protocol, and the checks of the replies every aggregator must send."""
from __future__ import annotations

import itertools

import numpy as np

from thc.codec.packing import pack_bits
from thc.wire import protocol as P

_job_ids = itertools.count(100)


def new_job(harness, n_workers=3, pool_size=4, table=None, **kw):
    job = harness.make_job(next(_job_ids), n_workers, pool_size=pool_size, table=table, **kw)
    harness.install(job)
    return job


RUN = 1
"""The run of most tests: a fresh install knows no run, so any nonzero id takes the job."""


def datagram(job, worker, seq, payload, pkt_type=P.PktType.DATA, offset=None, slot=None,
             version=None, job_id=None, run=RUN, tag=None):
    """The job's configuration tag in ``bitmap`` unless ``tag`` is given."""
    s, v = P.slot_of(seq, job.pool_size)
    hdr = P.Header(pkt_type, worker, job.job_id if job_id is None else job_id,
                   s if slot is None else slot, v if version is None else version, 0, seq,
                   (seq * job.lanes) % P.SEQ_MOD if offset is None else offset,
                   job.config_tag if tag is None else tag, run, 0)
    return hdr.pack() + bytes(payload)


def indices(rng, job):
    return rng.integers(0, 16, job.lanes).astype(np.uint8)


def data(job, worker, seq, idx, **kw):
    return datagram(job, worker, seq, pack_bits(idx, P.INDEX_BITS).tobytes(), **kw)


def expected_sums(job, idxs):
    table = np.asarray(job.table)
    return sum(table[i] for i in idxs)


def parse(d):
    hdr, payload = P.decode(d)
    return hdr, bytes(payload)


def sums_of(payload, job):
    assert len(payload) == P.payload_bytes(P.PktType.RESULT, job.lanes, job.sum_bits)
    return np.frombuffer(payload, dtype=P.sum_dtype(job.sum_bits)).astype(np.int64)


def settle(harness):
    """Wait until the aggregator handled what was sent (before reading counters)."""
    harness.sync()


def run_round(harness, job, seq, idxs, workers=None, run=RUN):
    """All (or the given) workers send chunk ``seq``; return what each worker receives."""
    workers = range(job.n_workers) if workers is None else workers
    for w in workers:
        harness.endpoint(job, w).send(data(job, w, seq, idxs[w], run=run))
    return harness.recv_each({w: harness.endpoint(job, w) for w in range(job.n_workers)})


def assert_result(got, job, seq, idxs, to_worker, run=RUN):
    assert len(got) == 1, f"worker {to_worker} expected one result, got {len(got)}"
    hdr, payload = parse(got[0])
    assert hdr.pkt_type == P.PktType.RESULT
    assert hdr.run == run and hdr.epoch != 0
    assert (hdr.job_id, hdr.seq, hdr.worker_id) == (job.job_id, seq, to_worker)
    assert (hdr.slot, hdr.version) == P.slot_of(seq, job.pool_size)
    assert hdr.offset == (seq * job.lanes) % P.SEQ_MOD
    assert hdr.count == job.n_workers
    assert hdr.bitmap == job.full_bitmap
    np.testing.assert_array_equal(sums_of(payload, job), expected_sums(job, idxs))


def assert_round(harness, job, seq, idxs, workers=None, run=RUN):
    """All (or the given) workers send chunk ``seq``; every worker of the job receives its
    RESULT of all of ``idxs``. Returns what each received."""
    got = run_round(harness, job, seq, idxs, workers=workers, run=run)
    for w in range(job.n_workers):
        assert_result(got[w], job, seq, idxs, w, run=run)
    return got


def assert_refused(got, job, reason, detail, seq, to_worker, run=RUN):
    """``got`` is exactly one REFUSED of ``job``'s chunk ``seq`` to ``to_worker``: the drop
    reason's code in ``count``, its detail in ``bitmap``, no payload."""
    assert len(got) == 1, f"worker {to_worker} expected one REFUSED, got {len(got)}"
    hdr, payload = parse(got[0])
    assert hdr.pkt_type == P.PktType.REFUSED and payload == b""
    assert (hdr.job_id, hdr.seq, hdr.worker_id, hdr.run) == (job.job_id, seq, to_worker, run)
    assert hdr.count == int(P.DropReason[reason]), f"refused as {hdr.count}, not {reason}"
    assert hdr.bitmap == detail and hdr.epoch != 0


def drops_delta(before, after):
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}
