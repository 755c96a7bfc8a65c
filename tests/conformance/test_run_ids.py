"""Runs and epochs every aggregator must implement: a restarted or interleaved run never
counts another run's contributions, run ids are ordered by serial arithmetic, replies carry
the run and the install's epoch, and chunks sent to the wrong shard are dropped."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conformance.rounds import (RUN, assert_refused, assert_result, assert_round, data,
                                      datagram, drops_delta, indices, new_job, parse, run_round,
                                      settle)
from thc.wire import protocol as P


def fresh_rounds_drop_nothing(harness, job, rng, rounds: int, run: int) -> None:
    """Seqs 0 .. rounds - 1 of ``run``, fresh indices: exact sums, no drop counted."""
    before = harness.drops()
    for seq in range(rounds):
        assert_round(harness, job, seq, [indices(rng, job) for _ in range(job.n_workers)],
                     run=run)
    settle(harness)
    assert drops_delta(before, harness.drops()) == {}


def test_restart_after_a_failed_round_gets_exact_sums(harness):
    """3 of 4 workers contribute to seq 0, then all four restart as a new run from seq 0:
    the failed run's contributions must not count in the new run."""
    rng = np.random.default_rng(20)
    job = new_job(harness, n_workers=4)
    failed = [indices(rng, job) for _ in range(4)]
    got = run_round(harness, job, 0, failed, workers=[0, 1, 2], run=1)
    assert all(not v for v in got.values())
    fresh_rounds_drop_nothing(harness, job, rng, 3, run=2)


def test_restart_after_a_completed_round_reuses_seqs_from_zero(harness):
    """A new run starting again at seq 0 is not stale: it takes the slots over."""
    rng = np.random.default_rng(21)
    job = new_job(harness, n_workers=2, pool_size=2)
    for seq in range(7):
        run_round(harness, job, seq, [indices(rng, job) for _ in range(2)], run=1)
    fresh_rounds_drop_nothing(harness, job, rng, 5, run=2)


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
    assert_round(harness, job, 0, again, run=5)


def test_a_reinstall_forgets_the_workers_incarnations_of_a_run(harness):
    """A worker's run is a new incarnation where its nonce changes (``reused_run``), but
    only within one install: after a re-install the same run id under a new nonce is a
    fresh start (the switch's per-worker registers survive a RESET; the epoch tells)."""
    rng = np.random.default_rng(41)
    job = new_job(harness, n_workers=2)
    first = [indices(rng, job) for _ in range(2)]
    assert_round(harness, job, 0, first, run=1000)
    harness.remove(job.job_id)
    harness.install(job)
    before = harness.drops()
    again = [indices(rng, job) for _ in range(2)]
    for w in range(2):
        d = bytearray(data(job, w, 0, again[w], run=1000))
        if w == 1:
            d[P.HEADER_BYTES - 4:P.HEADER_BYTES] = (0x5EED).to_bytes(4, "big")   # its nonce
        harness.endpoint(job, w).send(bytes(d))
    got = harness.recv_each({w: harness.endpoint(job, w) for w in range(2)})
    for w in range(2):
        assert_result(got[w], job, 0, again, w, run=1000)
    assert drops_delta(before, harness.drops()) == {}


def test_a_chunk_sent_to_the_wrong_shard_is_refused_counted_and_harmless(harness):
    """A shard aggregates only the chunks it owns (``seq mod n_shards``): another shard's
    chunk, even one of a newer run, is refused (naming the shard, so shard maps that differ
    between workers and shards fail at once) and changes no sum and no run."""
    if not harness.name.startswith("sharded"):   # by name: a sharded harness's lost method fails
        pytest.skip(f"the {harness.name} aggregator is not sharded")
    rng = np.random.default_rng(31)
    job = new_job(harness, n_workers=2)
    assert job.n_shards >= 2
    idxs = [indices(rng, job) for _ in range(2)]
    wrong = [indices(rng, job) for _ in range(2)]
    ep0 = harness.endpoint(job, 0)
    before = harness.drops()
    # seq 1 belongs to shard 1: shard 0 must refuse it, whatever its run.
    detail = P.shard_detail(0, job.n_shards)
    harness.send_to_shard(ep0, data(job, 0, 1, wrong[0]), 0)
    assert_refused(ep0.recv_all(), job, "wrong_shard", detail, 1, 0)
    harness.send_to_shard(ep0, data(job, 0, 1, wrong[0], run=RUN + 7), 0)
    assert_refused(ep0.recv_all(), job, "wrong_shard", detail, 1, 0, run=RUN + 7)
    settle(harness)
    assert drops_delta(before, harness.drops()) == {"wrong_shard": 2}
    # Both shards still aggregate the run exactly (shard 0 did not take RUN + 7).
    for seq in (0, 1):
        assert_round(harness, job, seq, idxs)
    assert drops_delta(before, harness.drops()) == {"wrong_shard": 2}


def test_a_newer_run_takes_a_live_job_within_the_run_jump_and_no_further(harness):
    """A live job's run yields to a run newer by exactly ``run_jump``, but one newer by
    ``run_jump + 1`` is refused as stale_run (the bound is inclusive on every aggregator)."""
    rng = np.random.default_rng(32)
    job = new_job(harness, n_workers=2)
    assert_round(harness, job, 0, [indices(rng, job) for _ in range(2)])
    ep0 = harness.endpoint(job, 0)
    far = RUN + P.RUN_JUMP + 1
    ep0.send(data(job, 0, 0, indices(rng, job), run=far))
    assert_refused(ep0.recv_all(), job, "stale_run", RUN, 0, 0, run=far)
    edge, fresh = RUN + P.RUN_JUMP, [indices(rng, job) for _ in range(2)]
    got = run_round(harness, job, 0, fresh, run=edge)
    kinds = [P.PktType(parse(d)[0].pkt_type).name for d in got[0]]
    assert kinds == ["RESULT"], f"run + run_jump did not take the job: worker 0 got {kinds}"
    for w in range(2):
        assert_result(got[w], job, 0, fresh, w, run=edge)
