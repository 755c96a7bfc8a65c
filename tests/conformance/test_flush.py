"""FLUSH (DLCP's bounded loss): a worker closes a chunk short; every aggregator freezes it.

The frozen RESULT carries the workers it counted (count, bitmap) and goes to every worker,
so all replicas decode the same chunk; nothing that arrives later changes it.
"""
from __future__ import annotations

import numpy as np
import pytest

from thc.wire import protocol as P
from tests.conformance.rounds import (data, datagram, drops_delta, expected_sums, indices, new_job,
                                      parse, run_round, settle, sums_of)


def flush(job, worker, seq, **kw):
    return datagram(job, worker, seq, b"", pkt_type=P.PktType.FLUSH, **kw)


def assert_short(got, job, seq, idxs, counted, to_worker):
    assert len(got) == 1, f"worker {to_worker} expected one result, got {len(got)}"
    hdr, payload = parse(got[0])
    assert hdr.pkt_type == P.PktType.RESULT
    assert (hdr.seq, hdr.worker_id) == (seq, to_worker)
    assert hdr.count == len(counted)
    assert hdr.bitmap == sum(1 << w for w in counted)
    want = expected_sums(job, [idxs[w] for w in counted]) if counted else 0
    np.testing.assert_array_equal(sums_of(payload, job), np.zeros(job.lanes) + want)


def recv_everyone(harness, job):
    return harness.recv_each({w: harness.endpoint(job, w) for w in range(job.n_workers)})


def test_flush_closes_a_chunk_short_for_every_worker(harness):
    rng = np.random.default_rng(40)
    job = new_job(harness, n_workers=3)
    idxs = [indices(rng, job) for _ in range(3)]
    run_round(harness, job, 0, idxs, workers=[0, 1])
    before = dict(harness.job_counters(job))
    harness.endpoint(job, 0).send(flush(job, 0, 0))
    got = recv_everyone(harness, job)
    for w in range(3):
        assert_short(got[w], job, 0, idxs, [0, 1], w)
    # the missing worker's DATA arrives late: it is not added, it gets the frozen result
    harness.endpoint(job, 2).send(data(job, 2, 0, idxs[2]))
    got = recv_everyone(harness, job)
    assert_short(got[2], job, 0, idxs, [0, 1], 2)
    assert got[0] == [] and got[1] == []
    # a repeated FLUSH is answered to its sender alone, unchanged
    harness.endpoint(job, 1).send(flush(job, 1, 0))
    got = recv_everyone(harness, job)
    assert_short(got[1], job, 0, idxs, [0, 1], 1)
    assert got[0] == [] and got[2] == []
    settle(harness)
    after = harness.job_counters(job)
    assert after["completions"] - before["completions"] == 1
    assert after["retransmissions"] - before["retransmissions"] == 2
    # the slot's next uses are normal, complete rounds: every worker walks on through the
    # slot's other version (acknowledging the chunk closed short), then its next use of
    # this version starts without being held
    for seq in (job.pool_size, 2 * job.pool_size):
        idxs = [indices(rng, job) for _ in range(3)]
        got = run_round(harness, job, seq, idxs)
        for w in range(3):
            assert_short(got[w], job, seq, idxs, [0, 1, 2], w)
    settle(harness)
    assert harness.job_counters(job)["held"] == after["held"]


def test_flush_before_anyone_contributed_freezes_an_empty_chunk(harness):
    rng = np.random.default_rng(41)
    job = new_job(harness, n_workers=2)
    idxs = [indices(rng, job) for _ in range(2)]
    run_round(harness, job, 0, idxs)           # the slot version holds an older use's sums
    # every worker moves on to the slot's other version, acknowledging seq 0's result
    other = [indices(rng, job) for _ in range(2)]
    got = run_round(harness, job, job.pool_size, other)
    for w in range(2):
        assert_short(got[w], job, job.pool_size, other, [0, 1], w)
    seq = 2 * job.pool_size
    harness.endpoint(job, 1).send(flush(job, 1, seq))
    got = recv_everyone(harness, job)
    for w in range(2):
        assert_short(got[w], job, seq, idxs, [], w)
    harness.endpoint(job, 0).send(data(job, 0, seq, idxs[0]))
    got = recv_everyone(harness, job)
    assert_short(got[0], job, seq, idxs, [], 0)


def test_flush_of_a_complete_chunk_gets_the_full_result(harness):
    rng = np.random.default_rng(42)
    job = new_job(harness, n_workers=2)
    idxs = [indices(rng, job) for _ in range(2)]
    run_round(harness, job, 0, idxs)
    harness.endpoint(job, 0).send(flush(job, 0, 0))
    got = recv_everyone(harness, job)
    assert_short(got[0], job, 0, idxs, [0, 1], 0)
    assert got[1] == []


@pytest.mark.parametrize("case", ["payload", "run0", "stranger", "outside"])
def test_bad_flush_is_dropped_counted_and_harmless(harness, case):
    rng = np.random.default_rng(43)
    job = new_job(harness, n_workers=2)
    idxs = [indices(rng, job) for _ in range(2)]
    run_round(harness, job, 0, idxs, workers=[0])
    ep = harness.endpoint(job, 0)
    reason, bad = {
        "payload": ("bad_lanes", flush(job, 0, 0) + b"\x00" * 4),
        "run0": ("malformed", flush(job, 0, 0, run=0)),
        "stranger": ("unknown_worker", flush(job, 0, 0)),
        "outside": ("worker_outside_job", flush(job, 2, 0)),
    }[case]
    if case == "stranger":
        ep = harness.stranger()
    before = harness.drops()
    ep.send(bad)
    assert ep.recv_all() == []
    settle(harness)
    assert drops_delta(before, harness.drops()) == {reason: 1}
    got = run_round(harness, job, 0, idxs, workers=[1])   # the chunk was not closed
    for w in range(2):
        assert_short(got[w], job, 0, idxs, [0, 1], w)


def test_a_reused_slot_version_forgets_the_acknowledgements_of_its_older_use(harness):
    """Each use of a slot version starts with no worker acknowledged: leftovers from an older
    use would let a worker that runs ahead by FLUSHing overwrite a result a straggler has not
    acknowledged, so the straggler's resend would be refused instead of answered."""
    rng = np.random.default_rng(44)
    job = new_job(harness, n_workers=2, pool_size=2)
    idxs = {s: [indices(rng, job) for _ in range(2)] for s in (0, 2, 4, 6, 8)}
    for seq in (0, 2):             # slot 0's two versions; seq 2 acknowledges seq 0 for both
        run_round(harness, job, seq, idxs[seq])
    ep0, ep1 = harness.endpoint(job, 0), harness.endpoint(job, 1)
    for seq in (4, 6):             # worker 0 closes the version's next uses short, alone
        ep0.send(data(job, 0, seq, idxs[seq][0]))
        ep0.send(flush(job, 0, seq))
        got = recv_everyone(harness, job)
        for w in range(2):
            assert_short(got[w], job, seq, idxs[seq], [0], w)
        if seq == 4:               # worker 1's late seq 4 acknowledges seq 2; its reply is lost
            ep1.send(data(job, 1, 4, idxs[4][1]))
            assert_short(ep1.recv_all(), job, 4, idxs[4], [0], 1)
    # worker 1 has not acknowledged seq 4 (it sent nothing past it): seq 8 is held
    ep0.send(data(job, 0, 8, idxs[8][0]))
    got = recv_everyone(harness, job)
    assert got[1] == [] and len(got[0]) == 1, f"seq 8 was not held: {got}"
    hdr, _ = parse(got[0][0])
    assert (hdr.pkt_type, hdr.seq, hdr.count, hdr.bitmap) == (P.PktType.PENDING, 8, 0, 0b01)
    # so worker 1's resend of seq 4 still gets seq 4's short result
    ep1.send(data(job, 1, 4, idxs[4][1]))
    assert_short(ep1.recv_all(), job, 4, idxs[4], [0], 1)
