"""Addresses as the command line and the compiled datapath write them: ``HOST:PORT`` text,
and IPv4 literals as 32-bit integers; and replies that leave from the address a datagram was
sent to, on a socket bound to the wildcard address."""
from __future__ import annotations

import functools
import socket
import struct


def parse_hostport(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (empty host: every address; port 0: any free one), else ValueError:
    a port past 65535 would fail later as an OverflowError of bind()."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    if int(port) > 65535:
        raise ValueError(f"port {port} of {text!r} is not in 0..65535")
    return host or "0.0.0.0", int(port)


def ipv4_int(ip: str) -> int | None:
    """The address as a 32-bit integer if ``ip`` is a dotted-quad literal as a received
    packet's source reads, else None (the Python aggregator compares address strings, so
    such a worker never matches)."""
    try:
        packed = socket.inet_aton(ip)
    except OSError:
        return None
    if socket.inet_ntoa(packed) != ip:
        return None
    return struct.unpack("!I", packed)[0]


def ipv4_str(value: int) -> str:
    return socket.inet_ntoa(struct.pack("!I", value))


def peer_address(addr, family: int = socket.AF_INET) -> tuple:
    """``addr`` (host and port, and for IPv6 flow info and scope) as a received packet's
    source reads on a socket of ``family``: the host's literal address, resolved once, so
    that replies from it match; a name or a form such as ``127.1`` would never equal a
    reply's source and every reply would be ignored."""
    try:
        host, port = tuple(addr)[:2]
        infos = socket.getaddrinfo(host, port, family, socket.SOCK_DGRAM)
    except (TypeError, ValueError, OSError) as e:
        raise ValueError(f"aggregator address {addr!r} is no {family.name} host and port: "
                         f"{e}") from None
    got = infos[0][4]
    if family == socket.AF_INET6 and len(tuple(addr)) == 4:
        got = got[:2] + tuple(addr)[2:]   # flow info and scope as given
    return got


IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8)
"""Linux's value: Python's socket module names IPV6_PKTINFO but not IP_PKTINFO."""
_PKTINFO = struct.Struct("@i4s4s")
"""struct in_pktinfo: interface index, the address to send from, the header's destination."""
PKTINFO_SPACE = socket.CMSG_SPACE(_PKTINFO.size)


def answer_from_destination(sock: socket.socket) -> bool:
    """Whether ``sock`` is bound to the IPv4 wildcard address, and if so, have the kernel
    report each datagram's destination (:func:`destination`). Such a socket's replies would
    otherwise leave from the address of the route to the peer, which on a host with several
    addresses is not always the one the peer sent to; workers take replies only from that."""
    name = sock.getsockname()
    if sock.family != socket.AF_INET or name[0] != "0.0.0.0":
        return False
    sock.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
    return True


_UNSPECIFIED = bytes(4)
"""0.0.0.0 packed: the destination of a datagram queued before the socket asked for it."""


def destination(ancdata: list) -> bytes | None:
    """The packed local address a datagram came in on, from ``recvmsg``'s ancillary data:
    the one it was sent to, or for a broadcast or multicast one, the interface's. None for
    a datagram queued before the socket asked for it (all zeros), as in the compiled one."""
    for level, kind, data in ancdata:
        if level == socket.IPPROTO_IP and kind == IP_PKTINFO and len(data) >= _PKTINFO.size:
            local = _PKTINFO.unpack_from(data)[1]
            return local if local != _UNSPECIFIED else None
    return None


@functools.lru_cache(maxsize=256)
def _from(source: bytes) -> list:
    return [(socket.IPPROTO_IP, IP_PKTINFO, _PKTINFO.pack(0, source, bytes(4)))]


def send_from(sock: socket.socket, data, dst: tuple[str, int], source: bytes | None) -> None:
    """``sock.sendto(data, dst)``, leaving from the packed address ``source`` if given."""
    if source is None:
        sock.sendto(data, dst)
    else:
        sock.sendmsg([data], _from(source), 0, dst)
