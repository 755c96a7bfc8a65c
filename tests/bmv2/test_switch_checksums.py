"""A frame damaged on its way is dropped by the switch as a host's network stack drops it
(``bad_checksum``), before it touches a slot: its worker's resend then sums exactly. So is
an intact one that no host delivers as one whole UDP datagram (``malformed``). A software
aggregator never sees such a frame (the kernel drops it), so the reference model has no rule
for it. An intact frame is taken whichever form of a computed 0 its checksums
carry (0x0000 or 0xFFFF), and a UDP checksum of 0 means none."""
from __future__ import annotations

import itertools
import struct

import numpy as np
import pytest

from thc.codec.packing import unpack_bits
from thc.controller.frames import ETH, IPV4, UDP, frame_faults, udp_frame
from thc.wire import protocol as P
from tests.bmv2.packets import check_result, data, datagram, random_indices
from tests.unwhole import HOW, unwhole

pytestmark = pytest.mark.bmv2
_ids = itertools.count(950)

PAYLOAD_AT = ETH.size + IPV4.size + UDP.size + P.HEADER_BYTES
"""The frame's first lane byte."""
UDP_CHECKSUM_AT = ETH.size + IPV4.size + 6
IP_CHECKSUM_AT = ETH.size + 10
IP_IDENT_AT = ETH.size + 4


def _field(frame: bytes, at: int) -> int:
    return struct.unpack_from("!H", frame, at)[0]


def _set(frame: bytes, at: int, value: int) -> bytes:
    out = bytearray(frame)
    struct.pack_into("!H", out, at, value)
    return bytes(out)


def _kernel_frame(ep, job, worker: int, payload: bytes, ident: int = 1) -> bytes:
    """Worker ``worker``'s DATA for seq 0, its checksums as a kernel computes them."""
    return udp_frame(ep.mac, ep.agg_mac, ep.ip, ep.agg_ip, ep.udp_port, P.UDP_PORT,
                     datagram(job, worker, 0, payload), ident=ident, checksum=True)


def _zero_sums(ep, job, worker: int, which: str) -> bytes:
    """A frame whose ``which`` checksum (``udp`` or ``ipv4``) is a computed 0, written 0xFFFF:
    one 16-bit word it covers (the first lane word, the IPv4 identification) set to the
    checksum the frame has with that word 0, which makes the rest sum to 0xFFFF."""
    zeros = bytes(P.payload_bytes(P.PktType.DATA, job.lanes))
    if which == "udp":
        word = _field(_kernel_frame(ep, job, worker, zeros), UDP_CHECKSUM_AT)
        frame = _kernel_frame(ep, job, worker, struct.pack("!H", word) + zeros[2:])
        assert _field(frame, UDP_CHECKSUM_AT) == 0xFFFF   # the form a kernel writes
        return frame
    word = _field(_kernel_frame(ep, job, worker, zeros, ident=0), IP_CHECKSUM_AT)
    frame = _kernel_frame(ep, job, worker, zeros, ident=word)
    assert _field(frame, IP_CHECKSUM_AT) == 0   # Linux writes a computed 0 so
    return _set(frame, IP_CHECKSUM_AT, 0xFFFF)


@pytest.mark.parametrize("how", HOW)
def test_a_frame_no_host_takes_as_one_datagram_is_malformed_and_its_resend_sums(bmv2, sw,
                                                                                how):
    """Another IP version, a first fragment, or an IPv4 length unlike the UDP datagram's
    was summed, and the multicast result kept the version or flag, so every worker's kernel
    dropped it."""
    job = bmv2.make_job(next(_ids), 2, pool_size=4)
    bmv2.install(job)
    eps = {w: bmv2.endpoint(job, w) for w in range(2)}
    idxs = [random_indices(np.random.default_rng(10 + w), job) for w in range(2)]
    frame = eps[1].frame(data(job, 1, 0, idxs[1]))
    before = bmv2.drops()
    eps[0].send(data(job, 0, 0, idxs[0]))
    eps[1].switch.send(eps[1].port, unwhole(frame, how))
    assert bmv2.recv_each(eps) == {0: [], 1: []}, "such a frame completed the round"
    after = bmv2.drops()
    assert {k: after[k] - before.get(k, 0) for k in after
            if after[k] != before.get(k, 0)} == {"malformed": 1}
    eps[1].switch.send(eps[1].port, frame)
    got = bmv2.recv_each(eps)
    for w in range(2):
        check_result(got[w], job, 0, idxs, w)


def damaged(frame: bytes, where: str) -> bytes:
    """``frame`` with one bit flipped: a lane byte (the UDP checksum no longer holds), the
    IPv4 TTL (the IPv4 header's does not), or the job id (a field the switch reads first)."""
    at = {"lane": PAYLOAD_AT + 5, "ttl": ETH.size + 8,
          "job id": ETH.size + IPV4.size + UDP.size + 3}[where]
    return frame[:at] + bytes([frame[at] ^ 0x01]) + frame[at + 1:]


@pytest.mark.parametrize("where,form", [("lane", "kernel"), ("ttl", "kernel"),
                                        ("job id", "kernel"), ("lane", "udp 0xffff"),
                                        ("job id", "ipv4 0xffff")])
def test_a_damaged_frame_is_dropped_and_counted_and_its_resend_sums_exactly(bmv2, sw, where,
                                                                            form):
    job = bmv2.make_job(next(_ids), 2, pool_size=4)
    bmv2.install(job)
    eps = {w: bmv2.endpoint(job, w) for w in range(2)}
    ep = eps[1]
    if form == "kernel":
        idxs = [random_indices(np.random.default_rng(w), job) for w in range(2)]
        frame = ep.frame(data(job, 1, 0, idxs[1]))
    else:
        frame = _zero_sums(ep, job, 1, form.split()[0])
        idxs = [random_indices(np.random.default_rng(0), job),
                unpack_bits(np.frombuffer(frame[PAYLOAD_AT:], np.uint8), P.INDEX_BITS,
                            job.lanes)]
    before = bmv2.drops()
    eps[0].send(data(job, 0, 0, idxs[0]))
    ep.switch.send(ep.port, damaged(frame, where))
    got = bmv2.recv_each(eps)
    assert got == {0: [], 1: []}, "a damaged frame completed the round"
    after = bmv2.drops()
    assert {k: after[k] - before.get(k, 0) for k in after
            if after[k] != before.get(k, 0)} == {"bad_checksum": 1}
    ep.switch.send(ep.port, frame)
    got = bmv2.recv_each(eps)
    for w in range(2):
        check_result(got[w], job, 0, idxs, w)


@pytest.mark.parametrize("form", ["udp 0xffff", "ipv4 0xffff", "no udp checksum"])
def test_an_intact_frame_is_taken_whatever_form_its_checksums_take(bmv2, sw, form):
    """0xFFFF is the other form of a computed 0 (RFC 768 writes a UDP one so, a kernel takes
    either for IPv4), and a UDP checksum of 0 means none: each is taken as intact."""
    job = bmv2.make_job(next(_ids), 2, pool_size=4)
    bmv2.install(job)
    eps = {w: bmv2.endpoint(job, w) for w in range(2)}
    ep = eps[0]
    if form == "no udp checksum":
        frame = _set(ep.frame(data(job, 0, 0, random_indices(np.random.default_rng(3), job))),
                     UDP_CHECKSUM_AT, 0)
    else:
        frame = _zero_sums(ep, job, 0, form.split()[0])
    assert frame_faults(frame) == [], "a frame a host's kernel would drop"
    idx0 = unpack_bits(np.frombuffer(frame[PAYLOAD_AT:], np.uint8), P.INDEX_BITS, job.lanes)
    other = random_indices(np.random.default_rng(2), job)
    ep.switch.send(ep.port, frame)
    eps[1].send(data(job, 1, 0, other))
    got = bmv2.recv_each(eps)
    for w in range(2):
        check_result(got[w], job, 0, [idx0, other], w)
