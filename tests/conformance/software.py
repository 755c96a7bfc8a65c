"""Harnesses for the software aggregators (Python reference and compiled datapath), central
and sharded: real UDP sockets on loopback."""
from __future__ import annotations

import dataclasses
import select
import socket
import time
from collections.abc import Callable

from thc.net.aggregator import Aggregator
from thc.net.fastagg import FastAggregator
from thc.wire import protocol as P
from thc.wire.jobs import Job, Shard
from tests.conformance.harness import Endpoint, Harness, job_fields


class UdpEndpoint(Endpoint):
    def __init__(self, addr: tuple[str, int], aggregator: tuple[str, int],
                 sync: Callable[[], None]):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(addr)
        self.aggregator = aggregator
        self.sync = sync

    def send(self, datagram: bytes) -> None:
        self.sock.sendto(datagram, self.aggregator)

    def recv(self, timeout: float = 1.0) -> bytes | None:
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(4096)
        except socket.timeout:
            return None

    def arrived(self) -> list[bytes]:
        """The datagrams already queued on the socket."""
        self.sock.setblocking(False)
        out = []
        while True:
            try:
                out.append(self.sock.recv(4096))
            except BlockingIOError:
                return out

    def close(self) -> None:
        self.sock.close()


SYNC_JOB_ID = (1 << 16) - 1
"""The job of the harness's barrier: one worker, the harness's own socket."""

SYNC_TIMEOUT = 30.0
"""Seconds a barrier waits for its reply: an aggregator this late has failed."""


class Barrier:
    """A one-worker job on one aggregator whose chunks complete at once: the RESULT of a
    chunk sent now leaves after every reply to the datagrams sent to that aggregator before
    it, as one loop takes datagrams from one socket in order and answers each before the
    next (the compiled loop: each recvmmsg batch before the next, hence two chunks)."""

    def __init__(self, aggregator, address: tuple[str, int]):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.address = address
        ip, port = self.sock.getsockname()
        self.job = Job.from_dict({"job_id": SYNC_JOB_ID, "pool_size": 8,
                                  "workers": [{"id": 0, "ip": ip, "port": port}],
                                  **job_fields(None, 30, "thc")})
        aggregator.install(self.job)
        self.seq = 0
        self.payload = bytes(P.payload_bytes(P.PktType.DATA, self.job.lanes))

    def wait(self) -> None:
        for _ in range(2):
            seq, self.seq = self.seq, self.seq + 1
            slot, version = P.slot_of(seq, self.job.pool_size)
            hdr = P.Header(P.PktType.DATA, 0, SYNC_JOB_ID, slot, version, 0, seq,
                           (seq * self.job.lanes) % P.SEQ_MOD, self.job.config_tag, 1, 0)
            self.sock.sendto(hdr.pack() + self.payload, self.address)
            end = time.monotonic() + SYNC_TIMEOUT
            while True:
                left = end - time.monotonic()
                ready, _, _ = select.select([self.sock], [], [], max(0.0, left))
                if not ready:
                    raise TimeoutError(f"the aggregator at {self.address} did not answer the "
                                       f"barrier chunk {seq} within {SYNC_TIMEOUT:.0f}s")
                got = P.Header.unpack(self.sock.recv(4096))
                if got.pkt_type == P.PktType.RESULT and got.seq == seq:
                    break

    def close(self) -> None:
        self.sock.close()


class SoftwareHarness(Harness):
    name = "software"

    def __init__(self, compiled: bool = False):
        self.name = "compiled" if compiled else "software"
        self.agg = FastAggregator() if compiled else Aggregator()
        self.addr = self.agg.start("127.0.0.1", 0)
        self._endpoints: dict[tuple[str, int], UdpEndpoint] = {}
        self._barriers = [Barrier(self.agg, self.addr)]

    def sync(self) -> None:
        """Returns once every aggregator answered all datagrams sent to it before the call
        (and counted them)."""
        for b in self._barriers:
            b.wait()

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
        return UdpEndpoint(addr, self.addr, self.sync)

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
        for b in self._barriers:
            b.close()
        self.agg.stop()


class ShardedEndpoint(UdpEndpoint):
    """A worker socket that sends each datagram to the shard owning its ``seq``, as the
    client does (datagrams too short to carry a seq go to shard 0)."""

    def __init__(self, addr: tuple[str, int], shards: list[tuple[str, int]],
                 sync: Callable[[], None]):
        super().__init__(addr, shards[0], sync)
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
        make = FastAggregator if compiled else Aggregator
        self.shards = [make(shard=i) for i in range(n_shards)]
        self.shard_addrs = [a.start("127.0.0.1", 0) for a in self.shards]
        self.agg = self.shards[0]
        self.addr = self.shard_addrs[0]
        self._endpoints = {}
        self._barriers = [Barrier(a, addr) for a, addr in zip(self.shards, self.shard_addrs)]

    def make_job(self, job_id: int, n_workers: int, pool_size: int = 8,
                 table: list[int] | None = None, granularity: int = 30,
                 aggregation: str = "thc") -> Job:
        job = super().make_job(job_id, n_workers, pool_size, table, granularity, aggregation)
        return dataclasses.replace(
            job, shards=tuple(Shard(ip, port) for ip, port in self.shard_addrs)).validate()

    def _new_endpoint(self, addr: tuple[str, int]) -> UdpEndpoint:
        return ShardedEndpoint(addr, self.shard_addrs, self.sync)

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
        for b in self._barriers:
            b.close()
        for a in self.shards:
            a.stop()
