"""The compiled aggregator against the Python reference, packet for packet.

The same packet sequence goes through both (their per-packet code, and over real UDP through
their serving loops); reply bytes, destinations and counters must be identical. A
differential fuzz sends the same hostile and mutated packets to both. The conformance suite
(tests/conformance/) also runs against the compiled aggregator.
"""
from __future__ import annotations

import dataclasses
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from thc.codec.packing import pack_bits
from thc.net import fastagg
from thc.net.aggregator import Aggregator
from thc.testing.clusters import free_port_block
from thc.wire import protocol as P
from thc.wire.jobs import VOTE_TABLE, Job, Shard
from tests.conformance.harness import TEST_TABLE
from tests.conformance.test_fuzz import (
    KNOWN_SEQ,
    REFUSED_REASONS,
    RUN,
    hostile,
    refused_batch,
    refused_fields,
)

pytestmark = pytest.mark.skipif(not fastagg.available(),
                                reason=f"compiled aggregator skipped: {fastagg.UNAVAILABLE}")

NONCE = 0x5EED
BASE_PORT = 41000
"""Addresses of the per-packet tests (no socket is bound); the UDP test takes free ports."""
SHARD = 1
"""The index both aggregators serve in the sharded job's shard map (3 shards)."""


def make_job(job_id: int, n: int, pool: int, granularity: int = 30, lanes: int = P.LANES,
             base: int = BASE_PORT, table=None, vote: bool = False, shards: int = 0) -> Job:
    """A job on fixed loopback ports (only the per-packet code sees them, no socket); a vote
    job, or one spread over ``shards`` aggregators on the ports after its workers'."""
    fields = {"table": VOTE_TABLE, "granularity": 1, "aggregation": "vote"} if vote else {
        "table": TEST_TABLE if table is None else table, "granularity": granularity}
    job = Job.from_dict({"job_id": job_id, "pool_size": pool, "lanes": lanes, **fields,
                         "workers": [{"id": i, "ip": "127.0.0.1", "port": base + i}
                                     for i in range(n)]})
    if shards:
        job = dataclasses.replace(job, shards=tuple(
            Shard("127.0.0.1", base + n + k) for k in range(shards))).validate()
    return job


def jobs(base: int = BASE_PORT) -> list[Job]:
    """An 8-bit job, a 16-bit job (9 workers x 30), a small-lane job with 2 workers, a vote
    job (3 workers), and a job over 3 shards of which both aggregators serve SHARD."""
    return [make_job(7, 3, 4, base=base), make_job(8, 9, 2, base=base + 20),
            make_job(9, 2, 2, lanes=16, base=base + 40),
            make_job(10, 3, 2, lanes=64, base=base + 44, vote=True),
            make_job(11, 2, 4, base=base + 48, shards=3)]


def stranger_of(base: int = BASE_PORT) -> tuple[str, int]:
    return ("127.0.0.1", base + 59)


def both(js=None):
    js = jobs() if js is None else js
    return (Aggregator(js, nonce=NONCE, shard=SHARD),
            fastagg.FastAggregator(js, nonce=NONCE, shard=SHARD))


def handle_both(py: Aggregator, c, data: bytes, src: tuple[str, int], now: float) -> list:
    """One datagram through both at the same time ``now`` (the reference model's handle, as
    the Python aggregator calls it, and the compiled one's): their replies, asserted
    identical."""
    want, _ = py.model.handle(data, src, now)
    assert c.handle(data, src, now) == want
    return want


def addr(job: Job, w: int) -> tuple[str, int]:
    wk = job.worker(w)
    return (wk.ip, wk.port)


def dgram(job: Job, w: int, seq: int, run: int = 1, pkt_type=P.PktType.DATA,
          payload: bytes | None = None, rng=None, **fields) -> bytes:
    slot, version = P.slot_of(seq, job.pool_size)
    hdr = {"pkt_type": int(pkt_type), "worker_id": w, "job_id": job.job_id, "slot": slot,
           "version": version, "count": 0, "seq": seq % P.SEQ_MOD,
           "offset": (seq * job.lanes) % P.SEQ_MOD, "bitmap": job.config_tag, "run": run,
           "epoch": 0}
    hdr.update(fields)
    if payload is None:
        if pkt_type == P.PktType.FLUSH:
            payload = b""
        elif job.aggregation == "vote" and pkt_type == P.PktType.DATA:
            payload = rng.bytes(job.lanes // 8)
        elif pkt_type == P.PktType.MAX:
            payload = rng.integers(0, 1 << 32, P.MAX_LANES, dtype=np.uint64).astype(">u4")
            payload = payload.tobytes()
        else:
            payload = pack_bits(rng.integers(0, 16, job.lanes).astype(np.uint8),
                                P.INDEX_BITS).tobytes()
    return P.Header(**hdr).pack() + payload


def trace(seed: int, length: int, base: int = BASE_PORT) -> list[tuple[bytes, tuple[str, int]]]:
    """A packet sequence with everything the protocol meets: rounds in and out of order,
    retransmissions before and after completion, MAX rounds, FLUSHes that close chunks
    short (before, during and after a round), vote jobs, chunks of another shard, slot
    reuse, stale seqs, runs that move on and come back, seq wrap-around, and hostile packets
    in between."""
    rng = np.random.default_rng(seed)
    js = jobs(base)
    stranger = stranger_of(base)
    out = []
    runs = {j.job_id: 1 for j in js}
    for _ in range(length):
        job = js[rng.integers(len(js))]
        w = int(rng.integers(job.n_workers))
        roll = rng.random()
        run = runs[job.job_id]
        if roll < 0.02:
            run = int(rng.choice([run + 1, run + (1 << 31) + 5])) % P.SEQ_MOD or 1
            runs[job.job_id] = run
        if roll < 0.70:
            seq = int(rng.integers(0, 3 * job.pool_size))
        elif roll < 0.80:
            seq = int(rng.integers(P.SEQ_MOD - 2 * job.pool_size, P.SEQ_MOD + 2 * job.pool_size))
        else:
            seq = int(rng.integers(0, 1 << 32))
        if job.shards and rng.random() < 0.7:  # mostly chunks this shard owns
            seq = (seq - seq % job.n_shards + SHARD) % P.SEQ_MOD
        kind = rng.random()
        if kind < 0.12:
            out.append((dgram(job, w, seq, run, P.PktType.MAX, rng=rng), addr(job, w)))
        elif kind < 0.16:
            out.append((dgram(job, w, seq, run, P.PktType.FLUSH, rng=rng), addr(job, w)))
        elif kind < 0.20:
            raw = bytearray(dgram(job, w, seq, run, rng=rng))
            pos = int(rng.integers(len(raw)))
            raw[pos] = int(rng.integers(256))
            out.append((bytes(raw[: int(rng.integers(len(raw) + 1))]), addr(job, w)))
        elif kind < 0.23:
            out.append((dgram(job, w, seq, run, rng=rng), stranger))
        elif kind < 0.26:
            out.append((dgram(job, w, seq, int(rng.integers(0, 1 << 32)), rng=rng),
                        addr(job, w)))
        else:
            out.append((dgram(job, w, seq, run, rng=rng), addr(job, w)))
        if rng.random() < 0.3:
            # every worker of a job sends the same chunk: rounds complete
            for v in range(job.n_workers):
                out.append((dgram(job, v, seq, run, rng=rng), addr(job, v)))
                if rng.random() < 0.1:  # a worker gives up on the chunk mid-round
                    out.append((dgram(job, v, seq, run, P.PktType.FLUSH), addr(job, v)))
    return out


def test_same_trace_same_reply_bytes_and_counters():
    py, c = both()
    replies = results = 0
    short = set()
    for i, (data, src) in enumerate(trace(seed=11, length=3000)):
        want = py.handle(data, src)
        assert c.handle(data, src) == want, f"packet {i} answered differently"
        replies += len(want)
        results += sum(d[0] == P.PktType.RESULT for d, _ in want)
        short.update(P.Header.unpack(d).job_id for d, _ in want
                     if d[0] == P.PktType.RESULT and P.Header.unpack(d).count < 2)
    assert py.counters() == c.counters()
    counters = c.counters()
    # The trace exercises what it claims to: completions, both retransmission replies, drops,
    # chunks closed short by FLUSH in every job, vote rounds and another shard's chunks.
    for name in ("completions", "retransmissions", "pending"):
        assert sum(j[name] for j in counters["jobs"].values()) > 10, name
    for reason in ("malformed", "stale", "stale_run", "unknown_worker", "bad_lanes",
                   "wrong_shard"):
        assert counters["drops"][reason] > 0, reason
    assert results > 100 and replies > results
    assert short == {7, 8, 9, 10, 11}
    assert counters["jobs"][10]["completions"] > 10 and counters["jobs"][11]["completions"] > 5


def test_reinstall_and_remove_follow_the_reference():
    py, c = both()
    js = jobs()
    packets = trace(seed=12, length=300)
    for step, (data, src) in enumerate(packets):
        if step == 100:
            for agg in (py, c):  # a re-install's new epoch, the same in both
                agg.install(js[0], NONCE + 1)
        if step == 200:
            for agg in (py, c):
                agg.remove(js[1].job_id)
        now = 1000.0 + 0.01 * step
        assert c.handle(data, src, now) == py.model.handle(data, src, now)[0], \
            f"packet {step}"
    assert py.counters() == c.counters()
    assert c.counters()["epochs"][js[0].job_id] == js[0].new_epoch(nonce=NONCE + 1)
    with pytest.raises(KeyError):
        c.remove(js[1].job_id)


def test_a_given_clock_is_taken_whatever_its_origin():
    """handle(..., now) reads now from any origin, as the model does; a negative now was
    once taken for "none given" and replaced by the monotonic clock, so the run-idle rule
    saw another time than the model."""
    py, c = both()
    job = jobs()[0]
    src = ("127.0.0.1", BASE_PORT)
    tag = job.config_tag
    first = P.Header(P.PktType.DATA, 0, job.job_id, 0, 0, 0, 0, 0, tag, RUN, NONCE).pack()
    far = P.Header(P.PktType.DATA, 0, job.job_id, 0, 0, 0, 0, 0, tag, RUN + (1 << 25),
                   NONCE + 1).pack()
    payload = bytes(P.payload_bytes(P.PktType.DATA, job.lanes))
    for now, data in ((-100.0, first), (-100.0 + P.RUN_IDLE_S + 1, far)):
        want, reason = py.model.handle(data + payload, src, now)
        assert c.handle(data + payload, src, now) == want
    assert reason is None, "the model refused a run that took an idle job over"


@pytest.mark.parametrize("engine", ["python", "compiled"])
def test_serve_with_a_spent_duration_returns_at_once(engine):
    """serve(duration) with a duration already spent returns; only None serves until
    stop() (the compiled loop once served forever on any negative duration)."""
    import threading
    agg = Aggregator() if engine == "python" else fastagg.FastAggregator()
    agg.bind("127.0.0.1", 0)
    t = threading.Thread(target=agg.serve, args=(-0.5,), daemon=True)
    t.start()
    t.join(2.0)
    alive = t.is_alive()
    agg.stop()
    t.join(2.0)
    assert not alive, "serve(-0.5) still serving after 2 s"


@pytest.mark.parametrize("engine", ["python", "compiled"])
def test_a_reinstall_keeps_the_address_each_worker_sends_to(engine):
    """A wildcard-bound aggregator answers each worker from the address it sends to. After
    a re-install, a worker silent since still hears the first result from its address (the
    compiled engine once forgot them at install and sent from the other worker's)."""
    base = free_port_block(2)
    job = make_job(4, 2, 2, lanes=16, base=base)
    agg = (Aggregator if engine == "python" else fastagg.FastAggregator)([job], nonce=NONCE)
    port = agg.start("0.0.0.0", 0)[1]
    socks = []
    try:
        for i in range(2):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("127.0.0.1", base + i))
            s.settimeout(2)
            socks.append(s)
        to = [("127.0.0.2", port), ("127.0.0.1", port)]
        payload = bytes(P.payload_bytes(P.PktType.DATA, job.lanes))
        for w in range(2):
            socks[w].sendto(P.Header(P.PktType.DATA, w, 4, 0, 0, 0, 0, 0, job.config_tag,
                                     RUN, NONCE + w).pack() + payload, to[w])
        assert socks[0].recvfrom(4096)[1][0] == "127.0.0.2"
        socks[1].recvfrom(4096)
        agg.install(job, NONCE + 1)
        socks[1].sendto(P.Header(P.PktType.FLUSH, 1, 4, 1, 0, 0, 1, 16, job.config_tag, RUN,
                                 NONCE + 1).pack(), to[1])
        data, src = socks[0].recvfrom(4096)
        assert P.Header.unpack(data).pkt_type == P.PktType.RESULT
        assert src[0] == "127.0.0.2", "worker 0 heard the result from another address"
    finally:
        agg.stop()
        for s in socks:
            s.close()


@pytest.mark.parametrize("engine", ["python", "compiled"])
def test_no_install_repeats_the_jobs_last_epoch(engine, monkeypatch):
    """install(job, nonce) with the installed nonce kept the epoch, and so did a random
    nonce after a remove (the last epoch was forgotten): a client whose run spanned the
    re-install met slots that forgot its chunks and blamed a worker that had sent. A random
    nonce steps on from the last one kept through the remove (protocol.NONCE_STEP)."""
    import secrets
    job = jobs()[0]
    agg = (Aggregator if engine == "python" else fastagg.FastAggregator)([job], nonce=NONCE)
    with pytest.raises(ValueError, match="repeats the job's last epoch"):
        agg.install(job, NONCE)
    monkeypatch.setattr(secrets, "randbelow", lambda n: 7)
    agg.remove(job.job_id)
    agg.install(job)
    assert agg.counters()["epochs"][job.job_id] == job.new_epoch(
        nonce=P.nonce_at(P.nonce_place(NONCE) + 8))


@pytest.mark.parametrize("engine", ["python", "compiled"])
def test_replies_that_fail_to_send_are_counted_in_the_counters(engine):
    """Both engines counted failed sends in ``send_errors`` but left them out of
    ``counters()``, which is all `thc aggregator` prints: a worker at a subnet broadcast
    address (sendto: EACCES) lost every result unreported."""
    base = free_port_block(1)   # worker 0's port, bound here: not one another test binds
    d = make_job(1, 2, 8, base=base).to_dict()
    d["workers"][1]["ip"] = "127.255.255.255"
    d["loss_bound"] = 0.5
    job = Job.from_dict(d)
    agg = (Aggregator if engine == "python" else fastagg.FastAggregator)([job], nonce=NONCE)
    addr = agg.start("127.0.0.1", 0)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", base))
    s.settimeout(5)
    try:
        s.sendto(P.Header(P.PktType.FLUSH, 0, 1, 0, 0, 0, 0, 0, job.config_tag, 7, 1).pack(),
                 addr)
        s.recv(4096)                    # worker 0's copy of the RESULT
        deadline = time.monotonic() + 5
        while agg.counters()["send_errors"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        agg.stop()
        s.close()
    assert agg.counters()["send_errors"] == 1


@pytest.mark.parametrize("engine", ["python", "compiled"])
def test_datagrams_the_kernel_drops_at_a_full_queue_are_counted(engine):
    """A receive queue the kernel filled dropped datagrams that no counter showed: to the
    operator an overloaded aggregator looked like a lossy network. Bound and not serving,
    with the smallest queue, the aggregator takes a few datagrams and the kernel drops the
    rest; ``queue_overflow`` counts them, also once stopped."""
    if fastagg.UNAVAILABLE and engine == "compiled":
        pytest.skip(fastagg.UNAVAILABLE)
    agg = (Aggregator if engine == "python" else fastagg.FastAggregator)(
        [make_job(1, 2, 8)], nonce=NONCE)
    to = agg.bind("127.0.0.1", 0)
    assert agg.receive_buffer > 0
    agg._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)   # the kernel's least
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        if sys.platform != "linux":
            pytest.skip("the kernel's drop count is Linux's (SO_MEMINFO)")
        assert agg.counters()["queue_overflow"] == 0   # None: no SO_MEMINFO
        datagram = bytes(1000)
        for _ in range(200):
            s.sendto(datagram, to)
        dropped = agg.counters()["queue_overflow"]
        assert 150 < dropped < 200, dropped
        agg._sock.close()   # as stop() leaves it for a moment: a reader meanwhile gets the last
        assert agg.counters()["queue_overflow"] == dropped
    finally:
        agg.stop()
        s.close()
    assert agg.counters()["queue_overflow"] == dropped


UDP_SEGMENT = 103  # linux/udp.h; Python's socket module does not name it


def bursts(packets, most: int = 16):
    """``packets`` as runs of consecutive datagrams from one source with one length (at most
    ``most`` each): what one UDP GSO send carries."""
    runs: list[tuple[list[bytes], tuple[str, int]]] = []
    for data, src in packets:
        if (runs and runs[-1][1] == src and len(runs[-1][0]) < most
                and len(runs[-1][0][0]) == len(data)):
            runs[-1][0].append(data)
        else:
            runs.append(([data], src))
    return runs


BARRIER_SEQ = 0x13579BDF
"""A seq no trace uses: the barrier's REFUSED is told from the trace's replies by it."""


def barrier_of(job: Job) -> tuple[bytes, tuple[str, int]]:
    """A datagram the aggregator answers with a REFUSED (``wrong_slot``: the other version)
    to worker 0 of ``job``: sent last, its answer is the last, so every reply before it is
    in its socket once it arrives (one receive socket, replies sent in order, loopback
    delivering in the send call)."""
    version = 1 - P.slot_of(BARRIER_SEQ, job.pool_size)[1]
    return (dgram(job, 0, BARRIER_SEQ, run=RUN, version=version,
                  rng=np.random.default_rng(0)), addr(job, 0))


def serve_trace(agg, packets, job_socks, stranger, barrier,
                gso: bool = False) -> tuple[dict, dict]:
    """Send ``packets`` over loopback to a started aggregator (``gso``: each run of
    :func:`bursts` as one UDP GSO send), then ``barrier`` (:func:`barrier_of`); return what
    each address received (in order, the barrier's REFUSED included) and the aggregator's
    counters."""
    target = agg.address
    sends = bursts(packets) if gso else [([data], src) for data, src in packets]
    for i, (run, src) in enumerate(sends):
        sock = job_socks.get(src) or stranger
        if len(run) == 1:
            sock.sendto(run[0], target)
        else:
            sock.sendmsg([b"".join(run)], [(socket.SOL_UDP, UDP_SEGMENT,
                                            struct.pack("=H", len(run[0])))], 0, target)
        if i % 16 == 15:
            time.sleep(0.002)
    data, bsrc = barrier
    job_socks[bsrc].sendto(data, target)
    got = {bsrc: []}
    job_socks[bsrc].settimeout(10.0)
    while True:
        try:
            reply = job_socks[bsrc].recv(4096)
        except TimeoutError:
            raise AssertionError("the barrier's REFUSED did not come back within 10 s") from None
        got[bsrc].append(reply)
        h = P.Header.unpack(reply)
        if (h.pkt_type, h.seq, h.count) == (
                P.PktType.REFUSED, BARRIER_SEQ, P.DropReason.wrong_slot):
            break
    for src, s in list(job_socks.items()) + [("stranger", stranger)]:
        got.setdefault(src, [])
        while src != bsrc:
            try:
                got[src].append(s.recv(4096, socket.MSG_DONTWAIT))
            except BlockingIOError:
                break
    return got, agg.counters()


def test_served_over_udp_both_answer_a_trace_identically():
    """Through the serving loops (recvmmsg/sendmmsg batches, with and without UDP GSO/GRO,
    vs recvfrom/sendto): every address gets the same datagrams in the same order, also when
    the workers send their runs of datagrams as GSO bursts that arrive by GRO as one
    buffer."""
    base = free_port_block(60)
    packets = trace(seed=13, length=400, base=base)
    assert max(len(run) for run, _ in bursts(packets)) > 1
    results = []
    kinds = ((lambda js, nonce: Aggregator(js, nonce=nonce, shard=SHARD), False),
             (lambda js, nonce: fastagg.FastAggregator(js, nonce, shard=SHARD), False),
             (lambda js, nonce: fastagg.FastAggregator(js, nonce, gso=False, shard=SHARD),
              False),
             (lambda js, nonce: fastagg.FastAggregator(js, nonce, shard=SHARD), True))
    for kind, gso in kinds:
        socks = {}
        stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            for job in jobs(base):
                for w in range(job.n_workers):
                    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
                    s.bind(addr(job, w))
                    socks[addr(job, w)] = s
            stranger.bind(stranger_of(base))
            with kind(jobs(base), nonce=NONCE) as agg:
                agg.start("127.0.0.1", 0)
                results.append(serve_trace(agg, packets, socks, stranger,
                                           barrier_of(jobs(base)[0]), gso))
        finally:
            for s in socks.values():
                s.close()
            stranger.close()
    (py_got, py_counters), *compiled = results
    assert sum(map(len, py_got.values())) > 100
    for c_got, c_counters in compiled:
        assert c_got == py_got
        assert c_counters == py_counters


# -- differential fuzz -------------------------------------------------------------------

FUZZ_T0 = 1000.0
"""The time of fuzz_setup's packets; the fuzzes' clocks go on from there."""


def fuzz_setup(kind: str = "thc"):
    """Both aggregators with the fuzzed job (2 workers, pool 2; a THC job, a vote job, or a
    job over 3 shards of which they serve SHARD) holding a known round at KNOWN_SEQ of run
    RUN, and the job next to it; as tests/conformance/test_fuzz.py."""
    job = make_job(30, 2, 2, base=BASE_PORT + 60, vote=kind == "vote",
                   shards=3 if kind == "sharded" else 0)
    other = make_job(31, 2, 2, base=BASE_PORT + 70)
    py, c = both([job, other])
    rng = np.random.default_rng(30)
    if job.aggregation == "vote":
        known = [rng.bytes(job.lanes // 8) for _ in range(2)]
    else:
        known = [pack_bits(rng.integers(0, 16, job.lanes).astype(np.uint8),
                           P.INDEX_BITS).tobytes() for _ in range(2)]
    # Every chunk up to KNOWN_SEQ that they serve, as workers stream them: every worker
    # acknowledges a slot version's use before its next use (KNOWN_SEQ's) starts.
    for seq in range(KNOWN_SEQ + 1):
        if job.shard_of(seq) != (SHARD if job.shards else 0):
            continue
        for w in range(2):
            d = dgram(job, w, seq, RUN, payload=known[w])
            handle_both(py, c, d, addr(job, w), FUZZ_T0)
    senders = {"w0": addr(job, 0), "w1": addr(job, 1), "stranger": stranger_of()}
    probe = dgram(job, 0, KNOWN_SEQ, RUN, payload=known[0])
    expected = handle_both(py, c, probe, senders["w0"], FUZZ_T0)
    assert len(expected) == 1 and expected[0][0][0] == P.PktType.RESULT
    assert sum(py.counters()["drops"].values()) == 0
    return job, other, py, c, senders, probe, expected


def test_differential_fuzz_hostile_packets_are_counted_drops_in_both():
    """Truncated, oversized, unknown type, wrong job/worker, stale seq, cross-run, wrong
    slot, spoofed: each is one drop of the same reason in both; stale, cross-run and wrong-slot
    packets are answered with the same REFUSED (the reason's code, its detail) to their
    sender alone, no other is answered, and the known round's result (the probe's
    retransmission reply) stays byte for byte what it was."""
    job, other, py, c, senders, probe, expected = fuzz_setup()
    clock = [FUZZ_T0]
    refused = {r: 0 for r in REFUSED_REASONS}

    @settings(max_examples=80, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(st.lists(hostile(job, other), min_size=1, max_size=6))
    @example(refused_batch(job))
    def fuzz(batch):
        before = c.counters()["drops"]
        for reason, data, sender in batch:
            src = senders[sender]
            clock[0] += 0.001
            got = handle_both(py, c, data, src, clock[0])
            if reason in REFUSED_REASONS:
                assert len(got) == 1 and got[0][1] == src
                reply = P.Header.unpack(got[0][0])
                assert len(got[0][0]) == P.HEADER_BYTES
                assert reply.pkt_type == P.PktType.REFUSED
                assert reply.epoch & P.NONCE_MASK == NONCE
                assert (reply.worker_id, reply.job_id, reply.slot, reply.version, reply.count,
                        reply.seq, reply.offset, reply.bitmap, reply.run) == \
                    refused_fields(reason, data)
                refused[reason] += 1
            else:
                assert got == []
        after = c.counters()["drops"]
        want = {}
        for reason, _, _ in batch:
            want[reason] = want.get(reason, 0) + 1
        assert {k: after[k] - before[k] for k in after if after[k] != before[k]} == want
        assert c.counters() == py.counters()
        assert handle_both(py, c, probe, senders["w0"], clock[0]) == expected

    fuzz()
    assert all(refused.values()), refused


@st.composite
def mutated(draw, job):
    """A packet of ``job`` as a worker would send it (DATA, MAX or FLUSH, near the known
    round), then up to three of its header fields, its length or its sender changed: many
    are dropped, others accumulate, close a chunk or are answered from it; whatever happens
    must happen identically."""
    seq = draw(st.sampled_from([KNOWN_SEQ, 5, 6, 7, KNOWN_SEQ - 2, 0, 2 ** 31 + 4]))
    kind = draw(st.sampled_from([P.PktType.DATA, P.PktType.DATA, P.PktType.MAX,
                                 P.PktType.FLUSH]))
    w = draw(st.sampled_from([0, 1]))
    slot, version = P.slot_of(seq, job.pool_size)
    fields = {"pkt_type": int(kind), "worker_id": w, "job_id": job.job_id, "slot": slot,
              "version": version, "count": 0, "seq": seq % P.SEQ_MOD,
              "offset": seq * job.lanes % P.SEQ_MOD, "bitmap": job.config_tag,
              "run": draw(st.sampled_from([RUN, RUN, RUN, RUN + 1, RUN - 1])), "epoch": 0}
    widths = dict(P.HEADER_FIELDS)
    for name in draw(st.lists(st.sampled_from(sorted(widths)), max_size=3)):
        fields[name] = draw(st.one_of(st.integers(0, (1 << widths[name]) - 1),
                                      st.integers(0, 2), st.just(job.job_id + 1)))
    size = (P.payload_bytes(P.PktType.MAX) if kind == P.PktType.MAX else
            0 if kind == P.PktType.FLUSH else
            P.payload_bytes(P.PktType.DATA, job.lanes, aggregation=job.aggregation))
    payload = draw(st.one_of(st.binary(min_size=size, max_size=size),
                             st.binary(min_size=size, max_size=size),
                             st.binary(max_size=2 * size)))
    cut = draw(st.one_of(st.none(), st.none(), st.none(),
                         st.integers(0, P.HEADER_BYTES + len(payload))))
    data = (P.HEADER_STRUCT.pack(*(fields[n] for n, _ in P.HEADER_FIELDS)) + payload)[:cut]
    return data, draw(st.sampled_from([f"w{w}"] * 4 + ["w0", "w1", "stranger"]))


@pytest.mark.parametrize("kind", ["thc", "vote", "sharded"])
def test_differential_fuzz_mutated_packets_behave_identically(kind):
    job, _, py, c, senders, _, _ = fuzz_setup(kind)
    clock = [FUZZ_T0]

    @settings(max_examples=100, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(st.lists(st.tuples(mutated(job), st.sampled_from([0.001] * 7 + [P.RUN_IDLE_S])),
                    min_size=1, max_size=8))
    def fuzz(batch):
        # the same time in both; now and then the job's run has been idle long enough
        for (data, sender), step in batch:
            clock[0] += step
            handle_both(py, c, data, senders[sender], clock[0])
        assert c.counters() == py.counters()

    before = c.counters()
    fuzz()
    after = c.counters()   # the fuzz's packets reached the job and its drops, not only setup's
    assert sum(after["jobs"][job.job_id].values()) > sum(before["jobs"][job.job_id].values())
    assert sum(after["drops"].values()) > sum(before["drops"].values())


def test_the_comparison_would_see_a_wrong_sum():
    """The check can fail: a job whose table differs by one entry answers other sums (its
    epoch differs too, by its configuration tag: only the payloads are compared)."""
    js = jobs()
    changed = make_job(7, 3, 4, table=[TEST_TABLE[0] + 1] + TEST_TABLE[1:])
    py = Aggregator(js, nonce=NONCE, shard=SHARD)
    c = fastagg.FastAggregator([changed] + js[1:], nonce=NONCE, shard=SHARD)

    def payloads(replies):
        return [(bytes(r[P.HEADER_BYTES:]), dst) for r, dst in replies]
    diffs = sum(payloads(c.handle(d, s)) != payloads(py.handle(d, s))
                for d, s in trace(seed=14, length=300))
    assert diffs > 0


def test_compiled_echo_answers_every_packet_with_a_result():
    job = make_job(7, 3, 4)
    echo = fastagg.FastEcho([job], nonce=NONCE)
    rng = np.random.default_rng(3)
    d = dgram(job, 1, 5, 9, rng=rng, epoch=77)
    [(reply, dst)] = echo.handle(d, addr(job, 1))
    hdr = P.Header.unpack(reply)
    assert dst == addr(job, 1) and hdr.pkt_type == P.PktType.RESULT
    # the job's epoch, not the worker's nonce (77): a client takes only its job's epochs
    assert (hdr.worker_id, hdr.seq, hdr.run, hdr.count) == (1, 5, 9, 3)
    assert hdr.epoch == echo.counters()["epochs"][job.job_id] == job.new_epoch(nonce=NONCE)
    assert len(reply) == P.HEADER_BYTES + P.payload_bytes(P.PktType.RESULT, job.lanes)
    assert reply[P.HEADER_BYTES:] == bytes(len(reply) - P.HEADER_BYTES)
    assert echo.handle(d[:10], addr(job, 1)) == []
    echo.counters()
    assert echo.echoed == 1


@pytest.mark.parametrize("kind", ["compiled", "python"])
def test_an_echo_answers_only_a_workers_upstream_packets(kind):
    """The benchmark's echoes answered any datagram of an installed job: a RESULT too (one
    forged packet set two echoes answering each other for good), and from any source (a
    reflector); the Python echo's thread died on an unknown job."""
    from thc.bench.aggregator import PythonEcho
    job = make_job(7, 3, 4)
    echo = fastagg.FastEcho([job], nonce=NONCE) if kind == "compiled" else PythonEcho([job])
    rng = np.random.default_rng(3)
    host, port = addr(job, 1)
    for d, src, reason in ((dgram(job, 1, 5, pkt_type=P.PktType.RESULT, rng=rng),
                            addr(job, 1), "wrong_direction"),
                           (dgram(job, 1, 5, rng=rng), (host, port + 1), "unknown_worker"),
                           (dgram(job, 3, 5, rng=rng), addr(job, 1), "worker_outside_job"),
                           (dgram(make_job(8, 3, 4), 1, 5, rng=rng), addr(job, 1),
                            "unknown_job"),
                           (dgram(job, 1, 5, rng=rng)[:20], addr(job, 1), "malformed")):
        assert echo.handle(d, src) == []
        assert echo.counters()["drops"][reason] == 1
    assert echo.echoed == 0
    assert len(echo.handle(dgram(job, 1, 5, rng=rng), addr(job, 1))) == 1


def test_a_missing_extension_is_reported_not_fatal(monkeypatch):
    monkeypatch.setattr(fastagg, "UNAVAILABLE", "not built (test)")
    assert not fastagg.available()
    with pytest.raises(RuntimeError, match="not built"):
        fastagg.FastAggregator()


def test_thc_aggregator_picks_the_compiled_datapath_and_says_so(tmp_path):
    from thc.net.aggregator import choose
    from thc.net.impair import Impairment
    from thc.wire.jobs import Cluster

    js = jobs()  # vote and sharded jobs among them: nothing makes it fall back
    agg, name = choose("auto", js, Impairment(), shard=SHARD)
    assert isinstance(agg, fastagg.FastAggregator) and name.startswith("compiled")
    agg, name = choose("python", js, Impairment(), shard=SHARD)
    assert type(agg) is Aggregator and name == "python (as asked)"
    agg, name = choose("auto", js, Impairment(loss=0.1), shard=SHARD)
    assert type(agg) is Aggregator and "impairment" in name
    with pytest.raises(RuntimeError, match="impairment"):
        choose("compiled", js, Impairment(loss=0.1), shard=SHARD)
    cfg = tmp_path / "cluster.json"
    Cluster(jobs=tuple(js)).save(cfg)
    shard = next(j for j in js if j.shards).shards[SHARD]   # where the map puts it
    out = subprocess.run([sys.executable, "-m", "thc.cli", "aggregator", "--listen",
                          f"{shard.ip}:{shard.port}", "--config", str(cfg),
                          "--duration", "0.2", "--stats-interval", "0", "--shard", str(SHARD)],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert "listening" in first and "datapath compiled" in first and "UDP GSO" in first
    agg, name = choose("auto", js, Impairment(), gso=False, shard=SHARD)
    assert not agg.gso and "no GSO" in name


@pytest.mark.parametrize("engine", ["python", "compiled"])
def test_installs_from_two_threads_draw_one_after_the_other(engine, monkeypatch):
    """The compiled aggregator drew an install's epoch before taking its lock: two installs
    of one job at once both stepped on from the same last epoch and could draw the same one,
    and a client whose run spanned the second would not see its slots wiped."""
    import threading
    job = jobs()[0]
    agg = (Aggregator if engine == "python" else fastagg.FastAggregator)([job], nonce=NONCE)
    draw, seen, drawn = P.job_epoch, [], []
    first = job.new_epoch(nonce=NONCE)

    def slow_draw(tag, nonce=None, previous=None, avoid=()):
        seen.append(previous)
        time.sleep(0.05)
        drawn.append(draw(tag, nonce, previous, avoid))
        return drawn[-1]

    monkeypatch.setattr(P, "job_epoch", slow_draw)
    threads = [threading.Thread(target=agg.install, args=(job,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 2 and seen[0] == first and seen[1] not in (first, None), \
        f"the installs stepped on from {seen}: the second did not see the first's epoch"
    assert drawn[0] != drawn[1] and agg.counters()["epochs"][job.job_id] == drawn[1]


@pytest.mark.skipif(sys.platform != "linux", reason="the kernel's drop count is Linux's")
def test_the_drop_count_is_read_while_other_sockets_come_and_go():
    """Read from /proc/self/net/udp, a page a read and resumed by position, the count was
    None in about one read in eight while another thread opened and closed sockets (a
    suite run beside it once read None)."""
    from thc.net.server import queue_overflow
    me = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    me.bind(("127.0.0.1", 0))
    kept = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(300)]
    for k in kept:
        k.bind(("127.0.0.1", 0))
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            batch = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(50)]
            for b in batch:
                b.bind(("127.0.0.1", 0))
            for b in batch:
                b.close()
    t = threading.Thread(target=churn)
    t.start()
    try:
        counts = [queue_overflow(me) for _ in range(500)]
    finally:
        stop.set()
        t.join()
        for k in [me, *kept]:
            k.close()
    assert counts == [0] * 500, counts.count(None)
