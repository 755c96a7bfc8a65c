"""The scapy layers agree byte for byte with the fast-path encoder."""
from __future__ import annotations

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from thc.codec.packing import pack_bits
from thc.wire import protocol as P
from thc.wire.layers import THC, THCIndices, THCMax, THCSums, dissect_port


def test_header_fields_follow_protocol_json():
    assert [f.name for f in THC.fields_desc] == [n for n, _ in P.HEADER_FIELDS]
    assert len(bytes(THC())) == P.HEADER_BYTES


def test_data_packet_dissects_like_the_encoder_builds_it():
    idx = np.random.default_rng(0).integers(0, 16, P.LANES).astype(np.uint8)
    hdr = P.Header(P.PktType.DATA, 3, 7, 5, 1, 0, 123456, 789, 0)
    raw = bytes(Ether() / IP(dst="10.0.0.1") / UDP(sport=5000, dport=P.UDP_PORT)
                / Raw(P.encode(hdr, pack_bits(idx, P.INDEX_BITS))))
    pkt = Ether(raw)
    thc = pkt[THC]
    assert (thc.pkt_type, thc.worker_id, thc.job_id, thc.slot, thc.version, thc.seq) == \
        (P.PktType.DATA, 3, 7, 5, 1, 123456)
    np.testing.assert_array_equal(pkt[THCIndices].indices(P.LANES, "thc"), idx)


def test_crafted_result_matches_encoder():
    sums = np.arange(P.LANES) % 200
    crafted = THC(pkt_type=P.PktType.RESULT, worker_id=1, job_id=2, seq=9, count=4,
                  bitmap=0xF) / THCSums(data=sums.astype(P.sum_dtype(8)).tobytes())
    hdr = P.Header(P.PktType.RESULT, 1, 2, 0, 0, 4, 9, 0, 0xF)
    assert bytes(crafted) == P.encode(hdr, sums.astype(P.sum_dtype(8)))
    again = UDP(bytes(UDP(sport=P.UDP_PORT, dport=4000) / crafted))
    np.testing.assert_array_equal(again[THCSums].sums(8, P.LANES), sums)


def test_max_values_round_trip():
    vals = np.zeros(P.MAX_LANES, dtype=np.float32)
    vals[:3] = [0.0, 1.5, 3e38]
    pkt = THC(pkt_type=P.PktType.MAX) / THCMax(
        data=P.floats_to_ordered_u32(vals).astype(">u4").tobytes())
    np.testing.assert_array_equal(THC(bytes(pkt))[THCMax].values(), vals)


def test_payloads_of_the_wrong_length_or_no_workers_values_are_refused():
    """The accessors once read whatever the payload held: 3 sums of a 3-byte RESULT, 10
    indices of a 5-byte DATA, more lanes than the job's from a padded one, NaN and -1.0 from
    a MAX_RESULT (lanes the client refuses)."""
    short = [(THCSums(data=bytes(3)), "sums", (8, P.LANES), "RESULT payload of 3 bytes"),
             (THCIndices(data=bytes(5)), "indices", (P.LANES, "thc"), "DATA payload of 5 bytes"),
             (THCMax(data=bytes(12)), "values", (), "MAX payload of 12 bytes"),
             (THCSums(data=bytes(P.LANES + 2)), "sums", (8, P.LANES),   # padded: 2 more
              f"RESULT payload of {P.LANES + 2} bytes")]
    for layer, read, args, match in short:
        with pytest.raises(P.ProtocolError, match=match):
            getattr(layer, read)(*args)
    bad = np.zeros(P.MAX_LANES, ">u4")
    bad[1] = np.array([-1.0], np.float32).view(np.uint32)[0]
    with pytest.raises(P.ProtocolError, match="MAX lane 1 holds"):
        THCMax(data=bad.tobytes()).values()
    wide = np.arange(P.LANES, dtype=P.sum_dtype(16))
    np.testing.assert_array_equal(THCSums(data=wide.tobytes()).sums(16, P.LANES),
                                  np.arange(P.LANES))
    signs = np.random.default_rng(1).integers(0, 2, 64).astype(np.uint8)
    got = THCIndices(data=pack_bits(signs, 1).tobytes()).indices(64, "vote")
    np.testing.assert_array_equal(got, signs)


def test_a_udp_layer_built_over_thc_goes_to_and_from_the_protocol_port():
    """Bound for dissection from either port, the layer built with the last binding's fields
    only: ``UDP()/THC()`` went to port 53 (UDP's default), from the protocol's port."""
    pkt = UDP(bytes(UDP() / THC(run=3)))
    assert (pkt.sport, pkt.dport) == (P.UDP_PORT, P.UDP_PORT) and pkt.haslayer(THC)
    for sport, dport in ((P.UDP_PORT, 5555), (5555, P.UDP_PORT)):
        assert IP(bytes(IP() / UDP(sport=sport, dport=dport) / THC(run=3))).haslayer(THC)
    assert not IP(bytes(IP() / UDP(sport=5555, dport=6666) / THC(run=3))).haslayer(THC)


def test_a_clusters_own_aggregation_port_is_dissected_once_named():
    """A cluster may serve on another ``agg_port``: its captures read as raw UDP until the
    port is named."""
    def capture():
        return IP(bytes(IP() / UDP(sport=40001, dport=40123) / THC(run=9, seq=4)))
    assert not capture().haslayer(THC)
    dissect_port(40123)
    assert capture()[THC].run == 9 and capture()[THC].seq == 4
    back = IP(bytes(IP() / UDP(sport=40123, dport=40002) / THC(run=9)))
    assert back.haslayer(THC)
    with pytest.raises(ValueError, match="not a UDP port"):
        dissect_port(70000)


def _dissects_after(first: str) -> str:
    """What a fresh process reads from a THC datagram to the protocol's port, with ``first``
    imported before thc.wire.layers."""
    import subprocess
    import sys
    code = (f"{first}\n"
            "from scapy.layers.inet import IP, UDP\n"
            "from thc.wire.layers import THC, dissect_port\n"
            "from thc.wire import protocol as P\n"
            "dissect_port(4789)\n"
            "print(IP(bytes(IP() / UDP(sport=50000, dport=P.UDP_PORT) / THC(run=7)))[THC].run,"
            " IP(bytes(IP() / UDP(sport=50000, dport=4789) / THC(run=8)))[THC].run)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()


@pytest.mark.parametrize("first", ["from scapy.all import rdpcap", "import os"])
def test_thc_takes_its_port_from_the_protocol_scapy_binds_it_to(first):
    """Scapy binds UDP 48879 (THC's) and 4789 to VXLAN; with ``scapy.all`` imported first
    a capture read as VXLAN (``[THC]``: "Layer [THC] not found"), whatever port was named."""
    assert _dissects_after(first) == ["7", "8"]


def test_a_short_or_unknown_datagram_is_a_protocol_error():
    """The tests' own reader of replies (``P.decode``) must not take a datagram of a packet
    type the protocol does not define as a header: a reply of an unknown type is wrong, not
    a packet to compare field by field."""
    hdr = P.Header(P.PktType.RESULT, 0, 1, 0, 0, 1, 0, 0, 1, 1, 1)
    got, payload = P.decode(P.encode(hdr, b"\x07"))
    assert got == hdr and bytes(payload) == b"\x07"
    with pytest.raises(P.ProtocolError, match="shorter than"):
        P.decode(hdr.pack()[:-1])
    unknown = max(P.PKT_TYPE_CODES) + 1
    with pytest.raises(P.ProtocolError, match=f"unknown packet type {unknown}"):
        P.decode(P.Header(unknown, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1).pack())


def test_max_values_order_like_their_floats_negative_zero_as_zero():
    """A switch takes the max of raw bits: -0.0's pattern (its sign bit) is above every
    positive float's, so sent as it is it would beat every worker's norm (and read back as a
    lane the client refuses); a negative value would too, and is refused."""
    u = P.floats_to_ordered_u32(np.array([-0.0, 0.0, 1.0], np.float32))
    assert u.tolist() == [0, 0, 0x3F800000]
    with pytest.raises(ValueError, match="finite and non-negative"):
        P.floats_to_ordered_u32(np.array([1.0, -2.0], np.float32))
    with pytest.raises(ValueError, match="finite and non-negative"):
        P.floats_to_ordered_u32(np.array([np.inf], np.float32))


def test_a_max_lane_just_above_the_largest_float_is_refused():
    """The largest finite float's bits are the top of what a worker sends; the pattern one
    above it is +inf, no worker's norm, and must be refused like a negative one."""
    lanes = np.zeros(P.MAX_LANES, ">u4")
    lanes[0] = P.MAX_LANE_TOP
    assert THCMax(data=lanes.tobytes()).values()[0] == np.finfo(np.float32).max
    lanes[0] = P.MAX_LANE_TOP + 1
    with pytest.raises(P.ProtocolError, match="MAX lane 0 holds 0x7f800000"):
        THCMax(data=lanes.tobytes()).values()


def test_port_zero_is_not_a_port_to_dissect():
    """UDP port 0 names no sender's or receiver's port: binding it would dissect nothing."""
    for bad in (0, -1, 65536):
        with pytest.raises(ValueError, match="not a UDP port"):
            dissect_port(bad)
