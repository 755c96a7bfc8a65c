"""The client windows against the reference model, fuzzed: worker 0's client (the Python
window, and the compiled one) aggregates through a UDP server that runs host/wire/model.py,
plays worker 1 itself (its DATA before or after worker 0's), and puts random hostile or
impossible replies before the model's own. Both windows must end alike: the exact sums
(an oracle that knows both workers' payloads), or the same error; and they must count the
replies they refused alike.

tests/test_client_datapath.py stages one fixed volley of such replies; here every chunk
draws its own, so their combinations and orders vary."""
from __future__ import annotations

import random
import socket
import threading

import numpy as np
import pytest

from thc.codec.packing import pack_bits
from thc.net import fastclient
from thc.net.client import AggregationClient
from thc.testing.clusters import free_port_block, local_job
from thc.wire import protocol as P
from thc.wire.model import Model

CHUNKS, LANES, RUN = 12, 16, 77
HOSTILE = ("length", "extra_worker", "count", "too_big", "below_own", "unreachable",
           "max_type", "other_run", "other_job", "other_worker", "pending_full",
           "pending_not_ours", "duplicate", "refused", "epoch")
"""What may come before a chunk's true replies. The last two may end the round (an error),
as may one of the others sent with another epoch of the job's configuration (a stray: an
impossible one teaches no epoch, any one after the epoch was learnt is a restart)."""
ENDS = {"refused": "AggregationRefused", "epoch": "AggregatorRestarted",
        "stray": "AggregatorRestarted"}
"""The error each reply that may end the round ends it with."""


def _peer_indices(seed: int, seq: int) -> np.ndarray:
    return np.random.default_rng((seed, seq, 1)).integers(0, 16, LANES).astype(np.uint8)


class FuzzAggregator:
    """The model behind a socket; worker 1 played from ``seed``; each chunk's first DATA
    draws whether worker 1 came first and which hostile replies go out before the true
    ones."""

    def __init__(self, job, seed: int):
        self.job, self.seed = job, seed
        self.epoch = job.new_epoch(nonce=0x77)
        self.model = Model()
        self.model.install(job, self.epoch)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.addr = self.sock.getsockname()
        self.seen: set[int] = set()
        self.ending: list[str] = []
        """The replies sent that may end the round (HOSTILE's last two, strays), in order."""
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _peer(self, hdr) -> bytes:
        return P.Header(P.PktType.DATA, 1, hdr.job_id, hdr.slot, hdr.version, 0, hdr.seq,
                        hdr.offset, self.job.config_tag, hdr.run, 5).pack() + pack_bits(
            _peer_indices(self.seed, hdr.seq), P.INDEX_BITS).tobytes()

    def _hostile(self, kind: str, hdr, own: np.ndarray, stray: bool = False) -> bytes:
        job, dtype = self.job, P.sum_dtype(self.job.sum_bits)
        true = own + job.lane_values(pack_bits(_peer_indices(self.seed, hdr.seq), 4))
        fields = dict(pkt_type=P.PktType.RESULT, worker_id=0, job_id=hdr.job_id,
                      slot=hdr.slot, version=hdr.version, count=2, seq=hdr.seq,
                      offset=hdr.offset, bitmap=0b11, run=hdr.run,
                      epoch=self.job.new_epoch(nonce=0x79) if stray else self.epoch)
        payload = true.astype(dtype).tobytes()
        if kind == "length":
            payload = payload[:-2]
        elif kind == "extra_worker":
            fields.update(count=3, bitmap=0b111)
        elif kind == "count":
            fields.update(count=1)
        elif kind == "too_big":
            payload = np.full(job.lanes, 61).astype(dtype).tobytes()
        elif kind == "below_own":
            payload = np.maximum(own.astype(np.int64) - 1, 0).astype(dtype).tobytes()
            if not own.any():
                payload = payload[:-2]
        elif kind == "unreachable":
            # within the range, and not the peer's table value: one lane's rest no single
            # table value makes
            rest = min(set(range(job.granularity + 1)) - set(job.table))
            payload = np.concatenate([own[:1] + rest, true[1:]]).astype(dtype).tobytes()
        elif kind == "max_type":
            fields.update(pkt_type=P.PktType.MAX_RESULT)
        elif kind == "other_run":
            fields.update(run=hdr.run + 1)
        elif kind == "other_job":
            fields.update(job_id=hdr.job_id + 1)
        elif kind == "other_worker":
            fields.update(worker_id=1)
        elif kind == "pending_full":
            fields.update(pkt_type=P.PktType.PENDING)
            payload = b""
        elif kind == "pending_not_ours":
            fields.update(pkt_type=P.PktType.PENDING, count=1, bitmap=0b10)
            payload = b""
        elif kind == "refused":
            fields.update(pkt_type=P.PktType.REFUSED, count=int(P.DropReason.stale),
                          bitmap=0)
            payload = b""
        elif kind == "epoch":
            fields.update(epoch=self.job.new_epoch(nonce=0x78))
        return P.Header(**fields).pack() + payload

    def _serve(self):
        while not self._stop:
            try:
                data, src = self.sock.recvfrom(4096)
            except socket.timeout:
                continue
            hdr = P.Header.unpack(data)
            first = hdr.pkt_type == P.PktType.DATA and hdr.seq not in self.seen
            out = []
            if first:
                self.seen.add(hdr.seq)
                rng = random.Random(self.seed * 7919 + hdr.seq)
                own = self.job.lane_values(data[P.HEADER_BYTES:]).astype(np.int64)
                stray = rng.random() < 0.03
                if stray:
                    self.ending.append("stray")
                # a duplicate last: the replies after it are ignored as the chunk's, and
                # an other_run one read or not as the round ends would count by timing
                kinds = sorted(rng.sample(HOSTILE[:-2], 2), key=lambda k: k == "duplicate")
                out += [self._hostile(k, hdr, own, stray and j == 0)
                        for j, k in enumerate(kinds)]
                if rng.random() < 0.05:
                    kind = rng.choice(HOSTILE[-2:])
                    self.ending.append(kind)
                    out.append(self._hostile(kind, hdr, own))
                peer_first = rng.random() < 0.5
                if peer_first:
                    self.model.handle(self._peer(hdr), self._worker(1), 0.0)
            replies, _ = self.model.handle(data, src, 0.0)
            out += [r for r, dst in replies if dst == src]
            if first and not peer_first:
                replies, _ = self.model.handle(self._peer(hdr), self._worker(1), 0.0)
                out += [r for r, dst in replies if dst == src]
            for datagram in out:
                self.sock.sendto(datagram, src)

    def _worker(self, w: int):
        return (self.job.worker(w).ip, self.job.worker(w).port)

    def close(self):
        self._stop = True
        self._thread.join()
        self.sock.close()


def _outcome(job, seed: int, datapath: str, own: np.ndarray):
    agg = FuzzAggregator(job, seed)
    try:
        with AggregationClient(job, 0, agg.addr, run=RUN, timeout=2.0, max_timeout=2.0,
                               deadline=10.0, datapath=datapath) as c:
            try:
                r = c.reduce(pack_bits(own, P.INDEX_BITS))
                result = ("sums", r.sums.tolist())
            except Exception as e:  # noqa: BLE001 - the outcome compared
                result = (type(e).__name__, None)
            s = c.stats
            return (result, (s.rejected, s.other_run, s.retransmitted), s.compiled_rounds,
                    tuple(agg.ending))
    finally:
        agg.close()


needs_compiled = pytest.mark.skipif(fastclient.CLIENT_UNAVAILABLE is not None,
                                    reason=f"compiled client: {fastclient.CLIENT_UNAVAILABLE}")


@needs_compiled
@pytest.mark.parametrize("seed", range(12))
def test_both_windows_end_alike_and_only_with_the_exact_sums(seed):
    job = local_job(1, 2, free_port_block(2), pool_size=8, lanes=LANES)
    own = np.random.default_rng(seed).integers(0, 16, CHUNKS * LANES).astype(np.uint8)
    python = _outcome(job, seed, "python", own)
    compiled = _outcome(job, seed, "compiled", own)
    assert compiled[2] == 1 and python[2] == 0, (python, compiled)
    assert python[:2] == compiled[:2], (python, compiled)
    (kind, sums), (rejected, other_run, retransmitted) = python[:2]
    # without a reply that may end it (HOSTILE's last two, or a stray), the round ends with
    # its sums; with one, with its sums or the error that one names
    assert kind == "sums" or kind in {ENDS[e] for e in python[3]}, (kind, python)
    if kind == "sums":
        want = job.lane_values(pack_bits(own, 4)).astype(np.int64) + np.concatenate(
            [job.lane_values(pack_bits(_peer_indices(seed, s), 4)) for s in range(CHUNKS)])
        assert sums == want.tolist()
        assert retransmitted == 0 and rejected > 0 and other_run + rejected <= 2 * CHUNKS


@needs_compiled
def test_the_oracle_sees_a_plausible_wrong_sum(monkeypatch):
    """A forged RESULT that adds another table value than the peer's in every lane is
    possible (no client can tell it from the aggregator's, which is why workers take replies
    from its address alone): both windows take it, and the oracle, not the comparison, must
    fail."""
    real = FuzzAggregator._hostile

    def forged(self, kind, hdr, own, stray=False):
        datagram = real(self, "duplicate", hdr, own)
        other = (_peer_indices(self.seed, hdr.seq) + 1) % 16
        sums = own + self.job.lane_values(pack_bits(other, P.INDEX_BITS))
        return datagram[:P.HEADER_BYTES] + sums.astype(P.sum_dtype(self.job.sum_bits)).tobytes()
    monkeypatch.setattr(FuzzAggregator, "_hostile", forged)
    with pytest.raises(AssertionError, match="assert \\["):
        test_both_windows_end_alike_and_only_with_the_exact_sums(0)
