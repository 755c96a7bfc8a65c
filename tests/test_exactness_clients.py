"""The exactness cases that need real clients, on both software aggregators and, where the
window matters, both client windows: a reused run id, bounded loss with a straggler, a
re-install within a run, a far-future run, a window that cannot hold a chunk.

Without its rule each case returns a wrong sum or waits forever (docs/protocol.md states the
rules; docs/faults.md lists the cases);
tests/conformance/test_exactness.py holds the packet-level cases for every aggregator.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from thc.codec.packing import pack_bits
from thc.net import fastagg
from thc.net.aggregator import Aggregator
from thc.net.client import (AggregationClient, AggregationRefused, AggregationTimeout,
                             AggregatorRestarted, RunFailed)
from thc.net.outcomes import AggregatorMisconfigured
from thc.testing.clusters import free_port_block, local_job
from thc.wire import protocol as P
from thc.wire.jobs import Job
from tests.scripted import scripted_aggregator
from tests.test_transport import datapath  # noqa: F401 (a fixture)

TABLE = [0, 1, 2, 4, 6, 8, 11, 14, 16, 19, 22, 24, 26, 28, 29, 30]


def make(kind: str, jobs, **kw):
    if kind == "compiled":
        if not fastagg.available():
            pytest.skip(f"compiled aggregator: {fastagg.UNAVAILABLE}")
        return fastagg.FastAggregator(jobs, **kw)
    return Aggregator(jobs, **kw)


@pytest.fixture(params=["python", "compiled"])
def aggregator_kind(request):
    return request.param


def indices(seed: int, chunks: int, job) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 16, chunks * job.lanes).astype(np.uint8)


def run_workers(job, addr, payloads, delays=None, first_round=False, **client_kw):
    """Every worker aggregates its payload in a thread; returns {w: (sums, counts, bitmaps)}
    or the exception it raised. ``delays``: seconds a worker waits before its round;
    ``first_round``: each worker first runs a round of the same payload together (a loss
    bound closes chunks short only at an aggregator heard in an earlier round)."""
    out = {}

    def work(w):
        try:
            with AggregationClient(job, w, addr, **client_kw) as c:
                if first_round:
                    c.reduce(pack_bits(payloads[w], P.INDEX_BITS))
                time.sleep((delays or {}).get(w, 0.0))
                r = c.reduce(pack_bits(payloads[w], P.INDEX_BITS))
                out[w] = (r.sums, r.counts, r.bitmaps)
        except Exception as e:  # noqa: BLE001 (reported by the test)
            out[w] = e

    threads = [threading.Thread(target=work, args=(w,)) for w in range(job.n_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_bounded_loss_with_a_straggler_finishes_exact(aggregator_kind, datapath):
    """Case 5: 3 workers, pool 4, 16 chunks, loss bound 0.75, one worker 0.5 s late to the
    run's second round. All three raised AggregationTimeout: chunks closed short let the
    others run more than two pools ahead and reuse slot versions whose results the straggler
    still needed."""
    job = local_job(1, 3, free_port_block(3), pool_size=4, table=TABLE)
    chunks = 16
    payloads = {w: indices(w, chunks, job) for w in range(3)}
    with make(aggregator_kind, [job]) as agg:
        addr = agg.start()
        out = run_workers(job, addr, payloads, delays={2: 0.5}, first_round=True, run=3,
                          loss_bound=0.75, deadline=10.0)
    table = np.asarray(TABLE)
    for w in range(3):
        assert not isinstance(out[w], Exception), f"worker {w}: {out[w]!r}"
        sums, counts, bitmaps = out[w]
        sums = sums.reshape(chunks, job.lanes)
        for i in range(chunks):
            members = [v for v in range(3) if bitmaps[i] >> v & 1]
            assert counts[i] == len(members)
            want = sum((table[payloads[v][i * job.lanes:(i + 1) * job.lanes]]
                        for v in members), np.zeros(job.lanes, np.int64))
            np.testing.assert_array_equal(sums[i], want, err_msg=f"worker {w} chunk {i}")
    for i in range(chunks):  # every worker decoded the same chunk
        assert len({int(out[w][2][i]) for w in range(3)}) == 1
    # the slots wait for the straggler once both versions are used: later chunks count it
    # (an aggregator that closed every chunk at its first DATA passed the checks above)
    counts = out[0][1]
    assert int(counts.max()) == 3, f"no chunk counted all three workers: {counts.tolist()}"
    assert int(counts.min()) < 3, f"no chunk closed short: {counts.tolist()}"   # it fired


def test_a_run_id_that_is_not_newer_is_refused():
    """Case 3: `client.run = <the same id>` was accepted and round 2 returned round 1's
    sums from the slots."""
    job = local_job(1, 1, free_port_block(1), table=TABLE)
    with AggregationClient(job, 0, ("127.0.0.1", 9), run=10) as c:
        for bad in (10, 9, (10 - (1 << 31)) % P.SEQ_MOD):
            with pytest.raises(ValueError, match="not newer"):
                c.run = bad
        c.run = 11
        assert c.run == 11 and c.next_seq == 0


def _aggregate_all(clients, payloads) -> dict:
    """Every client aggregates its payload in a thread of its own: {worker: sums}."""
    results = {}
    threads = [threading.Thread(target=lambda w=w: results.update(
        {w: clients[w].aggregate(pack_bits(payloads[w], P.INDEX_BITS))}))
        for w in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return results


def test_the_same_run_id_cannot_repeat_a_round(aggregator_kind, datapath):
    """Case 3 end to end: the clients that ran a round under run 40 cannot go back to it
    (their second round, the same incarnations at the same seqs, would read as
    retransmissions of the first and be answered with its sums); under run 41 the same
    clients get the new round's sums."""
    job = local_job(1, 2, free_port_block(2), table=list(range(16)))
    with make(aggregator_kind, [job]) as agg:
        addr = agg.start()
        clients = [AggregationClient(job, w, addr, run=40, deadline=3.0) for w in range(2)]
        try:
            ones = {w: np.full(job.lanes, 1, np.uint8) for w in range(2)}
            results = _aggregate_all(clients, ones)
            assert (results[0] == 2).all() and (results[1] == 2).all()
            for c in clients:
                with pytest.raises(ValueError, match="not newer"):
                    c.run = 40
                c.run = 41
            results = _aggregate_all(clients, {w: 2 * ones[w] for w in range(2)})
            assert (results[0] == 4).all() and (results[1] == 4).all()
        finally:
            for c in clients:
                c.close()


def test_a_reinstall_within_a_run_fails_the_run_instead_of_a_wrong_sum(aggregator_kind,
                                                                         datapath):
    """Case 6: after a re-install with another table, a run that went on got 26 instead
    of 4 with no error."""
    job = local_job(1, 2, free_port_block(2), table=list(range(16)))
    payloads = {w: np.full(job.lanes, 2, np.uint8) for w in range(2)}
    with make(aggregator_kind, [job]) as agg:
        addr = agg.start()
        clients = [AggregationClient(job, w, addr, run=50, deadline=3.0) for w in range(2)]
        try:
            results = _aggregate_all(clients, payloads)
            assert (results[0] == 4).all() and (results[1] == 4).all()
            agg.install(local_job(1, 2, job.workers[0].port, table=[13] * 16))
            with pytest.raises(AggregatorRestarted, match="re-installed"):
                clients[0].aggregate(pack_bits(payloads[0], P.INDEX_BITS))
            with pytest.raises(RunFailed):
                clients[0].aggregate(pack_bits(payloads[0], P.INDEX_BITS))
        finally:
            for c in clients:
                c.close()


def test_a_far_future_run_neither_locks_a_live_job_nor_an_idle_one(aggregator_kind,
                                                                   datapath):
    """Case 7: one packet with a far-future run id, taken, would lock the job until a
    re-install, every later run from the clock timing out. It is refused while the job's
    run is live; if it takes an idle job, a client learns at once why it is refused, and
    once that run has been idle for the aggregator's run_idle, a new run takes the job."""
    job = local_job(1, 1, free_port_block(1), table=list(range(16)))
    one = pack_bits(np.full(job.lanes, 3, np.uint8), P.INDEX_BITS)
    with make(aggregator_kind, [job], run_idle=0.5) as agg:
        addr = agg.start()
        with AggregationClient(job, 0, addr, run=1000) as c:
            assert (c.aggregate(one) == 3).all()
            far = (1000 + (1 << 31) - 1) % P.SEQ_MOD
            tag = job.config_tag
            c.sock.sendto(P.Header(P.PktType.DATA, 0, 1, 1, 0, 0, 1, 256, tag, far, 0).pack()
                          + bytes(one[: job.lanes // 2]), addr)
            reply = c.sock.recv(4096)
            assert P.Header.unpack(reply).pkt_type == P.PktType.REFUSED
            assert (c.aggregate(one) == 3).all()
            time.sleep(0.6)  # the run goes idle: now the far-future id may take the job
            c.sock.sendto(P.Header(P.PktType.DATA, 0, 1, 0, 0, 0, 0, 0, tag, far, 0).pack()
                          + bytes(one[: job.lanes // 2]), addr)
            assert P.PktType(P.Header.unpack(c.sock.recv(4096)).pkt_type) == P.PktType.RESULT
            c.run = 1001
            t0 = time.monotonic()
            with pytest.raises(AggregationRefused, match="stale_run") as e:
                c.aggregate(one)
            assert e.value.detail == far and time.monotonic() - t0 < c.deadline / 2
        time.sleep(0.6)
        with AggregationClient(job, 0, addr, run=1002) as c:
            assert (c.aggregate(one) == 3).all()


@pytest.mark.parametrize("window", [-1, 0, 1.5, "4", True, np.int64(0)])
def test_a_window_that_cannot_hold_a_chunk_is_refused(window):
    """Case 8: window=-1 looped forever, past its deadline; so did a window of 0 set after
    construction (the Python window sent nothing and armed no timer)."""
    job = local_job(1, 1, free_port_block(1), table=TABLE)
    with pytest.raises(ValueError, match="window"):
        AggregationClient(job, 0, ("127.0.0.1", 9), window=window, run=1)
    with AggregationClient(job, 0, ("127.0.0.1", 9), run=1) as c:
        with pytest.raises(ValueError, match="window"):
            c.window = window
        c.window = 10 ** 6
        assert c.window == job.pool_size


def test_a_window_of_any_integer_type_is_taken():
    """A numpy integer (a config read through numpy) is a number of chunks, kept as int."""
    job = local_job(1, 1, free_port_block(1), table=TABLE)
    with AggregationClient(job, 0, ("127.0.0.1", 9), window=np.int64(8), run=1) as c:
        assert c.window == 8 and type(c.window) is int


def test_a_restarted_worker_under_the_same_run_id_fails_at_once(aggregator_kind, datapath):
    """A launcher that reuses THC_RUN for restarted processes: the new incarnation's chunks
    would meet the old uses at the same seqs (their results, or this worker's old bit), so it
    is refused (reused_run), never answered with the old run's sums."""
    job = local_job(1, 2, free_port_block(2), table=list(range(16)))
    ones = {w: np.full(job.lanes, 1, np.uint8) for w in range(2)}
    with make(aggregator_kind, [job]) as agg:
        addr = agg.start()
        out = run_workers(job, addr, ones, run=60)
        assert (out[0][0] == 2).all() and (out[1][0] == 2).all()
        twos = {w: np.full(job.lanes, 2, np.uint8) for w in range(2)}
        out = run_workers(job, addr, twos, run=60, deadline=3.0)
        for w in range(2):
            assert isinstance(out[w], AggregationRefused) and out[w].reason == "reused_run", \
                out[w]


def test_a_chunk_held_for_a_gone_worker_times_out_naming_it(datapath):
    """Worker 1 of 2 contributes to the first round, then is gone. Worker 0 closes the next
    chunks short (loss bound) and reaches chunks that reuse the first round's slot versions:
    they are held for worker 1, which may still need those results. Worker 0 does not close
    a held chunk (a FLUSH could only close it empty) and times out naming worker 1 as the
    one that has not moved past the previous use."""
    job = local_job(1, 2, free_port_block(2), pool_size=2, table=list(range(16)))
    pool = job.pool_size
    with Aggregator([job]) as agg:
        addr = agg.start()
        w1 = AggregationClient(job, 1, addr, run=70, deadline=1.0)
        w0 = AggregationClient(job, 0, addr, run=70, deadline=1.5, loss_bound=0.9)
        try:
            first = pack_bits(np.zeros(pool * job.lanes, np.uint8), P.INDEX_BITS)
            t = threading.Thread(target=w1.aggregate, args=(first,))
            t.start()
            w0.aggregate(first)
            t.join(10)
            with pytest.raises(AggregationTimeout, match=r"held: worker\(s\) \[1\]") as e:
                w0.aggregate(pack_bits(np.zeros(2 * pool * job.lanes, np.uint8),
                                       P.INDEX_BITS))
            assert e.value.missing == [1]
            assert w0.stats.short == pool, "the chunks before the held ones closed short"
            assert w0.stats.flushed == pool, "no FLUSH for a held chunk"
            assert w0.stats.compiled_rounds == 2 * (datapath == "compiled")
        finally:
            w0.close()
            w1.close()


def test_a_refusal_names_what_the_aggregator_holds_or_leaves_it_out():
    """A REFUSED's detail (the job's run, the slot's newer seq, the use's packet type, the
    first incarnation's nonce) is never 0: an aggregator that does not report it sends 0,
    and the message must not name run 0 or seq 0 as what the aggregator holds."""
    where = "job 3 run 9 seq 12"
    assert "another run (7) that is active" in str(AggregationRefused(where, "stale_run", 7))
    assert "39 hours" not in str(AggregationRefused(where, "stale_run", 7))
    assert "silent for 39 to 78 hours" in str(AggregationRefused(where, "stale_run", 0))
    assert "newer chunk (seq 40) of" in str(AggregationRefused(where, "stale", 40))
    # a forged packet from a worker's address that took a slot ahead reads the same
    assert "another process sends from a worker's address" in str(
        AggregationRefused(where, "stale", 40))
    assert "(nonce 0x0000abcd)" in str(AggregationRefused(where, "reused_run", 0xABCD))
    for reason in ("stale_run", "stale", "wrong_use", "reused_run"):
        text = str(AggregationRefused(where, reason, 0))
        assert "(" + reason + ")" in text and "0)" not in text and "0x" not in text, text
    assert "(shard 1 of 2)" in str(AggregationRefused(where, "wrong_shard", 2 << 16 | 1))
    assert "shard 5 of 0" not in str(AggregationRefused(where, "wrong_shard", 5))
    # a reason no refusal carries, or none at all: said so, not an empty hint
    for reason in ("reason 99", "unknown_job"):
        text = str(AggregationRefused(where, reason, 0))
        assert text.endswith("does not define: the aggregator speaks another version of the "
                             "protocol, or is broken"), text
    assert "offsets below 2^31" in str(AggregationRefused(where, "malformed", 0))


def _answers(job, complete):
    """Full results while ``complete`` is set, else PENDINGs that only worker 0 (the test's
    one client) contributed."""
    zeros = np.zeros(job.lanes, P.sum_dtype(job.sum_bits)).tobytes()
    return lambda t, seq: ((P.PktType.RESULT, 2, 0b11, zeros) if complete.is_set()
                           else (P.PktType.PENDING, 1, 0b01, b""))


@pytest.mark.parametrize("first_round_completes", [False, True])
def test_a_missing_worker_in_the_first_round_a_worker_hears_may_be_a_restart(
        datapath, first_round_completes):
    """A worker whose every reply before an aggregator restart was lost learns the new epoch
    from a PENDING: it cannot tell a lost round from a missing peer, whose timeout named the
    peer alone while the peers raised AggregatorRestarted. The timeout names both where this
    worker first heard the aggregator in the round; not where it had heard it before."""
    job = local_job(3, 2, free_port_block(2), pool_size=4, lanes=16)
    complete = threading.Event()
    if first_round_completes:
        complete.set()
    chunk = np.zeros(job.lanes // 2, np.uint8)
    with scripted_aggregator(job, _answers(job, complete)) as addr, \
            AggregationClient(job, 0, addr, run=5, deadline=1.0, datapath=datapath) as c:
        if first_round_completes:
            c.reduce(chunk)
            complete.clear()
        with pytest.raises(AggregationTimeout, match=r"missing worker\(s\) \[1\]") as err:
            c.reduce(chunk)
    assert ("aggregator restarted before this worker's first reply" in str(err.value)) \
        is not first_round_completes
    assert err.value.missing == [1]


def test_a_shard_first_heard_in_the_round_closes_no_chunk_short(datapath):
    """Two shards, a loss bound of one chunk in two. Shard 1's replies to worker 1 are lost
    until shard 1 restarts, after worker 0 took both chunks full. Worker 1's FLUSH opened a
    closed, empty use at the restarted shard, and it took count 0 where worker 0 took count
    2: no error anywhere, two gradients. A worker closes a chunk short only at a shard it
    heard in an earlier round of the run; here it resends to its deadline, and the timeout
    names the restart."""
    import dataclasses
    from thc.wire.jobs import Shard
    base = free_port_block(2)
    job = dataclasses.replace(local_job(1, 2, free_port_block(2)), loss_bound=0.5,
                              shards=(Shard("127.0.0.1", base), Shard("127.0.0.1", base + 1)))
    job = job.validate()
    lost_to = (job.workers[1].ip, job.workers[1].port)

    class Lossy(Aggregator):
        def handle(self, datagram, src):
            return [(d, dst) for d, dst in super().handle(datagram, src) if dst != lost_to]

    chunks = np.concatenate([pack_bits(np.full(job.lanes, v, np.uint8), P.INDEX_BITS)
                             for v in (15, 3)])
    got = {}

    def worker(w: int, deadline: float) -> None:
        with AggregationClient(job, w, run=7, deadline=deadline) as c:
            try:
                got[w] = c.reduce(chunks).counts.tolist()
            except AggregationTimeout as e:
                got[w] = e

    shard0, shard1 = Aggregator([job], shard=0), Lossy([job], shard=1)
    shard0.start("127.0.0.1", base)
    shard1.start("127.0.0.1", base + 1)
    late = threading.Thread(target=worker, args=(1, 1.5))
    try:
        late.start()
        worker(0, 1.5)
        assert got[0] == [2, 2]
        shard1.stop()
        shard1 = Aggregator([job], shard=1)
        shard1.start("127.0.0.1", base + 1)
        late.join(5)
    finally:
        shard0.stop()
        shard1.stop()
    assert isinstance(got[1], AggregationTimeout), got[1]
    assert "aggregator restarted before this worker's first reply" in str(got[1])
    assert "closes chunks short only at an aggregator heard in an earlier round" in str(got[1])


def test_the_restart_hint_is_the_timed_out_chunks_shard_alone(datapath):
    """Shard 0 was heard in round 1; in round 2 shard 1 is first heard (its chunk completes)
    while shard 0's chunk waits for a missing worker: no restart of shard 0 is hinted (the
    hint took any shard first heard in the round)."""
    import dataclasses
    from thc.wire.jobs import Shard
    base = local_job(3, 2, free_port_block(2), pool_size=4, lanes=16)
    first, second = threading.Event(), threading.Event()
    first.set()
    second.set()
    chunk = np.zeros(base.lanes // 2, np.uint8)
    with scripted_aggregator(base, _answers(base, first)) as a0, \
            scripted_aggregator(base, _answers(base, second)) as a1:
        job = dataclasses.replace(base, shards=(Shard(*a0), Shard(*a1))).validate()
        with AggregationClient(job, 0, run=5, deadline=1.0, datapath=datapath) as c:
            c.reduce(chunk)                                     # seq 0: shard 0
            first.clear()
            with pytest.raises(AggregationTimeout, match=r"missing worker\(s\) \[1\]") as err:
                c.reduce(np.concatenate([chunk, chunk]))        # seq 1: shard 1, seq 2: 0
    assert err.value.shard == 0 and "restarted" not in str(err.value)


@pytest.mark.parametrize("change", [{"table": [2 * v for v in range(16)]},
                                    {"granularity": 31}, {"sum_bits": 16}])
def test_an_aggregator_installed_with_another_configuration_is_refused(datapath, change):
    """An aggregator given another table (every sum it makes still possible under the
    workers' granularity) returned sums of its table, taken by both windows as the workers'
    own. Its epoch now carries its job's configuration tag: the first reply is refused."""
    import dataclasses
    job = local_job(1, 2, free_port_block(2), table=TABLE)
    theirs = dataclasses.replace(job, **change).validate()
    assert theirs.config_tag != job.config_tag
    with Aggregator([theirs]) as agg:
        addr = agg.start()
        for w in range(2):
            with AggregationClient(job, w, addr, run=5, deadline=1.0) as c:
                with pytest.raises(AggregatorMisconfigured, match=rf"serves job 1 with another "
                                   rf"configuration .*tag {theirs.config_tag:#06x}"):
                    c.aggregate(pack_bits(np.full(job.lanes, 3, np.uint8), P.INDEX_BITS))
                assert c.stats.compiled_rounds == (datapath == "compiled")


@pytest.mark.parametrize("other", ["table", "vote"])
def test_a_worker_configured_with_another_job_is_never_summed_into_its_peers_round(
        datapath, other):
    """A worker whose job differs from the aggregator's but whose payload has the same size
    (another table; a vote job of 1024 lanes sends the 128 bytes a THC job of 256 does) was
    summed: it raised AggregatorMisconfigured at the reply, but its peer took a sum holding
    its indices. Its packets now carry its job's configuration tag, refused as
    wrong_config: the peer's chunk never completes, and its timeout names the worker."""
    import dataclasses
    job = local_job(1, 2, free_port_block(2), table=TABLE)
    if other == "table":
        theirs = dataclasses.replace(job, table=tuple(2 * v for v in range(16))).validate()
    else:
        theirs = Job.vote(1, job.workers, lanes=4 * job.lanes).validate()
    payloads = [pack_bits(np.full(job.lanes, 3, np.uint8), P.INDEX_BITS),
                np.packbits(np.ones(theirs.lanes, np.uint8)) if other == "vote" else
                pack_bits(np.full(job.lanes, 5, np.uint8), P.INDEX_BITS)]
    assert len(payloads[0]) == len(payloads[1]) and theirs.config_tag != job.config_tag
    out: dict[int, object] = {}
    with Aggregator([job]) as agg:
        addr = agg.start()

        def worker(w: int, mine) -> None:
            with AggregationClient(mine, w, addr, run=5, deadline=1.5,
                                   datapath=datapath) as c:
                try:
                    out[w] = c.aggregate(payloads[w])
                except Exception as e:   # noqa: BLE001 - the outcome is the test's
                    out[w] = e
        threads = [threading.Thread(target=worker, args=(w, mine))
                   for w, mine in enumerate((job, theirs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert isinstance(out[1], AggregatorMisconfigured), out[1]
        assert isinstance(out[0], AggregationTimeout) and out[0].missing == [1], out[0]
        assert "wrong_config" in str(out[0])
        assert agg.drops["wrong_config"] >= 1


def test_a_second_thread_on_a_busy_client_is_refused_at_once():
    """Two threads' rounds on one client took the same sequence numbers: the second's DATA
    counted as a retransmission of the first's, and either could take the other's sums. A
    new run set while a round is in flight is refused alike."""
    job = local_job(1, 2, free_port_block(2), table=TABLE)
    chunk = pack_bits(np.full(job.lanes, 3, np.uint8), P.INDEX_BITS)
    with Aggregator([job]) as agg:
        addr = agg.start()
        with AggregationClient(job, 0, addr, run=5, deadline=1.5) as c:
            ended = []

            def first_round():
                try:
                    c.aggregate(chunk)
                    ended.append("a result")
                except Exception as e:  # noqa: BLE001 - checked below, in the test's thread
                    ended.append(e)
            first = threading.Thread(target=first_round)
            first.start()   # waits for worker 1, who never comes
            time.sleep(0.3)
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match="another thread's round"):
                c.aggregate(chunk)
            assert time.monotonic() - t0 < 0.5
            # a new run then: the round's end wrote its seq over the new run's 0, and its
            # failure made the new run's first round raise RunFailed
            with pytest.raises(RuntimeError, match="a round is in flight on this client"):
                c.run = 6
            first.join()
            assert len(ended) == 1 and isinstance(ended[0], AggregationTimeout), ended
            assert c.stats.sent - c.stats.retransmitted == 1   # the first round's chunk
            assert c.run == 5
            c.run = 6
            assert (c.run, c.next_seq) == (6, 0)


def test_a_call_from_another_thread_between_a_reducers_exchanges_is_refused():
    """A reducer's round is several exchanges (its MAX, its DATA); a direct call from another
    thread between them took the sequence numbers its peers gave the reducer's DATA, and both
    took sums of two tensors (THC's mean 0.51 for two workers' 1.0). The reducer holds the
    client's round lock for its round: the call is refused, the round's sums are its own."""
    import torch

    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    params = THCParams(slice_size=256)
    job = local_job(1, 1, free_port_block(1), granularity=params.granularity,
                    table=params.table)
    chunk = pack_bits(np.full(job.lanes, 3, np.uint8), P.INDEX_BITS)
    with Aggregator([job]) as agg:
        addr = agg.start()
        with AggregationClient(job, 0, addr, run=1, deadline=2.0) as c:
            ar = THCAllReduce.through_aggregator(c, params)
            sum_round, between = ar.transport.sum, []

            def call_between(*a, **kw):
                def direct():
                    try:
                        between.append(c.aggregate(chunk))
                    except RuntimeError as e:
                        between.append(e)
                t = threading.Thread(target=direct)
                t.start()
                t.join()
                return sum_round(*a, **kw)
            ar.transport.sum = call_between
            out = ar(torch.ones(1024))
            assert len(between) == 1 and isinstance(between[0], RuntimeError), between
            assert "a reducer's exchanges" in str(between[0])
            assert abs(float(out.mean()) - 1.0) < 0.1
            assert c.aggregate(chunk).max() > 0   # the client goes on


@pytest.mark.parametrize("attr, value", [("deadline", float("inf")),
                                         ("deadline", float("nan")),
                                         ("deadline", P.RUN_IDLE_S), ("timeout", 0.0)])
def test_timers_set_after_the_client_was_made_are_checked_at_each_round(datapath, attr,
                                                                          value):
    """Checked only when the client was made, a deadline set later to inf or NaN let a round
    whose peer never came wait for good."""
    job = local_job(1, 2, free_port_block(2), table=TABLE)
    chunk = pack_bits(np.full(job.lanes, 3, np.uint8), P.INDEX_BITS)
    with Aggregator([job]) as agg:
        addr = agg.start()
        with AggregationClient(job, 0, addr, run=5, deadline=1.0, datapath=datapath) as c:
            setattr(c, attr, value)
            t0 = time.monotonic()
            with pytest.raises(ValueError, match="timeouts must be finite|below the aggregat"):
                c.aggregate(chunk)
            assert time.monotonic() - t0 < 0.5 and c.stats.sent == 0
