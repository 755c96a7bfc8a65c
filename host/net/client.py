"""Host transport: stream a job's chunks through an aggregator and collect the sums.

A worker keeps a window of chunks in flight. Chunk sequence number ``seq`` selects slot
``seq mod pool`` and version ``(seq div pool) mod 2``; the window never exceeds the pool,
so a slot version is reused only after every worker has its previous result (SwitchML).
Timeouts retransmit with exponential backoff; results are matched by ``seq``; a worker
that never shows up turns into a :class:`AggregationTimeout` naming it.

Every packet carries the client's ``run`` (one training run of the job, the same id on every
worker), so nothing of an earlier run is counted in this one; replies of another run are
ignored and counted. Every reply carries the aggregator's ``epoch``: when it changes within
a run the aggregator restarted and lost the run's in-flight state, and the client raises
:class:`AggregatorRestarted` rather than wait for contributions that are gone.
"""
from __future__ import annotations

import select
import socket
import time
from dataclasses import dataclass

import numpy as np

from host.net.impair import Impairment
from host.wire import protocol as P
from host.wire.jobs import Job


class AggregatorRestarted(ConnectionError):
    """The aggregator's epoch changed within a run: it restarted and lost in-flight chunks.

    Start a new run (new run id, sequence numbers from 0): it starts on clean slots."""

    def __init__(self, aggregator: tuple[str, int], run: int, old_epoch: int, new_epoch: int):
        super().__init__(f"the aggregator at {aggregator[0]}:{aggregator[1]} restarted during "
                         f"run {run}: its epoch changed from {old_epoch:#010x} to "
                         f"{new_epoch:#010x}, so the run's in-flight chunks are lost; start a "
                         f"new run")
        self.aggregator = aggregator
        self.run = run
        self.old_epoch = old_epoch
        self.new_epoch = new_epoch


class AggregationTimeout(TimeoutError):
    """A chunk did not complete in time; ``missing`` names the workers that never contributed."""

    def __init__(self, msg: str, missing: list[int] | None):
        super().__init__(msg)
        self.missing = missing


@dataclass
class TransportStats:
    sent: int = 0
    retransmitted: int = 0
    received: int = 0
    ignored: int = 0
    other_run: int = 0
    pending: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


class AggregationClient:
    """One worker's connection to an aggregator (software or switch) for one job."""

    DEFAULT_WINDOW = 32
    """Chunks in flight. Larger windows caused retransmission storms on busy hosts (38% of
    packets resent at 128 in Mininet on 2 cores) and overflow BMv2's input queues."""

    def __init__(self, job: Job, worker_id: int, aggregator: tuple[str, int],
                 window: int | None = None, timeout: float = 0.02, max_timeout: float = 0.5,
                 deadline: float = 10.0, impair: Impairment | None = None,
                 sock: socket.socket | None = None, run: int | None = None):
        """``run``: this training run's id, the same on every worker (default: ``THC_RUN`` from
        the environment; :func:`host.collective.allreduce.agree_run` agrees one over a process
        group). It may also be set later through :attr:`run`, before the first chunk."""
        self.job = job
        self.worker_id = worker_id
        self.aggregator = aggregator
        self.window = min(window or self.DEFAULT_WINDOW, job.pool_size)
        self.timeout = timeout
        self.max_timeout = max_timeout
        self.deadline = deadline
        self.impair = impair or Impairment()
        self.stats = TransportStats()
        self.next_seq = 0
        self.epoch: int | None = None
        self._run = P.run_from_env() if run is None else P.check_run(run)
        self.srtt: float | None = None
        self.rttvar = 0.0
        me = job.worker(worker_id)
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
            sock.bind((me.ip, me.port))
        self.sock = sock

    @property
    def run(self) -> int | None:
        return self._run

    @run.setter
    def run(self, run: int) -> None:
        """Start a (new) run: sequence numbers restart at 0 and the epoch is learnt anew."""
        self._run = P.check_run(run)
        self.next_seq = 0
        self.epoch = None

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- public API ------------------------------------------------------------------
    def aggregate(self, packed: np.ndarray, offset_base: int = 0) -> np.ndarray:
        """Sum of all workers' table values for ``packed`` 4-bit indices (lanes/2 bytes a chunk)
        or, in a vote job, the count of +1 votes for ``packed`` sign bits (lanes/8 bytes a
        chunk, :func:`host.codec.packing.pack_bits` with 1 bit).

        Returns one integer per lane (uint16), in order.
        """
        lanes = self.job.lanes
        packed = np.ascontiguousarray(packed, dtype=np.uint8).reshape(-1)
        chunk_bytes = P.payload_bytes(P.PktType.DATA, lanes, aggregation=self.job.aggregation)
        if packed.size % chunk_bytes:
            raise ValueError(f"packed indices ({packed.size} bytes) must be a multiple of one "
                             f"chunk ({chunk_bytes} bytes = {lanes} lanes); pad the index vector")
        chunks = packed.reshape(-1, chunk_bytes)
        out = np.zeros((len(chunks), lanes), dtype=np.uint16)
        self._stream(P.PktType.DATA, chunks, out, offset_base, lanes,
                     P.sum_dtype(self.job.sum_bits))
        return out.reshape(-1)

    def max(self, values: np.ndarray) -> np.ndarray:
        """Element-wise max over all workers of non-negative floats (the preliminary round)."""
        values = np.asarray(values, dtype=np.float32).reshape(-1)
        u = P.floats_to_ordered_u32(values)
        n_chunks = -(-u.size // P.MAX_LANES)
        padded = np.zeros(n_chunks * P.MAX_LANES, dtype=">u4")
        padded[: u.size] = u
        out = np.zeros((n_chunks, P.MAX_LANES), dtype=np.uint32)
        self._stream(P.PktType.MAX, padded.reshape(n_chunks, -1).view(np.uint8).reshape(
            n_chunks, -1), out, 0, P.MAX_LANES, np.dtype(">u4"))
        return P.ordered_u32_to_floats(out.reshape(-1)[: u.size].astype(np.uint32))

    # -- the sliding window ----------------------------------------------------------
    def _send(self, data: bytes) -> None:
        self.stats.sent += 1
        self.stats.bytes_sent += len(data)
        if self.impair.active:
            self.impair.send(self.sock.sendto, data, self.aggregator)
        else:
            self.sock.sendto(data, self.aggregator)

    def _stream(self, pkt_type: int, chunks: np.ndarray, out: np.ndarray, offset_base: int,
                lanes: int, dtype: np.dtype) -> None:
        job, me = self.job, self.worker_id
        total = len(chunks)
        if total == 0:
            return
        run = self._run
        if run is None:
            raise ValueError(f"job {job.job_id}, worker {me}: no run id. Pass "
                             f"AggregationClient(run=...), set {P.RUN_ENV} in the environment "
                             f"(the same on every worker), or agree one over the process group "
                             f"(host.collective.allreduce.agree_run)")
        base = self.next_seq
        pool = job.pool_size
        expect_payload = P.payload_bytes(P.PktType.RESULT if pkt_type == P.PktType.DATA
                                         else P.PktType.MAX_RESULT, lanes, job.sum_bits)
        result_type = P.PktType.RESULT if pkt_type == P.PktType.DATA else P.PktType.MAX_RESULT
        packets: dict[int, bytes] = {}
        due: dict[int, float] = {}
        backoff: dict[int, float] = {}
        started: dict[int, float] = {}
        pending_bitmap: dict[int, int] = {}
        later: dict[int, int] = {}
        done = np.zeros(total, dtype=bool)
        lo = 0
        hi = 0
        buf = bytearray(4096)
        sock = self.sock
        now = time.monotonic()

        pack, unpack = P.HEADER_STRUCT.pack, P.HEADER_STRUCT.unpack_from
        job_id, n_workers, header_bytes = job.job_id, job.n_workers, P.HEADER_BYTES
        pending_type = int(P.PktType.PENDING)
        reply_types = (pending_type, int(P.PktType.RESULT), int(P.PktType.MAX_RESULT))

        def packet(i: int) -> bytes:
            slot, version = P.slot_of(base + i, pool)
            return pack(pkt_type, me, job_id, slot, version, 0, (base + i) % P.SEQ_MOD,
                        (offset_base + i * lanes) % P.SEQ_MOD, 0, run, 0) + chunks[i].tobytes()

        while lo < total:
            while hi < total and hi < lo + self.window:
                packets[hi] = packet(hi)
                self._send(packets[hi])
                now = time.monotonic()
                due[hi], backoff[hi], started[hi] = now + self.rto, self.timeout, now
                hi += 1
            next_due = min(due.values()) if due else now + self.timeout
            wait = max(0.0, next_due - time.monotonic())
            ready, _, _ = select.select([sock], [], [], wait)
            if ready:
                while True:
                    try:
                        nbytes = sock.recv_into(buf, len(buf), socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        break
                    self.stats.received += 1
                    self.stats.bytes_received += nbytes
                    if nbytes < header_bytes:
                        self.stats.ignored += 1
                        continue
                    (r_type, r_worker, r_job, _slot, _version, r_count, r_seq, _offset,
                     r_bitmap, r_run, r_epoch) = unpack(buf)
                    if r_job != job_id or r_worker != me or r_type not in reply_types:
                        self.stats.ignored += 1
                        continue
                    if r_run != run:
                        self.stats.other_run += 1
                        continue
                    if r_epoch != self.epoch:
                        if self.epoch is not None:
                            raise AggregatorRestarted(self.aggregator, run, self.epoch, r_epoch)
                        self.epoch = r_epoch
                    i = (r_seq - base) % P.SEQ_MOD
                    if i >= hi or done[i]:
                        self.stats.ignored += 1
                        continue
                    if r_type == pending_type:
                        self.stats.pending += 1
                        pending_bitmap[i] = r_bitmap
                        continue
                    if (r_type != result_type or nbytes - header_bytes != expect_payload
                            or r_count != n_workers):
                        self.stats.ignored += 1
                        continue
                    out[i] = np.frombuffer(buf, dtype=dtype, count=lanes, offset=header_bytes)
                    done[i] = True
                    if backoff.get(i) == self.timeout:
                        self._sample_rtt(time.monotonic() - started[i])
                    for d in (packets, due, backoff, started, later):
                        d.pop(i, None)
                    while lo < total and done[lo]:
                        lo += 1
                    if i > lo:
                        self._fast_retransmit(i, due, later, packets)
            else:
                self.impair.flush(self.sock.sendto)
            now = time.monotonic()
            if now < next_due:
                continue
            for i, t in list(due.items()):
                if t > now:
                    continue
                if now - started[i] > self.deadline:
                    self._raise_timeout(base, i, pending_bitmap.get(i))
                self.stats.retransmitted += 1
                self._send(packets[i])
                backoff[i] = min(max(backoff[i], self.rto) * 2, self.max_timeout)
                due[i] = now + backoff[i]
        self.next_seq = (base + total) % P.SEQ_MOD

    FAST_RETRANSMIT_AFTER = 3
    """Results of this many later chunks mean an earlier chunk (or its result) was lost."""

    def _fast_retransmit(self, j: int, due: dict, later: dict, packets: dict) -> None:
        """Resend outstanding chunks that later chunks have overtaken (TCP's dupack idea)."""
        now = time.monotonic()
        for i in [i for i in due if i < j]:
            later[i] = later.get(i, 0) + 1
            if later[i] == self.FAST_RETRANSMIT_AFTER:
                self.stats.retransmitted += 1
                self._send(packets[i])
                due[i] = now + self.rto
                later[i] = -4 * self.FAST_RETRANSMIT_AFTER

    @property
    def rto(self) -> float:
        """Retransmission timeout: RFC 6298's estimator, never below the configured timeout."""
        if self.srtt is None:
            return self.timeout
        return min(self.max_timeout, max(self.timeout, self.srtt + 4 * self.rttvar))

    def _sample_rtt(self, rtt: float) -> None:
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt

    def _raise_timeout(self, base: int, i: int, bitmap: int | None):
        job = self.job
        seq = (base + i) % P.SEQ_MOD
        slot, version = P.slot_of(base + i, job.pool_size)
        where = (f"job {job.job_id}, worker {self.worker_id}: chunk seq {seq} (slot {slot}, "
                 f"version {version}) not aggregated within {self.deadline:.1f}s")
        if bitmap is None:
            raise AggregationTimeout(f"{where}; no answer from the aggregator at "
                                     f"{self.aggregator[0]}:{self.aggregator[1]}", None)
        missing = [w for w in range(job.n_workers) if not bitmap >> w & 1]
        got = [w for w in range(job.n_workers) if bitmap >> w & 1]
        raise AggregationTimeout(f"{where}; missing worker(s) {missing} "
                                 f"(contributed: {got})", missing)
