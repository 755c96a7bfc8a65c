"""The exactness rules, case by case, on every aggregator: a slot use keeps its op and
offset, slot and version must match seq, a new use waits until every worker holds the
previous result, stale and out-of-step packets are answered with REFUSED, a far-future run
cannot take a live job, and each install answers with a new epoch.

Without these rules each case is a way a client accepts a wrong sum or waits forever;
docs/protocol.md states them, docs/faults.md lists the cases.
"""
from __future__ import annotations

import numpy as np

from thc.wire import protocol as P
from tests.conformance.test_flush import flush
from tests.conformance.rounds import (RUN, assert_result, assert_round, data, datagram,
                                      drops_delta, indices, new_job, parse, run_round, settle)


def max_packet(job, worker, seq, value=1.0, **kw):
    vals = np.full(P.MAX_LANES, value, np.float32)
    return datagram(job, worker, seq, P.floats_to_ordered_u32(vals).astype(">u4").tobytes(),
                    pkt_type=P.PktType.MAX, offset=(seq * P.MAX_LANES) % P.SEQ_MOD, **kw)


def refused(got, reason: str, seq: int, detail: int | None = None):
    assert len(got) == 1, f"expected one REFUSED, got {len(got)}"
    hdr, payload = parse(got[0])
    assert hdr.pkt_type == P.PktType.REFUSED and payload == b""
    assert hdr.count == P.DropReason[reason] and hdr.seq == seq
    if detail is not None:
        assert hdr.bitmap == detail
    return hdr


def test_a_max_at_a_sums_seq_is_refused_and_adds_nothing(harness):
    """Case 1: an out-of-step worker's MAX at a DATA chunk's seq."""
    rng = np.random.default_rng(40)
    job = new_job(harness, n_workers=2)
    idxs = [indices(rng, job) for _ in range(2)]
    w0, w1 = harness.endpoint(job, 0), harness.endpoint(job, 1)
    w0.send(data(job, 0, 0, idxs[0]))
    settle(harness)  # workers on different switch ports: keep the order
    before = harness.drops()
    w1.send(max_packet(job, 1, 0))
    refused(w1.recv_all(), "wrong_use", 0, int(P.PktType.DATA))
    settle(harness)
    assert drops_delta(before, harness.drops()) == {"wrong_use": 1}
    assert_round(harness, job, 0, idxs, workers=[1])


def test_a_packet_of_another_configuration_is_refused_and_adds_nothing(harness):
    """A worker configured with another job whose payload has this job's size: its DATA,
    MAX and FLUSH carry another configuration tag and are refused (wrong_config), so the
    chunk completes with its peers' and its own right packets only. The high 16 bits of
    the field are not read."""
    rng = np.random.default_rng(45)
    job = new_job(harness, n_workers=2)
    idxs = [indices(rng, job) for _ in range(2)]
    w0, w1 = harness.endpoint(job, 0), harness.endpoint(job, 1)
    w0.send(data(job, 0, 0, idxs[0]))
    settle(harness)  # workers on different switch ports: keep the order
    before = harness.drops()
    other = job.config_tag ^ 0x8001
    for packet in (data(job, 1, 0, indices(rng, job), tag=other),
                   max_packet(job, 1, 0, tag=other),
                   datagram(job, 1, 0, b"", pkt_type=P.PktType.FLUSH, tag=other)):
        w1.send(packet)
        hdr = refused(w1.recv_all(), "wrong_config", 0, 0)
        assert P.epoch_tag(hdr.epoch) == job.config_tag
    settle(harness)
    assert drops_delta(before, harness.drops()) == {"wrong_config": 3}
    w1.send(data(job, 1, 0, idxs[1], tag=job.config_tag | 0xABCD << 16))
    for w, ep in enumerate((w0, w1)):
        assert_result(ep.recv_all(), job, 0, idxs, w)


def test_data_after_a_max_use_is_refused_and_the_next_use_starts_clean(harness):
    """Case 1: a MAX first, then DATA at the same seq; FLUSH of a MAX use; a retransmission
    of the other kind is refused, not answered with the use's lanes as its own kind."""
    rng = np.random.default_rng(41)
    job = new_job(harness, n_workers=2, pool_size=2)
    w0, w1 = harness.endpoint(job, 0), harness.endpoint(job, 1)
    w0.send(max_packet(job, 0, 0, 1e30))
    settle(harness)  # workers on different switch ports: keep the order
    w1.send(data(job, 1, 0, indices(rng, job)))
    refused(w1.recv_all(), "wrong_use", 0, int(P.PktType.MAX))
    w1.send(flush(job, 1, 0))
    refused(w1.recv_all(), "wrong_use", 0)
    w1.send(max_packet(job, 1, 0, 2.0))
    got = harness.recv_each({0: w0, 1: w1})
    for w in (0, 1):
        hdr, _ = parse(got[w][0])
        assert hdr.pkt_type == P.PktType.MAX_RESULT and hdr.count == 2
    w0.send(data(job, 0, 0, indices(rng, job)))
    refused(w0.recv_all(), "wrong_use", 0)
    # every worker moves on through the other version; the slot's next use sums from zero
    for seq in (2, 4):
        idxs = [indices(rng, job) for _ in range(2)]
        assert_round(harness, job, seq, idxs)


def test_a_chunk_whose_offset_differs_from_its_use_is_refused(harness):
    rng = np.random.default_rng(42)
    job = new_job(harness, n_workers=2)
    idxs = [indices(rng, job) for _ in range(2)]
    harness.endpoint(job, 0).send(data(job, 0, 0, idxs[0]))
    settle(harness)  # workers on different switch ports: keep the order
    w1 = harness.endpoint(job, 1)
    w1.send(data(job, 1, 0, idxs[1], offset=12345))
    refused(w1.recv_all(), "wrong_use", 0)
    assert_round(harness, job, 0, idxs, workers=[1])


def test_a_slot_or_version_that_is_not_the_seqs_is_refused(harness):
    """Case 4: a packet naming another chunk's slot with a newer seq overwrote that chunk's
    partial use, whose packets were then dropped as stale without a reply."""
    rng = np.random.default_rng(43)
    job = new_job(harness, n_workers=2, pool_size=4)
    idxs = [indices(rng, job) for _ in range(2)]
    w0, w1 = harness.endpoint(job, 0), harness.endpoint(job, 1)
    w0.send(data(job, 0, 1, idxs[0]))
    for kw in ({"slot": 1}, {"slot": 1, "version": 0}, {"version": 0}):
        before = harness.drops()
        w1.send(data(job, 1, 6, idxs[1], **kw))
        refused(w1.recv_all(), "wrong_slot", 6)
        settle(harness)
        assert drops_delta(before, harness.drops()) == {"wrong_slot": 1}
    assert_round(harness, job, 1, idxs, workers=[1])


def test_a_far_newer_seq_waits_and_dead_ends_nothing(harness):
    """Case 4: one packet at seq cur + 2^31 - 1 must not take the slot version for the rest
    of the run: a new use of a slot version waits (held, a PENDING naming who holds the
    previous result) until every worker has moved past the previous one."""
    rng = np.random.default_rng(44)
    pool = 2
    job = new_job(harness, n_workers=2, pool_size=pool)
    first = [indices(rng, job) for _ in range(2)]
    run_round(harness, job, 0, first)
    far = 2 * pool * ((1 << 28) - 1)  # slot 0, version 0, newer than 0 by almost 2^30
    assert P.slot_of(far, pool) == (0, 0) and P.seq_newer(far, 0)
    w0 = harness.endpoint(job, 0)
    held_before = harness.job_counters(job)["held"]
    w0.send(data(job, 0, far, first[0]))
    got = w0.recv_all()
    hdr, _ = parse(got[0])
    # held: only worker 0 (whose packet this is) has shown it holds seq 0's result
    assert len(got) == 1 and hdr.pkt_type == P.PktType.PENDING and hdr.bitmap == 0b01
    settle(harness)
    assert harness.job_counters(job)["held"] == held_before + 1
    # the slot version still answers seq 0 and continues normally
    harness.endpoint(job, 1).send(data(job, 1, 0, first[1]))
    assert_result(harness.endpoint(job, 1).recv_all(), job, 0, first, 1)
    for seq in (pool, 2 * pool):
        idxs = [indices(rng, job) for _ in range(2)]
        assert_round(harness, job, seq, idxs)


def test_a_new_use_waits_for_the_worker_that_lacks_the_previous_result(harness):
    """Case 5: chunks closed short without worker 1; worker 0 runs ahead to seq 2 x pool
    (slot 0, version 0 again) while worker 1 still needs chunk 0's result. The new use is
    held until worker 1 shows it has moved past chunk 0; chunk 0's result stays."""
    rng = np.random.default_rng(45)
    pool = 2
    job = new_job(harness, n_workers=2, pool_size=pool)
    w0, w1 = harness.endpoint(job, 0), harness.endpoint(job, 1)
    idxs = {s: [indices(rng, job) for _ in range(2)] for s in range(5)}
    for seq in range(2 * pool + 1):  # worker 0 goes on; worker 1 contributes to none
        w0.send(data(job, 0, seq, idxs[seq][0]))
        w0.send(flush(job, 0, seq))
        got = harness.recv_each({0: w0, 1: w1})
    hdr, _ = parse(got[0][-1])
    assert hdr.pkt_type == P.PktType.PENDING and hdr.bitmap == 0b01 and not got[1], \
        "seq 2 x pool must wait: worker 1 has not shown it holds seq 0's result"
    for seq in (0, pool):
        # the straggler still gets each chunk as it was closed (worker 0 alone)
        w1.send(data(job, 1, seq, idxs[seq][1]))
        hdr, _ = parse(w1.recv_all()[0])
        assert (hdr.pkt_type, hdr.seq, hdr.count, hdr.bitmap) == (P.PktType.RESULT, seq, 1, 1)
    # worker 1's chunk `pool` showed it holds chunk 0: chunk 2 x pool starts, exact
    seq = 2 * pool
    assert_round(harness, job, seq, idxs[seq])


def test_stale_packets_are_answered_so_the_sender_fails_at_once(harness):
    rng = np.random.default_rng(46)
    pool = 2
    job = new_job(harness, n_workers=2, pool_size=pool)
    for seq in (0, pool, 2 * pool):
        run_round(harness, job, seq, [indices(rng, job) for _ in range(2)])
    w0 = harness.endpoint(job, 0)
    w0.send(data(job, 0, 0, indices(rng, job)))
    refused(w0.recv_all(), "stale", 0, 2 * pool)
    w0.send(data(job, 0, 0, indices(rng, job), run=RUN - 1 or P.SEQ_MOD - 1))
    refused(w0.recv_all(), "stale_run", 0, RUN)


def test_a_far_future_run_cannot_take_a_live_job(harness):
    """Case 7: one packet with a run far ahead locked the job until a re-install."""
    rng = np.random.default_rng(47)
    job = new_job(harness, n_workers=2)
    for seq in (0, 1):  # both shards of a sharded job learn the run
        run_round(harness, job, seq, [indices(rng, job) for _ in range(2)])
    w1 = harness.endpoint(job, 1)
    far = (RUN + (1 << 31) - 1) % P.SEQ_MOD
    for seq in (2, 3):
        w1.send(data(job, 1, seq, indices(rng, job), run=far))
        refused(w1.recv_all(), "stale_run", seq, RUN)
    idxs = [indices(rng, job) for _ in range(2)]
    assert_round(harness, job, 2, idxs)
    # a later launch's run (newer within the jump) takes the job at once
    later = RUN + 600
    for seq in (0, 1):
        idxs = [indices(rng, job) for _ in range(2)]
        assert_round(harness, job, seq, idxs, run=later)


def test_each_install_answers_with_a_new_epoch(harness):
    """Case 6: a re-install kept the epoch, so a client whose run spanned it met slots
    that had forgotten its chunks and could not tell."""
    rng = np.random.default_rng(48)
    job = new_job(harness, n_workers=1)
    epochs = []
    for _ in range(3):
        idxs = [indices(rng, job)]
        got = run_round(harness, job, 0, idxs)
        epochs.append(parse(got[0][0])[0].epoch)
        harness.install(job)
    # each unlike the one before (an older one may come back, with chance 2^-16)
    assert all(a != b for a, b in zip(epochs, epochs[1:])) and 0 not in epochs


def test_a_second_incarnation_of_a_worker_in_one_run_is_refused(harness):
    """A worker process restarted under the same run id (its nonce, in the upstream epoch
    field, differs) would be answered from its predecessor's slot uses: refused instead."""
    rng = np.random.default_rng(49)
    job = new_job(harness, n_workers=2)
    idxs = [indices(rng, job) for _ in range(2)]
    assert_round(harness, job, 0, idxs)
    again = bytearray(data(job, 1, 0, idxs[1]))
    again[P.HEADER_BYTES - 4:P.HEADER_BYTES] = (0x5EED).to_bytes(4, "big")
    w1 = harness.endpoint(job, 1)
    before = harness.drops()
    w1.send(bytes(again))
    refused(w1.recv_all(), "reused_run", 0, 0)
    settle(harness)
    assert drops_delta(before, harness.drops()) == {"reused_run": 1}
    # the first incarnation goes on; a new run id starts cleanly with any nonce
    got = run_round(harness, job, 1, [indices(rng, job) for _ in range(2)])
    assert all(parse(got[w][0])[0].pkt_type == P.PktType.RESULT for w in range(2))
