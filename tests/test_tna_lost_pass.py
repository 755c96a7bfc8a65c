"""A pass lost on the Tofino's recirculation port (docs/switch.md, "What recirculation adds"):
the program's own text (tests/tna/) counts the worker in pass 0 and never adds its lanes, and
real clients on loopback get what it sends. Its last passes are counted (thc_passes), and
egress withholds the RESULT whose count that is not, and every copy answering a
retransmission (thc_lost_passes): neither worker takes a sum that lacks the other's values,
and both rounds end in a timeout. tests/tna/interleave.py's ``--lose`` loses passes
at random against the oracle."""
from __future__ import annotations

import shutil
import socket
import threading
import time

import numpy as np
import pytest

if shutil.which("cpp") is None:
    pytest.skip("cpp (the C preprocessor) is not installed: reading thc_tna.p4 needs it for "
                "its #includes and macros", allow_module_level=True)

from tests.tna.interleave import TABLE
from tests.tna.pass0 import TnaEngine
from thc.codec.packing import pack_bits
from thc.net.client import AggregationClient, AggregationTimeout
from thc.testing.clusters import free_port_block
from thc.wire import protocol as P
from thc.wire.jobs import Job
from tests.test_transport import datapath  # noqa: F401 (a fixture)


def _switch(engine: TnaEngine, job: Job, lose_first_of: int):
    """A UDP socket that runs every datagram through ``engine`` and sends its replies where
    they go; the passes after pass 0 of worker ``lose_first_of``'s first DATA are lost."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.05)
    stop, seen = threading.Event(), threading.Event()
    lost = job.worker(lose_first_of)

    def serve():
        while not stop.is_set():
            try:
                data, src = sock.recvfrom(4096)
            except socket.timeout:
                continue
            first = not seen.is_set() and src == (lost.ip, lost.port)
            engine.delay = 1 if first else 0      # its passes wait on the recirculation port
            replies, _ = engine.handle(data, src, time.monotonic())
            if first:
                engine.going_round.clear()          # ... and are lost there
                seen.set()
            for reply, dest in replies:
                sock.sendto(reply, dest)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return sock, stop, seen, thread


def test_a_lost_pass_withholds_the_sum(datapath):
    base = free_port_block(2)
    job = Job.from_dict({
        "job_id": 9, "pool_size": 4, "lanes": P.LANES, "table": list(TABLE), "granularity": 30,
        "workers": [{"id": w, "ip": "127.0.0.1", "port": base + w, "switch_port": 260 + w}
                    for w in range(2)]})
    engine = TnaEngine()
    engine.install(job, job.new_epoch(nonce=5), now=time.monotonic())
    rng = np.random.default_rng(3)
    idx = [rng.integers(1, 16, P.LANES, dtype=np.uint8) for _ in range(2)]
    sock, stop, seen, thread = _switch(engine, job, lose_first_of=0)
    out = {}

    def work(w):
        with AggregationClient(job, w, sock.getsockname(), run=7, deadline=4.0) as c:
            try:
                out[w] = c.reduce(pack_bits(idx[w], P.INDEX_BITS))
            except AggregationTimeout as e:
                out[w] = e
            out[w, "rejected"], out[w, "datapath"] = c.stats.rejected, c.datapath

    try:
        first = threading.Thread(target=work, args=(0,))
        first.start()
        assert seen.wait(10), "worker 0's DATA never reached the switch"
        work(1)
        first.join(30)
    finally:
        stop.set()
        thread.join()
        sock.close()
    assert (out[0, "datapath"], out[1, "datapath"]) == (datapath, datapath)
    # no RESULT left the switch: the one completing the use and those answering the
    # retransmissions of both workers, each counted
    for w in (0, 1):
        assert isinstance(out[w], AggregationTimeout), out[w]
        assert out[w, "rejected"] == 0
    assert engine.withheld() >= 2 + 2, engine.withheld()   # the multicast, a retransmission each
