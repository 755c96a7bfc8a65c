"""BMv2 harness: simple_switch_grpc on veth pairs, programmed by the controller, PTF style.

controller/testing/bmv2.py's ``LocalBMv2`` starts
``simple_switch_grpc --device-id 0 --cpu-port 255`` with one veth pair per port and pushes the
compiled program from p4src/build.
``BMv2Harness`` implements tests/conformance/harness.py's Harness on top: workers are
(MAC, IPv4, UDP port) triples spread over the worker ports (one more port hosts strangers);
an endpoint sends raw Ethernet frames from its worker's address to the aggregator's and
receives the THC datagrams addressed to it. ``sync`` is tests/bmv2/barrier.py's barrier:
no fixed wait decides what has been handled or what will still come.

Needs root (veth pairs, AF_PACKET) and simple_switch_grpc on PATH; ``bmv2_available()`` says
what is missing (through thc.controller.toolchain). p4c is not needed: the committed build in
p4src/build is used.
"""
from __future__ import annotations

import contextlib
import itertools
import queue
from dataclasses import replace
from pathlib import Path

from thc.controller import job_entries, toolchain
from thc.controller.frames import udp_frame
from thc.controller.testing.bmv2 import LocalBMv2
from thc.wire import protocol as P
from thc.wire.jobs import SWITCH_AGG_IP, SWITCH_AGG_MAC, Job, Worker
from tests.bmv2.barrier import SwitchBarrier
from tests.conformance.harness import Endpoint, Harness, job_fields

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "p4src" / "build"
AGG_IP, AGG_MAC = SWITCH_AGG_IP, SWITCH_AGG_MAC


def bmv2_available(program: str = "thc") -> tuple[bool, str]:
    """(True, "") when BMv2 tests can run here, else (False, what is missing)."""
    why = toolchain.bmv2_missing(program, BUILD)
    return why is None, why or ""


class FrameEndpoint(Endpoint):
    """A worker address on one switch port: raw frames out, THC datagrams in."""

    def __init__(self, switch: LocalBMv2, sync, port: int, mac: str, ip: str, udp_port: int,
                 agg_mac: str = AGG_MAC, agg_ip: str = AGG_IP):
        self.switch, self.sync, self.port = switch, sync, port
        self.mac, self.ip, self.udp_port = mac, ip, udp_port
        self.agg_mac, self.agg_ip = agg_mac, agg_ip
        self.inbox = switch.register(ip, udp_port)
        self._ident = itertools.count(1)

    def frame(self, datagram: bytes) -> bytes:
        """As a worker's kernel sends it: a UDP checksum the switch's replies must not keep."""
        return udp_frame(self.mac, self.agg_mac, self.ip, self.agg_ip, self.udp_port,
                         P.UDP_PORT, datagram, ident=next(self._ident), checksum=True)

    def _sound(self) -> None:
        if self.switch.faulty:
            raise AssertionError(f"the switch sent frames a worker's kernel drops: "
                                 f"{self.switch.faulty[:3]}")

    def send(self, datagram: bytes) -> None:
        self.switch.send(self.port, self.frame(datagram))

    def recv(self, timeout: float = 1.0) -> bytes | None:
        try:
            got = self.inbox.get(timeout=timeout)
        except queue.Empty:
            got = None
        self._sound()
        return got

    def arrived(self) -> list[bytes]:
        out = []
        while True:
            try:
                out.append(self.inbox.get_nowait())
            except queue.Empty:
                self._sound()
                return out


class BMv2Harness(Harness):
    name = "bmv2"
    max_jobs = 4
    """Jobs kept installed; the oldest is removed to make room (the switch holds MAX_JOBS,
    but every table read returns every job's entries: fewer keep reads fast)."""

    def __init__(self, worker_ports: int = 4, program: str = "thc", build_dir: Path = BUILD):
        self.worker_ports = worker_ports
        self.switch = LocalBMv2(worker_ports + 1, program=program, build_dir=build_dir)
        self.sw = self.switch.sw
        try:
            self.barrier = SwitchBarrier(self.switch)
        except BaseException:
            self.switch.close()
            raise
        self.stranger_port = worker_ports
        self._endpoints: dict[tuple[str, int], FrameEndpoint] = {}
        self._addr = itertools.count(1)
        self._pools: dict[int, tuple[int, int]] = {}     # job_id -> (base, size), oldest first
        self._installed: dict[int, int] = {}              # job_id -> job_index
        self._rr = 0

    # -- jobs -----------------------------------------------------------------------------
    def _new_address(self, port: int) -> tuple[str, str, int]:
        """A worker address no other worker and not the switch has (the controller refuses a
        worker at the switch's MAC or IP)."""
        while True:
            k = next(self._addr)
            if 20000 + k > 0xFFFF:
                raise RuntimeError("the harness has handed out every worker address it has")
            mac = f"02:00:00:{port:02x}:{(k >> 8) & 0xFF:02x}:{k & 0xFF:02x}"
            ip = f"10.{1 + port}.{(k >> 8) & 0xFF}.{k & 0xFF}"
            if mac.lower() != AGG_MAC.lower() and ip != AGG_IP:
                return mac, ip, 20000 + k

    def _alloc_pool(self, job_id: int, size: int) -> int:
        if job_id in self._pools and self._pools[job_id][1] == size:
            return self._pools[job_id][0]
        self._release(job_id)
        while True:
            if len(self._pools) < self.max_jobs:
                taken = sorted(self._pools.values())
                base = 0
                for b, s in taken:
                    if base + size <= b:
                        break
                    base = max(base, b + s)
                if base + size <= P.SWITCH_SLOTS:
                    self._pools[job_id] = (base, size)
                    return base
            if not self._pools:
                raise RuntimeError(f"a pool of {size} slots does not fit the switch")
            self._release(next(iter(self._pools)))

    def _release(self, job_id: int) -> None:
        self._pools.pop(job_id, None)
        if job_id in self._installed:
            from thc.controller import jobs
            # the harness evicts its own idle jobs: no liveness watch (test_switch_safety
            # tests that)
            jobs.remove_job(self.sw, job_id, force=True)
            del self._installed[job_id]

    def make_job(self, job_id: int, n_workers: int, pool_size: int = 8,
                 table: list[int] | None = None, granularity: int = 30,
                 aggregation: str = "thc", ports: list[int] | None = None) -> Job:
        """``ports``: switch port of each worker (default: spread over the worker ports)."""
        workers = []
        for i in range(n_workers):
            if ports is not None:
                port = ports[i]
            else:
                port = self._rr % self.worker_ports
                self._rr += 1
            mac, ip, udp_port = self._new_address(port)
            workers.append(Worker(i, ip, udp_port, mac, port))
            self._endpoints[(ip, udp_port)] = self._frame_endpoint(port, mac, ip, udp_port)
        base = self._alloc_pool(job_id, pool_size)
        job = Job(job_id=job_id, workers=tuple(workers), pool_size=pool_size, pool_base=base,
                  lanes=self.sw.lanes, **job_fields(table, granularity, aggregation))
        return job.validate()

    def install(self, job: Job) -> None:
        from thc.controller import jobs
        if job.job_id not in self._pools or self._pools[job.job_id] != (job.pool_base,
                                                                        job.pool_size):
            # a job made elsewhere: give it a pool of its own on the switch
            job = replace(job, pool_base=self._alloc_pool(job.job_id, job.pool_size))
        # the suite re-installs only idle jobs: no liveness watch (test_switch_safety tests it)
        self._installed[job.job_id] = jobs.install_job(self.sw, job,
                                                       job_entries.AggAddress(AGG_IP, AGG_MAC),
                                                       force=True)

    def remove(self, job_id: int) -> None:
        from thc.controller import jobs
        jobs.remove_job(self.sw, job_id, force=True)
        self._installed.pop(job_id, None)
        self._pools.pop(job_id, None)

    def sync(self) -> None:
        """Every frame sent so far handled, every reply to it arrived (a barrier, not a wait)."""
        self.barrier.wait()

    # -- endpoints ------------------------------------------------------------------------
    def _frame_endpoint(self, port: int, mac: str, ip: str, udp_port: int) -> FrameEndpoint:
        return FrameEndpoint(self.switch, self.sync, port, mac, ip, udp_port)

    def endpoint(self, job: Job, worker_id: int) -> Endpoint:
        w = job.worker(worker_id)
        key = (w.ip, w.port)
        if key not in self._endpoints:
            self._endpoints[key] = self._frame_endpoint(w.switch_port, w.mac, w.ip, w.port)
        return self._endpoints[key]

    def stranger(self) -> Endpoint:
        mac, ip, udp_port = self._new_address(self.stranger_port)
        ep = self._frame_endpoint(self.stranger_port, mac, ip, udp_port)
        self._endpoints[(ip, udp_port)] = ep
        return ep

    # -- counters -------------------------------------------------------------------------
    def drops(self) -> dict[str, int]:
        from thc.controller import counters
        return counters.drops(self.sw)

    def job_counters(self, job: Job) -> dict[str, int]:
        from thc.controller import counters
        return counters.job_counters(self.sw, self._installed[job.job_id])

    def lanes(self) -> int:
        return self.sw.lanes

    def reconnect(self) -> None:
        """A new session in place of one another controller displaced."""
        self.sw = self.switch.reconnect()

    def close(self) -> None:
        self.switch.close()


@contextlib.contextmanager
def bmv2_harness(**kwargs):
    """``with bmv2_harness() as h:`` a BMv2Harness, torn down afterwards (veths, process)."""
    h = BMv2Harness(**kwargs)
    try:
        yield h
    finally:
        h.close()
