"""Harnesses for the software aggregators (Python reference and compiled datapath), central
and sharded: real UDP sockets on loopback."""
from __future__ import annotations

import dataclasses
import select
import socket

from host.net.aggregator import Aggregator
from host.net.fastagg import FastAggregator
from host.wire import protocol as P
from host.wire.jobs import Job, Shard
from tests.conformance.harness import Endpoint, Harness, job_fields


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
                 table: list[int] | None = None, granularity: int = 30,
                 aggregation: str = "thc") -> Job:
        eps = [self._new_endpoint(("127.0.0.1", 0)) for _ in range(n_workers)]
        workers = []
        for i, ep in enumerate(eps):
            ip, port = ep.sock.getsockname()
            self._endpoints[(ip, port)] = ep
            workers.append({"id": i, "ip": ip, "port": port})
        return Job.from_dict({"job_id": job_id, "workers": workers, "pool_size": pool_size,
                              **job_fields(table, granularity, aggregation)})

    def _new_endpoint(self, addr: tuple[str, int]) -> UdpEndpoint:
        return UdpEndpoint(addr, self.addr)

    def recv_each(self, endpoints: dict) -> dict:
        """All endpoints at once: until ``quiet`` seconds pass with none receiving anything
        (the same condition as one ``recv_all`` each, without waiting it out per worker)."""
        got = {k: [] for k in endpoints}
        by_sock = {ep.sock: k for k, ep in endpoints.items()}
        while True:
            ready, _, _ = select.select(list(by_sock), [], [], self.quiet)
            if not ready:
                return got
            for sock in ready:
                got[by_sock[sock]].append(sock.recv(4096))

    def install(self, job: Job) -> None:
        self.agg.install(job)

    def remove(self, job_id: int) -> None:
        self.agg.remove(job_id)

    def endpoint(self, job: Job, worker_id: int) -> Endpoint:
        w = job.worker(worker_id)
        key = (w.ip, w.port)
        if key not in self._endpoints:
            self._endpoints[key] = self._new_endpoint(key)
        return self._endpoints[key]

    def stranger(self) -> Endpoint:
        ep = self._new_endpoint(("127.0.0.1", 0))
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


class ShardedEndpoint(UdpEndpoint):
    """A worker socket that sends each datagram to the shard owning its ``seq``, as the
    client does (datagrams too short to carry a seq go to shard 0)."""

    def __init__(self, addr: tuple[str, int], shards: list[tuple[str, int]]):
        super().__init__(addr, shards[0])
        self.shards = shards

    def send(self, datagram: bytes) -> None:
        dst = self.shards[0]
        if len(datagram) >= P.HEADER_BYTES:
            dst = self.shards[P.Header.unpack(datagram).seq % len(self.shards)]
        self.sock.sendto(datagram, dst)


class ShardedSoftwareHarness(SoftwareHarness):
    """Jobs spread over ``n_shards`` software aggregators (Python or compiled), each one shard
    of the job's shard map; the suite's counters are the sums over the shards, so
    exactly-once and every counted drop must hold per shard for the suite to pass."""

    def __init__(self, n_shards: int = 2, compiled: bool = False):
        self.name = "sharded compiled" if compiled else "sharded"
        if compiled:
            self.quiet, self.settle = 0.08, 0.03
        make = FastAggregator if compiled else Aggregator
        self.shards = [make(shard=i) for i in range(n_shards)]
        self.shard_addrs = [a.start("127.0.0.1", 0) for a in self.shards]
        self.agg = self.shards[0]
        self.addr = self.shard_addrs[0]
        self._endpoints = {}

    def make_job(self, job_id: int, n_workers: int, pool_size: int = 8,
                 table: list[int] | None = None, granularity: int = 30,
                 aggregation: str = "thc") -> Job:
        job = super().make_job(job_id, n_workers, pool_size, table, granularity, aggregation)
        return dataclasses.replace(
            job, shards=tuple(Shard(ip, port) for ip, port in self.shard_addrs)).validate()

    def _new_endpoint(self, addr: tuple[str, int]) -> UdpEndpoint:
        return ShardedEndpoint(addr, self.shard_addrs)

    def send_to_shard(self, ep: UdpEndpoint, datagram: bytes, shard: int) -> None:
        """Send from ``ep`` to shard ``shard`` whatever the datagram's seq (a misrouted chunk)."""
        ep.sock.sendto(datagram, self.shard_addrs[shard])

    def install(self, job: Job) -> None:
        for a in self.shards:
            a.install(job)

    def remove(self, job_id: int) -> None:
        for a in self.shards:
            a.remove(job_id)

    def drops(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for a in self.shards:
            for k, v in a.counters()["drops"].items():
                total[k] = total.get(k, 0) + v
        return total

    def job_counters(self, job: Job) -> dict[str, int]:
        total: dict[str, int] = {}
        for a in self.shards:
            for k, v in a.counters()["jobs"][job.job_id].items():
                total[k] = total.get(k, 0) + v
        return total

    def close(self) -> None:
        for ep in self._endpoints.values():
            ep.close()
        for a in self.shards:
            a.stop()
