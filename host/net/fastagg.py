"""The compiled aggregator: the reference model's rules with the datapath in C (``_fastagg``).

Python keeps the control plane (job validation, install/remove, counters by name, the
serving thread); the C extension, built by ``pip install`` where a compiler exists, runs the
per-packet work: recvmmsg/sendmmsg batches, the slot logic and the lane sums, without the
GIL: THC and vote jobs, chunks closed short by FLUSH, and one shard of a job's shard map
(``shard``). :mod:`thc.net.aggregator` stays the readable reference; both give the same
reply bytes and counters for the same packets (tests/test_fastagg.py). Where the extension
is missing, :data:`UNAVAILABLE` says why and callers use the Python aggregator.
"""
from __future__ import annotations

import math
import threading

from thc.net.addresses import ipv4_int, ipv4_str
from thc.net.cext import TYPE_CODES, UNAVAILABLE, _fastagg
from thc.net.server import UDPServer
from thc.wire import protocol as P
from thc.wire.jobs import Job

__all__ = ["FastAggregator", "FastEcho", "UNAVAILABLE", "available", "unsupported",
           "AGGREGATIONS"]


def available() -> bool:
    return UNAVAILABLE is None


AGGREGATIONS = frozenset(("thc", "vote"))
"""What the compiled datapath sums: THC table values, or vote counts of sign bits."""


def unsupported(jobs) -> str | None:
    """What of these jobs the compiled datapath does not implement (an aggregation type added
    to protocol.json but not to _fastagg_rules.c); None when it runs them all. The Python
    aggregator runs everything."""
    for job in jobs:
        if job.aggregation not in AGGREGATIONS:
            return f"job {job.job_id}: {job.aggregation} jobs run in the Python datapath only"
    return None


class FastAggregator(UDPServer):
    """Same interface as :class:`thc.net.aggregator.Aggregator` (no impairment injection);
    ``shard``: this aggregator's index in the shard map of the jobs that have one."""

    datapath = "compiled"
    echo = False

    def __init__(self, jobs: list[Job] | tuple[Job, ...] = (), nonce: int | None = None,
                 gso: bool = True, shard: int | None = None, run_idle: float = P.RUN_IDLE_S):
        """``nonce``: the low bits of the epochs of the jobs installed here, as the reference
        aggregator's (thc.net.aggregator.Aggregator). ``gso``: replies to one worker may
        leave as one UDP GSO send (a NIC cuts them into packets; an emulated veth link would
        carry the burst as one packet: turn it off there)."""
        if UNAVAILABLE is not None:
            raise RuntimeError(UNAVAILABLE)
        if (why := unsupported(jobs)) is not None:
            raise RuntimeError(why)
        self.gso = gso
        self.shard = shard
        self._dp = _fastagg.Datapath(
            TYPE_CODES, [int(P.DropReason[r]) for r in _fastagg.REASONS], P.MAX_LANES,
            P.SEQ_RESET, P.RUN_JUMP, float(run_idle), self.echo, gso)
        self._jobs: dict[int, Job] = {}
        self._lock = threading.Lock()
        self.send_errors = 0
        self._last_epoch: dict[int, int] = {}
        """Each job id's last epoch here (the installed job's), kept through a remove: the
        next install differs, as the reference's."""
        for job in jobs:
            self.install(job, nonce)

    # -- control plane -------------------------------------------------------------
    def install(self, job: Job, nonce: int | None = None) -> None:
        """Install or re-install a job: its slots reset, no run, a new epoch (the job's tag
        and ``nonce`` or a fresh random one), as the controller installs a job on a switch."""
        job.validate()
        if (why := unsupported([job])) is not None:
            raise RuntimeError(why)
        n_shards, shard = job.aggregator_shard(self.shard)
        addrs = [(ipv4_int(w.ip), w.port) for w in sorted(job.workers, key=lambda w: w.id)]
        with self._lock:
            epoch = job.new_epoch(self._last_epoch.get(job.job_id), nonce)
            self._dp.install(job.job_id, job.n_workers, job.pool_size, job.lanes, job.sum_bits,
                             list(job.table), addrs, job.aggregation == "vote", n_shards,
                             shard, epoch)
            self._jobs[job.job_id] = job
            self._last_epoch[job.job_id] = epoch

    def remove(self, job_id: int) -> None:
        with self._lock:
            if self._jobs.pop(job_id, None) is None:
                raise KeyError(f"job {job_id} is not installed")
            self._dp.remove(job_id)

    @property
    def jobs(self) -> dict[int, Job]:
        return dict(self._jobs)

    def counters(self) -> dict:
        """Counters of packets, completions, retransmissions and drops per reason."""
        with self._lock:
            ids = list(self._jobs)
            drops, jobs, self.send_errors, self.echoed = self._dp.counters(ids)
        by_reason = dict(zip(_fastagg.REASONS, drops))
        return {"drops": {name: by_reason[name] for name in P.DropReason.__members__},
                "send_errors": self.send_errors,
                "queue_overflow": self.queue_overflow(),
                "epochs": {jid: self._last_epoch[jid] for jid in ids},
                "jobs": {jid: {name: c for name, c in zip(_fastagg.COUNTERS, jobs[jid])}
                         for jid in ids}}

    # -- data plane ----------------------------------------------------------------
    def handle(self, datagram: bytes | memoryview, src: tuple[str, int],
               now: float | None = None) -> list:
        """Process one datagram from ``src`` through the compiled per-packet code; return the
        datagrams to send and where (as :meth:`Aggregator.handle`). ``now``: the time in
        seconds the run rules see (default: the monotonic clock, as the serving loop)."""
        ip = ipv4_int(src[0])
        if ip is None or not 0 <= src[1] <= 0xFFFF:
            raise ValueError(f"the compiled datapath takes IPv4 sources and ports, got {src!r}")
        args = (bytes(datagram), ip, src[1]) + (() if now is None else (float(now),))
        return [(data, (ipv4_str(dip), dport)) for data, dip, dport in self._dp.handle(*args)]

    # -- UDP server ------------------------------------------------------------------
    thread_name = "thc-fastagg"

    def _serve(self, duration: float | None) -> None:
        """The compiled loop, without the GIL."""
        self._dp.serve(self._sock.fileno(), math.inf if duration is None else float(duration))

    def _clear_stop(self) -> None:
        self._dp.clear_stop()

    def _set_stop(self) -> None:
        self._dp.stop()


class FastEcho(FastAggregator):
    """The ceiling of ``thc bench aggregator``: the same compiled loop and batching, but each
    packet of an installed job is answered at once with a result-sized RESULT to its sender;
    nothing is aggregated. ``echoed`` counts the packets answered."""

    datapath = "compiled echo"
    echo = True

    def __init__(self, jobs=(), nonce=None, gso: bool = True):
        self.echoed = 0
        super().__init__(jobs, nonce, gso)
