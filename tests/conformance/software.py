"""Harness for the software aggregators (Python reference and compiled datapath): real UDP
sockets on loopback."""
from __future__ import annotations

import socket

from host.net.aggregator import Aggregator
from host.net.fastagg import FastAggregator
from host.wire.jobs import Job
from tests.conformance.harness import TEST_TABLE, Endpoint, Harness


class UdpEndpoint(Endpoint):
    def __init__(self, addr: tuple[str, int], aggregator: tuple[str, int]):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(addr)
        self.aggregator = aggregator

    def send(self, datagram: bytes) -> None:
        self.sock.sendto(datagram, self.aggregator)

    def recv(self, timeout: float = 1.0) -> bytes | None:
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(4096)
        except socket.timeout:
            return None

    def close(self) -> None:
        self.sock.close()


class SoftwareHarness(Harness):
    name = "software"
    settle = 0.05

    def __init__(self, compiled: bool = False):
        self.name = "compiled" if compiled else "software"
        if compiled:
            # Its replies leave within microseconds of the packet (no GIL, no interpreter):
            # a shorter silence keeps the suite's second run short.
            self.quiet, self.settle = 0.08, 0.03
        self.agg = FastAggregator() if compiled else Aggregator()
        self.addr = self.agg.start("127.0.0.1", 0)
        self._endpoints: dict[tuple[str, int], UdpEndpoint] = {}

    def make_job(self, job_id: int, n_workers: int, pool_size: int = 8,
                 table: list[int] | None = None, granularity: int = 30) -> Job:
        eps = [UdpEndpoint(("127.0.0.1", 0), self.addr) for _ in range(n_workers)]
        workers = []
        for i, ep in enumerate(eps):
            ip, port = ep.sock.getsockname()
            self._endpoints[(ip, port)] = ep
            workers.append({"id": i, "ip": ip, "port": port})
        return Job.from_dict({"job_id": job_id, "workers": workers, "pool_size": pool_size,
                              "granularity": granularity,
                              "table": TEST_TABLE if table is None else table})

    def install(self, job: Job) -> None:
        self.agg.install(job)

    def remove(self, job_id: int) -> None:
        self.agg.remove(job_id)

    def endpoint(self, job: Job, worker_id: int) -> Endpoint:
        w = job.worker(worker_id)
        key = (w.ip, w.port)
        if key not in self._endpoints:
            self._endpoints[key] = UdpEndpoint(key, self.addr)
        return self._endpoints[key]

    def stranger(self) -> Endpoint:
        ep = UdpEndpoint(("127.0.0.1", 0), self.addr)
        self._endpoints[ep.sock.getsockname()] = ep
        return ep

    def drops(self) -> dict[str, int]:
        return self.agg.counters()["drops"]

    def job_counters(self, job: Job) -> dict[str, int]:
        return self.agg.counters()["jobs"][job.job_id]

    def close(self) -> None:
        for ep in self._endpoints.values():
            ep.close()
        self.agg.stop()
