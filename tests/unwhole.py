"""IPv4 frames that no host's kernel delivers as one UDP datagram, their checksums right:
another IP version, a first fragment, an IPv4 length unlike the datagram's (short, long, or
that of a header-only THC packet). The BMv2 program drops them as ``malformed``
(tests/bmv2/test_switch_checksums.py); the Tofino program leaves the first two to L2
forwarding and drops the others as ``malformed`` (tests/test_tna_slot_state.py); a software
aggregator never sees one."""
from __future__ import annotations

import struct

from thc.controller.frames import ETH, IPV4, ipv4_checksum
from thc.wire.protocol import HEADER_BYTES, IP_UDP_BYTES

HOW = ("version 6", "more fragments", "ipv4 length short", "ipv4 length long",
       "ipv4 length of a header-only packet")
HEADER_ONLY_TOTAL = IP_UDP_BYTES + HEADER_BYTES
"""The IPv4 total length of a THC packet without lanes."""


def _ip_set(frame: bytes, byte: int, value: int, extra: bytes = b"", wide: bool = False) -> bytes:
    """``frame`` with IPv4 header byte ``byte`` (``wide``: the 16-bit field there) set to
    ``value``, the header's checksum computed again, ``extra`` appended."""
    ip = bytearray(frame[ETH.size:ETH.size + IPV4.size])
    struct.pack_into("!H" if wide else "!B", ip, byte, value)
    struct.pack_into("!H", ip, 10, 0)
    struct.pack_into("!H", ip, 10, ipv4_checksum(bytes(ip)))
    return frame[:ETH.size] + bytes(ip) + frame[ETH.size + IPV4.size:] + extra


def unwhole(frame: bytes, how: str) -> bytes:
    """``frame`` as no host's kernel delivers it as one UDP datagram, its checksums right."""
    total = struct.unpack_from("!H", frame, ETH.size + 2)[0]
    out = {"version 6": lambda: _ip_set(frame, 0, 0x65),
           "more fragments": lambda: _ip_set(frame, 6, 0x20),
           "ipv4 length short": lambda: _ip_set(frame, 2, total - 2, wide=True),
           "ipv4 length long": lambda: _ip_set(frame, 2, total + 2, b"\0\0", wide=True),
           "ipv4 length of a header-only packet":
               lambda: _ip_set(frame, 2, HEADER_ONLY_TOTAL, wide=True)}[how]()
    assert struct.unpack_from("!H", out, ETH.size + 2)[0] in (
        total - 2, total, total + 2, HEADER_ONLY_TOTAL) and total != HEADER_ONLY_TOTAL
    return out
