"""Ethernet/IPv4/UDP frames as bytes (no scapy on the hot path): RESET packet-outs of the
controller, and what the BMv2 test harness and benchmark put on veth ports."""
from __future__ import annotations

import ipaddress
import struct

from thc.wire import protocol as P

ETH = struct.Struct("!6s6sH")
IPV4 = struct.Struct("!BBHHHBBH4s4s")
UDP = struct.Struct("!HHHH")
ETHERTYPE_IPV4 = 0x0800
HEADERS = ETH.size + IPV4.size + UDP.size


def mac_bytes(mac: str) -> bytes:
    b = bytes(int(x, 16) for x in mac.split(":"))
    if len(b) != 6:
        raise ValueError(f"bad MAC address {mac!r}")
    return b


def mac_str(b: bytes) -> str:
    return ":".join(f"{x:02x}" for x in b)


def ip_bytes(ip: str) -> bytes:
    return ipaddress.IPv4Address(ip).packed


def ipv4_checksum(header: bytes) -> int:
    s = sum(struct.unpack(f"!{len(header) // 2}H", header))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def udp_checksum(src_ip: bytes, dst_ip: bytes, segment: bytes) -> int:
    """RFC 768's checksum of a UDP segment (its checksum field 0) under its pseudo-header."""
    data = src_ip + dst_ip + struct.pack("!BBH", 0, 17, len(segment)) + segment
    if len(data) % 2:
        data += b"\0"
    return ipv4_checksum(data) or 0xFFFF


def udp_frame(src_mac: str, dst_mac: str, src_ip: str, dst_ip: str, sport: int, dport: int,
              payload: bytes, ident: int = 0, tos: int = 0, checksum: bool = False) -> bytes:
    """An Ethernet/IPv4/UDP frame; UDP checksum 0 (as the switch sends them), or computed
    (``checksum``, as a host's kernel sends them)."""
    total = IPV4.size + UDP.size + len(payload)
    ip = IPV4.pack(0x45, tos, total, ident & 0xFFFF, 0x4000, 64, 17, 0,
                   ip_bytes(src_ip), ip_bytes(dst_ip))
    ip = ip[:10] + struct.pack("!H", ipv4_checksum(ip)) + ip[12:]
    udp = UDP.pack(sport, dport, UDP.size + len(payload), 0) + payload
    if checksum:
        udp = udp[:6] + struct.pack("!H", udp_checksum(ip[12:16], ip[16:20], udp)) + udp[8:]
    return ETH.pack(mac_bytes(dst_mac), mac_bytes(src_mac), ETHERTYPE_IPV4) + ip + udp


def frame_faults(frame: bytes) -> list[str]:
    """Why a host's kernel would drop this IPv4/UDP frame (empty: it would not): the IPv4
    checksum, an IPv4 length past the frame's end (bytes after it, Ethernet's padding or
    any other, the kernel trims), a UDP length that is not the IPv4 payload's, a UDP checksum
    that is neither 0 nor right."""
    if len(frame) < HEADERS:
        return ["a frame shorter than its headers"]
    ip = frame[ETH.size:ETH.size + IPV4.size]
    total = struct.unpack_from("!H", ip, 2)[0]
    faults = [what for what, bad in (
        ("a bad IPv4 checksum", ipv4_checksum(ip) != 0),
        ("an IPv4 length past the frame's end", total > len(frame) - ETH.size),
        ("an IPv4 length too short for a UDP header", total < IPV4.size + UDP.size)) if bad]
    if total < IPV4.size + UDP.size:
        return faults
    udp = frame[ETH.size + IPV4.size:ETH.size + total]
    length, check = struct.unpack_from("!HH", udp, 4)
    if length != len(udp):
        faults.append("a UDP length that is not the IPv4 payload's")
    elif check and udp_checksum(ip[12:16], ip[16:20], udp[:6] + b"\0\0" + udp[8:]) != check:
        faults.append("a wrong UDP checksum")
    return faults


def parse_udp_frame(frame: bytes):
    """(src_mac, dst_mac, src_ip, dst_ip, sport, dport, payload) or None if not IPv4/UDP.

    The payload is cut to the UDP length (Ethernet padding dropped)."""
    if len(frame) < HEADERS:
        return None
    dst, src, ethertype = ETH.unpack_from(frame, 0)
    if ethertype != ETHERTYPE_IPV4:
        return None
    vihl, _, _, _, _, _, proto, _, sip, dip = IPV4.unpack_from(frame, ETH.size)
    if proto != 17 or vihl >> 4 != 4:
        return None
    off = ETH.size + (vihl & 0x0F) * 4
    if len(frame) < off + UDP.size:
        return None
    sport, dport, length, _ = UDP.unpack_from(frame, off)
    payload = frame[off + UDP.size: off + max(length, UDP.size)]
    return (mac_str(src), mac_str(dst), str(ipaddress.IPv4Address(sip)),
            str(ipaddress.IPv4Address(dip)), sport, dport, payload)


def reset_frame(job_id: int, slot: int, agg_mac: str, agg_ip: str, version: int = 0,
                epoch: int = 0) -> bytes:
    """The RESET packet-out that clears one version of one slot of a job (one register
    access per register and packet, as a Tofino pipeline needs). ``epoch``: the install's
    (its thc_install entry): the switch drops a RESET of another install (stale_reset)."""
    hdr = P.Header(P.PktType.RESET, 0, job_id, slot, version, 0, 0, 0, 0, 0, epoch)
    return udp_frame(agg_mac, agg_mac, agg_ip, agg_ip, P.UDP_PORT, P.UDP_PORT, hdr.pack())
