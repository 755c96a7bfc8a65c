"""DLCP's bounded loss and priority classes on both client windows, fuzzed against the
reference model: worker 0's client closes chunks short (FLUSH) while worker 1, played by
the server, comes early or late to each chunk or closes it short itself, and the server
loses some of worker 0's packets and some replies and duplicates others. Whatever the
timing, the round ends with sums that hold exactly the workers its counts and bitmaps name,
no more chunks closed short by the worker than its bound, and every packet in its class on the wire
(IP_TOS, read back).

tests/test_client_fuzz.py fuzzes hostile replies; this one the loss bound's rules."""
from __future__ import annotations

import random
import socket
import threading
import time

import numpy as np
import pytest

from thc.codec.packing import pack_bits
from thc.net.client import DATAPATH_ENV, AggregationClient
from thc.net.fastclient import CLIENT_UNAVAILABLE
from thc.net.priority import FLUSH_CLASS, N_CLASSES, tos_of
from thc.net.window import flush_budget
from thc.testing.clusters import free_port_block, local_job
from thc.wire import protocol as P
from thc.wire.model import Model

CHUNKS, LANES, RUN, BOUND = 16, 16, 31, 0.25
BUDGET = flush_budget(BOUND, CHUNKS)
PLANS = ("first", "late", "flush", "flush_after")
"""What worker 1 sends for a chunk of the fuzzed round: its DATA before worker 0's first
packet for it, or after worker 0's second (a DATA or a FLUSH); a FLUSH of its own before
worker 0's first packet, or after it (at most its bound's share of the round's chunks)."""


def _indices(seed: int, worker: int, seq: int) -> np.ndarray:
    return np.random.default_rng((seed, worker, seq)).integers(0, 16, LANES).astype(np.uint8)


class LossyPeer:
    """The model behind a socket that records each datagram's (type, seq, TOS byte), plays
    worker 1 by each chunk's plan, and loses or duplicates by a seeded draw per datagram."""

    def __init__(self, job, seed: int):
        self.job, self.seed = job, seed
        rng = random.Random(seed)
        self.plans = {s: "first" for s in range(CHUNKS)}
        self.plans |= {CHUNKS + i: rng.choice(PLANS[:2]) for i in range(CHUNKS)}
        for s in rng.sample(range(CHUNKS, 2 * CHUNKS), rng.randint(0, BUDGET)):
            self.plans[s] = rng.choice(PLANS[2:])
        self.model = Model()
        self.model.install(job, job.new_epoch(nonce=0x51))
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.addr = self.sock.getsockname()
        self.seen: list[tuple[int, int, int]] = []
        self.packets: dict[int, int] = {}
        self.joined: set[int] = set()
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _peer(self, hdr, flush: bool) -> bytes:
        head = P.Header(P.PktType.FLUSH if flush else P.PktType.DATA, 1, hdr.job_id, hdr.slot,
                        hdr.version, 0, hdr.seq, hdr.offset, self.job.config_tag, hdr.run,
                        3).pack()
        return head if flush else head + pack_bits(_indices(self.seed, 1, hdr.seq),
                                                   P.INDEX_BITS).tobytes()

    def _serve(self):
        worker1 = (self.job.worker(1).ip, self.job.worker(1).port)
        while not self._stop:
            try:
                data, anc, _, src = self.sock.recvmsg(4096, 64)
            except socket.timeout:
                continue
            hdr = P.Header.unpack(data)
            tos = next((c[2][0] for c in anc if c[1] == socket.IP_TOS), 0)
            self.seen.append((hdr.pkt_type, hdr.seq, tos))
            k = self.packets[hdr.seq] = self.packets.get(hdr.seq, 0) + 1
            rng = random.Random((self.seed * 1000 + hdr.seq) * 1000 + k)
            fuzzed = hdr.seq >= CHUNKS
            plan = self.plans[hdr.seq]
            if hdr.seq not in self.joined and k == {"late": 3, "flush_after": 2}.get(plan, 1):
                self.joined.add(hdr.seq)
                self.model.handle(self._peer(hdr, plan.startswith("flush")), worker1,
                                  time.monotonic())
            if fuzzed and rng.random() < 0.15:
                continue                                   # worker 0's packet lost
            replies, _ = self.model.handle(data, src, time.monotonic())
            for reply, dst in replies:
                if dst != src or (fuzzed and rng.random() < 0.15):
                    continue                               # a reply lost
                for _ in range(2 if fuzzed and rng.random() < 0.1 else 1):
                    self.sock.sendto(reply, dst)

    def close(self):
        self._stop = True
        self._thread.join()
        self.sock.close()


def _round(seed: int, gso: bool = False):
    """Both rounds of worker 0 (the first full, so the aggregator is heard), with classes;
    the fuzzed round's result or timeout, the client's stats and what the server saw."""
    job = local_job(2, 2, free_port_block(2), pool_size=8, lanes=LANES)
    peer = LossyPeer(job, seed)
    rng = np.random.default_rng(seed)
    own = rng.integers(0, 16, (2, CHUNKS * LANES)).astype(np.uint8)
    classes = rng.integers(0, N_CLASSES, (2, CHUNKS)).astype(np.uint8)
    try:
        with AggregationClient(job, 0, peer.addr, run=RUN, timeout=0.02, max_timeout=0.1,
                               deadline=2.0, loss_bound=BOUND, gso=gso) as c:
            first = c.reduce(pack_bits(own[0], P.INDEX_BITS), classes=classes[0])
            assert first.counts.min() == 2
            out = c.reduce(pack_bits(own[1], P.INDEX_BITS), classes=classes[1])
            return job, out, c.stats, peer, own[1], np.concatenate(classes)
    finally:
        peer.close()


@pytest.mark.parametrize("datapath,gso", [("python", False), ("compiled", False),
                                         ("compiled", True)])
@pytest.mark.parametrize("seed", range(10))
def test_a_bounded_round_holds_exactly_whom_it_names(seed, datapath, gso, monkeypatch):
    """Each window; ``gso``: the compiled one sends a batch's datagrams of one shard, length
    (DATA or FLUSH) and class as one UDP GSO send (the Python window has none)."""
    if datapath == "compiled" and CLIENT_UNAVAILABLE:
        pytest.skip(f"compiled client: {CLIENT_UNAVAILABLE}")
    monkeypatch.setenv(DATAPATH_ENV, datapath)
    job, out, stats, peer, own, classes = _round(seed, gso)
    assert stats.compiled_rounds == 2 * (datapath == "compiled")
    assert (stats.gso_sends > 0) == gso, stats.gso_sends
    flushed = {s for t, s, _ in peer.seen if t == P.PktType.FLUSH}
    assert all(s >= CHUNKS for s in flushed), flushed
    assert {(s, tos) for t, s, tos in peer.seen if t == P.PktType.DATA} == {
        (s, tos_of(classes[s])) for s in range(2 * CHUNKS) if peer.packets.get(s)}
    assert {tos for t, _, tos in peer.seen if t == P.PktType.FLUSH} <= {tos_of(FLUSH_CLASS)}
    values = [job.lane_values(pack_bits(own, P.INDEX_BITS)).astype(np.int64).reshape(
        CHUNKS, LANES)]
    values.append(np.stack([job.lane_values(pack_bits(_indices(seed, 1, CHUNKS + i), 4))
                            for i in range(CHUNKS)]).astype(np.int64))
    for i in range(CHUNKS):
        bitmap = int(out.bitmaps[i])
        want = sum((values[w][i] for w in range(2) if bitmap >> w & 1),
                   np.zeros(LANES, np.int64))
        assert out.sums.reshape(CHUNKS, LANES)[i].tolist() == want.tolist(), (i, bitmap)
        assert out.counts[i] == bin(bitmap).count("1")
        # worker 1 is in the sums where it sent its DATA before any FLUSH; worker 0 where
        # its DATA came before a FLUSH (its own, when that DATA was lost, or worker 1's)
        plan, mine = peer.plans[CHUNKS + i], CHUNKS + i in flushed
        assert bool(bitmap >> 1 & 1) == (plan == "first" or plan == "late" and (
            not mine or bitmap >> 1 & 1)), (i, plan, bitmap)
        assert bitmap & 1 or mine or plan.startswith("flush"), (i, plan, bitmap)
    # a flushed chunk that ended full gave its share of the bound back
    short = {CHUNKS + i for i in range(CHUNKS) if out.counts[i] < 2}
    assert len(short & flushed) <= BUDGET, (short, flushed)
    assert len(short) == stats.short <= 2 * BUDGET
    assert stats.flushed >= len(flushed)
