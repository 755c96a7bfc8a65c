"""Both client datapaths' timers against scripted aggregators on loopback: resends and their
backoff caps, the round-trip estimate (spurious timeouts, PENDING samples), deadlines kept,
and a silent aggregator or shard named as such."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from thc.codec.packing import unpack_bits
from thc.net.client import AggregationClient, AggregationTimeout
from thc.net.window import timeout_for
from thc.testing.clusters import free_port_block
from thc.wire import protocol as P
from thc.wire.jobs import Job
from tests.scripted import answering, epoch, scripted_aggregator
from tests.client_cases import ScriptedAggregator, _complete, _index_zero, _packed, _reply
from tests.client_cases import job  # noqa: F401 (a fixture)
from tests.test_transport import datapath  # noqa: F401 (a fixture)


def test_a_silent_aggregator_is_named_under_a_deadline_of_two_max_timeouts(job, datapath):
    """A PENDING (worker 1 late), then silence, under a deadline (0.8 s) below twice
    max_timeout (0.5 s): the resends it left unanswered name the aggregator, not worker 1."""
    t0 = time.monotonic()

    def answer(data):
        return [_reply(job, data, P.PktType.PENDING, 1, 0b01)] if time.monotonic() - t0 < 0.1 \
            else []

    with answering(answer) as addr:
        with AggregationClient(job, 0, addr, run=2, deadline=0.8) as c:
            t0 = time.monotonic()
            with pytest.raises(AggregationTimeout, match="the aggregator at .* stopped "
                                                         "answering") as e:
                c.aggregate(_packed(job, 1)[: job.lanes // 2])
            assert e.value.missing is None and c.stats.pending >= 1


def test_a_silent_shard_is_named_though_another_shard_answers(datapath):
    """Shard 1 answers one PENDING, then falls silent; shard 0 goes on answering its own
    chunks' resends (worker 1 is late there too). Shard 0's replies say nothing of shard 1:
    the timeout of shard 1's chunk names shard 1, not worker 1."""
    base = free_port_block(2)
    t0 = time.monotonic()
    first = {}

    def shard0(data):
        seq = P.HEADER_STRUCT.unpack_from(data)[6]
        # chunk 0 completes after 0.3 s (so chunk 2 starts late, timing out after chunk 1),
        # chunk 2 waits for worker 1 for ever
        if seq == 0 and time.monotonic() - first.setdefault(0, time.monotonic()) > 0.3:
            # sums the client can take: its own values twice (zeros it refuses as impossible,
            # and chunk 0 then raced chunk 1 to the first timeout)
            own = unpack_bits(np.frombuffer(data, np.uint8, offset=P.HEADER_BYTES),
                              P.INDEX_BITS, job.lanes)
            sums = (2 * np.asarray(job.table)[own]).astype(np.uint8).tobytes()
            return [_complete(data, P.PktType.RESULT, job) + sums]
        return [_reply(job, data, P.PktType.PENDING, 1, 0b01)]

    def shard1(data):
        return [_reply(job, data, P.PktType.PENDING, 1, 0b01)] if time.monotonic() - t0 < 0.1 \
            else []

    with answering(shard0) as a0, answering(shard1) as a1:
        job = Job.from_dict({"job_id": 1, "pool_size": 16, "lanes": P.LANES, "granularity": 30,
                             "workers": [{"id": i, "ip": "127.0.0.1", "port": base + i}
                                         for i in range(2)],
                             "shards": [{"ip": a[0], "port": a[1]} for a in (a0, a1)]})
        packed = _packed(job, 1)[: 3 * job.lanes // 2]
        with AggregationClient(job, 0, run=2, deadline=1.2, max_timeout=0.1, window=2) as c:
            t0 = time.monotonic()
            with pytest.raises(AggregationTimeout, match=r"chunk seq 1 .* aggregator shard 1 "
                                                         r"at .* stopped answering") as e:
                c.aggregate(packed)
            assert e.value.missing is None and c.stats.rejected == 0
            assert c.stats.compiled_rounds == (datapath == "compiled")


@pytest.mark.parametrize("then", ["silent", "strays"])
def test_a_shard_that_dies_mid_round_is_named_as_stopped_not_as_losing_packets(datapath,
                                                                                then):
    """Shard 1 takes the round's first chunk of its own, then falls silent; its next chunk
    never had a PENDING. The resends it left unanswered for half the deadline name it as
    stopped (down or unreachable), not the chunk's packets as lost: it took a chunk, but
    that was before it went quiet. One that goes on answering with another worker's id is
    up, and its strays are named."""
    def result(data):
        own = unpack_bits(np.frombuffer(data, np.uint8, offset=P.HEADER_BYTES),
                          P.INDEX_BITS, job.lanes)
        return _complete(data, P.PktType.RESULT, job) + \
            np.asarray(job.table)[own].astype(np.uint8).tobytes()

    answered = set()

    def shard1(data):
        seq = P.HEADER_STRUCT.unpack_from(data)[6]
        if not answered or seq in answered:
            answered.add(seq)
            return [result(data)]
        if then == "strays":
            stray = bytearray(_reply(job, data, P.PktType.PENDING, 0, 0))
            stray[1] = 7    # another worker's id
            return [bytes(stray)]
        return []

    with answering(lambda data: [result(data)]) as a0, answering(shard1) as a1:
        job = Job.from_dict({"job_id": 1, "pool_size": 16, "lanes": P.LANES, "granularity": 30,
                             "workers": [{"id": 0, "ip": "127.0.0.1",
                                          "port": free_port_block(1)}],
                             "shards": [{"ip": a[0], "port": a[1]} for a in (a0, a1)]})
        with AggregationClient(job, 0, run=2, deadline=1.2, max_timeout=0.1, window=4) as c:
            named = (r"aggregator shard 1 at .* stopped answering .*\(down, unreachable"
                     if then == "silent" else r"no answer from aggregator shard 1 .* datagrams "
                     r"from aggregator shard 1's address this round answered no chunk")
            with pytest.raises(AggregationTimeout, match=named):
                c.aggregate(_packed(job, 1)[: 6 * job.lanes // 2])
            assert answered == {1}


def test_a_live_aggregator_quiet_between_long_backoffs_is_not_called_silent(job, datapath):
    """A DSCP-marked chunk backs off in full (0.32 s after the resend at 0.3 s), so with a
    0.5 s deadline the aggregator, answering every resend, was last heard more than half
    the deadline ago: with no resend left unanswered that is no silence, and the missing
    worker is named, on both windows."""
    agg = ScriptedAggregator(job, mode="pending")
    try:
        with AggregationClient(job, 0, agg.addr, run=5, deadline=0.5) as c:
            with pytest.raises(AggregationTimeout, match=r"missing worker\(s\) \[1\]") as e:
                c.aggregate(_packed(job, 1)[: job.lanes // 2], classes=np.zeros(1, np.uint8))
            assert e.value.missing == [1]
            assert c.stats.compiled_rounds == (datapath == "compiled")
    finally:
        agg.close()


def test_a_chunk_later_ones_overtook_is_resent_within_the_fast_backoff_cap(job, datapath):
    """Chunk 3 is lost 8 times while every later chunk completes and the head (chunk 0)
    waits 1 s for a peer: the overtakes say a packet was lost, so chunk 3 is resent at
    least every FAST_BACKOFF_CAP RTOs (80 ms at the 20 ms floor), not after a backoff
    grown towards max_timeout (1 s here) as for a chunk waiting on peers."""
    n, lost, sent = 8, 8, []
    zeros = np.zeros(job.lanes, P.sum_dtype(job.sum_bits)).tobytes()
    result = (P.PktType.RESULT, 2, 0b11, zeros)
    start = time.monotonic()

    def answer(t, seq):
        i = seq % n
        if i == 3:
            sent.append(time.monotonic())
            return result if len(sent) > lost else None
        if i == 0 and time.monotonic() < start + 1.0:
            return (P.PktType.PENDING, 1, 0b01, b"")
        return result

    with scripted_aggregator(job, answer) as addr, \
            AggregationClient(job, 0, addr, run=4, deadline=5.0, window=n,
                              max_timeout=1.0) as c:
        c.aggregate(_index_zero(job, n))
        assert c.stats.compiled_rounds == (datapath == "compiled")
    gaps = np.diff(sent[: lost + 1])
    assert len(sent) > lost and gaps.max() < 0.3, gaps


def test_a_round_trip_past_the_timeout_floor_is_learnt_from_spurious_timeouts(job, datapath):
    """Every result comes 50 ms after its DATA, 2.5 times the 20 ms timeout floor, so the
    first chunks all time out and are resent. Karn's rule takes no sample from a resent
    chunk, and the estimator never learnt the round trip (each chunk resent about twice,
    every round). The second RESULT of a chunk resent once shows the timeout spurious and
    gives the sample: after the first round, few resends (a late scripted reply)."""
    zeros = np.zeros(job.lanes, P.sum_dtype(job.sum_bits)).tobytes()
    n = 64
    with scripted_aggregator(job, lambda t, seq: (P.PktType.RESULT, 2, 0b11, zeros),
                             delay=0.05) as addr, \
            AggregationClient(job, 0, addr, run=4, window=16) as c:
        data = _index_zero(job, n)
        c.aggregate(data)
        first = c.stats.retransmitted
        for _ in range(2):
            c.aggregate(data)
        assert c.stats.compiled_rounds == (datapath == "compiled") * 3
    assert c.stats.spurious > 0 and first > 0
    assert c.stats.retransmitted - first < n // 2, (first, c.stats.retransmitted)


def test_a_steady_round_trip_keeps_the_timeout_as_margin(job, datapath):
    """Steady 50 ms round trips take the estimator's variance to about zero. With an RTO of
    ``srtt + 4 * rttvar`` alone, round trips 12 ms longer then time every chunk out and
    the window is sent twice; the configured timeout (20 ms) is kept as the margin."""
    zeros = np.zeros(job.lanes, P.sum_dtype(job.sum_bits)).tobytes()
    n, path = 64, {"delay": 0.05}
    with scripted_aggregator(job, lambda t, seq: (P.PktType.RESULT, 2, 0b11, zeros),
                             delay=lambda: path["delay"]) as addr, \
            AggregationClient(job, 0, addr, run=4, window=16, timeout=timeout_for(0.1)) as c:
        data = _index_zero(job, n)
        for _ in range(3):
            c.aggregate(data)
        assert c.rto(0) >= c.rtt.srtt[0] + 0.02, (c.rto(0), c.rtt.srtt, c.rtt.rttvar)
        before = c.stats.retransmitted
        path["delay"] = 0.062
        c.aggregate(data)
    assert c.stats.retransmitted - before < n // 2, (before, c.stats.retransmitted)


def test_a_duplicated_answer_to_a_resend_is_no_spurious_timeout(job, datapath):
    """Each chunk's first DATA is lost and its resend answered with two RESULTs (a
    duplicated reply): two RESULTs, but the first send was never answered. A sample from
    it (the RTO plus the round trip) would raise the RTO every round towards max_timeout;
    the duplicate comes at once, not the resend's delay after the first RESULT, so no
    sample is taken and the RTO stays at the floor."""
    zeros = np.zeros(job.lanes, P.sum_dtype(job.sum_bits)).tobytes()
    seen = set()

    def reply(data):
        (_t, w, j, slot, ver, _c, seq, off, _b, run, _e) = P.HEADER_STRUCT.unpack_from(data)
        if seq not in seen:
            seen.add(seq)
            return []
        r = P.HEADER_STRUCT.pack(P.PktType.RESULT, w, j, slot, ver, 2, seq, off, 0b11, run,
                                 epoch(job)) + zeros
        return [r, r]

    # a 200 ms floor: the copy counts as a duplicate when read within half the resend's
    # delay of the first RESULT, and under the suite's load the Python datapath read one
    # more than 10 ms (half the default floor) after it
    with answering(reply) as addr, AggregationClient(job, 0, addr, run=4, window=16,
                                                     timeout=0.2) as c:
        data = _index_zero(job, 16)
        for _ in range(8):
            c.aggregate(data)
        assert c.stats.compiled_rounds == (datapath == "compiled") * 8
        assert c.stats.retransmitted >= 8 * 16 and c.stats.spurious == 0
        assert c.rtt.rto(0) == c.timeout


def _peer_late(job, wait: float, held: bool = False):
    """A scripted aggregator's answers while the other worker is ``wait`` seconds late with
    each chunk: nothing to a chunk's first DATA, then PENDINGs (held ones, count 0, to every
    DATA with ``held``: this worker, whose DATA acknowledges the slot's previous use, is the
    only one past it), then its RESULT."""
    zeros = np.zeros(job.lanes, P.sum_dtype(job.sum_bits)).tobytes()
    first: dict[int, float] = {}

    def answer(t, seq):
        now = time.monotonic()
        if seq not in first:
            first[seq] = now
            if not held:
                return None
        if now < first[seq] + wait:
            return (P.PktType.PENDING, 0, 0b01, b"") if held else \
                (P.PktType.PENDING, 1, 0b01, b"")
        return (P.PktType.RESULT, 2, 0b11, zeros)
    return answer


def _srtt_while_peer_late(job, datapath, wait, delay, chunks, held=False, **kw):
    """The estimator's srtt after one round of ``chunks`` against :func:`_peer_late`, its
    replies ``delay`` seconds late."""
    with scripted_aggregator(job, _peer_late(job, wait, held), delay=delay) as addr, \
            AggregationClient(job, 0, addr, run=4, window=chunks, **kw) as c:
        c.aggregate(_index_zero(job, chunks))
        assert c.stats.compiled_rounds == (datapath == "compiled")
        assert c.stats.pending > 0 and c.stats.retransmitted >= chunks
    return c.rtt.srtt[0]


def test_a_pending_gives_its_resends_round_trip_while_peers_are_late(job, datapath):
    """Each chunk waits 0.2 s for the other worker, and every reply comes 30 ms late (after
    the first resend at 20 ms, before the second at 60): every chunk is resent, and the
    resends are answered with PENDINGs. Karn's rule, and the spurious-timeout rule (a
    PENDING came), take no sample: the estimator never learnt the 30 ms. A PENDING that is
    not held answers a resend, so for a chunk resent once it is that resend's round trip: at
    least the replies' 30 ms, and far below the 0.2 s wait for the peer (the bound leaves
    room for a loaded machine's scheduling)."""
    srtt = _srtt_while_peer_late(job, datapath, wait=0.2, delay=0.03, chunks=8)
    assert srtt is not None and 0.028 < srtt < 0.1, srtt


def test_a_held_pending_gives_no_round_trip(job, datapath):
    """A held PENDING (count 0: the slot's previous use is not acknowledged) answers a first
    send as well as a resend: one arriving after a resend may be the first send's, 50 ms
    late, and would give the resend's shorter time. No sample is taken from it."""
    srtt = _srtt_while_peer_late(job, datapath, wait=0.2, delay=0.05, chunks=8, held=True)
    assert srtt is None, srtt


def test_pending_samples_are_never_shorter_than_the_round_trip(job, datapath):
    """Replies 150 ms late, resends at most 100 ms apart (max_timeout) while the chunk waits
    0.6 s for a peer: several resends are in flight, and a PENDING may answer any of them.
    Paired with the latest resend, each sample was the round trip less the gap between
    resends."""
    srtt = _srtt_while_peer_late(job, datapath, wait=0.6, delay=0.15, chunks=4,
                                 max_timeout=0.1)
    assert srtt is None or srtt > 0.14, srtt   # no sample, or none short


def test_a_deadline_ends_the_round_in_time_rather_than_hang(job, datapath):
    """The deadline counts from a chunk's first send, not its latest resend: a worker that
    waits for a peer that never comes raises within a bound time. Run in a thread joined
    with a limit, so that a window whose deadline never comes fails in seconds, saying so
    (the suite's per-test timeout would take minutes)."""
    agg = ScriptedAggregator(job, mode="pending")
    out = {}

    def wait():
        with AggregationClient(job, 0, agg.addr, run=5, deadline=0.3) as c:
            try:
                c.aggregate(_packed(job, 1)[: job.lanes // 2])
            except AggregationTimeout as e:
                out["error"] = e

    try:
        t0 = time.monotonic()
        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        waiter.join(10)
        assert "error" in out, f"no AggregationTimeout {time.monotonic() - t0:.0f} s into " \
                               f"a round under a 0.3 s deadline"
        assert out["error"].missing == [1]
    finally:
        agg.close()


@pytest.mark.parametrize("kw", [{"timeout": 4.0, "max_timeout": 4.0, "deadline": 0.5},
                                {"max_timeout": 8.0, "deadline": 3.0, "tos": True},
                                {"timeout": 1.5, "max_timeout": 8.0, "deadline": 3.0}],
                         ids=["deadline-below-timeout", "priority-classes-backoff",
                              "backoff-past-the-deadline"])
def test_no_resend_timer_waits_past_the_deadline(job, datapath, kw):
    """A chunk's resend timer is cut at its deadline: a deadline below the timeout, a chunk
    of a priority class backed off towards max_timeout, or a resend at 1.5 s backed off to
    3 s more (past a 3 s deadline), raises at the deadline, not at the next resend (4 s for
    a 0.5 s deadline, 5.1 s or 4.5 s for 3 s)."""
    kw = dict(kw)
    tos = kw.pop("tos", False)
    with answering(lambda data: [_reply(job, data, P.PktType.PENDING, 1, 0b01)]) as addr:
        with AggregationClient(job, 0, addr, run=5, **kw) as c:
            packed = _packed(job, 1)[: job.lanes]
            t0 = time.monotonic()
            with pytest.raises(AggregationTimeout, match=r"missing worker\(s\) \[1\]"):
                c.aggregate(packed, classes=np.zeros(2, int) if tos else None)
            waited = time.monotonic() - t0
            assert c.stats.compiled_rounds == (datapath == "compiled")
    assert kw["deadline"] <= waited < kw["deadline"] + 0.4, waited


def test_a_held_chunk_is_resent_within_the_fast_backoff_cap(job, datapath):
    """Chunk 1 is held 1.3 s (PENDING count 0: a peer holds its slot's previous result) while
    the head, chunk 0, waits for a peer: a held chunk goes on the moment the peer moves on,
    so it is resent at least every FAST_BACKOFF_CAP RTOs (80 ms at the 20 ms floor), not
    after a backoff grown towards max_timeout (1 s here)."""
    sent = []
    zeros = np.zeros(job.lanes, P.sum_dtype(job.sum_bits)).tobytes()
    start = time.monotonic()

    def answer(t, seq):
        if time.monotonic() >= start + 1.3:
            return (P.PktType.RESULT, 2, 0b11, zeros)
        if seq == 1:
            sent.append(time.monotonic())
            return (P.PktType.PENDING, 0, 0b01, b"")
        return (P.PktType.PENDING, 1, 0b01, b"")

    with scripted_aggregator(job, answer) as addr, \
            AggregationClient(job, 0, addr, run=4, deadline=5.0, window=2,
                              max_timeout=1.0) as c:
        start = time.monotonic()
        c.aggregate(_index_zero(job, 2))
        assert c.stats.compiled_rounds == (datapath == "compiled")
    gaps = np.diff(sent)
    assert len(sent) > 5 and gaps.max() < 0.45, gaps   # the doubling reached 0.64 s


def test_the_resend_timer_never_exceeds_its_cap():
    """A reply after a long stall is a round-trip sample of seconds: uncapped, the next
    resend would wait that long plus four deviations, far past --max-timeout."""
    from thc.net.window import RttEstimator
    est = RttEstimator(2, timeout=0.05, max_timeout=1.0)
    assert est.rto(0) == 0.05
    est.sample(0, 10.0)
    assert est.rto(0) == 1.0 and est.rto(1) == 0.05
    for _ in range(40):
        est.sample(0, 0.01)
    assert 0.05 < est.rto(0) < 1.0


def test_timers_set_after_the_client_was_made_time_its_resends(job, datapath):
    """The Python window timed resends by the timers the client was made with (a first
    resend after 1 s where 0.05 s had been set since, 10 times the new cap), as did
    ``rto()``; the compiled window took the new ones."""
    sent = []

    def silent(data):
        sent.append(time.monotonic())
        return []

    with answering(silent) as addr:
        with AggregationClient(job, 0, addr, run=3, timeout=1.0, max_timeout=2.0,
                               deadline=0.6, datapath=datapath) as c:
            c.timeout, c.max_timeout = 0.05, 0.1
            assert c.rto(0) == 0.05
            with pytest.raises(AggregationTimeout):
                c.aggregate(_packed(job, 1)[: job.lanes // 2])
    gaps = np.diff(sent)
    assert len(sent) >= 4 and gaps.max() < 0.3, gaps


def test_a_timeout_of_half_a_long_round_trip_learns_it_in_the_first_round(job, datapath):
    """Every result comes 100 ms after its DATA. At the 20 ms default a chunk goes three
    times (0, 20 and 60 ms) before its first RESULT, which gives no sample: every chunk of
    every round went three times (384 datagrams a round of 128 chunks). At half the round
    trip (what a testbed with link delay gives its workers, thc.emu.links.client_timeout)
    the first two windows go twice (the second leaves before the first's spurious timeouts
    are told), those give the round trip, and later chunks go once."""
    zeros = np.zeros(job.lanes, P.sum_dtype(job.sum_bits)).tobytes()
    n, window = 64, 16
    with scripted_aggregator(job, lambda t, seq: (P.PktType.RESULT, 2, 0b11, zeros),
                             delay=0.1) as addr, \
            AggregationClient(job, 0, addr, run=4, window=window,
                              timeout=timeout_for(0.1)) as c:
        c.aggregate(_index_zero(job, n))
        first = c.stats.retransmitted
        c.aggregate(_index_zero(job, n))
    later = c.stats.retransmitted - first   # a few where a loaded host answers late
    assert first <= 2 * window and later <= window // 4, (first, later)
