"""Addresses as the command line and the compiled datapath write them: ``HOST:PORT`` text,
and IPv4 literals as 32-bit integers."""
from __future__ import annotations

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
