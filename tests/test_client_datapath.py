"""Both client datapaths (the Python window and the compiled one) against a scripted aggregator
on loopback: the datagrams they send, hostile replies ignored and counted alike, a chunk closed
short within a loss bound, an epoch change, a missing worker named, and the cases that fall
back to Python. Their timers: tests/test_client_timers.py."""
from __future__ import annotations

import dataclasses
import errno
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from thc.codec import settings
from thc.codec.packing import pack_bits
from thc.net.client import (DATAPATH_ENV, AggregationClient, AggregationTimeout,
                             AggregatorRestarted, resolve_datapath)
from thc.net.aggregator import Aggregator
from thc.net.outcomes import ClientClosed
from thc.net.impair import Impairment
from thc.testing.clusters import free_port_block, local_job
from thc.wire import protocol as P
from thc.wire.jobs import Job
from tests.scripted import answering, epoch
from tests.client_cases import (N_CHUNKS, SHORT_SEQ, ScriptedAggregator, _complete, _index_zero,
                                 _others, _packed, _reply)
from tests.client_cases import job  # noqa: F401 (a fixture)
from tests.test_transport import datapath  # noqa: F401 (a fixture)


def _want(job, packed, first_seq=0, short=None):
    """The sums of the chunks of ``packed`` (worker 0's indices) from seq ``first_seq``: its
    table values plus worker 1's; chunk ``short``'s its values alone."""
    own = job.lane_values(packed).reshape(N_CHUNKS, job.lanes).astype(np.int64)
    return np.concatenate([own[k] + (0 if first_seq + k == short else
                                     _others(first_seq + k, job.lanes))
                           for k in range(N_CHUNKS)])


def test_hostile_replies_ignored_and_counted_short_chunks_and_restart(job, datapath):
    agg = ScriptedAggregator(job)
    try:
        with AggregationClient(job, 0, agg.addr, run=77, timeout=2.0, max_timeout=2.0) as c:
            packed = _packed(job, 1)
            r = c.reduce(packed, offset_base=1000)
            sums = r.sums
            assert r.datapath == datapath
            np.testing.assert_array_equal(sums, _want(job, packed))
            s = c.stats
            assert s.retransmitted == 0 and s.sent == N_CHUNKS
            assert s.received == 14 * N_CHUNKS + 2
            assert s.ignored == 11 * N_CHUNKS + 2
            # impossible from the right address: count n/bitmap, > 2 x 30, type, length
            assert s.rejected == 4 * N_CHUNKS + 2
            assert s.other_run == N_CHUNKS and s.pending == N_CHUNKS and s.short == 0
            assert s.bytes_sent == sum(map(len, agg.received))
            assert (r.counts == 2).all() and (r.bitmaps == 0b11).all()
            assert c.epoch == job.new_epoch(nonce=0x1234) and c.rtt.srtt[0] is not None
            # the datagrams, field by field, as the protocol lays them out
            chunk = len(packed) // N_CHUNKS
            for seq, data in enumerate(agg.received):
                slot, version = P.slot_of(seq, job.pool_size)
                payload = packed[seq * chunk:(seq + 1) * chunk].tobytes()
                assert data == P.HEADER_STRUCT.pack(
                    P.PktType.DATA, 0, job.job_id, slot, version, 0, seq,
                    1000 + seq * job.lanes, job.config_tag, 77, c.incarnation) + payload
            # a second round continues the sequence numbers; then the aggregator restarts
            sums = c.aggregate(_packed(job, 2))
            np.testing.assert_array_equal(sums, _want(job, _packed(job, 2), N_CHUNKS))
            agg.epoch = job.new_epoch(nonce=0x5678)
            with pytest.raises(AggregatorRestarted, match="the aggregator at 127.0.0.1") as e:
                c.aggregate(_packed(job, 3))
            assert (e.value.old_epoch & P.NONCE_MASK, e.value.new_epoch & P.NONCE_MASK,
                    e.value.run) == (0x1234, 0x5678, 77)
    finally:
        agg.close()


def test_an_impossible_reply_teaches_the_client_no_epoch(job, datapath):
    """The epoch was learnt from the first reply for a chunk in flight before that reply's
    checks: an impossible reply of another epoch, first, made every true reply after it an
    AggregatorRestarted naming a restart that never was."""
    agg = ScriptedAggregator(job, stray_epoch=job.new_epoch(nonce=0x4321))
    try:
        with AggregationClient(job, 0, agg.addr, run=77, timeout=2.0, max_timeout=2.0) as c:
            packed = _packed(job, 1)
            np.testing.assert_array_equal(c.reduce(packed).sums, _want(job, packed))
            assert c.epoch == job.new_epoch(nonce=0x1234)
            assert c.stats.rejected == 4 * N_CHUNKS + 4 and c.stats.retransmitted == 0
    finally:
        agg.close()


def test_missing_worker_named_by_the_last_pending(job, datapath):
    agg = ScriptedAggregator(job, mode="pending")
    try:
        with AggregationClient(job, 0, agg.addr, run=5, deadline=0.3) as c:
            with pytest.raises(AggregationTimeout, match=r"missing worker\(s\) \[1\]") as e:
                c.aggregate(_packed(job, 1)[: job.lanes // 2])
            assert e.value.missing == [1]
            assert c.stats.rounds == 1 and c.stats.compiled_rounds == (datapath == "compiled")
            assert c.stats.retransmitted > 0 and c.stats.pending == c.stats.sent
    finally:
        agg.close()


def test_only_an_impairment_runs_in_python(job):
    """An impairment (it wraps Python's sends) makes a compiled client run the round in the
    Python window, with the same sums, and duplicated DATA is sent; a loss bound and DSCP
    classes run compiled, a chunk closed short within the bound with its count."""
    agg = ScriptedAggregator(job)
    try:
        packed = _packed(job, 1)
        want = _want(job, packed)
        for kw in ({"impair": Impairment(dup=0.2, seed=1)}, {"loss_bound": 0.1}):
            agg.short = "loss_bound" in kw   # a chunk may close short within a bound only
            with AggregationClient(job, 0, agg.addr, run=9, datapath="compiled", **kw) as c:
                result = c.reduce(packed)
                np.testing.assert_array_equal(
                    result.sums, _want(job, packed, short=SHORT_SEQ) if agg.short else want)
                assert (result.counts[SHORT_SEQ] == 1) == agg.short
                assert (result.bitmaps[SHORT_SEQ] == 0b01) == agg.short
                assert result.datapath == ("compiled" if agg.short else "python"), kw
                assert c.stats.short == agg.short
                if "impair" in kw:
                    assert c.impair.stats["duplicated"] > 0
        agg.short = False
        with AggregationClient(job, 0, agg.addr, run=9, datapath="compiled") as c:
            result = c.reduce(packed, classes=np.zeros(N_CHUNKS, np.uint8))
            np.testing.assert_array_equal(result.sums, want)
            assert result.datapath == "compiled"
    finally:
        agg.close()


def test_datapath_choice(monkeypatch):
    monkeypatch.setenv("THC_CLIENT_DATAPATH", "python")
    assert resolve_datapath() == "python"
    assert resolve_datapath("PYTHON") == "python"
    with pytest.raises(ValueError, match="not one of auto, compiled, python"):
        resolve_datapath("fast")
    monkeypatch.setenv("THC_CLIENT_DATAPATH", "bogus")
    assert resolve_datapath() == "python"      # the process's settings are read once
    settings.reset()
    with pytest.raises(ValueError, match="THC_CLIENT_DATAPATH"):
        resolve_datapath()
    settings.use(settings.Settings(client_datapath="python"))
    with AggregationClient(local_job(3, 1, free_port_block(1)), 0, ("127.0.0.1", 9)) as c:
        assert c.datapath == "python"          # a command's flag reaches a client it builds


def test_an_ipv6_socket_falls_back_from_the_compiled_window_with_the_same_sums(job):
    """The compiled window speaks IPv4 only: an IPv6 socket's rounds run in Python, with
    the sums and the hostile replies handled as on IPv4."""
    agg = ScriptedAggregator(job, family=socket.AF_INET6)
    sock = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    sock.bind(("::1", 0))
    try:
        with AggregationClient(job, 0, agg.addr, run=3, datapath="compiled",
                               sock=sock) as c:
            result = c.reduce(_packed(job, 1))
            np.testing.assert_array_equal(result.sums, _want(job, _packed(job, 1)))
            assert result.datapath == "python"
            # the chunks' volleys of hostile replies ignored (more if a resent chunk drew
            # another; on a loaded machine the socket's buffer may drop a few of them)
            assert c.stats.ignored >= 10 * N_CHUNKS and c.stats.short == 0
    finally:
        agg.close()


def test_priority_classes_must_match_the_chunks(job):
    with AggregationClient(job, 0, ("127.0.0.1", 9), run=1) as c:
        with pytest.raises(ValueError, match=f"3 priority classes for {N_CHUNKS} chunks"):
            c.aggregate(_packed(job, 1), classes=np.zeros(3, np.uint8))
        assert c.stats.sent == 0 and c.stats.rounds == 0


def test_a_refused_send_is_an_oserror_on_both_datapaths(job, datapath):
    """The kernel refuses a datagram to the broadcast address from a socket without
    SO_BROADCAST (EACCES): the round ends with that error, not a timeout."""
    with AggregationClient(job, 0, ("255.255.255.255", 9), run=1, deadline=5.0) as c:
        with pytest.raises(PermissionError):
            c.aggregate(_packed(job, 1))
        assert c.datapath == datapath


class _FullQueue:
    """A socket whose first ``n`` sends fail as a full queue (``err``), then send."""

    def __init__(self, sock, n: int, err: int):
        self.sock, self.left, self.err, self.refused = sock, n, err, 0

    def __getattr__(self, name):
        return getattr(self.sock, name)

    def sendto(self, data, dst):
        if self.left:
            self.left -= 1
            self.refused += 1
            raise OSError(self.err, os.strerror(self.err))
        return self.sock.sendto(data, dst)


@pytest.mark.parametrize("err", [errno.ENOBUFS, errno.EAGAIN])
def test_a_full_send_queue_is_a_loss_the_python_window_resends(job, monkeypatch, err):
    """A send refused for a full queue loses its datagram, as the compiled window takes it:
    the chunk's timer resends it and the sums are exact. The Python window ended the round
    with the OSError."""
    monkeypatch.setenv(DATAPATH_ENV, "python")
    agg = ScriptedAggregator(job)
    try:
        with AggregationClient(job, 0, agg.addr, run=77, timeout=0.05, deadline=10.0) as c:
            c.sock = full = _FullQueue(c.sock, 5, err)
            packed = _packed(job, 1)
            np.testing.assert_array_equal(c.aggregate(packed), _want(job, packed))
            assert full.refused == 5 and c.stats.retransmitted >= 5
    finally:
        agg.close()


FULL_QUEUE_WORKER = """
import os, socket
import numpy as np
from thc.net.client import AggregationClient, AggregationTimeout
from thc.testing.clusters import local_job
job = local_job(1, 2, 47000, pool_size=16)
with AggregationClient(job, 0, ("127.0.0.1", 47010), run=1, timeout=0.05, deadline=1.5) as c:
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    os.set_blocking(c.sock.fileno(), False)
    try:
        c.reduce(np.zeros(20 * job.lanes // 2, np.uint8))
    except AggregationTimeout as e:
        print(c.stats.compiled_rounds, c.stats.queue_full, e)
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("tc"),
                    reason="needs root, unshare and tc (a namespace of its own whose loopback "
                           "queue is slow)")
def test_a_send_queue_that_stays_full_is_named_in_the_timeout(datapath):
    """A worker whose own send queue stays full (the kernel's EAGAIN, in a namespace of its
    own whose loopback a token bucket drains at 1 kB/s) loses every datagram it sends: the
    round times out, and the error counts the refused datagrams and names them as the cause,
    which the aggregator alone would take for a missing worker."""
    r = subprocess.run(
        ["unshare", "-n", "sh", "-c", "ip link set lo up && tc qdisc add dev lo root tbf "
         "rate 8kbit burst 1600 limit 1000000 && exec \"$0\" -c \"$1\"", sys.executable,
         FULL_QUEUE_WORKER], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    compiled, refused, message = r.stdout.split(" ", 2)
    assert int(compiled) == (datapath == "compiled") and int(refused) > 10, r.stdout
    assert f"; {refused} datagrams of this round were refused by this worker's own send " \
        f"queue" in message, message


def test_results_queued_before_a_round_are_not_taken_as_its_own(job, datapath):
    """A RESULT that reached the socket before the round sent anything (here: from the
    aggregator's own address, every field right, as a restarted worker's predecessor's
    result would be) is dropped unread, not taken for chunk 0."""
    agg = ScriptedAggregator(job)
    try:
        with AggregationClient(job, 0, agg.addr, run=4, timeout=2.0, max_timeout=2.0) as c:
            slot, version = P.slot_of(0, job.pool_size)
            stale = P.HEADER_STRUCT.pack(P.PktType.RESULT, 0, job.job_id, slot, version, 2, 0,
                                         0, 0b11, 4, agg.epoch)
            agg.sock.sendto(stale + np.full(job.lanes, 5, P.sum_dtype(job.sum_bits)).tobytes(),
                            c.sock.getsockname())
            deadline = time.monotonic() + 5
            while not select.select([c.sock], [], [], 0.01)[0] and time.monotonic() < deadline:
                pass
            r = c.reduce(_packed(job, 1))
            assert r.datapath == datapath and c.stats.drained == 1
            np.testing.assert_array_equal(r.sums, _want(job, _packed(job, 1)))
    finally:
        agg.close()


def test_a_max_above_every_float_is_ignored(job, datapath):
    """A MAX_RESULT lane no worker can send (a NaN, infinite or negative float's bits, all
    at or above its own lanes) is ignored and counted; the honest answer is taken."""
    def answer(data):
        head = _complete(data, P.PktType.MAX_RESULT, job)
        lanes = np.frombuffer(data, ">u4", offset=P.HEADER_BYTES)
        return [head + np.where(np.arange(lanes.size) == 1, bad, lanes).astype(">u4").tobytes()
                for bad in (0x7F800000, 0x7FC00000, 0xBF800000)] + \
            [head + (lanes + 1).astype(">u4").tobytes()]

    values = np.arange(1, 5, dtype=np.float32)
    with answering(answer) as addr:
        with AggregationClient(job, 0, addr, run=2, timeout=2.0, max_timeout=2.0) as c:
            got = c.max(values)
            assert c.stats.compiled_rounds == (datapath == "compiled")
            assert c.stats.ignored == 3
    np.testing.assert_array_equal(got.view(np.uint32), values.view(np.uint32) + 1)


def test_an_aggregator_named_by_host_name_answers(job, datapath):
    """``localhost`` is resolved once to the address replies come from."""
    agg = ScriptedAggregator(job)
    try:
        with AggregationClient(job, 0, ("localhost", agg.addr[1]), run=6, timeout=2.0,
                               max_timeout=2.0) as c:
            assert c.aggregator == agg.addr
            assert c.reduce(_packed(job, 1)).datapath == datapath
        with pytest.raises(ValueError, match="nohost.invalid"):
            AggregationClient(job, 0, ("nohost.invalid", 9), run=1)
    finally:
        agg.close()


@pytest.mark.parametrize("kw, match", [
    ({"deadline": float("nan")}, "deadline nan"),
    ({"deadline": 0.0}, "deadline 0.0"),
    ({"timeout": 0.0}, "0 < timeout"),
    ({"timeout": 1.0, "max_timeout": 0.5}, "timeout <= max_timeout"),
    # a chunk resent past the run idle time could reopen its slot under its old run after
    # another run took the job and went quiet: its workers would hold different sums
    ({"deadline": P.RUN_IDLE_S}, "below the aggregators' run idle time"),
])
def test_timeouts_are_checked(job, kw, match):
    with pytest.raises(ValueError, match=match):
        AggregationClient(job, 0, ("127.0.0.1", 9), run=1, **kw)


def test_classes_and_indices_are_checked_before_anything_is_sent(job):
    with AggregationClient(job, 0, ("127.0.0.1", 9), run=1) as c:
        with pytest.raises(ValueError, match=r"priority classes are 0\.\.3, got \[7\]"):
            c.aggregate(_packed(job, 1), classes=np.full(N_CHUNKS, 7))
        with pytest.raises(ValueError, match=r"got \[-1\]"):
            c.aggregate(_packed(job, 1), classes=np.full(N_CHUNKS, -1))
        with pytest.raises(TypeError, match="uint8"):
            c.aggregate(_packed(job, 1).astype(np.int64) + 256)
        assert c.stats.sent == 0


def test_python_window_and_aggregator_serve_sockets_numbered_past_1024():
    """Both wait by poll, which takes any descriptor (select stops at 1024)."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1200
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"the descriptor limit ({hard}) is below {want}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    fill = [open(os.devnull) for _ in range(1100)]
    try:
        job = local_job(1, 1, free_port_block(1), pool_size=16)
        with Aggregator([job]) as agg:
            addr = agg.start()
            with AggregationClient(job, 0, addr, run=1, datapath="python") as c:
                assert c.sock.fileno() >= 1024 and agg._sock.fileno() >= 1024
                idx = np.random.default_rng(0).integers(0, 16, 4 * job.lanes).astype(np.uint8)
                sums = c.aggregate(pack_bits(idx, P.INDEX_BITS))
            assert agg.error is None
        np.testing.assert_array_equal(sums, np.asarray(job.table)[idx])
    finally:
        for f in fill:
            f.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_aggregator_answering_only_impossible_results_is_named_so(job, datapath):
    """Configured with another job (here: 16-bit sums where the job has 8): every RESULT is
    the wrong size, and the timeout says so instead of calling the aggregator silent."""
    def answer(data):
        return [_complete(data, P.PktType.RESULT, job) + bytes(2 * job.lanes)]

    with answering(answer) as addr:
        with AggregationClient(job, 0, addr, run=2, deadline=0.5) as c:
            with pytest.raises(AggregationTimeout, match=r"answered with \d+ impossible "
                                                         r"replies .* configured with this job"):
                c.aggregate(_packed(job, 1)[: job.lanes // 2])
            assert c.stats.rejected > 0 and c.stats.compiled_rounds == (datapath == "compiled")


def test_a_negative_zero_max_is_a_zero_and_a_socket_with_a_timeout_is_refused(datapath):
    """-0.0's bits (the sign bit) order above every float's: sent as they are, the
    aggregator's max was refused as no float's."""
    job = local_job(1, 1, free_port_block(1), pool_size=16)
    with Aggregator([job]) as agg:
        addr = agg.start()
        with AggregationClient(job, 0, addr, run=1) as c:
            got = c.max(np.array([-0.0, 1.0], dtype=np.float32))
    assert got.tolist() == [0.0, 1.0] and not np.signbit(got[0])
    with AggregationClient(job, 0, addr, run=2) as c:
        with pytest.raises(ValueError, match="finite values beyond float32's range"):
            c.max(np.array([1e39, 1.0]))
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(1.5)
    with pytest.raises(ValueError, match=r"socket has a timeout .*settimeout\(None\)"):
        AggregationClient(job, 0, addr, run=1, sock=sock)
    sock.close()


def test_impossible_results_after_a_pending_name_the_aggregator_not_a_worker(job, datapath):
    """A PENDING first (worker 1 late), then only impossible RESULTs (16-bit sums where the
    job has 8: the aggregator runs another job's config): the newer evidence names the
    aggregator; the old PENDING's bitmap named worker 1, who was fine."""
    seen = []

    def answer(data):
        seen.append(data)
        if len(seen) <= 2:
            return [_reply(job, data, P.PktType.PENDING, 1, 0b01)]
        return [_complete(data, P.PktType.RESULT, job) + bytes(2 * job.lanes)]

    with answering(answer) as addr:
        with AggregationClient(job, 0, addr, run=2, deadline=0.5) as c:
            with pytest.raises(AggregationTimeout, match=r"answered with \d+ impossible "
                                                         r"replies .* configured with this "
                                                         r"job") as e:
                c.aggregate(_packed(job, 1)[: job.lanes // 2])
            assert e.value.missing is None
            assert c.stats.pending >= 1 and c.stats.rejected > 0
            assert c.stats.compiled_rounds == (datapath == "compiled")


def test_a_shard_forging_another_shards_results_is_ignored(datapath):
    """Each of two shards, on every DATA it gets, at once sends a RESULT for the other
    shard's neighbouring chunks with every field right (epoch included) but another of
    worker 1's table values in every lane, a plausible sum; the owning shard answers the
    truth 0.3 s later. Only the chunk's own shard answers for it: the sums are exact and
    every forged reply is counted as ignored."""
    base, n = free_port_block(2), 6

    def shard(data):
        (_t, w, j, _s, _v, _c, seq, _o, _b, run, _e) = P.HEADER_STRUCT.unpack_from(data)

        def result(x, peer):
            slot, version = P.slot_of(x, job.pool_size)
            sums = job.lane_values(packed[x * chunk:(x + 1) * chunk]) + _others(peer, job.lanes)
            return P.HEADER_STRUCT.pack(P.PktType.RESULT, w, j, slot, version, 2, x,
                                        x * job.lanes, 0b11, run, epoch(job)) + \
                sums.astype(P.sum_dtype(job.sum_bits)).tobytes()
        forged = [(result(x, x + 1), 0) for x in (seq - 1, seq + 1) if 0 <= x < n]
        return forged + [(result(seq, seq), 0.3)]

    with answering(shard) as a0, answering(shard) as a1:
        job = Job.from_dict({"job_id": 1, "pool_size": 16, "lanes": P.LANES, "granularity": 30,
                             "workers": [{"id": i, "ip": "127.0.0.1", "port": base + i}
                                         for i in range(2)],
                             "shards": [{"ip": a[0], "port": a[1]} for a in (a0, a1)]})
        chunk = job.lanes // 2
        packed = _packed(job, 1)[: n * chunk]
        with AggregationClient(job, 0, run=2, window=n, timeout=1.0, max_timeout=1.0) as c:
            r = c.reduce(packed)
            assert r.datapath == datapath and c.stats.retransmitted == 0
            want = job.lane_values(packed).reshape(n, job.lanes) + \
                np.stack([_others(x, job.lanes) for x in range(n)])
            np.testing.assert_array_equal(r.sums, want.reshape(-1))
            assert c.stats.ignored == 2 * (n - 1) and c.stats.rejected == 0


@pytest.mark.parametrize("aggregation", ["thc", "vote"])
def test_a_sum_without_the_workers_own_values_is_ignored(job, datapath, aggregation):
    """An aggregator that counted this worker and lost its values answers the other
    worker's alone, with count 2 and both bits: within count x granularity, so only the
    worker's own table values (sign bits) show it. Each such RESULT is an impossible reply;
    the honest one after it is taken."""
    if aggregation == "vote":
        job = Job.vote(job.job_id, job.workers, pool_size=job.pool_size)
    lanes = job.lanes
    dtype = P.sum_dtype(job.sum_bits)
    rng, peers = np.random.default_rng(7), {}

    def answer(data):
        own = job.lane_values(data[P.HEADER_BYTES:]).astype(np.int64)
        seq = P.HEADER_STRUCT.unpack_from(data)[6]
        peer = peers.setdefault(seq, rng.integers(0, 2, lanes) if aggregation == "vote"
                                else _others(seq, lanes))
        head = _complete(data, P.PktType.RESULT, job)
        return [head + peer.astype(dtype).tobytes(), head + (own + peer).astype(dtype).tobytes()]

    per_chunk = lanes // (8 if aggregation == "vote" else 2)
    packed = np.random.default_rng(3).integers(0, 256, 8 * per_chunk).astype(np.uint8)
    with answering(answer) as addr:
        with AggregationClient(job, 0, addr, run=2, timeout=2.0, max_timeout=2.0) as c:
            r = c.reduce(packed)
            assert c.stats.compiled_rounds == (datapath == "compiled")
            assert c.stats.rejected == 8 and c.stats.retransmitted == 0
    own = job.lane_values(packed).reshape(8, lanes).astype(np.int64)
    np.testing.assert_array_equal(r.sums, np.concatenate([own[k] + peers[k] for k in range(8)]))


@pytest.mark.parametrize("table, sum_bits", [("even", 8), ("even", 16), ("default", 16)])
def test_a_sum_no_table_values_make_is_ignored(datapath, table, sum_bits):
    """A RESULT whose lane holds the worker's own value and, beside it, a rest no other
    worker's table value makes (an odd one where every value is even; 1 in the default
    table) is within count x granularity, and no aggregator's sum: an impossible reply,
    in 8- and 16-bit sums. The honest one after it is taken."""
    job = local_job(1, 2, free_port_block(2), pool_size=16,
                    table=range(0, 31, 2) if table == "even" else None)
    job = dataclasses.replace(job, sum_bits=sum_bits).validate()
    rest = 1
    assert rest not in job.table
    dtype = P.sum_dtype(job.sum_bits)

    def answer(data):
        own = job.lane_values(data[P.HEADER_BYTES:]).astype(np.int64)
        seq = P.HEADER_STRUCT.unpack_from(data)[6]
        peer = np.asarray(job.table)[(np.arange(job.lanes) + seq) % 16]
        bad = own + peer
        bad[seq % job.lanes] = own[seq % job.lanes] + rest
        head = _complete(data, P.PktType.RESULT, job)
        return [head + bad.astype(dtype).tobytes(), head + (own + peer).astype(dtype).tobytes()]

    packed = np.random.default_rng(5).integers(0, 256, 8 * job.lanes // 2).astype(np.uint8)
    with answering(answer) as addr:
        with AggregationClient(job, 0, addr, run=2, timeout=2.0, max_timeout=2.0) as c:
            r = c.reduce(packed)
            assert c.stats.compiled_rounds == (datapath == "compiled")
            assert c.stats.rejected == 8 and c.stats.retransmitted == 0
    want = job.lane_values(packed).reshape(8, job.lanes).astype(np.int64) + np.stack(
        [np.asarray(job.table)[(np.arange(job.lanes) + k) % 16] for k in range(8)])
    np.testing.assert_array_equal(r.sums, want.reshape(-1))


def test_impossible_pendings_are_rejected_and_name_the_aggregator(job, datapath):
    """PENDINGs no aggregator sends (a wait for a chunk every worker reached, one without
    this worker's bit, a held one every worker acknowledged, a held one without this
    worker's bit, bits beyond the job, a count its bitmap does not hold) are rejected, not
    taken as a wait: the timeout names the aggregator, not a missing worker (it named
    "missing worker(s) []", a worker that was fine, or this worker itself as not past the
    slot's previous use)."""
    bad = [(2, 0b11), (1, 0b10), (0, 0b11), (0, 0b10), (1, 0b101), (1, 0b11)]
    with answering(lambda data: [_reply(job, data, P.PktType.PENDING, count, bitmap)
                                 for count, bitmap in bad]) as addr:
        with AggregationClient(job, 0, addr, run=2, deadline=0.3) as c:
            with pytest.raises(AggregationTimeout, match="impossible replies"):
                c.aggregate(_packed(job, 1)[: job.lanes // 2])
            assert c.stats.compiled_rounds == (datapath == "compiled")
            assert c.stats.pending == 0 and c.stats.rejected == len(bad) * c.stats.sent


def test_a_peers_max_lane_above_every_float_is_named_in_the_timeout(job, datapath):
    """A sender at worker 1's address puts a NaN's bits in its MAX chunk; the aggregator
    takes it into the maxima, so each MAX_RESULT is impossible for worker 0. Its timeout
    names the peer's value, not the aggregator's configuration."""
    agg = Aggregator([job])
    addr = agg.start("127.0.0.1", 0)
    peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        peer.bind((job.workers[1].ip, job.workers[1].port))
        lanes = np.zeros(P.MAX_LANES, dtype=">u4")
        lanes[3] = 0x7FC00000
        head = P.Header(P.PktType.MAX, 1, job.job_id, 0, 0, 0, 0, 0, job.config_tag, 2, 0x1234)
        threading.Timer(0.05, peer.sendto, (P.encode(head, lanes.tobytes()), addr)).start()
        with AggregationClient(job, 0, addr, run=2, deadline=0.5) as c:
            with pytest.raises(AggregationTimeout, match=r"MAX_RESULTs holding a lane above "
                                                         r"the largest finite float's bits"):
                c.max(np.ones(P.MAX_LANES, dtype=np.float32))
            assert c.stats.compiled_rounds == (datapath == "compiled")
            assert c.stats.rejected > 0
    finally:
        peer.close()
        agg.stop()


def test_replies_of_another_run_are_named_in_the_timeout(job, datapath):
    """An aggregator that answers every DATA, but with another run id, is not silent: the
    timeout says so instead of "no answer" alone."""
    def answer(data):
        reply = bytearray(_complete(data, P.PktType.RESULT, job))
        P.HEADER_STRUCT.pack_into(reply, 0, *(P.HEADER_STRUCT.unpack_from(reply)[:9]), 3,
                                  epoch(job))
        return [bytes(reply) + bytes(P.payload_bytes(P.PktType.RESULT, job.lanes))]

    with answering(answer) as addr:
        with AggregationClient(job, 0, addr, run=2, deadline=0.3) as c:
            with pytest.raises(AggregationTimeout, match=r"no answer .* with another run id "
                                                         r"than this round's \(2\)"):
                c.aggregate(_index_zero(job, 1))
            assert c.stats.compiled_rounds == (datapath == "compiled")
            assert c.stats.other_run == c.stats.sent


def _assert_one_impossible_max_ignored(job, datapath, answer):
    """A MAX round of 1..4 against ``answer``, whose first reply is impossible and whose
    second is the honest max (each value's bits plus one): the second is taken, the first
    ignored and counted."""
    values = np.arange(1, 5, dtype=np.float32)
    with answering(answer) as addr:
        with AggregationClient(job, 0, addr, run=2, timeout=2.0, max_timeout=2.0) as c:
            got = c.max(values)
            assert c.stats.compiled_rounds == (datapath == "compiled")
            assert c.stats.ignored == 1 and c.stats.rejected == 1
    np.testing.assert_array_equal(got.view(np.uint32), values.view(np.uint32) + 1)


def test_a_short_max_result_is_ignored(job, datapath):
    """A MAX round never closes short (a FLUSH closes sums of DATA only): a MAX_RESULT
    counting fewer than every worker is impossible, ignored and counted, and the complete
    one after it is taken. Taken, it ended the round as a loss beyond the bound."""
    def answer(data):
        lanes = np.frombuffer(data, ">u4", offset=P.HEADER_BYTES)
        payload = (lanes + 1).astype(">u4").tobytes()
        return [_reply(job, data, P.PktType.MAX_RESULT, 1, 0b01) + payload,
                _complete(data, P.PktType.MAX_RESULT, job) + payload]

    _assert_one_impossible_max_ignored(job, datapath, answer)


def test_a_max_below_the_workers_own_is_ignored(job, datapath):
    """A MAX_RESULT with a lane below this worker's own value (a max that left it out) is
    impossible, ignored and counted; the honest answer is taken. Taken, the agreed max norm
    would lie below this worker's slice norm, and its encode would clip silently."""
    def answer(data):
        head = _complete(data, P.PktType.MAX_RESULT, job)
        lanes = np.frombuffer(data, ">u4", offset=P.HEADER_BYTES)
        low = np.where(np.arange(lanes.size) == 2, lanes - 1, lanes + 1)
        return [head + low.astype(">u4").tobytes(), head + (lanes + 1).astype(">u4").tobytes()]

    _assert_one_impossible_max_ignored(job, datapath, answer)


def test_a_waiting_chunk_names_its_missing_worker_though_another_drew_impossible_replies(
        job, datapath):
    """Chunk 0 waits for worker 1 (a PENDING to every send); chunk 1 drew an impossible
    RESULT (16-bit sums where the job has 8) before its true one. Chunk 0's own evidence is
    its PENDING: its timeout names worker 1, not a misconfigured aggregator."""
    dtype = P.sum_dtype(job.sum_bits)

    def answer(data):
        if P.HEADER_STRUCT.unpack_from(data)[6] == 0:
            return [_reply(job, data, P.PktType.PENDING, 1, 0b01)]
        own = job.lane_values(data[P.HEADER_BYTES:])
        head = _complete(data, P.PktType.RESULT, job)
        return [head + bytes(2 * job.lanes), head + (2 * own).astype(dtype).tobytes()]

    with answering(answer) as addr:
        with AggregationClient(job, 0, addr, run=2, deadline=0.5) as c:
            with pytest.raises(AggregationTimeout, match=r"missing worker\(s\) \[1\]") as e:
                c.aggregate(_packed(job, 1)[: job.lanes])
            assert e.value.missing == [1] and c.stats.rejected == 1
            assert c.stats.compiled_rounds == (datapath == "compiled")


@pytest.mark.parametrize("answer", ["another-worker", "another-job", "echo"])
def test_an_aggregator_answering_with_other_ids_is_not_called_silent(job, datapath, answer):
    """Replies from the aggregator's address that are no reply to this worker's chunks (its
    egress writes another worker's or job's id, or an echo on its port) are ignored, and the
    timeout counts them instead of naming a silent aggregator alone."""
    def reply(data):
        out = bytearray(_complete(data, P.PktType.RESULT, job))
        fields = list(P.HEADER_STRUCT.unpack_from(out))
        if answer == "echo":
            return [data]
        fields[1 if answer == "another-worker" else 2] += 1
        P.HEADER_STRUCT.pack_into(out, 0, *fields)
        return [bytes(out) + bytes(P.payload_bytes(P.PktType.RESULT, job.lanes))]

    with answering(reply) as addr:
        with AggregationClient(job, 0, addr, run=2, deadline=0.3) as c:
            with pytest.raises(AggregationTimeout, match=r"no answer .*; \d+ datagrams from "
                                                         r"the aggregator's address this "
                                                         r"round answered no chunk") as e:
                c.aggregate(_index_zero(job, 1))
            assert c.stats.compiled_rounds == (datapath == "compiled")
    assert c.stats.strays == c.stats.ignored == c.stats.received > 0
    assert f"; {c.stats.strays} datagrams" in str(e.value)


def test_late_replies_to_the_last_round_are_no_strays(job, datapath):
    """Replies to the previous round's resends arrive after it ended; this round's aggregator
    then falls silent: its timeout names no aggregator answering with other ids."""
    silent = threading.Event()

    def answer(data):
        return [] if silent.is_set() else [
            _complete(data, P.PktType.RESULT, job) + bytes(P.payload_bytes(P.PktType.RESULT,
                                                                            job.lanes))]

    with answering(answer, delay=0.15) as addr:
        with AggregationClient(job, 0, addr, run=2, deadline=0.6) as c:
            c.aggregate(_index_zero(job, 1))
            assert c.stats.retransmitted > 0   # so late copies of their replies come
            silent.set()
            with pytest.raises(AggregationTimeout, match="no answer") as e:
                c.aggregate(_index_zero(job, 1))
            assert c.stats.compiled_rounds == 2 * (datapath == "compiled")
    assert "answered no chunk" not in str(e.value) and c.stats.strays == 0


def test_replies_for_chunks_not_yet_sent_are_ignored(job, datapath):
    """With the window at 4 of 8 chunks, the aggregator answers chunk 0's DATA first with a
    plausible short RESULT (count 1, worker 1 alone) for chunk 4, not yet sent, and chunk
    7's with one for seq 8, the next round's first chunk: neither answers a chunk of this
    round that was sent. Both are ignored; every chunk ends with its full sums."""
    n, dtype = 8, P.sum_dtype(job.sum_bits)

    def answer(data):
        (_t, w, j, _s, _v, _c, seq, _o, _b, run, _e) = P.HEADER_STRUCT.unpack_from(data)
        out = []
        for x in {0: [4], n - 1: [n]}.get(seq, []):
            slot, version = P.slot_of(x, job.pool_size)
            out.append(P.HEADER_STRUCT.pack(P.PktType.RESULT, w, j, slot, version, 1, x,
                                            x * job.lanes, 0b10, run, epoch(job))
                       + _others(x, job.lanes).astype(dtype).tobytes())
        own = job.lane_values(data[P.HEADER_BYTES:])
        return out + [_complete(data, P.PktType.RESULT, job)
                      + (own + _others(seq, job.lanes)).astype(dtype).tobytes()]

    packed = _packed(job, 1)[: n * job.lanes // 2]
    with answering(answer) as addr, AggregationClient(job, 0, addr, run=2, window=4,
                                                      timeout=1.0, max_timeout=1.0) as c:
        r = c.reduce(packed)
        assert r.datapath == datapath and c.stats.retransmitted == 0
    want = job.lane_values(packed).reshape(n, job.lanes) + \
        np.stack([_others(x, job.lanes) for x in range(n)])
    np.testing.assert_array_equal(r.sums, want.reshape(-1))
    assert (r.counts == 2).all() and (r.bitmaps == 0b11).all()
    assert c.stats.ignored == 2 and c.stats.short == 0 and c.stats.strays == 0


def test_a_max_round_under_a_loss_bound_resends_rather_than_flushes(job, datapath):
    """A loss bound is for DATA rounds (a MAX chunk closed short would be no maximum): the
    MAX round's first datagram is lost, and its timer resends it, never a FLUSH, and the
    maxima are exact."""
    seen, lanes = [], {}

    def answer(data):
        (t, *_, seq, _o, _b, _r, _e) = P.HEADER_STRUCT.unpack_from(data)
        seen.append(t)
        lanes.setdefault(seq, data[P.HEADER_BYTES:])   # a FLUSH closes it with the lanes
        if len(seen) == 1:
            return []
        return [_complete(data, P.PktType.MAX_RESULT, job) + lanes[seq]]

    values = np.arange(2 * P.MAX_LANES, dtype=np.float32)
    with answering(answer) as addr, AggregationClient(job, 0, addr, run=2, loss_bound=0.5,
                                                      deadline=1.0) as c:
        r = c.reduce_max(values)
        assert c.stats.compiled_rounds == (datapath == "compiled")
    assert P.PktType.FLUSH not in seen and c.stats.flushed == 0 and c.stats.retransmitted >= 1
    np.testing.assert_array_equal(r.sums, values)


def test_a_closed_client_says_so_before_and_after_a_reducer_fails_on_it(job, datapath):
    """A round on a client after close() was a socket error, then "run failed after its MAX
    round" with advice (a new run) that cannot help: the socket is gone."""
    from thc.codec.params import THCParams
    from thc.collective.allreduce import THCAllReduce
    with Aggregator([job]) as agg:
        c = AggregationClient(job, 0, agg.start(), run=1)
        c.close()
        with pytest.raises(ClientClosed, match="worker 0: this client was closed"):
            c.max(np.ones(3, np.float32))
        ar = THCAllReduce.through_aggregator(c, THCParams())
        for _ in range(2):
            with pytest.raises(ClientClosed, match="this client was closed"):
                ar(torch.randn(100))
        with pytest.raises(ClientClosed, match="this client was closed"):
            c.reduce(np.zeros(128, np.uint8))


def test_an_empty_round_sends_nothing_and_returns_empty_sums(job, datapath):
    """reduce() and max() of nothing: no chunk, no wait, empty sums (max() raised numpy's
    reshape error)."""
    with AggregationClient(job, 0, ("127.0.0.1", 9), run=1) as c:
        assert c.reduce(np.zeros(0, np.uint8)).sums.size == 0
        assert c.max(np.zeros(0, np.float32)).size == 0
        assert c.stats.sent == 0
