"""Non-THC traffic through the THC program: l2_forward by destination MAC, misses counted."""
from __future__ import annotations

import queue
import time

import pytest

from thc.controller import counters, forwarding
from thc.controller.frames import udp_frame

pytestmark = pytest.mark.bmv2


def _drain(q):
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return


def test_l2_forwarding_of_non_thc_traffic(bmv2, sw):
    port_in, port_out = 0, 1
    dst = "02:aa:00:00:00:01"
    forwarding.install(sw, {dst: port_out})
    raw = bmv2.switch.raw
    for q in raw:
        _drain(q)
    frame = udp_frame("02:aa:00:00:00:02", dst, "192.168.7.1", "192.168.7.2", 1234, 5678,
                      b"hello, not THC")
    bmv2.switch.send(port_in, frame)
    got = raw[port_out].get(timeout=2)
    assert got == frame
    assert forwarding.routes(sw)[dst] == port_out
    # non-IP too
    arp_like = (bytes.fromhex("02aa00000001") + bytes.fromhex("02aa00000002") + b"\x08\x06"
                + bytes(46))
    bmv2.switch.send(port_in, arp_like)
    assert raw[port_out].get(timeout=2) == arp_like
    # a miss is dropped and counted, never flooded
    misses = counters.l2_misses(sw)
    bmv2.switch.send(port_in, udp_frame("02:aa:00:00:00:02", "02:bb:00:00:00:09", "192.168.7.1",
                                        "192.168.7.2", 1234, 5678, b"nobody"))
    deadline = time.monotonic() + 10
    while counters.l2_misses(sw) == misses:     # the switch has handled it: its miss counted
        assert time.monotonic() < deadline, "the switch never counted the miss"
        time.sleep(0.01)
    assert counters.l2_misses(sw) == misses + 1
    bmv2.sync()   # anything the miss put out has come out by now
    assert all(q.empty() for q in raw)
    assert forwarding.remove(sw, [dst]) == 1
    assert dst not in forwarding.routes(sw)
