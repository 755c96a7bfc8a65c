"""Vote jobs (Marsit's sign bits counted in the network) on every aggregator: each lane's
count of +1 signs, retransmissions counted once, sign packets of the wrong size dropped."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conformance.rounds import (assert_round, datagram, drops_delta, indices, new_job, parse,
                                      settle, sums_of)
from thc.codec.packing import pack_bits
from thc.wire import protocol as P


def new_vote_job(harness, n_workers=3, pool_size=4):
    return new_job(harness, n_workers, pool_size, aggregation="vote")


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
        assert_round(harness, job, 0, idxs)
    else:
        bits = [rng.random(job.lanes) < 0.5 for _ in range(2)]
        got = vote_round(harness, job, 0, bits)
        for w in range(2):
            assert_counts(got[w], job, 0, bits, w)
