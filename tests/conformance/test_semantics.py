"""Aggregation semantics every aggregator must implement (software aggregator and BMv2).

Each test speaks the wire protocol directly, so a difference between implementations shows
up as a failing test here rather than as a wrong gradient somewhere in training.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from thc.codec.packing import pack_bits
from thc.wire import protocol as P

_job_ids = itertools.count(100)


def new_job(harness, n_workers=3, pool_size=4, table=None):
    job = harness.make_job(next(_job_ids), n_workers, pool_size=pool_size, table=table)
    harness.install(job)
    return job


RUN = 1
"""The run of most tests: a fresh install knows no run, so any nonzero id takes the job."""


def datagram(job, worker, seq, payload, pkt_type=P.PktType.DATA, offset=None, slot=None,
             version=None, job_id=None, run=RUN):
    s, v = P.slot_of(seq, job.pool_size)
    hdr = P.Header(pkt_type, worker, job.job_id if job_id is None else job_id,
                   s if slot is None else slot, v if version is None else version, 0, seq,
                   (seq * job.lanes) % P.SEQ_MOD if offset is None else offset, 0, run, 0)
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


def assert_refused(got, job, reason, detail, seq, to_worker, run=RUN):
    """``got`` is exactly one REFUSED of ``job``'s chunk ``seq`` to ``to_worker``: the drop
    reason's code in ``count``, its detail in ``bitmap``, no payload."""
    assert len(got) == 1, f"worker {to_worker} expected one REFUSED, got {len(got)}"
    hdr, payload = parse(got[0])
    assert hdr.pkt_type == P.PktType.REFUSED and payload == b""
    assert (hdr.job_id, hdr.seq, hdr.worker_id, hdr.run) == (job.job_id, seq, to_worker, run)
    assert hdr.count == int(P.DropReason[reason]), f"refused as {hdr.count}, not {reason}"
    assert hdr.bitmap == detail and hdr.epoch != 0


def test_exact_sums_multicast_to_every_worker(harness):
    rng = np.random.default_rng(1)
    job = new_job(harness, n_workers=3)
    for seq in range(6):
        idxs = [indices(rng, job) for _ in range(job.n_workers)]
        got = run_round(harness, job, seq, idxs)
        for w in range(job.n_workers):
            assert_result(got[w], job, seq, idxs, w)


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
    got = run_round(harness, job, 0, idxs)
    for w in range(n_workers):
        assert_result(got[w], job, 0, idxs, w)
    rng = np.random.default_rng(12)
    idxs = [indices(rng, job) for _ in range(n_workers)]
    got = run_round(harness, job, 1, idxs)
    for w in range(n_workers):
        assert_result(got[w], job, 1, idxs, w)


def test_extreme_indices_sum_exactly(harness):
    job = new_job(harness, n_workers=4)
    lanes = job.lanes
    idxs = [np.full(lanes, 15, np.uint8), np.full(lanes, 15, np.uint8),
            np.arange(lanes, dtype=np.uint8) % 16, np.zeros(lanes, np.uint8)]
    got = run_round(harness, job, 0, idxs)
    for w in range(4):
        assert_result(got[w], job, 0, idxs, w)


def test_partial_then_complete(harness):
    rng = np.random.default_rng(2)
    job = new_job(harness, n_workers=3)
    idxs = [indices(rng, job) for _ in range(3)]
    got = run_round(harness, job, 0, idxs, workers=[0, 1])
    assert all(not v for v in got.values()), "no result before the last worker contributes"
    got = run_round(harness, job, 0, idxs, workers=[2])
    for w in range(3):
        assert_result(got[w], job, 0, idxs, w)


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
    got = run_round(harness, job, 0, idxs, workers=[1])
    for w in range(3):
        assert_result(got[w], job, 0, idxs, w)


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
        by_seq = {parse(d)[0].seq: [d] for d in got}
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
        got = run_round(harness, job, seq, idxs)
        for w in range(2):
            assert_result(got[w], job, seq, idxs, w)
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


def _bad_packets(harness, job, good_idx):
    """(reason, datagram, endpoint) triples; each must be dropped and counted."""
    idx = good_idx
    payload = pack_bits(idx, P.INDEX_BITS).tobytes()
    w0 = harness.endpoint(job, 0)
    return [
        ("malformed", datagram(job, 0, 0, b"")[: P.HEADER_BYTES - 3], w0),
        ("malformed", datagram(job, 0, 0, payload, pkt_type=0x7F), w0),
        ("malformed", datagram(job, 0, 0, payload, version=2), w0),
        ("wrong_direction", datagram(job, 0, 0, payload, pkt_type=P.PktType.RESULT), w0),
        ("not_from_cpu", datagram(job, 0, 0, b"", pkt_type=P.PktType.RESET), w0),
        ("unknown_job", datagram(job, 0, 0, payload, job_id=4242), w0),
        ("bad_lanes", datagram(job, 0, 0, payload[:-1]), w0),
        ("bad_lanes", datagram(job, 0, 0, payload + b"\x00\x00"), w0),
        ("worker_outside_job", datagram(job, job.n_workers, 0, payload), w0),
        ("unknown_worker", datagram(job, 1, 0, payload), w0),
        ("unknown_worker", datagram(job, 0, 0, payload), harness.stranger()),
        ("slot_outside_pool", datagram(job, 0, 0, payload, slot=job.pool_size), w0),
        ("malformed", datagram(job, 0, 0, payload, run=0), w0),
        ("malformed", datagram(job, 0, 0, P.floats_to_ordered_u32(np.ones(P.MAX_LANES))
                               .astype(">u4").tobytes(), pkt_type=P.PktType.MAX, run=0), w0),
    ]


@pytest.mark.parametrize("case", range(14))
def test_bad_packet_is_dropped_counted_and_harmless(harness, case):
    rng = np.random.default_rng(100 + case)
    job = new_job(harness, n_workers=2)
    idxs = [indices(rng, job) for _ in range(2)]
    reason, bad, ep = _bad_packets(harness, job, np.full(job.lanes, 15, np.uint8))[case]
    before = harness.drops()
    ep.send(bad)
    assert ep.recv_all() == []
    settle(harness)
    after = harness.drops()
    changed = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    assert changed == {reason: 1}
    # The aggregate afterwards is exactly what the good packets make.
    got = run_round(harness, job, 0, idxs)
    for w in range(2):
        assert_result(got[w], job, 0, idxs, w)


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


# -- runs and epochs ---------------------------------------------------------------------

def drops_delta(before, after):
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def test_restart_after_a_failed_round_gets_exact_sums(harness):
    """3 of 4 workers contribute to seq 0, then all four restart as a new run from seq 0:
    the failed run's contributions must not count in the new run."""
    rng = np.random.default_rng(20)
    job = new_job(harness, n_workers=4)
    failed = [indices(rng, job) for _ in range(4)]
    got = run_round(harness, job, 0, failed, workers=[0, 1, 2], run=1)
    assert all(not v for v in got.values())
    before = harness.drops()
    for seq in range(3):
        fresh = [indices(rng, job) for _ in range(4)]
        got = run_round(harness, job, seq, fresh, run=2)
        for w in range(4):
            assert_result(got[w], job, seq, fresh, w, run=2)
    settle(harness)
    assert drops_delta(before, harness.drops()) == {}


def test_restart_after_a_completed_round_reuses_seqs_from_zero(harness):
    """A new run starting again at seq 0 is not stale: it takes the slots over."""
    rng = np.random.default_rng(21)
    job = new_job(harness, n_workers=2, pool_size=2)
    for seq in range(7):
        run_round(harness, job, seq, [indices(rng, job) for _ in range(2)], run=1)
    before = harness.drops()
    for seq in range(5):
        fresh = [indices(rng, job) for _ in range(2)]
        got = run_round(harness, job, seq, fresh, run=2)
        for w in range(2):
            assert_result(got[w], job, seq, fresh, w, run=2)
    settle(harness)
    assert drops_delta(before, harness.drops()) == {}


def test_interleaved_runs_drop_the_old_run_as_stale_run(harness):
    rng = np.random.default_rng(22)
    job = new_job(harness, n_workers=3)
    old = [indices(rng, job) for _ in range(3)]
    new = [indices(rng, job) for _ in range(3)]
    new1 = [indices(rng, job) for _ in range(3)]
    ep = [harness.endpoint(job, w) for w in range(3)]
    ep[0].send(data(job, 0, 0, old[0], run=7))
    ep[1].send(data(job, 1, 0, old[1], run=7))
    ep[0].send(data(job, 0, 0, new[0], run=8))
    ep[1].send(data(job, 1, 1, new1[1], run=8))
    # workers on different switch ports may be handled out of send order: worker 1's run-7
    # packet can come after run 8 took the job, and then it is refused already here
    harness.recv_each(dict(enumerate(ep)))
    before = harness.drops()
    # The old run's packets after the new run took the job over: dropped, counted, each
    # refused to its sender (the detail: the job's run).
    ep[2].send(data(job, 2, 0, old[2], run=7))
    ep[1].send(data(job, 1, 0, old[1], run=7))
    ep[2].send(data(job, 2, 1, old[2], run=7))
    got = harness.recv_each(dict(enumerate(ep)))
    assert got[0] == [], "worker 0 sent nothing of run 7 here"
    assert_refused(got[1], job, "stale_run", 8, 0, 1, run=7)
    refused = sorted(got[2], key=lambda d: parse(d)[0].seq)
    assert len(refused) == 2
    assert_refused(refused[:1], job, "stale_run", 8, 0, 2, run=7)
    assert_refused(refused[1:], job, "stale_run", 8, 1, 2, run=7)
    settle(harness)
    assert drops_delta(before, harness.drops()) == {"stale_run": 3}
    ep[1].send(data(job, 1, 0, new[1], run=8))
    ep[2].send(data(job, 2, 0, new[2], run=8))
    ep[0].send(data(job, 0, 1, new1[0], run=8))
    ep[2].send(data(job, 2, 1, new1[2], run=8))
    for w in range(3):
        got = sorted(ep[w].recv_all(), key=lambda d: parse(d)[0].seq)
        assert len(got) == 2
        assert_result(got[:1], job, 0, new, w, run=8)
        assert_result(got[1:], job, 1, new1, w, run=8)


def test_runs_are_ordered_by_serial_arithmetic(harness):
    """Run 2^32 - 1 is older than run 5 (RFC 1982), so run 5 takes the job over from it."""
    rng = np.random.default_rng(23)
    job = new_job(harness, n_workers=2)
    top = P.SEQ_MOD - 1
    got = run_round(harness, job, 0, [indices(rng, job) for _ in range(2)], run=top)
    assert len(got[0]) == 1
    fresh = [indices(rng, job) for _ in range(2)]
    got = run_round(harness, job, 0, fresh, run=5)
    assert_result(got[0], job, 0, fresh, 0, run=5)
    before = harness.drops()
    # the next chunk of the aggregator that has seen run 5 (seq 1 unless the job is sharded)
    harness.endpoint(job, 0).send(data(job, 0, job.n_shards, fresh[0], run=top))
    settle(harness)
    assert drops_delta(before, harness.drops()) == {"stale_run": 1}


def test_replies_carry_the_run_and_one_epoch(harness):
    """Every reply of one aggregator (of one shard, for a sharded job) carries its epoch."""
    rng = np.random.default_rng(24)
    job = new_job(harness, n_workers=2)
    run = 0x1234_5678
    idxs = [indices(rng, job) for _ in range(2)]
    ep0 = harness.endpoint(job, 0)
    ep0.send(data(job, 0, 0, idxs[0], run=run))
    ep0.send(data(job, 0, 0, idxs[0], run=run))
    pending = ep0.recv_all()
    assert len(pending) == 1
    hdr, _ = parse(pending[0])
    assert hdr.pkt_type == P.PktType.PENDING and hdr.run == run and hdr.epoch != 0
    epoch = hdr.epoch
    got = run_round(harness, job, 0, idxs, workers=[1], run=run)
    got[0] = got[0] or ep0.recv_all()
    for w in range(2):
        assert_result(got[w], job, 0, idxs, w, run=run)
        assert parse(got[w][0])[0].epoch == epoch
    vals = P.floats_to_ordered_u32(np.arange(P.MAX_LANES, dtype=np.float32)).astype(">u4")
    for w in range(2):  # the same aggregator's next chunk (seq 1 unless sharded)
        harness.endpoint(job, w).send(datagram(job, w, job.n_shards, vals.tobytes(),
                                               pkt_type=P.PktType.MAX, run=run))
    for w in range(2):
        got = harness.endpoint(job, w).recv_all()
        hdr, _ = parse(got[0])
        assert hdr.pkt_type == P.PktType.MAX_RESULT and (hdr.run, hdr.epoch) == (run, epoch)


def test_a_reinstalled_job_knows_no_run(harness):
    """Installing a job forgets the run of whatever used its state before (on the switch:
    the job index's thc_job_run), so any run, even one older than the last, takes it."""
    rng = np.random.default_rng(29)
    job = new_job(harness, n_workers=2)
    first = [indices(rng, job) for _ in range(2)]
    assert_result(run_round(harness, job, 0, first, run=1000)[0], job, 0, first, 0, run=1000)
    harness.remove(job.job_id)
    harness.install(job)
    again = [indices(rng, job) for _ in range(2)]
    got = run_round(harness, job, 0, again, run=5)
    for w in range(2):
        assert_result(got[w], job, 0, again, w, run=5)


def test_a_chunk_sent_to_the_wrong_shard_is_dropped_counted_and_harmless(harness):
    """A shard aggregates only the chunks it owns (``seq mod n_shards``): another shard's
    chunk, even one of a newer run, is a counted drop that changes no sum and no run."""
    if not hasattr(harness, "send_to_shard"):
        pytest.skip(f"the {harness.name} aggregator is not sharded")
    rng = np.random.default_rng(31)
    job = new_job(harness, n_workers=2)
    assert job.n_shards >= 2
    idxs = [indices(rng, job) for _ in range(2)]
    wrong = [indices(rng, job) for _ in range(2)]
    ep0 = harness.endpoint(job, 0)
    before = harness.drops()
    # seq 1 belongs to shard 1: shard 0 must drop it, whatever its run.
    harness.send_to_shard(ep0, data(job, 0, 1, wrong[0]), 0)
    harness.send_to_shard(ep0, data(job, 0, 1, wrong[0], run=RUN + 7), 0)
    assert ep0.recv_all() == []
    settle(harness)
    assert drops_delta(before, harness.drops()) == {"wrong_shard": 2}
    # Both shards still aggregate the run exactly (shard 0 did not take RUN + 7).
    for seq in (0, 1):
        got = run_round(harness, job, seq, idxs)
        for w in range(2):
            assert_result(got[w], job, seq, idxs, w)
    assert drops_delta(before, harness.drops()) == {"wrong_shard": 2}


# -- vote jobs (Marsit's sign bits counted in the network) ---------------------------------

def new_vote_job(harness, n_workers=3, pool_size=4):
    job = harness.make_job(next(_job_ids), n_workers, pool_size=pool_size, aggregation="vote")
    harness.install(job)
    return job


def vote_data(job, worker, seq, bits, **kw):
    """A vote job's DATA: one sign bit a lane (1 = +1), the first lane in the high bit."""
    return datagram(job, worker, seq, pack_bits(bits.astype(np.uint8), 1).tobytes(), **kw)


def assert_counts(got, job, seq, bits, to_worker):
    assert len(got) == 1, f"worker {to_worker} expected one result, got {len(got)}"
    hdr, payload = parse(got[0])
    assert hdr.pkt_type == P.PktType.RESULT
    assert (hdr.job_id, hdr.seq, hdr.worker_id) == (job.job_id, seq, to_worker)
    assert hdr.count == job.n_workers and hdr.bitmap == job.full_bitmap
    assert job.sum_bits == 8
    np.testing.assert_array_equal(sums_of(payload, job), sum(b.astype(np.int64) for b in bits))


def vote_round(harness, job, seq, bits, workers=None):
    for w in range(job.n_workers) if workers is None else workers:
        harness.endpoint(job, w).send(vote_data(job, w, seq, bits[w]))
    return harness.recv_each({w: harness.endpoint(job, w) for w in range(job.n_workers)})


def test_vote_counts_the_plus_one_signs_of_every_lane(harness):
    rng = np.random.default_rng(40)
    job = new_vote_job(harness, n_workers=5)
    lanes = job.lanes
    rounds = [[np.ones(lanes, bool)] * 5,                               # every count 5
              [np.arange(lanes) % (w + 2) == 0 for w in range(5)],      # lane patterns
              [rng.random(lanes) < 0.5 for _ in range(5)]]
    for seq, bits in enumerate(rounds):
        got = vote_round(harness, job, seq, bits)
        for w in range(5):
            assert_counts(got[w], job, seq, bits, w)


def test_vote_retransmissions_pending_then_counted_once(harness):
    rng = np.random.default_rng(41)
    job = new_vote_job(harness, n_workers=3)
    bits = [rng.random(job.lanes) < 0.5 for _ in range(3)]
    vote_round(harness, job, 0, bits, workers=[0, 1])
    ep = harness.endpoint(job, 1)
    ep.send(vote_data(job, 1, 0, bits[1]))
    got = ep.recv_all()
    assert len(got) == 1 and parse(got[0])[0].pkt_type == P.PktType.PENDING
    got = vote_round(harness, job, 0, bits, workers=[2])
    for w in range(3):
        assert_counts(got[w], job, 0, bits, w)
    ep.send(vote_data(job, 1, 0, bits[1]))
    assert_counts(ep.recv_all(), job, 0, bits, 1)


@pytest.mark.parametrize("case", ["thc_size", "short", "long", "empty", "vote_to_thc"])
def test_sign_packet_with_wrong_lane_count_is_dropped_and_harmless(harness, case):
    """A vote job takes lanes/8 bytes of signs, nothing else; a THC job not those: the
    packet is dropped as bad_lanes, no reply, and the next round's counts are exact."""
    rng = np.random.default_rng(42)
    thc = case == "vote_to_thc"
    job = new_job(harness, n_workers=2) if thc else new_vote_job(harness, n_workers=2)
    signs = pack_bits(np.ones(job.lanes, np.uint8), 1).tobytes()
    payload = {"thc_size": bytes(P.payload_bytes(P.PktType.DATA, job.lanes)),
               "short": signs[:-1], "long": signs + b"\xff", "empty": b"",
               "vote_to_thc": signs}[case]
    ep = harness.endpoint(job, 0)
    before = harness.drops()
    ep.send(datagram(job, 0, 0, payload))
    assert ep.recv_all() == []
    settle(harness)
    assert drops_delta(before, harness.drops()) == {"bad_lanes": 1}
    if thc:
        idxs = [indices(rng, job) for _ in range(2)]
        got = run_round(harness, job, 0, idxs)
        for w in range(2):
            assert_result(got[w], job, 0, idxs, w)
    else:
        bits = [rng.random(job.lanes) < 0.5 for _ in range(2)]
        got = vote_round(harness, job, 0, bits)
        for w in range(2):
            assert_counts(got[w], job, 0, bits, w)
