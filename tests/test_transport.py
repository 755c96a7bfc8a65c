"""Host transport against a real aggregator process over loopback UDP."""
from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from thc.codec import settings
from thc.codec.packing import pack_bits
from thc.net import fastclient
from thc.net.client import (DATAPATH_ENV, GSO_ENV, AggregationClient, AggregationTimeout,
                             resolve_gso)
from thc.net.impair import Impairment
from thc.net.outcomes import AggregatorMisconfigured
from thc.testing.clusters import free_port_block, local_job
from thc.testing.stats import fresh_stats
from thc.wire import protocol as P
from thc.wire.jobs import Cluster, Job, Shard
from tests import procs as procs_

N_ELEMENTS = 1 << 20


class AggregatorProcess:
    """`thc aggregator` started as its own process, the way a user runs it."""

    def __init__(self, tmp_path, jobs, port=None, **impair):
        self.port = port or free_port_block(1)
        cfg = tmp_path / "cluster.json"
        Cluster(jobs=tuple(jobs), agg_port=self.port).save(cfg)
        args = [sys.executable, "-m", "thc.cli", "aggregator", "--listen",
                f"127.0.0.1:{self.port}", "--config", str(cfg), "--stats-interval", "0",
                "--stats-file", str(tmp_path / "stats.json")]
        for k, v in impair.items():
            args += [f"--{k}", str(v)]
        self.stats_file = tmp_path / "stats.json"
        self.final: dict | None = None
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        line = self.proc.stdout.readline()
        assert "listening" in line, line + self.proc.stdout.read()

    @property
    def addr(self):
        return ("127.0.0.1", self.port)

    def stats(self) -> dict:
        """Counters taken after this call began (the stats file, awaited until fresh)."""
        return fresh_stats([self.stats_file], alive=lambda: self.proc.poll() is None)[0]

    def stop(self) -> dict:
        """Stop it as Ctrl-C does and return the final counters it prints on the way out
        (once its serving loop runs, which its first stats file shows: an interrupt while it
        prints its first line ends it with a traceback)."""
        if self.final is None:
            end = time.monotonic() + 30
            while not self.stats_file.exists() and self.proc.poll() is None:
                assert time.monotonic() < end, "the aggregator never wrote its stats file"
                time.sleep(0.01)
            self.proc.send_signal(signal.SIGINT)
            out, _ = self.proc.communicate(timeout=30)
            lines = out.strip().splitlines()
            if self.proc.returncode != 0 or not lines or not lines[-1].startswith("{"):
                raise RuntimeError(f"thc aggregator exited with {self.proc.returncode}: {out}")
            self.final = json.loads(lines[-1])
        return self.final


def _worker(job, w, addr, impair, q, deadline=20.0, run=1, n=N_ELEMENTS):
    rng = np.random.default_rng(1000 + w)
    idx = rng.integers(0, 16, n).astype(np.uint8)
    try:
        with AggregationClient(job, w, addr, deadline=deadline, run=run,
                               impair=Impairment(**impair, seed=w) if impair else None) as c:
            r = c.reduce(pack_bits(idx, P.INDEX_BITS))
            q.put((w, "ok", r.sums, (c.stats.retransmitted, r.datapath, vars(c.stats))))
    except AggregationTimeout as e:
        q.put((w, "timeout", str(e), e.missing))
    except Exception as e:   # told at once, not by the parent's wait running out
        q.put((w, "error", repr(e), None))


def _run_workers(job, addr, impair=None, workers=None, deadline=20.0, run=1, n=N_ELEMENTS):
    """Each worker's (status, payload, extra), the workers forked from the tests' fork
    server: forked from this process, one inherited a lock another thread held and hung."""
    q = procs_.queue()
    workers = range(job.n_workers) if workers is None else workers
    procs = [procs_.start(_worker, job, w, addr, impair, q, deadline, run, n) for w in workers]
    results = {}
    for _ in procs:
        w, status, payload, extra = q.get(timeout=120)
        results[w] = (status, payload, extra)
    for p in procs:
        p.join(timeout=10)
    return results


def _reference(job, n=N_ELEMENTS):
    table = np.asarray(job.table)
    return sum(table[np.random.default_rng(1000 + w).integers(0, 16, n)]
               for w in range(job.n_workers))


@pytest.fixture
def job():
    return local_job(1, 4, free_port_block(4), pool_size=64)


@pytest.fixture(params=["python", "compiled"])
def datapath(request, monkeypatch):
    """Runs a test once per client datapath (through THC_CLIENT_DATAPATH, which forked
    workers inherit)."""
    if request.param == "compiled" and fastclient.CLIENT_UNAVAILABLE:
        pytest.skip(fastclient.CLIENT_UNAVAILABLE)
    monkeypatch.setenv(DATAPATH_ENV, request.param)
    return request.param


def _assert_exact_through_an_aggregator(tmp_path, job, datapath) -> dict:
    """Every worker gets the exact sums of N_ELEMENTS, through ``datapath``; every chunk
    completes once and nothing is dropped. Returns each worker's client stats."""
    agg = AggregatorProcess(tmp_path, [job])
    try:
        results = _run_workers(job, agg.addr)
        stats = agg.stop()
    finally:
        agg.stop()
    ref = _reference(job)
    for w, (status, sums, (_, ran, _)) in results.items():
        assert status == "ok", sums
        np.testing.assert_array_equal(sums, ref)
        assert ran == datapath
    chunks = N_ELEMENTS // job.lanes
    assert stats["jobs"]["1"]["completions"] == chunks
    assert sum(stats["drops"].values()) == 0
    return {w: extra[2] for w, (_, _, extra) in results.items()}


def test_four_workers_one_million_elements_bit_exact(tmp_path, job, datapath):
    _assert_exact_through_an_aggregator(tmp_path, job, datapath)


def test_compiled_client_with_gso_and_gro_sums_exactly(tmp_path, job, monkeypatch):
    """DATA leaves as one GSO send per aggregator and batch, replies (GSO bursts from the
    compiled aggregator) come in by GRO as one buffer each: the sums are the same."""
    if fastclient.CLIENT_UNAVAILABLE:
        pytest.skip(fastclient.CLIENT_UNAVAILABLE)
    monkeypatch.setenv(DATAPATH_ENV, "compiled")
    monkeypatch.setenv(GSO_ENV, "1")
    for w, stats in _assert_exact_through_an_aggregator(tmp_path, job, "compiled").items():
        assert stats["gso_sends"] > 0 and stats["gro_bursts"] > 0, (w, stats)


def test_without_gso_the_compiled_client_sends_and_takes_datagrams_one_by_one(
        tmp_path, job, monkeypatch):
    """The counters above count only what GSO and GRO did."""
    if fastclient.CLIENT_UNAVAILABLE:
        pytest.skip(fastclient.CLIENT_UNAVAILABLE)
    monkeypatch.setenv(DATAPATH_ENV, "compiled")
    monkeypatch.setenv(GSO_ENV, "0")
    for w, stats in _assert_exact_through_an_aggregator(tmp_path, job, "compiled").items():
        assert stats["gso_sends"] == 0 and stats["gro_bursts"] == 0, (w, stats)


def test_gso_choice_follows_the_job_and_the_environment(job, monkeypatch):
    sharded = dataclasses.replace(job, shards=(Shard("127.0.0.1", 1),)).validate()
    monkeypatch.delenv(GSO_ENV, raising=False)
    assert resolve_gso(None, job) is False and resolve_gso(None, sharded) is True
    assert resolve_gso(True, job) is True and resolve_gso(False, sharded) is False
    monkeypatch.setenv(GSO_ENV, "0")
    settings.reset()                    # the process's settings are read once
    assert resolve_gso(None, sharded) is False
    monkeypatch.setenv(GSO_ENV, "auto")    # as unset: the settings line prints "auto"
    settings.reset()
    assert resolve_gso(None, job) is False and resolve_gso(None, sharded) is True
    monkeypatch.setenv(GSO_ENV, "yes")
    settings.reset()
    with pytest.raises(ValueError, match="THC_CLIENT_GSO"):
        resolve_gso(None, job)


def test_sixteen_workers_get_exact_16_bit_sums(tmp_path):
    """16 workers x granularity 30 = 480 > 255: the job's sums are 16 bits wide, RESULT
    payloads twice as long, and every worker still gets every sum exactly."""
    job = local_job(1, 16, free_port_block(16), pool_size=32)
    assert job.sum_bits == 16
    n = 1 << 16
    agg = AggregatorProcess(tmp_path, [job])
    try:
        results = _run_workers(job, agg.addr, n=n, deadline=50.0)
        stats = agg.stop()
    finally:
        agg.stop()
    ref = _reference(job, n)
    assert ref.max() > 255
    for w, (status, sums, _) in results.items():
        assert status == "ok", sums
        np.testing.assert_array_equal(sums, ref)
    assert stats["jobs"]["1"]["completions"] == n // job.lanes
    assert sum(stats["drops"].values()) == 0


def test_exactly_once_under_loss_duplication_and_reordering(tmp_path, job):
    impair = {"loss": 0.05, "dup": 0.05, "reorder": 0.05}
    agg = AggregatorProcess(tmp_path, [job], **impair)
    try:
        results = _run_workers(job, agg.addr, impair=impair)
        stats = agg.stop()
    finally:
        agg.stop()
    ref = _reference(job)
    for w, (status, sums, (retransmitted, ran, _)) in results.items():
        assert status == "ok", sums
        np.testing.assert_array_equal(sums, ref)
        assert retransmitted > 0, "5% loss must have caused retransmissions"
        assert ran == "python"  # the client's own impairments run in the Python loop only
    chunks = N_ELEMENTS // job.lanes
    # Exactly once: every chunk completed once, whatever was lost or duplicated.
    assert stats["jobs"]["1"]["completions"] == chunks


def test_compiled_client_exactly_once_under_lossy_duplicating_reordering_replies(
        tmp_path, job, monkeypatch):
    """The compiled client window against an aggregator whose replies are lost, duplicated
    and reordered: lost replies make it retransmit, which the aggregator answers from its
    slots; duplicates are ignored; every chunk completes once and every sum is exact."""
    if fastclient.CLIENT_UNAVAILABLE:
        pytest.skip(fastclient.CLIENT_UNAVAILABLE)
    n = 1 << 18
    agg = AggregatorProcess(tmp_path, [job], loss=0.05, dup=0.05, reorder=0.05)
    monkeypatch.setenv(DATAPATH_ENV, "compiled")
    try:
        results = _run_workers(job, agg.addr, n=n)
        stats = agg.stop()
    finally:
        agg.stop()
    ref = _reference(job, n)
    for w, (status, sums, (retransmitted, ran, _)) in results.items():
        assert status == "ok", sums
        assert ran == "compiled"
        np.testing.assert_array_equal(sums, ref)
        assert retransmitted > 0, "5% lost replies must have caused retransmissions"
    assert stats["jobs"]["1"]["completions"] == n // job.lanes
    assert stats["jobs"]["1"]["retransmissions"] > 0


def test_missing_worker_named_in_timeout(tmp_path, job, datapath):
    agg = AggregatorProcess(tmp_path, [job])
    try:
        # 3 s: a present worker forked a second after the others, on a loaded host, was
        # named missing too at 1 s
        results = _run_workers(job, agg.addr, workers=[0, 1, 2], deadline=3.0)
    finally:
        agg.stop()
    for w in (0, 1, 2):
        status, msg, missing = results[w]
        assert status == "timeout"
        assert missing == [3]
        assert "missing worker(s) [3]" in msg


def test_no_aggregator_is_a_clear_timeout(job, datapath):
    dead = ("127.0.0.1", free_port_block(1))
    with AggregationClient(job, 0, dead, deadline=0.5, run=1) as c:
        with pytest.raises(AggregationTimeout, match="no answer from the aggregator"):
            c.aggregate(np.zeros(job.lanes // 2, np.uint8))
        assert c.stats.compiled_rounds == (datapath == "compiled")
        assert c.stats.retransmitted > 0


@pytest.mark.parametrize("engine", ["python", "compiled", "compiled-gso", "python-impaired"])
def test_a_wildcard_aggregator_answers_from_the_address_it_was_sent_to(datapath, engine):
    """An aggregator listening on 0.0.0.0 answered every chunk from the address of its route
    (127.0.0.1); a worker that sent to 127.0.0.2 rightly ignored the replies, so no round
    completed. Each worker now hears from the address it sends to (IP_PKTINFO), whichever
    worker's datagram completed the chunk: one by one, in GSO bursts and through the
    impairment's delayed sends alike."""
    from thc.net.aggregator import Aggregator
    from thc.net.fastagg import FastAggregator, available
    if engine.startswith("compiled") and not available():
        pytest.skip("the compiled aggregator is not built")
    job = local_job(1, 2, free_port_block(2), pool_size=8, lanes=16)
    if engine.startswith("python"):
        impair = Impairment(jitter=0.002, seed=3) if engine.endswith("impaired") else None
        agg = Aggregator([job], impair=impair)
    else:
        agg = FastAggregator([job], gso=engine.endswith("gso"))
    _, port = agg.start("0.0.0.0", 0)
    rng = np.random.default_rng(5)
    idx = [rng.integers(0, 16, 16 * 40, dtype=np.uint8) for _ in range(2)]
    sums, errors, elsewhere = {}, {}, {}

    def work(w):
        with AggregationClient(job, w, (f"127.0.0.{w + 1}", port), deadline=20.0, run=5) as c:
            try:
                sums[w] = c.reduce(pack_bits(idx[w], P.INDEX_BITS)).sums
            except AggregationTimeout as e:
                errors[w] = str(e)
            elsewhere[w] = c.stats.elsewhere
    threads = [threading.Thread(target=work, args=(w,)) for w in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        agg.stop()
    assert errors == {} and elsewhere == {0: 0, 1: 0}
    for w in range(2):
        np.testing.assert_array_equal(sums[w], sum(np.asarray(job.table)[i] for i in idx))


@pytest.mark.parametrize("stray", ["malformed", "older run"])
@pytest.mark.parametrize("engine", ["python", "compiled"])
def test_a_stray_datagram_sent_elsewhere_does_not_move_where_results_leave_from(engine, stray):
    """A wildcard aggregator took the address of ours a worker last sent to from any datagram
    (Python: even a malformed one; both: an older run's, refused): the worker's next RESULT
    left from that address, the worker ignored it and waited for a resend. Only a datagram
    that is taken moves it; a refusal leaves from where its datagram was sent."""
    from thc.net.aggregator import Aggregator
    from thc.net.fastagg import FastAggregator, available
    if engine == "compiled" and not available():
        pytest.skip("the compiled aggregator is not built")
    job = local_job(1, 2, free_port_block(2), pool_size=4, lanes=16)
    agg = Aggregator([job]) if engine == "python" else FastAggregator([job], gso=False)
    _, port = agg.start("0.0.0.0", 0)
    socks = []
    for w in job.workers:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((w.ip, w.port))
        s.settimeout(2.0)
        socks.append(s)

    def data(w: int, run: int) -> bytes:
        return P.HEADER_STRUCT.pack(P.PktType.DATA, w, job.job_id, 0, 0, 0, 0, 0,
                                    job.config_tag, run, 100 + w) + bytes(8)

    try:
        socks[1].sendto(data(1, 7), ("127.0.0.1", port))
        time.sleep(0.1)
        socks[1].sendto(data(1, 7)[:20] if stray == "malformed" else data(1, 6),
                        ("127.0.0.2", port))
        if stray == "older run":
            refusal, src = socks[1].recvfrom(2048)
            assert (P.PktType(refusal[0]), src[0]) == (P.PktType.REFUSED, "127.0.0.2")
        time.sleep(0.1)
        socks[0].sendto(data(0, 7), ("127.0.0.1", port))
        got = [(P.PktType(d[0]), src[0]) for d, src in (s.recvfrom(2048) for s in socks)]
    finally:
        agg.stop()
        for s in socks:
            s.close()
    assert got == [(P.PktType.RESULT, "127.0.0.1")] * 2


@pytest.mark.parametrize("engine", ["python", "compiled"])
def test_a_worker_of_two_jobs_hears_each_from_where_it_sent_that_jobs_chunks(engine):
    """One worker address in two jobs, sending job 1's chunks to 127.0.0.2 and job 2's to
    127.0.0.1 of a wildcard aggregator: the Python aggregator remembered one address a
    worker, the last datagram's, and job 1's RESULT left from 127.0.0.1, where the worker
    ignores it. Each job's results leave from the address its chunks went to."""
    from thc.net.aggregator import Aggregator
    from thc.net.fastagg import FastAggregator, available
    if engine == "compiled" and not available():
        pytest.skip("the compiled aggregator is not built")
    base = free_port_block(3)
    jobs = [Job.from_dict({"job_id": j, "pool_size": 4, "lanes": 16, "granularity": 30,
                           "p": 1 / 32, "workers": [{"id": 0, "ip": "127.0.0.1", "port": base},
                                                    {"id": 1, "ip": "127.0.0.1",
                                                     "port": base + j}]})
            for j in (1, 2)]
    agg = Aggregator(jobs) if engine == "python" else FastAggregator(jobs, gso=False)
    _, port = agg.start("0.0.0.0", 0)
    socks = []
    for p in range(base, base + 3):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", p))
        s.settimeout(2.0)
        socks.append(s)

    def data(job, w: int) -> bytes:
        return P.HEADER_STRUCT.pack(P.PktType.DATA, w, job.job_id, 0, 0, 0, 0, 0,
                                    job.config_tag, 7, 100 + w) + bytes(8)

    try:
        socks[0].sendto(data(jobs[0], 0), ("127.0.0.2", port))
        time.sleep(0.1)
        socks[0].sendto(data(jobs[1], 0), ("127.0.0.1", port))
        time.sleep(0.1)
        socks[1].sendto(data(jobs[0], 1), ("127.0.0.1", port))
        reply, src = socks[0].recvfrom(2048)
    finally:
        agg.stop()
        for s in socks:
            s.close()
    assert (P.PktType(reply[0]), P.Header.unpack(reply).job_id, src[0]) == \
        (P.PktType.RESULT, 1, "127.0.0.2")


@pytest.mark.parametrize("host", ["0.0.0.0", "0"])
@pytest.mark.parametrize("engine", ["python", "compiled"])
def test_datagrams_queued_before_the_server_runs_are_answered_from_their_address(engine, host):
    """A datagram that reached a wildcard socket before its serving thread asked for each
    datagram's destination carried 0.0.0.0 as that destination: the worker's replies left
    from the route's address (127.0.0.1), though it sent to 127.0.0.2, and it ignored them
    until a resend. The socket asks before it is bound, so no datagram comes without it."""
    from thc.net.aggregator import Aggregator
    from thc.net.fastagg import FastAggregator, available
    if engine == "compiled" and not available():
        pytest.skip("the compiled aggregator is not built")
    job = local_job(1, 2, free_port_block(2), pool_size=8, lanes=16)
    agg = Aggregator([job]) if engine == "python" else FastAggregator([job])
    _, port = agg.bind(host, 0)
    payload = pack_bits(np.full(job.lanes, 3, np.uint8), P.INDEX_BITS).tobytes()
    socks = []
    for w in range(2):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((job.worker(w).ip, job.worker(w).port))
        s.settimeout(5.0)
        socks.append(s)

    def send(w):
        head = P.Header(P.PktType.DATA, w, job.job_id, 0, 0, 0, 0, 0, job.config_tag, 5,
                        77).pack()
        socks[w].sendto(head + payload, (f"127.0.0.{w + 1}", port))
    send(1)
    time.sleep(0.05)
    thread = threading.Thread(target=agg.serve, daemon=True)
    thread.start()
    try:
        time.sleep(0.1)
        send(0)
        replies = [s.recvfrom(4096) for s in socks]
    finally:
        agg._set_stop()
        thread.join(5)
        agg.stop()
        for s in socks:
            s.close()
    assert [src for _, src in replies] == [("127.0.0.1", port), ("127.0.0.2", port)]
    assert all(P.Header.unpack(d).pkt_type == P.PktType.RESULT for d, _ in replies)


def test_replies_from_another_address_are_named_in_the_timeout(datapath):
    """Replies from the port of the job's aggregator at another IP (an aggregator or a NAT
    that answers from another address) are ignored, and the timeout counts them and names the
    address the workers send to, not only "down, unreachable"."""
    job = local_job(1, 1, free_port_block(1), pool_size=8, lanes=16)
    port = free_port_block(1)
    stop = threading.Event()
    other = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    other.bind(("127.0.0.3", port))

    def answer_from_elsewhere():
        w = job.worker(0)
        while not stop.is_set():
            other.sendto(P.Header(P.PktType.PENDING, 0, 1, 0, 0, 0, 0, 0, 0, 5, 1).pack(),
                         (w.ip, w.port))
            time.sleep(0.05)
    t = threading.Thread(target=answer_from_elsewhere)
    t.start()
    try:
        with AggregationClient(job, 0, ("127.0.0.2", port), deadline=1.0, run=5) as c:
            with pytest.raises(AggregationTimeout) as e:
                c.reduce(np.zeros(8, np.uint8))
            elsewhere = c.stats.elsewhere
    finally:
        stop.set()
        t.join()
        other.close()
    assert elsewhere > 0
    assert f"{elsewhere} replies to this worker this round came from the port" in str(e.value)
    assert f"--listen 127.0.0.2:{port}" in str(e.value)


def test_replies_from_another_port_leave_the_timeout_as_it_was(datapath):
    """A stranger's replies from another port than the aggregator's (spoofed, protorows'
    row) do not make the timeout blame the listen address."""
    job = local_job(1, 1, free_port_block(1), pool_size=8, lanes=16)
    dead = ("127.0.0.1", free_port_block(1))
    stop = threading.Event()

    def forger():
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        w = job.worker(0)
        while not stop.is_set():
            s.sendto(P.Header(P.PktType.PENDING, 0, 1, 0, 0, 0, 0, 0, 0, 5, 1).pack(),
                     (w.ip, w.port))
            time.sleep(0.05)
        s.close()
    t = threading.Thread(target=forger)
    t.start()
    try:
        with AggregationClient(job, 0, dead, deadline=1.0, run=5) as c:
            with pytest.raises(AggregationTimeout, match=r"no answer from the aggregator at "
                               r".*\(down, unreachable, not serving job 1[^;]*, or a switch "
                               r"withholding [^;]*\)$") as e:
                c.reduce(np.zeros(8, np.uint8))
            assert c.stats.ignored > 0 and c.stats.elsewhere == 0
    finally:
        stop.set()
        t.join()
    assert "another IP" not in str(e.value)
    assert "a switch expecting this worker on another switch_port" in str(e.value)


def test_a_worker_id_outside_the_job_is_refused_by_name(job):
    """A bare KeyError(3) came out of the client's constructor."""
    with pytest.raises(ValueError, match=r"job 1 has no worker 7 \(its workers: \[0, 1, 2, 3\]\)"):
        AggregationClient(job, 7, ("127.0.0.1", 1), run=1)


def test_a_workers_address_already_held_is_named_with_its_job():
    """A second launch while the first still ran failed with a bare "[Errno 98] Address
    already in use", naming neither the address nor the job."""
    job = local_job(3, 2, free_port_block(2))
    with AggregationClient(job, 0, ("127.0.0.1", 9), run=1):
        with pytest.raises(OSError, match=r"job 3, worker 0: cannot bind its address "
                                          r"127\.0\.0\.1:\d+ .*another launch of this job"):
            AggregationClient(job, 0, ("127.0.0.1", 9), run=1)

def test_max_round_over_loopback(tmp_path, job, datapath):
    agg = AggregatorProcess(tmp_path, [job])
    out = {}

    def run(w):
        with AggregationClient(job, w, agg.addr, run=1) as c:
            r = c.reduce_max(np.arange(40, dtype=np.float32) * (w + 1))
            out[w] = r.sums, r.datapath

    try:
        ts = [threading.Thread(target=run, args=(w,)) for w in range(4)]
        [t.start() for t in ts]
        [t.join() for t in ts]
    finally:
        agg.stop()
    for w in range(4):
        np.testing.assert_array_equal(out[w][0], np.arange(40, dtype=np.float32) * 4)
        assert out[w][1] == datapath


def test_packed_length_must_be_whole_chunks(job):
    with AggregationClient(job, 0, ("127.0.0.1", 9), run=1) as c:
        with pytest.raises(ValueError, match="multiple of one chunk"):
            c.aggregate(np.zeros(3, np.uint8))


class LossyRelay:
    """Stands between each worker and the aggregator, dropping packets in both directions.

    It owns the job's worker addresses (so the aggregator sees every packet come from the
    worker it expects); each worker's client runs on a socket of its own and sends to its
    relay socket. ``loss`` 0.36 is 20% loss on each of two links in series, as the fault
    matrix's Mininet row drops on every host's ingress (thc.emu.links.path_loss)."""

    def __init__(self, job, agg_addr, worker_addrs, loss, seed=0):
        self.agg_addr, self.worker_addrs, self.loss = agg_addr, worker_addrs, loss
        self.rng = np.random.default_rng(seed)
        self.socks = []
        for w in sorted(job.workers, key=lambda w: w.id):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            s.bind((w.ip, w.port))
            s.setblocking(False)
            self.socks.append(s)
        self.dropped = {"to aggregator": 0, "to workers": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def address(self, w):
        return self.socks[w].getsockname()

    def _serve(self):
        while not self._stop.is_set():
            ready, _, _ = select.select(self.socks, [], [], 0.05)
            for s in ready:
                w = self.socks.index(s)
                while True:
                    try:
                        data, src = s.recvfrom(4096)
                    except BlockingIOError:
                        break
                    up = src != self.agg_addr
                    if self.rng.random() < self.loss:
                        self.dropped["to aggregator" if up else "to workers"] += 1
                        continue
                    s.sendto(data, self.agg_addr if up else self.worker_addrs[w])

    def close(self):
        self._stop.set()
        self._thread.join()
        for s in self.socks:
            s.close()


def _relayed_worker(job, w, sock, relay_addr, q, deadline, n, datapath):
    idx = np.random.default_rng(1000 + w).integers(0, 16, n).astype(np.uint8)
    try:
        with AggregationClient(job, w, relay_addr, deadline=deadline, run=1, sock=sock,
                               datapath=datapath) as c:
            r = c.reduce(pack_bits(idx, P.INDEX_BITS))
            q.put((w, "ok", r.sums, (c.stats.retransmitted, r.datapath)))
    except AggregationTimeout as e:
        q.put((w, "timeout", str(e), e.missing))


def test_heavy_loss_on_every_link_recovers_lost_results_in_time(tmp_path, job, datapath):
    """20% loss on every link (36% of packets each way): each chunk loses some worker's
    RESULT, and windows of all workers stall behind it. 128 chunks each, all exact, within
    the client's default 10 s deadline per chunk. A shorter deadline is a coin toss here: a
    chunk unanswered through ~10 resends (0.59 each) does happen (about 1 run in 10 at 2 s
    on a loaded 2-core host); test_client_datapath checks the resend rule that keeps this
    tail short (lost chunks resent within FAST_BACKOFF_CAP RTOs)."""
    n = 128 * job.lanes
    agg = AggregatorProcess(tmp_path, [job])
    socks = []
    for _ in range(job.n_workers):
        socks.append(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
        socks[-1].setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        socks[-1].bind(("127.0.0.1", 0))
    relay = LossyRelay(job, agg.addr, [s.getsockname() for s in socks], loss=0.36, seed=7)
    # spawned, not forked: a fork of a test process that loaded grpc (the controller's
    # tests) could crash in its first garbage collection
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_relayed_worker,
                         args=(job, w, socks[w], relay.address(w), q, 10.0, n, datapath))
             for w in range(job.n_workers)]
    try:
        for p in procs:
            p.start()
        results = {}
        for _ in procs:
            w, status, payload, extra = q.get(timeout=120)
            results[w] = (status, payload, extra)
        for p in procs:
            p.join(timeout=10)
        stats = agg.stop()
    finally:
        relay.close()
        agg.stop()
        for s in socks:
            s.close()
    ref = _reference(job, n)
    for w, (status, sums, extra) in results.items():
        assert status == "ok", sums
        np.testing.assert_array_equal(sums, ref)
        retransmitted, ran = extra
        assert ran == datapath and retransmitted > 0
    assert relay.dropped["to aggregator"] > 0 and relay.dropped["to workers"] > 0
    assert stats["jobs"]["1"]["completions"] == 128  # exactly once


_FLOOD = """
import socket, struct, sys, time
port, seconds = int(sys.argv[1]), float(sys.argv[2])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
try:   # UDP GSO: 64 one-byte datagrams a send, far more than plain sends make
    cmsg = [(socket.SOL_UDP, 103, struct.pack("H", 1))]
    s.sendmsg([bytes(64)], cmsg, 0, ("127.0.0.1", port))
except OSError:
    cmsg = []
print("flooding", flush=True)
stop = time.monotonic() + seconds
while time.monotonic() < stop:
    try:
        s.sendmsg([bytes(64 if cmsg else 1)], cmsg, 0, ("127.0.0.1", port))
    except OSError:
        pass
"""


@pytest.mark.parametrize("start", ["before", "during"])
def test_a_flood_to_the_worker_port_does_not_hold_off_the_deadline(job, datapath, start):
    """Strangers flood the worker's port with junk datagrams, queued before the round (the
    drain before its first packet) or arriving during it (the window's receive loop), while
    the aggregator says nothing: the round still ends near its deadline, naming the silent
    aggregator, not after the flood. Three flooders: the compiled window reads one
    flooder's datagrams faster than it sends them."""
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    deadline, flood_s = 0.5, 5.0
    with AggregationClient(job, 0, silent.getsockname(), run=3, deadline=deadline) as c:
        port = str(c.sock.getsockname()[1])
        floods = [subprocess.Popen([sys.executable, "-c", _FLOOD, port, str(flood_s)],
                                   stdout=subprocess.PIPE, text=True) for _ in range(3)]
        try:
            for flood in floods:
                assert flood.stdout.readline().strip() == "flooding"
            if start == "before":
                time.sleep(0.2)  # the socket's queue fills
            t0 = time.monotonic()
            with pytest.raises(AggregationTimeout, match="no answer from the aggregator"):
                c.aggregate(np.zeros(job.lanes // 2, np.uint8))
            took = time.monotonic() - t0
        finally:
            for flood in floods:
                flood.kill()
                flood.wait()
                flood.stdout.close()
            silent.close()
        assert c.stats.compiled_rounds == (datapath == "compiled")
        assert c.stats.received + c.stats.drained > 1000, "no flood arrived"
        assert took < deadline + 1.0, f"the round took {took:.2f}s (deadline {deadline}s)"


@pytest.mark.parametrize("max_first", [False, True])
@pytest.mark.parametrize("other", [{"lanes": 128}, {"pool_size": 32}])
def test_an_aggregator_holding_the_job_with_other_lanes_or_pool_is_named(tmp_path, datapath,
                                                                          other, max_first):
    """An aggregator that holds the job with other lanes or another pool: the first reply's
    epoch carries another configuration tag, refused at once (a MAX round takes no lanes,
    so it is answered; a smaller pool answers its own slots). Where nothing is answered
    (other lanes, no MAX round), the timeout names the configuration beside a dead host."""
    job = local_job(1, 1, free_port_block(1), pool_size=64)
    theirs = dataclasses.replace(job, **other).validate()
    agg = AggregatorProcess(tmp_path, [theirs])
    try:
        with AggregationClient(job, 0, agg.addr, deadline=0.5, run=1) as c:
            if "lanes" in other and not max_first:
                with pytest.raises(AggregationTimeout, match=r"chunk seq 0 .*no answer from the "
                                   r"aggregator .* not serving job 1 with this worker's "
                                   r"address, 256 lanes and pool 64"):
                    c.aggregate(np.zeros(job.lanes // 2 * 64, np.uint8))
                return
            with pytest.raises(AggregatorMisconfigured, match=rf"the aggregator at .* serves job "
                               rf"1 with another configuration than this worker's \(tag "
                               rf"{theirs.config_tag:#06x}, this worker's {job.config_tag:#06x}"):
                if max_first:
                    c.max(np.ones(4, np.float32))
                c.aggregate(np.zeros(job.lanes // 2 * 64, np.uint8))
    finally:
        agg.stop()
