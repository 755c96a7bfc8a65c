"""A scripted aggregator for client tests: a UDP socket that answers each datagram as a test
function says, so a test can stage replies no real aggregator would give in that order."""
from __future__ import annotations

import socket
import threading
from contextlib import contextmanager

from thc.wire import protocol as P

EPOCH = 0x42


@contextmanager
def scripted_aggregator(answer):
    """Yield the address of a server on 127.0.0.1 that answers every datagram with
    ``answer(pkt_type, seq)``: None (no reply) or (reply type, count, bitmap, payload),
    echoing the datagram's other header fields with epoch :data:`EPOCH`."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.05)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                data, src = sock.recvfrom(4096)
            except socket.timeout:
                continue
            (t, w, j, slot, ver, _c, seq, off, _b, run, _e) = P.HEADER_STRUCT.unpack_from(data)
            reply = answer(t, seq)
            if reply is not None:
                kind, count, bitmap, payload = reply
                sock.sendto(P.HEADER_STRUCT.pack(kind, w, j, slot, ver, count, seq, off,
                                                 bitmap, run, EPOCH) + payload, src)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        yield sock.getsockname()
    finally:
        stop.set()
        server.join()
        sock.close()
