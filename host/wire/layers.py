"""Scapy layers for THC, generated from protocol.json: dissect captures, craft test packets.

The fast path never uses scapy (plain sockets); these layers are for humans and tests:
``rdpcap("x.pcap")[0][THC].show()`` works on any capture of the aggregation port
(:func:`dissect_port` for a cluster's ``agg_port`` other than the protocol's).
"""
from __future__ import annotations

import numpy as np
from scapy.fields import ByteEnumField, ByteField, IntField, ShortField, StrField, XIntField
from scapy.layers.inet import UDP
from scapy.layers import vxlan  # noqa: F401 - its bindings exist before THC takes its port
from scapy.packet import Packet, bind_bottom_up, bind_top_down, split_bottom_up

from thc.codec.packing import unpack_bits
from thc.wire import protocol as P

_FIELD_TYPES = {8: ByteField, 16: ShortField, 32: IntField}


def _field(name: str, width: int):
    if name == "pkt_type":
        return ByteEnumField(name, P.PktType.DATA, {t.value: t.name for t in P.PktType})
    if name == "bitmap":
        return XIntField(name, 0)
    return _FIELD_TYPES[width](name, 0)


class THC(Packet):
    """The THC aggregation header (protocol.json's ``header``)."""

    name = "THC"
    fields_desc = [_field(n, w) for n, w in P.HEADER_FIELDS]

    def mysummary(self):
        return self.sprintf("THC %pkt_type% job=%job_id% run=%run% w=%worker_id% seq=%seq% "
                            "slot=%slot%/v%version% count=%count% epoch=%epoch%")

    def guess_payload_class(self, payload):
        classes = {P.PktType.DATA: THCIndices, P.PktType.RESULT: THCSums,
                   P.PktType.MAX: THCMax, P.PktType.MAX_RESULT: THCMax}
        return classes.get(self.pkt_type, Packet.guess_payload_class(self, payload))


class _Payload(Packet):
    fields_desc = [StrField("data", b"")]

    def _checked(self, pkt_type: int, want: int) -> bytes:
        """The payload, refused unless it is the ``want`` bytes its packet carries: a
        truncated or padded one reads as fewer or more lanes than the job's."""
        if len(self.data) != want:
            raise P.ProtocolError(f"{P.PktType(pkt_type).name} payload of {len(self.data)} "
                                  f"bytes, {want} expected")
        return self.data


class THCIndices(_Payload):
    """Packed 4-bit table indices (uplink)."""

    name = "THC indices"

    def indices(self, lanes: int, aggregation: str) -> np.ndarray:
        """The ``lanes`` indices (a vote job's: sign bits) of the job's DATA. Both are the
        job's, given: a 1024-lane vote DATA is as long as a 256-lane THC one."""
        data = self._checked(P.PktType.DATA, P.payload_bytes(P.PktType.DATA, lanes,
                                                              aggregation=aggregation))
        return unpack_bits(np.frombuffer(data, np.uint8), P.LANE_BITS[aggregation], lanes)


class THCSums(_Payload):
    """Per-lane sums of table values (downlink)."""

    name = "THC sums"

    def sums(self, sum_bits: int, lanes: int) -> np.ndarray:
        """The ``lanes`` sums, read as ``sum_bits``-wide big-endian integers. Both are the
        job's, given: 128 16-bit sums are as long as 256 8-bit ones."""
        data = self._checked(P.PktType.RESULT, P.payload_bytes(P.PktType.RESULT, lanes,
                                                                sum_bits))
        return np.frombuffer(data, P.sum_dtype(sum_bits)).astype(np.int64)


class THCMax(_Payload):
    """Norms of the preliminary round, as ordered uint32 bit patterns of floats."""

    name = "THC max"

    def values(self) -> np.ndarray:
        """The lanes as floats; a lane no worker sends (above the largest finite float's
        bits: a negative, infinite or NaN pattern) is refused, as the client refuses it."""
        data = self._checked(P.PktType.MAX, P.payload_bytes(P.PktType.MAX))
        u = np.frombuffer(data, ">u4").astype(np.uint32)
        if u.size and int(u.max()) > P.MAX_LANE_TOP:
            raise P.ProtocolError(f"MAX lane {int(np.argmax(u))} holds {int(u.max()):#x}, "
                                  f"no non-negative finite float")
        return P.ordered_u32_to_floats(u)


def _claim(port: int) -> None:
    """Dissect UDP to and from ``port`` as THC, as replies come from it. Scapy binds some
    ports to other protocols (THC's own, 48879, to VXLAN for Cisco ACI, in scapy.all's
    import), and the first binding that matches wins: those on ``port`` are taken off."""
    for fval, upper in list(UDP.payload_guess):
        if upper is not THC and port in (fval.get("dport"), fval.get("sport")):
            split_bottom_up(UDP, upper, **fval)
    bind_bottom_up(UDP, THC, dport=port)
    bind_bottom_up(UDP, THC, sport=port)


_claim(P.UDP_PORT)
bind_top_down(UDP, THC, sport=P.UDP_PORT, dport=P.UDP_PORT)   # UDP()/THC() builds to it


def dissect_port(port: int) -> None:
    """Dissect THC to and from ``port`` too, as from the protocol's: a cluster's ``agg_port``
    may be another. Scapy's bindings are process-wide, so this holds for every later read."""
    if not 0 < port < 65536:
        raise ValueError(f"port {port}: not a UDP port")
    _claim(port)
