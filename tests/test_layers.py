"""The scapy layers agree byte for byte with the fast-path encoder."""
from __future__ import annotations

import numpy as np
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from thc.codec.packing import pack_bits
from thc.wire import protocol as P
from thc.wire.layers import THC, THCIndices, THCMax, THCSums


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
    np.testing.assert_array_equal(pkt[THCIndices].indices(), idx)


def test_crafted_result_matches_encoder():
    sums = np.arange(P.LANES) % 200
    crafted = THC(pkt_type=P.PktType.RESULT, worker_id=1, job_id=2, seq=9, count=4,
                  bitmap=0xF) / THCSums(data=sums.astype(P.sum_dtype(8)).tobytes())
    hdr = P.Header(P.PktType.RESULT, 1, 2, 0, 0, 4, 9, 0, 0xF)
    assert bytes(crafted) == P.encode(hdr, sums.astype(P.sum_dtype(8)))
    again = UDP(bytes(UDP(sport=P.UDP_PORT, dport=4000) / crafted))
    np.testing.assert_array_equal(again[THCSums].sums(), sums)


def test_max_values_round_trip():
    vals = np.array([0.0, 1.5, 3e38], dtype=np.float32)
    pkt = THC(pkt_type=P.PktType.MAX) / THCMax(
        data=P.floats_to_ordered_u32(vals).astype(">u4").tobytes())
    np.testing.assert_array_equal(THC(bytes(pkt))[THCMax].values(), vals)
