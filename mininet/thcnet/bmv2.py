"""BMv2 (simple_switch_grpc) as the Mininet switch, programmed by the project's controller.

The switch runs in the root namespace on the switch ends of the veth pairs
(``-i <port>@thc<tag>s-eth<port>``), starts without a program (``--no-p4``), and listens for
P4Runtime on a free local port (never the default 9559, so it cannot clash with another
switch on the machine). ``program(cluster.json)`` runs ``thc controller install --push`` in a
separate process (p4runtime-shell keeps one global client per process): it pushes
p4src/build/thc.json + thc.p4info.txt and installs the job (tables, multicast group, L2
routes, slot reset), exactly as an operator would.

The toolchain is not part of the project: ``simple_switch_grpc`` must be on PATH and the
program compiled (``make p4``) for this mode to be offered.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from mininet.node import Switch

from thc.controller.toolchain import BUILD_DIR, ROOT
from thc.testing.clusters import free_tcp_port
from thc.wire import protocol as P
from thc.emu.cleanup import kill_process, start_time

START_TIMEOUT = 30.0
PROGRAM_TIMEOUT = 180.0


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class BMv2Switch(Switch):
    """A Mininet switch node that is a simple_switch_grpc process."""

    logdir: Path = Path("/tmp")
    registry = None

    def __init__(self, name, **params):
        super().__init__(name, **params)
        self.grpc_port = free_tcp_port()
        self.thrift_port = free_tcp_port()
        self.proc: subprocess.Popen | None = None
        self.started_at: int | None = None
        self.log_path = self.logdir / f"{name}.log"

    @property
    def grpc_addr(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self, controllers) -> None:
        ports = []
        for intf in self.intfList():
            if intf.name.startswith(self.name):
                ports += ["-i", f"{self.ports[intf]}@{intf.name}"]
        argv = (["simple_switch_grpc", "--device-id", "0", "--thrift-port",
                 str(self.thrift_port), "--no-p4", "--log-level", "off"] + ports +
                ["--", "--grpc-server-addr", self.grpc_addr, "--cpu-port", str(P.CPU_PORT),
                 "--priority-queues", str(P.PRIORITY_QUEUES)])
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self.started_at = start_time(self.proc.pid)
        if self.registry is not None:
            self.registry.add_pid(self.proc.pid, group=True)
        end = time.monotonic() + START_TIMEOUT
        while not _port_open(self.grpc_port):
            if self.proc.poll() is not None:
                raise RuntimeError(f"simple_switch_grpc exited with code {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            if time.monotonic() > end:
                raise RuntimeError(f"simple_switch_grpc did not open {self.grpc_addr} within "
                                   f"{START_TIMEOUT:.0f} s: {self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:].strip()
        except OSError:
            return "(no log)"

    def program(self, cluster_path: Path | str) -> str:
        """Push the THC program and install the cluster's jobs; returns the controller's output."""
        argv = [sys.executable, "-m", "thc.cli", "controller", "--grpc-addr", self.grpc_addr,
                "--device-id", "0", "--build-dir", str(BUILD_DIR), "install", "--config",
                str(cluster_path), "--push"]
        try:
            r = subprocess.run(argv, cwd=str(ROOT), capture_output=True, text=True,
                               timeout=PROGRAM_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"programming the switch took more than {PROGRAM_TIMEOUT:.0f} s")
        if r.returncode != 0:
            raise RuntimeError(f"thc controller install failed ({r.returncode}): "
                               f"{(r.stderr or r.stdout).strip()[-2000:]}")
        return r.stdout

    def counters(self) -> str:
        argv = [sys.executable, "-m", "thc.cli", "controller", "--grpc-addr", self.grpc_addr,
                "--device-id", "0", "counters", "--json"]
        r = subprocess.run(argv, cwd=str(ROOT), capture_output=True, text=True, timeout=60)
        return r.stdout if r.returncode == 0 else r.stderr

    def crash_and_restart(self) -> None:
        """Kill simple_switch_grpc with SIGKILL (a crash: every register is lost) and start
        it again on the same ports, without a program, as a switch reboot would."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)
        self.start([])

    def stop(self, deleteIntfs=True) -> None:
        if self.proc is not None and self.proc.poll() is None:
            kill_process(self.proc.pid, self.started_at, group=True, grace=1.0)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        super().stop(deleteIntfs)


def switch_class(logdir: Path, registry) -> type:
    """A BMv2Switch subclass bound to this testbed's log directory and registry."""
    return type("BoundBMv2Switch", (BMv2Switch,), {"logdir": Path(logdir), "registry": registry})
