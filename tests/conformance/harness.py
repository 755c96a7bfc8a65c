"""What the conformance suite needs from an aggregator: install jobs, talk as workers, read
counters.

One suite of aggregation semantics runs against every implementation (software aggregator,
BMv2 switch). A harness hides how datagrams reach the aggregator: UDP sockets on loopback
for the software aggregator, raw Ethernet frames on veth ports for BMv2 (PTF style).
"""
from __future__ import annotations

import abc
from collections.abc import Callable

from thc.wire import protocol as P
from thc.wire.jobs import VOTE_TABLE, Job


class Endpoint(abc.ABC):
    """One worker's view of the network: datagrams (THC header + payload) in and out."""

    sync: Callable[[], None]
    """The harness's :meth:`Harness.sync`."""

    @abc.abstractmethod
    def send(self, datagram: bytes) -> None: ...

    @abc.abstractmethod
    def recv(self, timeout: float = 1.0) -> bytes | None:
        """Next THC datagram addressed to this worker, or None after ``timeout`` seconds."""

    @abc.abstractmethod
    def arrived(self) -> list[bytes]:
        """The datagrams addressed to this worker that are here now, without waiting."""

    def recv_all(self) -> list[bytes]:
        """Every datagram the aggregator sends this worker in reply to what any endpoint sent
        before the call, however late: the harness's barrier, then what has arrived (so that
        an extra reply shows, and a missing one is missing, not late)."""
        self.sync()
        return self.arrived()

    def close(self) -> None:
        pass


class Harness(abc.ABC):
    """An aggregator under test plus the network around it."""

    name: str = "?"

    @abc.abstractmethod
    def sync(self) -> None:
        """Return once the aggregator handled every datagram sent before the call and every
        reply to them has arrived at its endpoint, so that counters and replies reflect them;
        past a deadline it raises, naming what did not come."""

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
        """What each endpoint gets in reply to what was sent so far (one barrier for all)."""
        self.sync()
        return {k: ep.arrived() for k, ep in endpoints.items()}

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
