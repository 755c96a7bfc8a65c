"""The frames the controller and the BMv2 harness build, and the checks a worker's kernel
makes of the switch's replies (``frame_faults``)."""
from __future__ import annotations

import struct

from scapy.layers.inet import UDP
from scapy.layers.l2 import Ether

from thc.controller.frames import frame_faults, ipv4_checksum, udp_frame


def frame(payload: bytes = bytes(range(28)), checksum: bool = True) -> bytes:
    return udp_frame("02:00:00:00:00:01", "02:00:00:00:00:fe", "10.0.0.1", "10.0.0.254",
                     20001, 48879, payload, ident=7, checksum=checksum)


def test_a_built_frame_is_sound_and_its_udp_checksum_is_scapys():
    assert frame_faults(frame(checksum=False)) == []
    for n in (0, 27, 28, 1000):
        f = frame(bytes(i % 256 for i in range(n)))
        assert frame_faults(f) == []
        p = Ether(f)
        got = p[UDP].chksum
        del p[UDP].chksum
        assert got == Ether(bytes(p))[UDP].chksum != 0


def test_what_a_kernel_drops_is_named():
    """A reply that kept the worker's UDP checksum over a new payload, or claims another IPv4
    length, or whose IPv4 checksum was not recomputed: each a frame a worker never reads, so
    a harness that did not look saw replies no worker would get."""
    f = bytearray(frame())
    f[-1] ^= 1                                        # a payload changed, the checksum kept
    assert frame_faults(bytes(f)) == ["a wrong UDP checksum"]
    f = bytearray(frame(checksum=False))
    f[16:18] = struct.pack("!H", struct.unpack("!H", f[16:18])[0] + 8)   # IPv4 length + 8
    assert frame_faults(bytes(f)) == ["a bad IPv4 checksum",
                                      "an IPv4 length past the frame's end"]
    f[24:26] = b"\0\0"
    f[24:26] = struct.pack("!H", ipv4_checksum(bytes(f[14:34])))       # recomputed
    assert frame_faults(bytes(f)) == ["an IPv4 length past the frame's end"]
    assert frame_faults(frame()[:40]) == ["a frame shorter than its headers"]
    padded = frame(b"", checksum=False) + bytes(18)   # Ethernet's minimum: 60 bytes
    assert len(padded) == 60 and frame_faults(padded) == []
    trailer = frame() + bytes(range(7))   # bytes past the IPv4 length: the kernel trims them
    assert frame_faults(trailer) == []


def test_an_ipv4_length_shorter_than_the_headers_is_named_not_raised():
    """The harness's receive thread runs this on every reply: a length field too small for
    a UDP header must be a fault, not an exception that ends the thread."""
    f = bytearray(frame(checksum=False))
    f[16:18] = (20).to_bytes(2, "big")
    f[24:26] = b"\0\0"
    f[24:26] = ipv4_checksum(bytes(f[14:34])).to_bytes(2, "big")
    assert frame_faults(bytes(f)) == ["an IPv4 length too short for a UDP header"]
