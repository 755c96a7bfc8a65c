"""What the conformance suite needs from an aggregator: install jobs, talk as workers, read counters.

One suite of aggregation semantics runs against every implementation (software aggregator,
BMv2 switch). A harness hides how datagrams reach the aggregator: UDP sockets on loopback
for the software aggregator, raw Ethernet frames on veth ports for BMv2 (PTF style).
"""
from __future__ import annotations

import abc
import time

from thc.wire import protocol as P
from thc.wire.jobs import VOTE_TABLE, Job


class Endpoint(abc.ABC):
    """One worker's view of the network: datagrams (THC header + payload) in and out."""

    @abc.abstractmethod
    def send(self, datagram: bytes) -> None: ...

    @abc.abstractmethod
    def recv(self, timeout: float = 1.0) -> bytes | None:
        """Next THC datagram addressed to this worker, or None after ``timeout`` seconds."""

    def recv_all(self, timeout: float = 0.3) -> list[bytes]:
        out = []
        while (d := self.recv(timeout)) is not None:
            out.append(d)
        return out

    def close(self) -> None:
        pass


class Harness(abc.ABC):
    """An aggregator under test plus the network around it."""

    name: str = "?"
    settle: float = 0.0
    """Seconds a harness that cannot observe the aggregator's progress waits in :meth:`sync`."""
    quiet: float = 0.15
    """Seconds of silence after which no more datagrams are expected (where replies cannot be
    awaited by a barrier)."""

    def sync(self) -> None:
        """Return once the aggregator handled every datagram sent before the call, so that
        counters and replies reflect them. The base waits ``settle`` seconds."""
        time.sleep(self.settle)

    @abc.abstractmethod
    def make_job(self, job_id: int, n_workers: int, pool_size: int = 8,
                 table: list[int] | None = None, granularity: int = 30,
                 aggregation: str = "thc") -> Job:
        """A job whose worker addresses this harness can send from and receive at.

        ``table`` defaults to a test table with distinct entries, so a wrong index shows;
        ``aggregation="vote"`` makes a vote job (its table and granularity are fixed).
        """

    @abc.abstractmethod
    def install(self, job: Job) -> None:
        """Install (or re-install, resetting its slots) a job."""

    @abc.abstractmethod
    def remove(self, job_id: int) -> None: ...

    @abc.abstractmethod
    def endpoint(self, job: Job, worker_id: int) -> Endpoint:
        """An endpoint with worker ``worker_id``'s configured address."""

    @abc.abstractmethod
    def stranger(self) -> Endpoint:
        """An endpoint whose address belongs to no worker of any job."""

    @abc.abstractmethod
    def drops(self) -> dict[str, int]:
        """Dropped packets by reason name (protocol.json's drop_reasons), cumulative."""

    @abc.abstractmethod
    def job_counters(self, job: Job) -> dict[str, int]:
        """Cumulative per-job events by name (protocol.json's job_counters)."""

    def recv_each(self, endpoints: dict) -> dict:
        """What each endpoint receives until ``quiet`` seconds pass without a datagram."""
        return {k: ep.recv_all(timeout=self.quiet) for k, ep in endpoints.items()}

    def close(self) -> None:
        pass

    def lanes(self) -> int:
        return P.LANES


def job_fields(table, granularity, aggregation) -> dict:
    """Job fields of a harness's make_job: a vote job takes Job.vote's table and granularity."""
    if aggregation == "vote":
        return {"table": VOTE_TABLE, "granularity": 1, "aggregation": "vote"}
    return {"table": tuple(TEST_TABLE if table is None else table),
            "granularity": granularity, "aggregation": aggregation}


TEST_TABLE = [0, 1, 2, 4, 6, 8, 11, 14, 16, 19, 22, 24, 26, 28, 29, 30]
"""Distinct, symmetric-ish values in 0..30: any index mix-up changes a sum."""
