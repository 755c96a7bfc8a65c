"""A local BMv2 switch for tests and benchmarks: simple_switch_grpc on veth pairs.

``LocalBMv2`` starts ``simple_switch_grpc --device-id 0 --no-p4 -- --cpu-port 255`` with
one veth pair per port (the switch owns ``<tag>s<i>``, the root namespace keeps
``<tag>h<i>``), opens a controller session (controller/switch.py) that pushes the compiled
program, and gives raw access to the host-side ends: ``send(port, frame)`` and, with
``receive=True``, a background thread that hands every received UDP payload to the queue
registered for its (dst IP, dst port) and keeps the other frames per port in ``raw``.

Needs root and simple_switch_grpc on PATH (``thc.controller.toolchain.bmv2_missing()`` says
what is missing). Every veth and the process are removed by ``close()``.
"""
from __future__ import annotations

import os
import queue
import select
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from thc.controller.frames import frame_faults, parse_udp_frame
from thc.controller.switch import BUILD_DIR, Switch
from thc.lifetime import with_parent
from thc.testing.clusters import free_tcp_port
from thc.wire import protocol as P

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _sysctl(key: str, value: str) -> None:
    try:
        (Path("/proc/sys") / key.replace(".", "/")).write_text(value)
    except OSError:
        pass


class LocalBMv2:
    """simple_switch_grpc with ``n_ports`` veth ports and (unless ``connect=False``) an open
    controller session ``sw`` that pushed ``program``."""

    def __init__(self, n_ports: int, program: str | None = "thc",
                 build_dir: Path | str = BUILD_DIR, receive: bool = True,
                 log_dir: Path | None = None, tag: str | None = None,
                 connect: bool = True):
        self.n_ports = n_ports
        self.tag = tag or f"t{os.getpid() % 100000}"
        self.host_ifs = [f"{self.tag}h{i}" for i in range(n_ports)]
        self.sw_ifs = [f"{self.tag}s{i}" for i in range(n_ports)]
        self.workdir = Path(tempfile.mkdtemp(prefix="thc-bmv2-"))
        self.grpc_addr = f"127.0.0.1:{free_tcp_port()}"
        self.thrift_port = free_tcp_port()
        self.proc: subprocess.Popen | None = None
        self.sw = None
        self._socks: list[socket.socket] = []
        self._handlers: dict[tuple[str, int], queue.Queue] = {}
        self.raw: list[queue.Queue] = [queue.Queue() for _ in range(n_ports)]
        """Frames each host-side port received that no registered queue claimed."""
        self.faulty: list[str] = []
        """Frames for a registered queue that a host's kernel would drop (frame_faults):
        delivered all the same, for the harness to fail on."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self._make_veths()
            self._start_switch(log_dir)
            if connect:
                self.sw = Switch(self.grpc_addr, device_id=0, timeout=10.0)
                self.sw.connect(program=program, build_dir=build_dir)
            self._open_sockets(receive)
        except BaseException:
            self.close()
            raise

    # -- setup ----------------------------------------------------------------------------
    def _make_veths(self) -> None:
        for h, s in zip(self.host_ifs, self.sw_ifs):
            _ip("link", "del", h, check=False)
            _ip("link", "add", h, "type", "veth", "peer", "name", s)
            for ifname in (h, s):
                _sysctl(f"net.ipv6.conf.{ifname}.disable_ipv6", "1")
                _sysctl(f"net.ipv4.conf.{ifname}.forwarding", "0")
                _ip("link", "set", "dev", ifname, "arp", "off", "multicast", "off", "up")

    def _start_switch(self, log_dir: Path | None) -> None:
        cmd = ["simple_switch_grpc", "--device-id", "0", "--no-p4",
               "--thrift-port", str(self.thrift_port)]
        for i, s in enumerate(self.sw_ifs):
            cmd += ["-i", f"{i}@{s}"]
        if log_dir is not None:
            cmd += ["--log-file", str(Path(log_dir) / "bmv2"), "--log-flush"]
        else:
            # without a log sink BMv2 still formats every trace message (level trace into a
            # null sink): "off" makes it ~4x faster on the THC program
            cmd += ["--log-level", "off"]
        cmd += ["--", "--grpc-server-addr", self.grpc_addr, "--cpu-port", str(P.CPU_PORT),
                "--priority-queues", str(P.PRIORITY_QUEUES)]
        self.log_path = self.workdir / "simple_switch_grpc.out"
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=with_parent())
        import grpc
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"simple_switch_grpc exited ({self.proc.returncode}): "
                                   f"{self.log_path.read_text(errors='replace')[-2000:]}")
            ch = grpc.insecure_channel(self.grpc_addr)
            try:
                grpc.channel_ready_future(ch).result(timeout=0.5)
                return
            except grpc.FutureTimeoutError:
                pass
            finally:
                ch.close()
        raise RuntimeError(f"simple_switch_grpc did not open {self.grpc_addr} within 30s")

    def _open_sockets(self, receive: bool) -> None:
        for h in self.host_ifs:
            # protocol 0: a send-only socket (no copy of every frame to drain). socket()
            # takes the protocol in network order, bind() in host order.
            proto = ETH_P_ALL if receive else 0
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(proto))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            s.bind((h, proto))
            s.setblocking(False)
            self._socks.append(s)
        if receive:
            self._thread = threading.Thread(target=self._receive, name="bmv2-rx", daemon=True)
            self._thread.start()

    # -- frames ---------------------------------------------------------------------------
    def register(self, ip: str, port: int) -> queue.Queue:
        """Queue of the UDP payloads the switch sends to (ip, port)."""
        return self._handlers.setdefault((ip, port), queue.Queue())

    def send(self, port: int, frame: bytes) -> None:
        while True:
            try:
                self._socks[port].send(frame)
                return
            except BlockingIOError:
                time.sleep(0.0005)

    def socket(self, port: int) -> socket.socket:
        return self._socks[port]

    def rx_packets(self, port: int) -> int:
        """Kernel count of frames the switch sent out of ``port``."""
        return int(Path(f"/sys/class/net/{self.host_ifs[port]}/statistics/rx_packets").read_text())

    def _receive(self) -> None:
        index = {s.fileno(): i for i, s in enumerate(self._socks)}
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select(self._socks, [], [], 0.1)
            except (OSError, ValueError):
                return
            for s in ready:
                while True:
                    try:
                        frame, addr = s.recvfrom(65535)
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError:
                        return
                    if addr[2] == PACKET_OUTGOING:
                        continue
                    parsed = parse_udp_frame(frame)
                    q = self._handlers.get((parsed[3], parsed[5])) if parsed else None
                    if q is not None:
                        faults = frame_faults(frame)
                        if faults:     # a worker's kernel would drop it
                            self.faulty.append(f"{', '.join(faults)}: {frame[:42].hex()}")
                        q.put(parsed[6])
                    else:
                        self.raw[index[s.fileno()]].put(frame)

    def restart(self) -> None:
        """Kill the switch and start another on the same ports and address, without a
        program: a crash and its restart, under whatever sessions were open."""
        self.proc.kill()
        self.proc.wait(timeout=5)
        self._start_switch(None)

    def reconnect(self) -> Switch:
        """A new controller session on the running switch, its program and entries kept: a
        session another controller displaced refuses everything (controller/switch.py)."""
        if self.sw is not None:
            self.sw.close()
        self.sw = None
        self.sw = Switch(self.grpc_addr, device_id=0, timeout=10.0).connect(program=None)
        return self.sw

    # -- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        for s in self._socks:
            s.close()
        self._socks = []
        if self.sw is not None:
            self.sw.close()
            self.sw = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=5)
            self.proc = None
        for h in self.host_ifs:
            _ip("link", "del", h, check=False)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "LocalBMv2":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
