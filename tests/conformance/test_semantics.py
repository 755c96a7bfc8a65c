"""Aggregation semantics every aggregator must implement (software aggregator and BMv2).

Each test speaks the wire protocol directly, so a difference between implementations shows
up as a failing test here rather than as a wrong gradient somewhere in training.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.conformance.rounds import (assert_refused, assert_result, assert_round, data, datagram,
                                      drops_delta, indices, new_job, parse, run_round, settle)
from thc.codec.packing import pack_bits
from thc.wire import protocol as P


def test_exact_sums_multicast_to_every_worker(harness):
    rng = np.random.default_rng(1)
    job = new_job(harness, n_workers=3)
    for seq in range(6):
        idxs = [indices(rng, job) for _ in range(job.n_workers)]
        assert_round(harness, job, seq, idxs)


@pytest.mark.parametrize("n_workers,sum_bits", [(8, 8), (9, 16), (32, 16)])
def test_sum_width_follows_workers_times_granularity(harness, n_workers, sum_bits):
    """8-bit sums while n x g <= 255, 16-bit above: the largest table value from every
    worker of a 32-worker job at g = 30 sums to 960 exactly, in 16-bit RESULT lanes."""
    job = new_job(harness, n_workers=n_workers)
    assert job.granularity == 30 and job.sum_bits == sum_bits
    lanes = job.lanes
    top = int(np.argmax(job.table))
    idxs = [np.full(lanes, top, np.uint8) for _ in range(n_workers - 1)]
    idxs.append(np.arange(lanes, dtype=np.uint8) % 16)
    assert_round(harness, job, 0, idxs)
    rng = np.random.default_rng(12)
    idxs = [indices(rng, job) for _ in range(n_workers)]
    assert_round(harness, job, 1, idxs)


def test_extreme_indices_sum_exactly(harness):
    job = new_job(harness, n_workers=4)
    lanes = job.lanes
    idxs = [np.full(lanes, 15, np.uint8), np.full(lanes, 15, np.uint8),
            np.arange(lanes, dtype=np.uint8) % 16, np.zeros(lanes, np.uint8)]
    assert_round(harness, job, 0, idxs)


def test_partial_then_complete(harness):
    rng = np.random.default_rng(2)
    job = new_job(harness, n_workers=3)
    idxs = [indices(rng, job) for _ in range(3)]
    got = run_round(harness, job, 0, idxs, workers=[0, 1])
    assert all(not v for v in got.values()), "no result before the last worker contributes"
    assert_round(harness, job, 0, idxs, workers=[2])


def test_duplicate_before_completion_counts_once_and_reports_pending(harness):
    rng = np.random.default_rng(3)
    job = new_job(harness, n_workers=3)
    idxs = [indices(rng, job) for _ in range(3)]
    run_round(harness, job, 0, idxs, workers=[0, 2])
    ep = harness.endpoint(job, 0)
    ep.send(data(job, 0, 0, idxs[0]))
    got = ep.recv_all()
    assert len(got) == 1
    hdr, payload = parse(got[0])
    assert hdr.pkt_type == P.PktType.PENDING and payload == b""
    assert hdr.bitmap == 0b101 and hdr.count == 2 and hdr.worker_id == 0
    assert_round(harness, job, 0, idxs, workers=[1])


def test_retransmission_to_completed_slot_answers_that_worker_only(harness):
    rng = np.random.default_rng(4)
    job = new_job(harness, n_workers=3)
    idxs = [indices(rng, job) for _ in range(3)]
    run_round(harness, job, 0, idxs)
    before = harness.job_counters(job)["retransmissions"]
    harness.endpoint(job, 1).send(data(job, 1, 0, idxs[1]))
    got = harness.recv_each({w: harness.endpoint(job, w) for w in range(3)})
    assert not got[0] and not got[2]
    assert_result(got[1], job, 0, idxs, 1)
    settle(harness)
    assert harness.job_counters(job)["retransmissions"] == before + 1


def test_reordered_chunks_and_interleaved_workers(harness):
    rng = np.random.default_rng(5)
    job = new_job(harness, n_workers=3, pool_size=4)
    chunks = {seq: [indices(rng, job) for _ in range(3)] for seq in range(4)}
    order = [(w, seq) for seq in range(4) for w in range(3)]
    rng.shuffle(order)
    for w, seq in order:
        harness.endpoint(job, w).send(data(job, w, seq, chunks[seq][w]))
    for w in range(3):
        got = harness.endpoint(job, w).recv_all()
        by_seq: dict[int, list] = {}
        for d in got:
            by_seq.setdefault(parse(d)[0].seq, []).append(d)   # a duplicate fails below
        assert sorted(by_seq) == [0, 1, 2, 3]
        for seq, d in by_seq.items():
            assert_result(d, job, seq, chunks[seq], w)


def test_slot_reuse_across_versions_and_stale_packets(harness):
    rng = np.random.default_rng(6)
    pool = 2
    job = new_job(harness, n_workers=2, pool_size=pool)
    first = [indices(rng, job) for _ in range(2)]
    run_round(harness, job, 0, first)
    other_version = [indices(rng, job) for _ in range(2)]
    got = run_round(harness, job, pool, other_version)
    assert_result(got[0], job, pool, other_version, 0)
    # Same slot and version as seq 0, a new use: the old sums must not leak in.
    reuse = [indices(rng, job) for _ in range(2)]
    got = run_round(harness, job, 2 * pool, reuse)
    assert_result(got[1], job, 2 * pool, reuse, 1)
    # A late duplicate of seq 0 is stale: dropped, counted, refused to its sender alone
    # (the detail: the seq the slot version holds now), sums untouched.
    before = harness.drops()
    harness.endpoint(job, 0).send(data(job, 0, 0, first[0]))
    got = harness.recv_each({w: harness.endpoint(job, w) for w in range(2)})
    assert_refused(got[0], job, "stale", 2 * pool, 0, 0)
    assert got[1] == []
    settle(harness)
    assert drops_delta(before, harness.drops()) == {"stale": 1}
    harness.endpoint(job, 0).send(data(job, 0, 2 * pool, reuse[0]))
    assert_result(harness.endpoint(job, 0).recv_all(), job, 2 * pool, reuse, 0)


def test_sequence_numbers_wrap_around(harness):
    """Serial-number order: a stream of consecutive chunks, every worker sending every one,
    crosses the 2^32 wrap; each chunk is newer than the last, every slot version's next use
    starts (no drop, nothing held) and every sum is exact."""
    rng = np.random.default_rng(7)
    pool = 4
    job = new_job(harness, n_workers=2, pool_size=pool)
    before, held = harness.drops(), harness.job_counters(job)["held"]
    seqs = [s % P.SEQ_MOD for s in range(P.SEQ_MOD - 2 * pool, P.SEQ_MOD + 2 * pool + 1)]
    assert seqs[0] == P.SEQ_MOD - 2 * pool and 0 in seqs and seqs[-1] == 2 * pool
    for seq in seqs:
        idxs = [indices(rng, job) for _ in range(2)]
        assert_round(harness, job, seq, idxs)
    settle(harness)
    assert drops_delta(before, harness.drops()) == {}
    assert harness.job_counters(job)["held"] == held


def test_single_worker_job_completes_immediately(harness):
    rng = np.random.default_rng(8)
    job = new_job(harness, n_workers=1)
    idxs = [indices(rng, job)]
    got = run_round(harness, job, 0, idxs)
    assert_result(got[0], job, 0, idxs, 0)


def test_max_round(harness):
    job = new_job(harness, n_workers=3)
    rng = np.random.default_rng(9)
    vals = [rng.random(P.MAX_LANES).astype(np.float32) * 100 for _ in range(3)]
    vals[1][0] = 0.0
    vals[2][1] = np.float32(3.4e38)
    for w in range(3):
        payload = P.floats_to_ordered_u32(vals[w]).astype(">u4").tobytes()
        harness.endpoint(job, w).send(datagram(job, w, 0, payload, pkt_type=P.PktType.MAX))
    for w in range(3):
        got = harness.endpoint(job, w).recv_all()
        assert len(got) == 1
        hdr, payload = parse(got[0])
        assert hdr.pkt_type == P.PktType.MAX_RESULT and hdr.count == 3
        out = P.ordered_u32_to_floats(np.frombuffer(payload, ">u4").astype(np.uint32))
        np.testing.assert_array_equal(out, np.maximum.reduce(vals))


def test_jobs_are_isolated(harness):
    rng = np.random.default_rng(10)
    a = new_job(harness, n_workers=2, pool_size=4)
    b = new_job(harness, n_workers=2, pool_size=4,
                table=[0, 2, 3, 5, 7, 9, 12, 13, 17, 18, 21, 23, 25, 27, 28, 30])
    ia = [indices(rng, a) for _ in range(2)]
    ib = [indices(rng, b) for _ in range(2)]
    for w in range(2):
        harness.endpoint(a, w).send(data(a, w, 0, ia[w]))
        harness.endpoint(b, w).send(data(b, w, 0, ib[w]))
    for w in range(2):
        assert_result(harness.endpoint(a, w).recv_all(), a, 0, ia, w)
        assert_result(harness.endpoint(b, w).recv_all(), b, 0, ib, w)
    # A worker of job a cannot contribute to job b's slots, even with a valid worker id.
    before = harness.drops()["unknown_worker"]
    harness.endpoint(a, 0).send(data(b, 0, 1, ia[0]))
    settle(harness)
    assert harness.drops()["unknown_worker"] == before + 1
    ib1 = [indices(rng, b) for _ in range(2)]
    got = run_round(harness, b, 1, ib1)
    assert_result(got[0], b, 1, ib1, 0)


def test_reinstall_resets_the_pool(harness):
    rng = np.random.default_rng(11)
    job = new_job(harness, n_workers=2, pool_size=2)
    for seq in range(5):
        run_round(harness, job, seq, [indices(rng, job) for _ in range(2)])
    harness.install(job)
    idxs = [indices(rng, job) for _ in range(2)]
    got = run_round(harness, job, 0, idxs)
    assert_result(got[0], job, 0, idxs, 0)


def _bad_packets(harness, job, good_idx, seq):
    """(reason, datagram, endpoint) triples of chunk ``seq``; each must be dropped and
    counted."""
    payload = pack_bits(good_idx, P.INDEX_BITS).tobytes()
    w0 = harness.endpoint(job, 0)
    return [
        ("malformed", datagram(job, 0, seq, b"")[: P.HEADER_BYTES - 3], w0),
        ("malformed", datagram(job, 0, seq, payload, pkt_type=0x7F), w0),
        ("malformed", datagram(job, 0, seq, payload, version=2), w0),
        ("wrong_direction", datagram(job, 0, seq, payload, pkt_type=P.PktType.RESULT), w0),
        ("not_from_cpu", datagram(job, 0, seq, b"", pkt_type=P.PktType.RESET), w0),
        ("unknown_job", datagram(job, 0, seq, payload, job_id=4242), w0),
        ("bad_lanes", datagram(job, 0, seq, payload[:-1]), w0),
        ("bad_lanes", datagram(job, 0, seq, payload + b"\x00\x00"), w0),
        ("worker_outside_job", datagram(job, job.n_workers, seq, payload), w0),
        ("unknown_worker", datagram(job, 1, seq, payload), w0),
        ("unknown_worker", datagram(job, 0, seq, payload), None),
        ("slot_outside_pool", datagram(job, 0, seq, payload, slot=job.pool_size), w0),
        ("malformed", datagram(job, 0, seq, payload, run=0), w0),
        ("malformed", datagram(job, 0, seq, P.floats_to_ordered_u32(np.ones(P.MAX_LANES))
                               .astype(">u4").tobytes(), pkt_type=P.PktType.MAX, run=0), w0),
    ]


BAD_PACKETS = 14


def test_bad_packets_are_dropped_counted_and_harmless(harness):
    """Bad packet k goes out before the good packets of chunk k: it is dropped and counted
    under its reason, answered with nothing, and chunk k's sums are exact. (None: from an
    address that belongs to no worker.)"""
    rng = np.random.default_rng(100)
    job = new_job(harness, n_workers=2)
    stranger = harness.stranger()
    for seq in range(BAD_PACKETS):
        bad_packets = _bad_packets(harness, job, np.full(job.lanes, 15, np.uint8), seq)
        assert len(bad_packets) == BAD_PACKETS
        reason, bad, ep = bad_packets[seq]
        ep = ep or stranger
        before = harness.drops()
        ep.send(bad)
        assert ep.recv_all() == [], f"bad packet {seq} ({reason}) was answered"
        settle(harness)
        assert drops_delta(before, harness.drops()) == {reason: 1}, f"bad packet {seq}"
        assert_round(harness, job, seq, [indices(rng, job) for _ in range(2)])


def test_job_counters_track_packets_and_completions(harness):
    rng = np.random.default_rng(12)
    job = new_job(harness, n_workers=2)
    before = dict(harness.job_counters(job))
    for seq in range(3):
        run_round(harness, job, seq, [indices(rng, job) for _ in range(2)])
    settle(harness)
    after = harness.job_counters(job)
    assert after["packets"] - before["packets"] == 6
    assert after["completions"] - before["completions"] == 3
