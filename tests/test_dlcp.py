"""DLCP on the host: priority classes in DSCP, and rounds that close short within a loss bound."""
from __future__ import annotations

import argparse
import json
import math
import re
import socket
import threading
import time

import numpy as np
import pytest
import torch

from thc.codec.params import THCParams
from thc.collective.allreduce import THCAllReduce
from thc.net.aggregator import Aggregator
from thc.net.client import AggregationClient, AggregationTimeout
from thc.net.fastclient import CLIENT_UNAVAILABLE
from thc.net.impair import Impairment
from thc.net.outcomes import LossBoundExceeded
from thc.net.priority import FLUSH_CLASS, N_CLASSES, magnitude_rank, priority_class, tos_of
from thc.testing.clusters import free_port_block, local_job
from thc.wire import protocol as P
from thc.wire.jobs import ConfigError, Job
from tests.scripted import answering, epoch, scripted_aggregator
from tests.test_transport import datapath  # noqa: F401 (a fixture)


def test_classes_rank_early_layers_and_large_gradients_first():
    assert priority_class(0.0, 1.0) == N_CLASSES - 1
    assert priority_class(1.0, 0.0) == 0
    pos = np.linspace(0, 1, 50)
    assert np.all(np.diff(priority_class(pos, np.full(50, 0.5)).astype(int)) <= 0)
    assert np.all(np.diff(priority_class(np.full(50, 0.5), pos).astype(int)) >= 0)
    np.testing.assert_array_equal(magnitude_rank([3.0, 1.0, 2.0]), [1.0, 0.0, 0.5])
    for bad in ((1.5, 0.0), (float("nan"), 0.5), (0.0, float("nan"))):
        with pytest.raises(ValueError, match="must lie in"):   # NaN passed as class 0
            priority_class(*bad)


@pytest.mark.parametrize("bad", [1.0, -0.01, float("nan"), True, "0.1", 2])
def test_loss_bound_outside_unit_interval_is_a_clear_error(bad):
    job = local_job(1, 2, 40000)
    d = job.to_dict() | {"loss_bound": bad}
    with pytest.raises(ConfigError, match="loss_bound"):
        Job.from_dict(d)
    with pytest.raises(ConfigError, match="loss_bound"):
        AggregationClient(job, 0, ("127.0.0.1", 1), loss_bound=bad,
                          sock=socket.socket(socket.AF_INET, socket.SOCK_DGRAM))


def test_the_flush_budget_is_the_bounds_floor_in_real_arithmetic():
    """floor(loss_bound x chunks) as docs/protocol.md writes it: 0.29 x 100 is
    28.999999999999996 in floating point, which gave 28; a bound just below an integer
    product (0.9999999999 of one chunk) is not rounded up to it."""
    from thc.net.window import flush_budget
    cases = {(0.29, 100): 29, (1 / 3, 3): 1, (0.57, 100): 57, (0.5, 3): 1, (0.1, 9): 0,
             (0.99, 1999): 1979, (0.25, 4): 1,
             (0.9999999999, 1): 0, (0.2999999999, 10): 2, (0.4999999995, 2): 0}
    assert {k: flush_budget(*k) for k in cases} == cases
    # every bound of two decimals over up to 1999 chunks, against exact decimal arithmetic
    from fractions import Fraction
    wrong = [(b, n) for b in range(1, 100) for n in range(1, 2000)
             if flush_budget(b / 100, n) != math.floor(Fraction(b * n, 100))]
    assert not wrong, wrong[:5]
    # the largest bound below 1: its product rounds to the count itself in floating point
    below_one = math.nextafter(1.0, 0.0)
    assert [flush_budget(below_one, n) for n in (1, 2, 4, 1000, 12345)] == \
        [0, 1, 3, 999, 12344]


class TosRecordingAggregator:
    """The software aggregator behind a socket that records each datagram's TOS byte."""

    def __init__(self, job):
        self.agg = Aggregator([job])
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.tos: list[tuple[int, int, int]] = []     # (pkt_type, seq, tos)
        self.stop = False
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while not self.stop:
            try:
                data, anc, _, src = self.sock.recvmsg(4096, 64)
            except socket.timeout:
                continue
            tos = next((c[2][0] for c in anc if c[1] == socket.IP_TOS), 0)
            self.tos.append((data[0], P.HEADER_STRUCT.unpack_from(data)[6], tos))
            for out, dst in self.agg.handle(data, src):
                self.sock.sendto(out, dst)

    def close(self):
        self.stop = True
        self.thread.join()
        self.sock.close()


def test_each_data_packet_carries_its_chunks_class_in_dscp(datapath):
    job = local_job(7, 1, free_port_block(1))
    agg = TosRecordingAggregator(job)
    try:
        with AggregationClient(job, 0, agg.sock.getsockname(), run=5) as c:
            classes = np.array([3, 0, 1, 2, 3, 0], np.uint8)
            packed = np.zeros(len(classes) * job.lanes // 2, np.uint8)
            c.aggregate(packed, classes=classes)
            c.aggregate(packed[: job.lanes // 2])          # no classes: best effort
            assert c.stats.compiled_rounds == 2 * (datapath == "compiled")
    finally:
        agg.close()
    # each seq's class, in every send of it (a late retransmission comes after the next round)
    data = {(seq, tos) for t, seq, tos in agg.tos if t == P.PktType.DATA}
    assert data == {(i, tos_of(k)) for i, k in enumerate(classes)} | {(len(classes), 0)}, data
    assert [tos_of(k) >> 2 for k in range(N_CLASSES)] == list(P.PRIORITY_DSCP)
    # a FLUSH ends a wait: it goes in the class of the chunks kept longest (docs/protocol.md)
    assert FLUSH_CLASS == int(priority_class(0.0, 1.0)) == N_CLASSES - 1


@pytest.mark.parametrize("dest", ["ipv6", "ipv4-mapped"])
def test_an_ipv6_socket_marks_its_classes_and_names_a_silent_aggregator(dest):
    """An IPv6 socket ignores an IP_TOS control message: every chunk went out best effort.
    Its marks go in IPV6_TCLASS, but to an IPv4-mapped address (``::ffff:a.b.c.d``, IPv4 on
    the wire) in IP_TOS, which that honours; a round no one answers ends in the timeout that
    names the aggregator (it ended in a ValueError, unpacking an IPv6 address as two
    values)."""
    job = local_job(7, 1, free_port_block(1))
    v6 = dest == "ipv6"
    rx = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM)
    level, option, mark = ((socket.IPPROTO_IPV6, socket.IPV6_RECVTCLASS, socket.IPV6_TCLASS)
                           if v6 else (socket.IPPROTO_IP, socket.IP_RECVTOS, socket.IP_TOS))
    rx.setsockopt(level, option, 1)
    rx.bind(("::1" if v6 else "127.0.0.1", 0))
    rx.settimeout(0.2)
    sock = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(("::", 0))
    host = "::1" if v6 else "::ffff:127.0.0.1"
    classes = np.array([3, 1], np.uint8)
    try:
        with AggregationClient(job, 0, (host, rx.getsockname()[1]), run=5, sock=sock,
                               timeout=0.05, deadline=0.5) as c:
            with pytest.raises(AggregationTimeout,
                               match=re.escape(f"no answer from the aggregator at [{host}]:"
                                               f"{rx.getsockname()[1]} ")):
                c.aggregate(np.zeros(len(classes) * job.lanes // 2, np.uint8),
                            classes=classes)
        seen = set()
        while True:
            try:
                data, anc, _, _ = rx.recvmsg(4096, 64)
            except socket.timeout:
                break
            tos = next(c[2][0] for c in anc if c[1] == mark)
            seen.add((data[0], P.HEADER_STRUCT.unpack_from(data)[6], tos))
    finally:
        rx.close()
    assert {(seq, tos) for t, seq, tos in seen if t == P.PktType.DATA} == {
        (i, tos_of(k)) for i, k in enumerate(classes)}, seen


def test_a_flush_goes_in_the_top_class_of_a_round_with_classes(datapath):
    """A bounded round with classes: the chunk worker 0 closes short (worker 1 is gone after
    a full round) goes out as a FLUSH marked with the top class, whatever its DATA's."""
    job = local_job(7, 2, free_port_block(2), pool_size=16)
    agg = TosRecordingAggregator(job)
    classes = np.array([0, 1, 0, 1], np.uint8)
    packed = np.zeros(len(classes) * job.lanes // 2, np.uint8)
    clients = [AggregationClient(job, w, agg.sock.getsockname(), run=5, timeout=0.02,
                                 max_timeout=0.1, deadline=1.0, loss_bound=0.25)
               for w in range(2)]
    try:
        ts = [threading.Thread(target=c.aggregate, args=(packed,), kwargs={"classes": classes})
              for c in clients]
        [t.start() for t in ts]
        [t.join() for t in ts]
        with pytest.raises(AggregationTimeout):
            clients[0].aggregate(packed, classes=classes)
    finally:
        for c in clients:
            c.close()
        agg.close()
    flushes = {tos for t, _seq, tos in agg.tos if t == P.PktType.FLUSH}
    assert flushes == {tos_of(N_CLASSES - 1)}, flushes
    data = {(seq, tos) for t, seq, tos in agg.tos if t == P.PktType.DATA}
    assert data == {(i, tos_of(k)) for i, k in enumerate(classes)} | {
        (len(classes) + i, tos_of(k)) for i, k in enumerate(classes)}, data
    assert clients[0].stats.compiled_rounds == 2 * (datapath == "compiled")


class Recording(AggregationClient):
    """A client that keeps its last DATA round's result for the checks."""
    last = None

    def reduce(self, *args, **kw):
        self.last = super().reduce(*args, **kw)
        return self.last


def _allreduce_with_loss(loss_bound: float, n: int = 3, numel: int = 1 << 14):
    """n workers through the software aggregator; worker n-1 loses 30% of what it sends."""
    job = local_job(9, n, free_port_block(n), pool_size=16)
    params = THCParams(slice_size=1 << 12)
    rng = np.random.default_rng(0)
    xs = [torch.from_numpy(rng.standard_normal(numel).astype(np.float32)) for _ in range(n)]
    out, ars, clients = [None] * n, [None] * n, [None] * n
    with Aggregator([job]) as agg:
        addr = agg.start()

        def worker(w):
            imp = Impairment(loss=0.3, seed=w) if w == n - 1 else None
            clients[w] = Recording(job, w, addr, run=11, impair=imp, deadline=20,
                                           loss_bound=loss_bound)
            ars[w] = THCAllReduce.through_aggregator(clients[w], params)
            out[w] = ars[w](xs[w], position=torch.linspace(0, 1, numel))

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for c in clients:
        c.close()
    return xs, out, ars, clients


def test_round_closes_short_within_the_bound_and_feedback_keeps_what_was_lost():
    xs, out, ars, clients = _allreduce_with_loss(loss_bound=0.4)
    n = len(xs)
    budget = int(0.4 * len(clients[0].last.counts))
    assert all(c.stats.short > 0 for c in clients), "some chunks must have closed short"
    # every replica saw the same frozen chunks and decoded the same mean
    for c in clients[1:]:
        np.testing.assert_array_equal(c.last.counts, clients[0].last.counts)
        np.testing.assert_array_equal(c.last.bitmaps, clients[0].last.bitmaps)
    for o in out[1:]:
        assert torch.equal(o, out[0])
    assert (clients[0].last.counts < n).sum() <= n * budget
    lost = clients[-1].last.bitmaps >> (n - 1) & 1 == 0
    assert lost.any()
    # the estimate is the sum of what each worker had counted (its own value, zero where
    # lost), over n; each worker's residual is exactly the rest of its input
    own = [xs[w] - ars[w].feedback.residual for w in range(n)]
    torch.testing.assert_close(out[0], sum(own) / n, atol=2e-5, rtol=1e-4)
    # The lost chunks' share of the (rotated, so evenly spread) input went to each worker's
    # feedback: worker n-1's residual's energy beyond worker 0's is about the difference of
    # their shares (worker 0 loses nothing on the wire, but a chunk may close short before
    # its DATA, slow under a loaded machine, came in).
    res, base = ars[-1].feedback.residual, ars[0].feedback.residual
    share, share0 = float(lost.mean()), float((clients[-1].last.bitmaps & 1 == 0).mean())
    excess = float((res.norm() ** 2 - base.norm() ** 2) / xs[-1].norm() ** 2)
    assert abs(excess - (share - share0)) < 0.5 * share, \
        f"the lost part went to feedback: {excess} of the input's energy for {share} of " \
        f"chunks ({share0} of worker 0's)"


def _after_a_full_round(job, answer, chunks: int):
    """``answer`` for the second round of a run whose first, of ``chunks`` chunks, ended full:
    a worker closes a chunk short only at an aggregator it heard in an earlier round of the
    run (one that restarted before this worker first heard it may have served its peers a
    result this worker never saw). ``answer`` sees the second round's seqs from 0."""
    zeros = np.zeros(job.lanes, P.sum_dtype(job.sum_bits)).tobytes()

    def shifted(t, seq):
        if seq < chunks:
            return P.PktType.RESULT, job.n_workers, job.full_bitmap, zeros
        return answer(t, seq - chunks)
    return shifted


def test_a_flushed_chunk_that_ends_full_gives_its_share_of_the_bound_back(datapath):
    """A scripted aggregator, loss bound 0.25 of 4 chunks (one may end short): chunk 0's
    FLUSH is answered with the full result (the straggler's DATA came first), chunk 1's
    straggler is gone. Chunk 1 must be closed short; it was retransmitted to the deadline,
    chunk 0 still counted against the bound."""
    job = local_job(4, 2, free_port_block(2), pool_size=8, lanes=16)
    zeros = np.zeros(job.lanes, P.sum_dtype(job.sum_bits)).tobytes()
    seen = set()

    def answer(t, seq):
        again = (seq, t) in seen
        seen.add((seq, t))
        if seq >= 2 or (seq == 0 and t == P.PktType.FLUSH):
            return P.PktType.RESULT, 2, 0b11, zeros
        if seq == 1 and t == P.PktType.FLUSH:
            return P.PktType.RESULT, 1, 0b01, zeros
        return (P.PktType.PENDING, 1, 0b01, b"") if seq == 1 and again else None

    with scripted_aggregator(job, _after_a_full_round(job, answer, 4)) as addr:
        with AggregationClient(job, 0, addr, run=9, timeout=0.02, max_timeout=0.1,
                               deadline=3.0, loss_bound=0.25) as c:
            c.reduce(np.zeros(4 * job.lanes // 2, np.uint8))
            r = c.reduce(np.zeros(4 * job.lanes // 2, np.uint8))
    assert r.datapath == datapath
    assert r.counts.tolist() == [2, 1, 2, 2]
    assert c.stats.short == 1 and c.stats.flushed >= 2


def test_without_a_loss_bound_every_chunk_is_retransmitted_to_completion():
    xs, out, ars, clients = _allreduce_with_loss(loss_bound=0.0)
    assert all(c.stats.short == 0 and c.stats.flushed == 0 for c in clients)
    assert clients[-1].stats.retransmitted > 0
    assert (clients[0].last.counts == len(xs)).all()


def _short_answers(short_seqs):
    """A scripted aggregator's answer: the chunks in ``short_seqs`` closed short by worker
    1's FLUSH before worker 0's DATA came (count 0), every other chunk full."""
    def answer(t, seq):
        if t != P.PktType.DATA:
            return None
        if seq in short_seqs:
            return P.PktType.RESULT, 0, 0, bytes(16)
        return P.PktType.RESULT, 2, 0b11, bytes(16)
    return answer


def test_a_short_result_without_a_loss_bound_ends_the_round_with_the_cause(datapath):
    """A peer with a loss bound of its own (or FLUSHes for chunks it never sent) must not
    close chunks of a worker whose job has none: those lost shares were taken as counted
    short on both windows, and the round returned as if nothing happened."""
    job = local_job(4, 2, free_port_block(2), pool_size=8, lanes=16)
    assert job.loss_bound == 0
    with scripted_aggregator(job, _short_answers({2})) as addr:
        with AggregationClient(job, 0, addr, run=9, deadline=2.0) as c:
            with pytest.raises(LossBoundExceeded, match=r"seq 2 .*counting 0 of 2 workers "
                                                        r"\(workers \[0, 1\] missing\).*no "
                                                        r"loss bound"):
                c.reduce(np.zeros(4 * job.lanes // 2, np.uint8))
    assert c.stats.short == 0
    with scripted_aggregator(job, _short_answers({2})) as addr:
        with AggregationClient(job, 0, addr, run=9, deadline=2.0, loss_bound=0.2) as c:
            with pytest.raises(LossBoundExceeded, match=r"its loss bound 0.2 lets 0 of the "
                                                        r"round's 4 chunks") as err:
                c.reduce(np.zeros(4 * job.lanes // 2, np.uint8))
    assert "no loss bound" not in str(err.value)   # it was said of a bound that lets none


def test_short_chunks_beyond_n_times_the_bound_end_the_round(datapath):
    """Loss bound 0.25 of 8 chunks: each of 2 workers may close 2, so 4 may end short and a
    fifth is refused; the aggregate() of a round with short chunks refuses to drop counts."""
    job = local_job(4, 2, free_port_block(2), pool_size=16, lanes=16)
    data = np.zeros(8 * job.lanes // 2, np.uint8)
    with scripted_aggregator(job, _short_answers({1, 3, 4, 6})) as addr:
        with AggregationClient(job, 0, addr, run=9, deadline=2.0, loss_bound=0.25) as c:
            r = c.reduce(data)
    assert r.counts.tolist() == [2, 0, 2, 0, 0, 2, 0, 2] and c.stats.short == 4
    assert r.bitmaps.tolist() == [3, 0, 3, 0, 0, 3, 0, 3] and r.datapath == datapath
    with scripted_aggregator(job, _short_answers({1, 3, 4, 6, 7})) as addr:
        with AggregationClient(job, 0, addr, run=9, deadline=2.0, loss_bound=0.25) as c:
            with pytest.raises(LossBoundExceeded, match=r"seq 7 .*lets 4 of the round's 8"):
                c.reduce(data)
        with AggregationClient(job, 0, addr, run=10, deadline=2.0, loss_bound=0.5) as c:
            with pytest.raises(ValueError, match="chunk 1 ended short.*reduce"):
                c.aggregate(data)


@pytest.mark.parametrize("loss_bound,window", [(0.5, "python"), (0.0, "python"),
                                                (0.0, "compiled"), (0.5, "compiled")])
def test_a_short_result_without_this_worker_above_its_count_is_ignored(loss_bound, window):
    """A chunk may end short without this worker (its FLUSH came first): a RESULT counting
    worker 1 alone sums one worker's table values, so a lane above g is impossible (though
    below n x g), ignored and counted; the complete RESULT after it is taken. Without a loss
    bound too (where a possible short RESULT ends the round), on both windows."""
    if window == "compiled" and CLIENT_UNAVAILABLE:
        pytest.skip(f"compiled client: {CLIENT_UNAVAILABLE}")
    job = local_job(4, 2, free_port_block(2), pool_size=8, lanes=16)
    dtype = P.sum_dtype(job.sum_bits)
    bogus = np.full(job.lanes, job.granularity + 1, dtype).tobytes()
    zeros = np.zeros(job.lanes, dtype).tobytes()

    def answer(data):
        (_t, w, j, slot, ver, _c, seq, off, _b, run, _e) = P.HEADER_STRUCT.unpack_from(data)
        head = [P.HEADER_STRUCT.pack(P.PktType.RESULT, w, j, slot, ver, count, seq, off,
                                     bitmap, run, epoch(job))
                for count, bitmap in ((1, 0b10), (2, 0b11))]
        return [head[0] + bogus, head[1] + zeros]

    with answering(answer) as addr:
        with AggregationClient(job, 0, addr, run=9, timeout=2.0, max_timeout=2.0,
                               loss_bound=loss_bound, datapath=window) as c:
            r = c.reduce(np.zeros(4 * job.lanes // 2, np.uint8))
    assert r.datapath == window
    assert r.counts.tolist() == [2, 2, 2, 2] and c.stats.short == 0
    assert c.stats.rejected == 4 and not r.sums.any()


def test_a_chunk_found_lost_by_later_results_is_resent_not_flushed(datapath):
    """Under a loss bound, chunk 0's first DATA goes unanswered and later chunks' results
    come back: the fast retransmit resends its DATA (it may merely wait in a lower class's
    queue); only its timer, far off here, may close it short."""
    job = local_job(4, 2, free_port_block(2), pool_size=16, lanes=16)
    zeros = np.zeros(job.lanes, P.sum_dtype(job.sum_bits)).tobytes()
    sends = []

    def answer(t, seq):
        if seq == 0:
            sends.append(t)
            if t == P.PktType.FLUSH:
                return P.PktType.RESULT, 1, 0b01, zeros
            if len(sends) == 1:
                return None
        return P.PktType.RESULT, 2, 0b11, zeros

    with scripted_aggregator(job, _after_a_full_round(job, answer, 8)) as addr:
        with AggregationClient(job, 0, addr, run=9, timeout=2.0, max_timeout=4.0,
                               deadline=10.0, loss_bound=0.25) as c:
            c.reduce(np.zeros(8 * job.lanes // 2, np.uint8))
            r = c.reduce(np.zeros(8 * job.lanes // 2, np.uint8))
    assert r.datapath == datapath
    assert sends == [P.PktType.DATA, P.PktType.DATA], sends
    assert c.stats.flushed == 0 and r.counts.min() == 2


@pytest.mark.parametrize("bound", [0.25, 0.3])
def test_a_worker_flushes_no_more_chunks_than_its_loss_bound(bound, datapath):
    """Loss bound 0.25 (or 0.3: 2.4 chunks, rounded down) of 8 chunks: this worker may close
    2 chunks short itself. Worker 1 is gone for 3 chunks: two are FLUSHed and end short, the
    third is retransmitted to the deadline, which names worker 1. A third FLUSH returned a
    round that lost more than the bound (the round's n x bound cap let it through)."""
    job = local_job(4, 2, free_port_block(2), pool_size=16, lanes=16)
    zeros = np.zeros(job.lanes, P.sum_dtype(job.sum_bits)).tobytes()

    def answer(t, seq):
        if seq in (1, 3, 5):
            if t == P.PktType.FLUSH:
                return P.PktType.RESULT, 1, 0b01, zeros
            return P.PktType.PENDING, 1, 0b01, b""
        return P.PktType.RESULT, 2, 0b11, zeros

    with scripted_aggregator(job, _after_a_full_round(job, answer, 8)) as addr:
        with AggregationClient(job, 0, addr, run=9, timeout=0.02, max_timeout=0.1,
                               deadline=1.0, loss_bound=bound) as c:
            c.reduce(np.zeros(8 * job.lanes // 2, np.uint8))
            with pytest.raises(AggregationTimeout, match=r"missing worker\(s\) \[1\]"):
                c.reduce(np.zeros(8 * job.lanes // 2, np.uint8))
    assert c.stats.short == 2 and c.stats.compiled_rounds == 2 * (datapath == "compiled")


def test_a_bound_just_below_one_leaves_a_chunk_to_wait_for(datapath):
    """Loss bound 0.9999999999999999, whose product with 8 chunks is 8.0 in floating point:
    with worker 1 gone for a whole round, this worker closed all 8 chunks short and returned
    zeros for the round. It closes 7, and the last one's deadline names worker 1."""
    job = local_job(4, 2, free_port_block(2), pool_size=16, lanes=16)
    zeros = np.zeros(job.lanes, P.sum_dtype(job.sum_bits)).tobytes()

    def answer(t, seq):
        if t == P.PktType.FLUSH:
            return P.PktType.RESULT, 1, 0b01, zeros
        return P.PktType.PENDING, 1, 0b01, b""

    with scripted_aggregator(job, _after_a_full_round(job, answer, 8)) as addr:
        with AggregationClient(job, 0, addr, run=9, timeout=0.02, max_timeout=0.1,
                               deadline=1.0, loss_bound=math.nextafter(1.0, 0.0)) as c:
            c.reduce(np.zeros(8 * job.lanes // 2, np.uint8))
            with pytest.raises(AggregationTimeout, match=r"missing worker\(s\) \[1\]"):
                c.reduce(np.zeros(8 * job.lanes // 2, np.uint8))
    assert c.stats.short == 7 and c.stats.compiled_rounds == 2 * (datapath == "compiled")


def test_the_dlcp_bench_worker_times_its_rounds_after_an_untimed_one(tmp_path):
    """`thc bench dlcp`'s worker, two ranks through a real software aggregator on the
    loopback: the rounds asked for are timed, the workers' estimates agree and are close to
    the mean (the bench fails a run where they are not), and one round ran before them."""
    import subprocess
    import sys

    from thc.testing.clusters import free_tcp_port
    from thc.wire.jobs import Cluster
    job = local_job(1, 2, free_port_block(2))
    cfg = tmp_path / "cluster.json"
    with Aggregator([job]) as agg:
        host, port = agg.start()
        Cluster(jobs=(job,), agg_ip=host, agg_port=port).save(cfg)
        master = f"127.0.0.1:{free_tcp_port()}"
        procs = [subprocess.Popen(
            [sys.executable, "-m", "thc.bench.dlcp_worker", "--rank", str(r), "--world", "2",
             "--rendezvous", master, "--config", str(cfg), "--run-id", "7", "--numel", "4096",
             "--layers", "4", "--rounds", "3", "--loss-bound", "0.1", "--priorities"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
        outs = [p.communicate(timeout=120) for p in procs]
        completions = agg.counters()["jobs"][job.job_id]["completions"]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    rows = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert [len(r["times"]) for r in rows] == [3, 3]
    # each round's line as it ends (the bench's progress), before the result's
    progress = [json.loads(line) for line in outs[0][0].strip().splitlines()[:-1]]
    assert [(p["round"], p["seconds"]) for p in progress] == list(enumerate(rows[0]["times"]))
    # THC's error for two workers is about 0.02; an estimate missing a worker's is 0.33
    assert rows[0]["nmse"] == rows[1]["nmse"] and max(rows[0]["nmse"]) < 0.1, rows[0]["nmse"]
    # four rounds reached the aggregator, each a MAX chunk and its THC chunks: three timed
    assert completions >= 4 * (rows[0]["chunks_per_round"] + 1), completions


@pytest.mark.parametrize("head_class, fast", [(0, False), (3, True)])
def test_only_chunks_of_the_same_class_overtake_a_chunk_into_a_fast_retransmit(head_class,
                                                                                fast):
    """Chunk 0's DATA is lost; chunks 1-5, class 3, complete at once. Of its own class they
    show it lost and it goes again within a round trip; of a higher class than its own they
    may merely have passed it in the queues, and it waits for its timer (0.5 s)."""
    job = local_job(13, 1, free_port_block(1))
    agg = Aggregator([job])
    src = (job.workers[0].ip, job.workers[0].port)
    head_sends: list[float] = []

    def answer(data):
        if data[0] == P.PktType.DATA and P.HEADER_STRUCT.unpack_from(data)[6] == 0:
            head_sends.append(time.monotonic())
            if len(head_sends) == 1:
                return []
        return [out for out, _ in agg.handle(data, src)]

    classes = np.array([head_class, 3, 3, 3, 3, 3], np.uint8)
    with answering(answer) as addr:
        with AggregationClient(job, 0, addr, run=5, timeout=0.5, max_timeout=1.0) as c:
            c.aggregate(np.zeros(len(classes) * job.lanes // 2, np.uint8), classes=classes)
    gap = head_sends[1] - head_sends[0]
    assert (gap < 0.25) == fast, f"chunk 0 went again after {gap:.3f} s"


def test_the_dlcp_bench_reads_its_modes_shows_rounds_and_names_unlike_windows(capsys):
    """`thc bench dlcp --modes` takes a subset (ratios only where retransmit ran); rank 0's
    rounds show as they end; a table of modes that ran unlike client windows says so (the
    compiled window ran retransmit-everything while the bounded modes ran Python's, and the
    ratios held the windows' difference, unsaid)."""
    from thc.emu import bench_dlcp
    assert bench_dlcp._modes("bound, bound+prio,bound") == ("bound", "bound+prio")
    for bad in ("", "bound,fast"):
        with pytest.raises(argparse.ArgumentTypeError, match="modes are retransmit"):
            bench_dlcp._modes(bad)
    show = bench_dlcp._progress("bound", 4)
    show(1, '{"round": 0, "seconds": 9.0, "short": 0}')
    show(0, '{"round": 1, "seconds": 0.25, "short": 3}')
    show(0, "not a round")
    assert capsys.readouterr().out == "    bound round 2/4: 0.250 s, 3 chunks short\n"

    def mode(median, compiled):
        return {"median_s": median, "p99_s": median, "nmse_mean": 0.02,
                "cumulative_nmse": 0.001, "short_chunks_per_round": 0.0,
                "chunks_per_round": 8, "identical_results": True, "compiled_rounds": compiled}
    bench_dlcp._print_table({"rounds": 2, "modes": {"retransmit": mode(2.0, 16),
                                                     "bound": mode(1.0, 8)}})
    out = capsys.readouterr().out
    assert " 2.00x" in out and "unlike client windows" in out and "retransmit 16, bound 8" in out
    bench_dlcp._print_table({"rounds": 2, "modes": {"bound": mode(1.0, 0)}})
    out = capsys.readouterr().out
    assert "x " not in out.split("\n")[2] and "unlike" not in out


def test_a_stopped_dlcp_bench_names_where_and_keeps_the_modes_done(monkeypatch, tmp_path,
                                                                   capsys):
    """SIGTERM ended `thc bench dlcp` without a word (only Ctrl-C was caught), and either
    lost the modes it had measured."""
    import contextlib
    import types

    from thc.emu import bench_dlcp
    from thc.lifetime import Terminated
    bed = types.SimpleNamespace(describe=lambda: "testbed", popen=lambda *a, **k: None,
                                start_aggregator=lambda: None, agg_bw_factor=4.0)
    monkeypatch.setattr(bench_dlcp, "mininet_unavailable_reason", lambda kind: None)
    monkeypatch.setattr(bench_dlcp, "open_testbed",
                        lambda *a, **k: contextlib.nullcontext(bed))

    def run_mode(tb, name, *a):
        if name == "bound":
            raise Terminated(143)
        return {"median_s": 1.0, "p99_s": 1.0, "nmse_mean": 0.02, "cumulative_nmse": 0.001,
                "short_chunks_per_round": 0.0, "chunks_per_round": 8}
    monkeypatch.setattr(bench_dlcp, "_run_mode", run_mode)
    parser = argparse.ArgumentParser()
    bench_dlcp.add_arguments(parser)
    out = tmp_path / "dlcp.json"
    assert bench_dlcp.run(parser.parse_args(["--quick", "--json", str(out)])) == 143
    err = capsys.readouterr().err
    assert "terminated (SIGTERM) in mode bound" in err and "modes done: retransmit" in err
    saved = json.loads(out.read_text())
    assert list(saved["modes"]) == ["retransmit"] and saved["complete"] is False
