"""A frame damaged on its way is dropped by the switch as a host's network stack drops it
(``bad_checksum``), before it touches a slot: its worker's resend then sums exactly. A
software aggregator never sees such a frame (the kernel drops it), so the reference model
has no rule for it."""
from __future__ import annotations

import itertools
import struct

import numpy as np
import pytest

from thc.codec.packing import unpack_bits
from thc.controller.frames import ETH, IPV4, UDP, udp_frame
from thc.wire import protocol as P
from tests.bmv2.packets import check_result, data, datagram, random_indices

pytestmark = pytest.mark.bmv2
_ids = itertools.count(950)

PAYLOAD_AT = ETH.size + IPV4.size + UDP.size + P.HEADER_BYTES
"""The frame's first lane byte."""
CHECKSUM_AT = ETH.size + IPV4.size + 6


def damaged(frame: bytes, where: str) -> bytes:
    """``frame`` with one bit flipped: a lane byte (the UDP checksum no longer holds), the
    IPv4 TTL (the IPv4 header's does not), or the job id (a field the switch reads first)."""
    at = {"lane": PAYLOAD_AT + 5, "ttl": ETH.size + 8,
          "job id": ETH.size + IPV4.size + UDP.size + 3}[where]
    return frame[:at] + bytes([frame[at] ^ 0x01]) + frame[at + 1:]


@pytest.mark.parametrize("where", ["lane", "ttl", "job id"])
def test_a_damaged_frame_is_dropped_and_counted_and_its_resend_sums_exactly(bmv2, sw, where):
    job = bmv2.make_job(next(_ids), 2, pool_size=4)
    bmv2.install(job)
    rng = np.random.default_rng(1)
    idxs = [random_indices(rng, job) for _ in range(2)]
    eps = {w: bmv2.endpoint(job, w) for w in range(2)}
    before = bmv2.drops()
    eps[0].send(data(job, 0, 0, idxs[0]))
    ep = eps[1]
    ep.switch.send(ep.port, damaged(ep.frame(data(job, 1, 0, idxs[1])), where))
    got = bmv2.recv_each(eps)
    assert got == {0: [], 1: []}, "a damaged frame completed the round"
    after = bmv2.drops()
    assert {k: after[k] - before.get(k, 0) for k in after
            if after[k] != before.get(k, 0)} == {"bad_checksum": 1}
    eps[1].send(data(job, 1, 0, idxs[1]))
    got = bmv2.recv_each(eps)
    for w in range(2):
        check_result(got[w], job, 0, idxs, w)


def _ffff_frame(ep, job) -> bytes:
    """Worker 0's DATA for seq 0 with the UDP checksum 0xFFFF, as a kernel writes a computed
    0: its first lane word is the checksum of the same datagram with that word 0, which makes
    the datagram and pseudo-header sum to 0xFFFF (one's complement)."""
    def frame_with(word: int) -> bytes:
        payload = bytearray(P.payload_bytes(P.PktType.DATA, job.lanes))
        struct.pack_into("!H", payload, 0, word)
        return ep.frame(datagram(job, 0, 0, bytes(payload)))
    return frame_with(struct.unpack_from("!H", frame_with(0), CHECKSUM_AT)[0])


@pytest.mark.parametrize("checksum", ["0xffff", "none"])
def test_a_frame_with_the_checksum_ffff_or_none_is_taken(bmv2, sw, checksum):
    """0xFFFF is how a sender writes a computed 0 (RFC 768), and 0 means none: both are
    taken as intact."""
    job = bmv2.make_job(next(_ids), 2, pool_size=4)
    bmv2.install(job)
    eps = {w: bmv2.endpoint(job, w) for w in range(2)}
    ep = eps[0]
    if checksum == "none":
        frame = udp_frame(ep.mac, ep.agg_mac, ep.ip, ep.agg_ip, ep.udp_port, P.UDP_PORT,
                          data(job, 0, 0, random_indices(np.random.default_rng(3), job)))
        assert struct.unpack_from("!H", frame, CHECKSUM_AT)[0] == 0
    else:
        frame = _ffff_frame(ep, job)
        assert struct.unpack_from("!H", frame, CHECKSUM_AT)[0] == 0xFFFF
    idx0 = unpack_bits(np.frombuffer(frame[PAYLOAD_AT:], np.uint8), P.INDEX_BITS, job.lanes)
    other = random_indices(np.random.default_rng(2), job)
    ep.switch.send(ep.port, frame)
    eps[1].send(data(job, 1, 0, other))
    got = bmv2.recv_each(eps)
    for w in range(2):
        check_result(got[w], job, 0, [idx0, other], w)
