"""The UDP shell both aggregator datapaths share: bind a socket, serve it in a background
thread, stop. The datapath supplies ``serve`` and how to ask it to stop."""
from __future__ import annotations

import socket
import struct
import threading

from thc.net.addresses import IP_PKTINFO
from thc.wire import protocol as P


RECEIVE_BUFFER = 8 << 20
"""Bytes of receive queue asked for; the kernel grants at most net.core.rmem_max."""
DATAGRAM_BYTES = 2048
"""What an aggregator reads of one datagram, on either datapath (the compiled one's
RECV_BYTES, checked by thc.net.cext): a longer one is cut there, and refused as its
cut length reads."""


SO_MEMINFO = 55
"""Linux's socket option for a socket's memory counters (sock_diag's SK_MEMINFO_* order,
``u32`` each; Python's socket module does not name it)."""
SK_MEMINFO_DROPS = 8


def queue_overflow(sock: socket.socket) -> int | None:
    """Datagrams the kernel dropped at ``sock``, its receive queue full: the socket's own
    drop count (SO_MEMINFO, the count /proc/net/udp lists; that table, handed out a page a
    read and resumed by position, skipped sockets while others closed). Neither datapath
    sees them; workers retransmit them as any lost packet. None off Linux."""
    size = 4 * (SK_MEMINFO_DROPS + 1)
    try:
        info = sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, size)   # EBADF: closed
    except OSError:
        return None
    return struct.unpack_from("=I", info, 4 * SK_MEMINFO_DROPS)[0] if len(info) >= size \
        else None


class UDPServer:
    thread_name = "thc-aggregator"
    _sock: socket.socket | None = None
    _thread: threading.Thread | None = None
    _error: OSError | None = None
    _overflow: int | None = None
    receive_buffer = 0
    """Bytes of receive queue the kernel granted (Linux reports twice that, socket(7))."""

    def serve(self, duration: float | None = None) -> None:
        """Receive and answer until :meth:`stop` (or ``duration`` seconds); :meth:`stop`
        from another thread waits for this loop to end before it closes the socket."""
        if self._sock is None:
            raise RuntimeError("call bind() first")
        with self._serving:
            self._serving_on = threading.get_ident()
            try:
                self._serve(duration)
            finally:
                self._serving_on = None
                if self._close_pending:
                    self._close_pending = False
                    self._close()

    def _serve(self, duration: float | None) -> None:
        raise NotImplementedError

    def _clear_stop(self) -> None:
        raise NotImplementedError

    def _set_stop(self) -> None:
        raise NotImplementedError

    def bind(self, host: str = "127.0.0.1", port: int = P.UDP_PORT) -> tuple[str, int]:
        if self._sock is not None:
            raise RuntimeError(f"already bound to {self.address}: stop() first")
        self._serving = threading.Lock()
        self._serving_on: int | None = None
        """The thread in serve(), whose own signal handler may call stop()."""
        self._close_pending = False
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        self.receive_buffer = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 2
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        # before bind, on any address (a wildcard may be spelled "0", "0.0.0.0" or ""): a
        # datagram queued without it carries no destination for a wildcard socket to answer from
        sock.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
        sock.bind((host, port))
        self._sock = sock
        return sock.getsockname()

    @property
    def address(self) -> tuple[str, int]:
        if self._sock is None:
            raise RuntimeError("aggregator is not bound")
        return self._sock.getsockname()

    def _serve_thread(self) -> None:
        try:
            self.serve()
        except Exception as e:  # `thc aggregator` reports it and exits: never a silent stop
            self._error = e

    @property
    def error(self) -> Exception | None:
        """What ended the serving thread early, if anything did: a socket failure or a bug,
        which would otherwise leave a server that answers nothing."""
        return self._error

    def start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Bind and serve in a background thread (tests, embedded use)."""
        addr = self.bind(host, port)
        self._clear_stop()
        self._error = None
        self._thread = threading.Thread(target=self._serve_thread, name=self.thread_name,
                                        daemon=True)
        self._thread.start()
        return addr

    def queue_overflow(self) -> int | None:
        """:func:`queue_overflow` of the socket; after :meth:`stop`, its last count."""
        sock = self._sock
        if sock is not None:
            self._overflow = queue_overflow(sock) if sock.fileno() >= 0 else self._overflow
        return self._overflow

    def stop(self) -> None:
        self._set_stop()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._sock is None:
            return
        if self._serving_on == threading.get_ident():
            # a signal handler on the serving thread: its loop closes the socket as it ends
            self._close_pending = True
            return
        # a serve() on another thread's foreground still reads the socket: closed under it,
        # its descriptor's number could be another file's by the loop's next read
        ended = self._serving.acquire(timeout=5)
        try:
            self._close()
        finally:
            if ended:
                self._serving.release()

    def _close(self) -> None:
        if self._sock is not None:
            self.queue_overflow()
            self._sock.close()
            self._sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
