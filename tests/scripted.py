"""Scripted aggregators for client tests: a UDP socket that answers each datagram as a test
function says, so a test can stage replies no real aggregator would give in that order."""
from __future__ import annotations

import socket
import threading
import time
from collections import deque
from contextlib import contextmanager

from thc.wire import protocol as P

NONCE = 0x42


def epoch(job) -> int:
    """The epoch scripted replies carry: the job's configuration tag and :data:`NONCE`."""
    return job.new_epoch(nonce=NONCE)


@contextmanager
def answering(answer, delay=0.0):
    """A UDP server on loopback sending each datagram's sender what ``answer(datagram)``
    returns (a list of datagrams), ``delay`` seconds later (a long path, in order; a
    callable gives each reply's delay; a (datagram, seconds) pair its own); yields its
    address."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    srv.bind(("127.0.0.1", 0))
    stop = threading.Event()
    later: deque = deque()

    def serve():
        while not stop.is_set():
            now = time.monotonic()
            while later and later[0][0] <= now:
                _, out, src = later.popleft()
                srv.sendto(out, src)
            srv.settimeout(max(1e-4, min(0.05, later[0][0] - now)) if later else 0.05)
            try:
                data, src = srv.recvfrom(4096)
            except socket.timeout:
                continue
            for out in answer(data):
                if isinstance(out, tuple):
                    out, wait = out
                else:
                    wait = delay() if callable(delay) else delay
                if wait:
                    later.append((time.monotonic() + wait, out, src))
                else:
                    srv.sendto(out, src)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()
    finally:
        stop.set()
        t.join()
        srv.close()


def scripted_aggregator(job, answer, delay=0.0):
    """:func:`answering` by header for ``job``: ``answer(pkt_type, seq)`` gives None (no
    reply) or (reply type, count, bitmap, payload), sent with the datagram's other header
    fields and the job's :func:`epoch`."""
    tagged = epoch(job)

    def reply(data):
        (t, w, j, slot, ver, _c, seq, off, _b, run, _e) = P.HEADER_STRUCT.unpack_from(data)
        got = answer(t, seq)
        if got is None:
            return []
        kind, count, bitmap, payload = got
        return [P.HEADER_STRUCT.pack(kind, w, j, slot, ver, count, seq, off, bitmap, run,
                                     tagged) + payload]
    return answering(reply, delay)
