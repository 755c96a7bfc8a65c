"""The scripted aggregator, jobs and payloads that the client datapath tests
(tests/test_client_datapath.py, tests/test_client_timers.py) share."""
from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from thc.codec.packing import pack_bits
from thc.testing.clusters import free_port_block, local_job
from thc.wire import protocol as P
from tests.scripted import epoch


N_CHUNKS = 20
SHORT_SEQ = 3


_TABLE = np.asarray(local_job(1, 1, 1).table)
"""The table of the jobs here (granularity 30): a client refuses a sum no table values make."""


def _others(seq, lanes):
    """Worker 1's table values in chunk ``seq``."""
    return _TABLE[(np.arange(lanes) + 7 * seq) % len(_TABLE)]


class ScriptedAggregator:
    """Answers each DATA chunk with a volley of hostile and impossible replies, a PENDING,
    then its RESULT (``mode="pending"``: the PENDING only, as if worker 1 never came;
    ``short``: chunk SHORT_SEQ's RESULT closed short, worker 1 missing); a FLUSH (a timeout
    under a loss bound) is answered as its chunk's DATA was. A stranger's socket forges a
    RESULT with every field right, the epoch included. ``stray_epoch``: the first chunk's volley
    opens with two impossible replies of that epoch (a PENDING without our bit, a RESULT
    above 2 x 30)."""

    def __init__(self, job, nonce=0x1234, mode="answer", family=socket.AF_INET, short=False,
                 stray_epoch=None):
        self.job, self.epoch = job, job.new_epoch(nonce=nonce)
        self.mode, self.short, self.stray_epoch = mode, short, stray_epoch
        host = "::1" if family == socket.AF_INET6 else "127.0.0.1"
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.sock.settimeout(0.05)
        self.addr = self.sock.getsockname()
        self.stranger = socket.socket(family, socket.SOCK_DGRAM)
        self.stranger.bind((host, 0))
        self.received: list[bytes] = []
        self._own: dict[int, np.ndarray] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()


    def _serve(self):
        job, pack = self.job, P.HEADER_STRUCT.pack
        dtype = P.sum_dtype(job.sum_bits)
        while not self._stop:
            try:
                data, src = self.sock.recvfrom(4096)
            except socket.timeout:
                continue
            self.received.append(data)
            (_t, w, j, slot, version, _c, seq, offset, _b, run, _e) = \
                P.HEADER_STRUCT.unpack_from(data)
            if _t == P.PktType.FLUSH:   # closes the chunk with the DATA it holds
                own = self._own.get(seq)
                if own is None:
                    continue
            else:
                own = self._own[seq] = job.lane_values(data[P.HEADER_BYTES:])

            def reply(t=P.PktType.RESULT, worker=w, job_id=j, count=job.n_workers,
                      bitmap=job.full_bitmap, run=run, payload=None, slot=slot,
                      version=version, offset=offset, sock=self.sock, epoch=self.epoch):
                if payload is None:
                    payload = (own + _others(seq, job.lanes)).astype(dtype).tobytes()
                sock.sendto(pack(t, worker, job_id, slot, version, count, seq, offset,
                                 bitmap, run, epoch) + payload, src)

            if self.stray_epoch is not None and seq == 0:
                reply(t=P.PktType.PENDING, count=1, bitmap=0b10, payload=b"",
                      epoch=self.stray_epoch)                            # rejected: not ours
                reply(payload=np.full(job.lanes, 61).astype(dtype).tobytes(),
                      epoch=self.stray_epoch)                            # rejected: > 2 x 30
            reply(t=P.PktType.PENDING, count=1, bitmap=0b01, payload=b"")
            if self.mode == "pending":
                continue
            reply(sock=self.stranger)                                   # ignored: stranger
            reply(slot=slot + 1)                                        # ignored: slot
            reply(version=1 - version)                                  # ignored: version
            reply(offset=offset + 1)                                    # ignored: offset
            reply(bitmap=0b01)                                          # ignored: count n, bitmap
            reply(payload=np.full(job.lanes, 61).astype(dtype).tobytes())  # ignored: > 2 x 30
            self.sock.sendto(b"\x00" * 10, src)                         # ignored: short
            reply(job_id=j + 1)                                         # ignored: other job
            reply(worker=w + 1)                                         # ignored: other worker
            reply(t=P.PktType.MAX_RESULT)                               # ignored: wrong type
            reply(payload=b"\x01" * 5)                                  # ignored: length
            reply(run=run + 1)                                          # other_run
            if seq % N_CHUNKS == SHORT_SEQ:
                reply(count=1, bitmap=0b11)                             # ignored: count/bitmap
                reply(count=1, bitmap=0b01, payload=np.full(job.lanes, 31).astype(
                    dtype).tobytes())                                   # ignored: > 1 x 30
                if self.short:
                    reply(count=1, bitmap=0b01, payload=own.astype(dtype).tobytes())  # short
                    continue
            reply()

    def close(self):
        self._stop = True
        self._thread.join()
        self.sock.close()
        self.stranger.close()


@pytest.fixture
def job():
    return local_job(1, 2, free_port_block(2), pool_size=16)


def _index_zero(job, chunks):
    """Chunks of index 0 (table value 0): a RESULT of zeros counts them, for the tests that
    time replies rather than check sums."""
    return np.zeros(chunks * job.lanes // 2, np.uint8)


def _packed(job, seed):
    idx = np.random.default_rng(seed).integers(0, 16, N_CHUNKS * job.lanes).astype(np.uint8)
    return pack_bits(idx, P.INDEX_BITS)


def _complete(data: bytes, pkt_type: int, job) -> bytes:
    """``data``'s header made a complete reply of ``pkt_type`` (every worker counted)."""
    return _reply(job, data, pkt_type, job.n_workers, job.full_bitmap)


def _reply(job, data: bytes, pkt_type: int, count: int, bitmap: int) -> bytes:
    """A payload-less reply to ``data`` (a DATA or MAX packet) with its fields, and the
    job's scripted epoch."""
    (_t, w, j, slot, version, _c, seq, offset, _b, run, _e) = P.HEADER_STRUCT.unpack_from(data)
    return P.HEADER_STRUCT.pack(pkt_type, w, j, slot, version, count, seq, offset, bitmap, run,
                                epoch(job))
