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

A sharded job (``Job.shards``) spreads its chunks over several aggregators: chunk ``seq`` goes
to shard ``seq mod n_shards``. The window and deadlines are per chunk as before; the epoch,
the round-trip estimate (a co-located shard answers sooner than a remote one) and fast
retransmission (only later chunks of the same shard count as overtaking) are per shard, so a
restarted shard is named by its index and address.

DLCP's bounded loss: with a job ``loss_bound`` > 0, a DATA chunk that would be retransmitted
is closed short instead (a ``FLUSH``: the aggregator freezes the chunk with the workers it
has and sends that RESULT, with its count and bitmap, to every worker), as long as at most
``loss_bound`` of the round's chunks end short. :attr:`AggregationClient.last_counts` and
``last_bitmaps`` say per chunk who was counted. Each DATA packet may carry a priority class
in its IPv4 DSCP (:mod:`host.net.priority`), set per packet with an ``IP_TOS`` control
message (as cheap as a plain ``sendto``).

Two datapaths run the window: this module's Python loop (the readable reference, and the only
one for impairments, bounded loss and DSCP marks) and a compiled one in
:mod:`host.net._fastagg` (recvmmsg/sendmmsg batches without the GIL, the same validation,
retransmission and estimator) for the common case. ``THC_CLIENT_DATAPATH`` (or the
``datapath`` argument) picks ``python``, ``compiled`` or ``auto`` (compiled where built);
:attr:`AggregationClient.last_datapath` says which one ran the last round.
"""
from __future__ import annotations

import math
import os
import select
import socket
import struct
import time
from dataclasses import dataclass

import numpy as np

from host.net import fastagg
from host.net.impair import Impairment
from host.net.priority import FLUSH_CLASS, tos_of
from host.wire import protocol as P
from host.wire.jobs import Job, check_loss_bound


class AggregatorRestarted(ConnectionError):
    """The aggregator's epoch changed within a run: it restarted, or the job was installed
    again, and the run's in-flight chunks are lost.

    Start a new run (new run id, sequence numbers from 0): it starts on clean slots."""

    def __init__(self, aggregator: tuple[str, int], run: int, old_epoch: int, new_epoch: int,
                 shard: int | None = None):
        who = "the aggregator" if shard is None else f"aggregator shard {shard}"
        super().__init__(f"{who} at {aggregator[0]}:{aggregator[1]} restarted or re-installed "
                         f"the job during run {run}: its epoch changed from {old_epoch:#010x} "
                         f"to {new_epoch:#010x}, so the run's in-flight chunks are lost; start "
                         f"a new run")
        self.aggregator = aggregator
        self.shard = shard
        self.run = run
        self.old_epoch = old_epoch
        self.new_epoch = new_epoch


class AggregationTimeout(TimeoutError):
    """A chunk did not complete in time; ``missing`` names the workers that never contributed."""

    def __init__(self, msg: str, missing: list[int] | None):
        super().__init__(msg)
        self.missing = missing


class AggregationRefused(RuntimeError):
    """The aggregator refused a chunk of this run (a REFUSED reply): ``reason`` is the drop
    reason (protocol.json), ``detail`` what the aggregator holds instead (stale_run: the
    job's run; stale: the slot's newer seq; wrong_use: the use's packet type)."""

    HINTS = {
        "stale_run": "the job belongs to another run ({detail}) that is active: a run takes "
                     "an active job over only with an id newer by at most {jump} (the "
                     "default clock id of a later launch), any run once the job has been "
                     "idle for {idle} s; restarted workers need a new run id",
        "stale": "the slot already holds a newer chunk (seq {detail}) of this run: a worker "
                 "of the run is out of step (restarted with the same run id?)",
        "wrong_use": "the chunk's slot is in use by another kind of round or another offset "
                     "(packet type {detail}): the workers of this run are out of step",
        "wrong_slot": "the packet named a slot or version that is not its sequence number's",
        "reused_run": "another incarnation of this worker (nonce {detail:#010x}) already sent "
                      "chunks under this run id: restarted workers need a new run id (a "
                      "launcher must set a fresh THC_RUN at every launch and restart)",
    }

    def __init__(self, where: str, reason: str, detail: int):
        hint = self.HINTS.get(reason, "").format(detail=detail, jump=P.RUN_JUMP,
                                                 idle=P.RUN_IDLE_S)
        super().__init__(f"{where}: refused by the aggregator ({reason}): {hint}")
        self.reason = reason
        self.detail = detail


class RunFailed(RuntimeError):
    """An earlier round of this run failed, so its sequence numbers are spoilt: the slots may
    hold that round's sums or this worker's old contribution, and a retry would be answered
    from them. Start a new run (``client.run = ...``, a newer id, the same on every worker)."""


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
    flushed: int = 0
    """FLUSH packets sent (chunks this worker asked to close short; repeats included)."""
    short: int = 0
    """Chunks that ended with fewer than all workers (whoever closed them)."""
    compiled_rounds: int = 0
    """Rounds (aggregate/max calls) the compiled datapath ran; the others ran in Python."""


DATAPATH_ENV = "THC_CLIENT_DATAPATH"
DATAPATHS = ("auto", "compiled", "python")


def resolve_datapath(choice: str | None = None) -> str:
    """``choice`` (else ``THC_CLIENT_DATAPATH``, else auto) -> "compiled" or "python";
    asking for the compiled one where it is not built is an error that says why."""
    choice = (choice or os.environ.get(DATAPATH_ENV) or "auto").lower()
    if choice not in DATAPATHS:
        raise ValueError(f"client datapath {choice!r} is not one of {', '.join(DATAPATHS)} "
                         f"(argument or {DATAPATH_ENV})")
    if choice == "python" or (choice == "auto" and fastagg.CLIENT_UNAVAILABLE):
        return "python"
    if fastagg.CLIENT_UNAVAILABLE:
        raise ValueError(f"client datapath 'compiled' asked for, but "
                         f"{fastagg.CLIENT_UNAVAILABLE}")
    return "compiled"


GSO_ENV = "THC_CLIENT_GSO"


def resolve_gso(choice: bool | None, job: Job) -> bool:
    """``choice`` (else ``THC_CLIENT_GSO`` = 0/1, else whether the job is sharded)."""
    if choice is not None:
        return bool(choice)
    env = os.environ.get(GSO_ENV)
    if env is None or env == "":
        return bool(job.shards)
    if env not in ("0", "1"):
        raise ValueError(f"{GSO_ENV}={env!r}: use 0 or 1")
    return env == "1"


class AggregationClient:
    """One worker's connection to an aggregator (software or switch) for one job."""

    DEFAULT_WINDOW = 32
    """Chunks in flight. Larger windows caused retransmission storms on busy hosts (38% of
    packets resent at 128 in Mininet on 2 cores) and overflow BMv2's input queues."""

    def __init__(self, job: Job, worker_id: int, aggregator: tuple[str, int] | None = None,
                 window: int | None = None, timeout: float = 0.02, max_timeout: float = 0.5,
                 deadline: float = 10.0, impair: Impairment | None = None,
                 sock: socket.socket | None = None, run: int | None = None,
                 loss_bound: float | None = None, datapath: str | None = None,
                 gso: bool | None = None):
        """``run``: this training run's id, the same on every worker (default: ``THC_RUN`` from
        the environment; :func:`host.collective.allreduce.agree_run` agrees one over a process
        group). It may also be set later through :attr:`run`, before the first chunk.

        ``aggregator``: the switch's or central aggregator's address; leave it out for a
        sharded job, whose shard map (``job.shards``) says where each chunk goes.

        ``loss_bound``: overrides the job's (a fraction of each round's chunks in [0, 1)).

        ``datapath``: "python", "compiled" or "auto" (default: ``THC_CLIENT_DATAPATH``, else
        auto); the compiled one runs rounds without impairment, loss bound or DSCP marks.

        ``gso``: the compiled datapath sends a batch's DATA to one aggregator as one UDP GSO
        send and takes replies in by UDP GRO, as TCP does with its segments (default:
        ``THC_CLIENT_GSO`` = 0/1, else on for a sharded job, whose aggregators are hosts, and
        off where a switch may be next: a software switch on veths would see a burst as one
        frame)."""
        self.job = job
        self.worker_id = worker_id
        if job.shards:
            if aggregator is not None:
                raise ValueError(f"job {job.job_id} is sharded over {job.n_shards} aggregators "
                                 f"(its shard map names them); pass no aggregator address")
            self.aggregators = [(s.ip, s.port) for s in job.shards]
        elif aggregator is None:
            raise ValueError(f"job {job.job_id} has no shard map: pass the aggregator's address")
        else:
            self.aggregators = [tuple(aggregator)]
        self.aggregator = self.aggregators[0]
        """The aggregator (the first shard's address for a sharded job)."""
        self.epochs: list[int | None] = [None] * len(self.aggregators)
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be a positive number of chunks, got {window!r}")
        self.window = min(window or self.DEFAULT_WINDOW, job.pool_size)
        self.timeout = timeout
        self.max_timeout = max_timeout
        self.deadline = deadline
        self.loss_bound = check_loss_bound(job.loss_bound if loss_bound is None else loss_bound,
                                           f"job {job.job_id}: ")
        self.last_counts = np.zeros(0, dtype=np.uint8)
        self.last_bitmaps = np.zeros(0, dtype=np.uint32)
        self.impair = impair or Impairment()
        self.stats = TransportStats()
        self.datapath = resolve_datapath(datapath)
        """The datapath rounds run in where they can ("compiled" or "python")."""
        self.gso = resolve_gso(gso, job)
        """Whether compiled rounds batch datagrams by UDP GSO/GRO."""
        self.last_datapath: str | None = None
        """The datapath that ran the last round."""
        self.next_seq = 0
        self.incarnation = P.new_epoch()
        """This client's nonce, sent in the epoch field of every packet: the aggregator
        refuses a second incarnation of a worker under one run id (``reused_run``)."""
        self._run = P.run_from_env() if run is None else P.check_run(run)
        self._failed: str | None = None
        """Why a round of this run failed (then the run takes no more rounds)."""
        self._srtt: list[float | None] = [None] * len(self.aggregators)
        self._rttvar = [0.0] * len(self.aggregators)
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
        """Start a new run: sequence numbers restart at 0 and the epoch is learnt anew. The id
        must be newer (serial order) than the current one: under the same id the slots
        would answer the new run's seq 0 from the old run's uses."""
        run = P.check_run(run)
        if self._run is not None and not P.seq_newer(run, self._run):
            raise ValueError(f"run {run} is not newer than this client's run {self._run}: "
                             f"a new run needs a newer id (the same on every worker)")
        self._run = run
        self.next_seq = 0
        self.epochs = [None] * len(self.aggregators)
        self._failed = None

    @property
    def epoch(self) -> int | None:
        """The epoch of the (first) aggregator learnt in this run; per shard: :attr:`epochs`."""
        return self.epochs[0]

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- public API ------------------------------------------------------------------
    def aggregate(self, packed: np.ndarray, offset_base: int = 0,
                  classes: np.ndarray | None = None) -> np.ndarray:
        """Sum of all workers' table values for ``packed`` 4-bit indices (lanes/2 bytes a chunk)
        or, in a vote job, the count of +1 votes for ``packed`` sign bits (lanes/8 bytes a
        chunk, :func:`host.codec.packing.pack_bits` with 1 bit).

        Returns one integer per lane (uint16), in order. ``classes``: a priority class per
        chunk (:func:`host.net.priority.priority_class`), marked in DSCP; None sends best
        effort. A chunk closed short sums only the workers in ``last_bitmaps`` (its count in
        ``last_counts``; all zero when nobody's packet arrived).
        """
        lanes = self.job.lanes
        packed = np.ascontiguousarray(packed, dtype=np.uint8).reshape(-1)
        chunk_bytes = P.payload_bytes(P.PktType.DATA, lanes, aggregation=self.job.aggregation)
        if packed.size % chunk_bytes:
            raise ValueError(f"packed indices ({packed.size} bytes) must be a multiple of one "
                             f"chunk ({chunk_bytes} bytes = {lanes} lanes); pad the index vector")
        chunks = packed.reshape(-1, chunk_bytes)
        out = np.zeros((len(chunks), lanes), dtype=np.uint16)
        tos = None
        if classes is not None:
            classes = np.asarray(classes).reshape(-1)
            if classes.size != len(chunks):
                raise ValueError(f"{classes.size} priority classes for {len(chunks)} chunks")
            tos = [tos_of(c) for c in classes]
        self._stream(P.PktType.DATA, chunks, out, offset_base, lanes,
                     P.sum_dtype(self.job.sum_bits), tos)
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
    _TOS_CMSG: dict[int, list] = {}

    def _send(self, data: bytes, dst: tuple[str, int], tos: int = 0) -> None:
        self.stats.sent += 1
        self.stats.bytes_sent += len(data)
        if tos:
            cmsg = self._TOS_CMSG.get(tos)
            if cmsg is None:
                cmsg = self._TOS_CMSG[tos] = [(socket.IPPROTO_IP, socket.IP_TOS,
                                               struct.pack("i", tos))]
            send = lambda d, a: self.sock.sendmsg([d], cmsg, 0, a)  # noqa: E731
        else:
            send = self.sock.sendto
        if self.impair.active:
            self.impair.send(send, data, dst)
        else:
            send(data, dst)

    def _stream(self, pkt_type: int, chunks: np.ndarray, out: np.ndarray, offset_base: int,
                lanes: int, dtype: np.dtype, tos: list[int] | None = None) -> None:
        """One round; a round that fails leaves the run unusable (:class:`RunFailed`)."""
        job, me = self.job, self.worker_id
        if len(chunks) == 0:
            return
        if self._run is None:
            raise ValueError(f"job {job.job_id}, worker {me}: no run id. Pass "
                             f"AggregationClient(run=...), set {P.RUN_ENV} in the environment "
                             f"(the same on every worker), or agree one over the process group "
                             f"(host.collective.allreduce.agree_run)")
        if self._failed is not None:
            raise RunFailed(f"job {job.job_id}, worker {me}: run {self._run} failed in an "
                            f"earlier round ({self._failed}); a retry under the same run "
                            f"would be answered from that round's slots. Start a new run "
                            f"(client.run = a newer id, the same on every worker)")
        try:
            self._stream_round(pkt_type, chunks, out, offset_base, lanes, dtype, tos)
        except BaseException as e:
            self._failed = f"{type(e).__name__}: {e}"
            raise

    def _stream_round(self, pkt_type: int, chunks: np.ndarray, out: np.ndarray,
                      offset_base: int, lanes: int, dtype: np.dtype,
                      tos: list[int] | None) -> None:
        job, me = self.job, self.worker_id
        total = len(chunks)
        run = self._run
        base = self.next_seq
        pool = job.pool_size
        aggs, epochs, n_shards = self.aggregators, self.epochs, len(self.aggregators)
        expect_payload = P.payload_bytes(P.PktType.RESULT if pkt_type == P.PktType.DATA
                                         else P.PktType.MAX_RESULT, lanes, job.sum_bits)
        result_type = P.PktType.RESULT if pkt_type == P.PktType.DATA else P.PktType.MAX_RESULT
        packets: dict[int, bytes] = {}
        due: dict[int, float] = {}
        backoff: dict[int, float] = {}
        started: dict[int, float] = {}
        resent: set[int] = set()    # retransmitted chunks: no RTT sample (Karn)
        overtaken: set[int] = set()  # a lost packet, not a missing worker: no backoff
        pending_bitmap: dict[int, int] = {}
        later: dict[int, int] = {}
        done = np.zeros(total, dtype=bool)
        counts = np.full(total, job.n_workers, dtype=np.uint8)
        bitmaps = np.full(total, job.full_bitmap, dtype=np.uint32)
        bounded = pkt_type == P.PktType.DATA and self.loss_bound > 0
        if (self.datapath == "compiled" and not bounded and tos is None
                and not self.impair.active and self._compiled_fits(chunks)):
            self._stream_compiled(pkt_type, result_type, chunks, out, offset_base, lanes,
                                  expect_payload, base, run, counts, bitmaps)
            return
        self.last_datapath = "python"
        budget = math.floor(self.loss_bound * total) if bounded else 0
        short: set[int] = set()     # chunks flushed by this worker or ended short
        flush_type, flush_tos = int(P.PktType.FLUSH), tos_of(FLUSH_CLASS) if tos else 0
        lo = 0
        hi = 0
        buf = bytearray(4096)
        sock = self.sock
        jitter = self.impair.jitter
        now = time.monotonic()
        last_reply = now

        pack, unpack = P.HEADER_STRUCT.pack, P.HEADER_STRUCT.unpack_from
        job_id, n_workers, header_bytes = job.job_id, job.n_workers, P.HEADER_BYTES
        pending_type, refused_type = int(P.PktType.PENDING), int(P.PktType.REFUSED)
        reply_types = (pending_type, refused_type, int(P.PktType.RESULT),
                       int(P.PktType.MAX_RESULT))
        full, top, incarnation = job.full_bitmap, job.granularity, self.incarnation
        is_data = pkt_type == P.PktType.DATA

        def packet(i: int) -> bytes:
            slot, version = P.slot_of(base + i, pool)
            return pack(pkt_type, me, job_id, slot, version, 0, (base + i) % P.SEQ_MOD,
                        (offset_base + i * lanes) % P.SEQ_MOD, 0, run,
                        incarnation) + chunks[i].tobytes()

        def shard_of(i: int) -> int:
            return ((base + i) % P.SEQ_MOD) % n_shards

        def dst(i: int) -> tuple[str, int]:
            return aggs[shard_of(i)]

        def resend(i: int, may_flush: bool = True) -> None:
            """Retransmit chunk i, or close it short while the loss bound allows. Only a
            timeout closes a chunk: overtaken chunks (fast retransmit) may merely sit in a
            lower class's queue, and a duplicate DATA costs nothing."""
            resent.add(i)
            if pending_bitmap.get(i, 0) >> 32:
                # held: a FLUSH could only open the use closed and empty; the DATA waits in
                # the same place and counts once the previous use is acknowledged
                self.stats.retransmitted += 1
                self._send(packet(i), dst(i), tos[i] if tos else 0)
            elif bounded and (i in short or (may_flush and len(short) < budget)):
                if i not in short:
                    short.add(i)
                    slot, version = P.slot_of(base + i, pool)
                    packets[i] = pack(flush_type, me, job_id, slot, version, 0,
                                      (base + i) % P.SEQ_MOD,
                                      (offset_base + i * lanes) % P.SEQ_MOD, 0, run,
                                      incarnation)
                self.stats.flushed += 1
                self._send(packets[i], dst(i), flush_tos)
            else:
                self.stats.retransmitted += 1
                self._send(packets[i], dst(i), tos[i] if tos else 0)

        while lo < total:
            while hi < total and hi < lo + self.window:
                packets[hi] = packet(hi)
                self._send(packets[hi], dst(hi), tos[hi] if tos else 0)
                now = time.monotonic()
                due[hi], backoff[hi], started[hi] = now + self.rto(shard_of(hi)), self.timeout, now
                hi += 1
            next_due = min(due.values()) if due else now + self.timeout
            wait = max(0.0, next_due - time.monotonic())
            if jitter:
                release = self.impair.next_release()
                if release is not None:
                    wait = min(wait, release)
            ready, _, _ = select.select([sock], [], [], wait)
            if jitter:
                self.impair.release_due()
            if ready:
                while True:
                    try:
                        nbytes, src = sock.recvfrom_into(buf, len(buf), socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        break
                    self.stats.received += 1
                    self.stats.bytes_received += nbytes
                    if nbytes < header_bytes:
                        self.stats.ignored += 1
                        continue
                    (r_type, r_worker, r_job, r_slot, r_version, r_count, r_seq, r_offset,
                     r_bitmap, r_run, r_epoch) = unpack(buf)
                    shard = r_seq % n_shards
                    if (r_job != job_id or r_worker != me or r_type not in reply_types
                            or src != aggs[shard]):
                        self.stats.ignored += 1
                        continue
                    if r_run != run:
                        self.stats.other_run += 1
                        continue
                    i = (r_seq - base) % P.SEQ_MOD
                    if (i >= hi or done[i] or (r_slot, r_version) != P.slot_of(r_seq, pool)
                            or r_offset != (offset_base + i * lanes) % P.SEQ_MOD):
                        self.stats.ignored += 1
                        continue
                    last_reply = time.monotonic()
                    if r_epoch != epochs[shard]:
                        if epochs[shard] is not None:
                            raise AggregatorRestarted(aggs[shard], run, epochs[shard], r_epoch,
                                                      shard if n_shards > 1 else None)
                        epochs[shard] = r_epoch
                    if r_type == refused_type:
                        self._raise_refused(base, i, r_count, r_bitmap)
                    if r_type == pending_type:
                        self.stats.pending += 1
                        # bit 32: held (count 0): the bitmap names who holds the previous
                        # use's result, and a FLUSH could only close the chunk empty
                        pending_bitmap[i] = r_bitmap & full | (r_count == 0) << 32
                        continue
                    if (r_type != result_type or nbytes - header_bytes != expect_payload
                            or r_bitmap & ~full or bin(r_bitmap).count("1") != r_count
                            or (r_count < n_workers and not is_data)):
                        self.stats.ignored += 1
                        continue
                    sums = np.frombuffer(buf, dtype=dtype, count=lanes, offset=header_bytes)
                    if (sums.max() > r_count * top if is_data else
                            (sums < chunks[i].view(">u4")).any()):
                        # more than the contributors can sum to, or a max below our own
                        self.stats.ignored += 1
                        continue
                    if r_count != n_workers:
                        # closed short (FLUSH): count and bitmap say who was counted
                        self.stats.short += 1
                        short.add(i)
                        counts[i], bitmaps[i] = r_count, r_bitmap
                    out[i] = sums
                    done[i] = True
                    if i not in resent:
                        self._sample_rtt(shard, time.monotonic() - started[i])
                    resent.discard(i)
                    overtaken.discard(i)
                    for d in (packets, due, backoff, started, later):
                        d.pop(i, None)
                    if i == lo:
                        while lo < total and done[lo]:
                            lo += 1
                        if lo < hi and tos is None:
                            # the new head: the whole window waits for it
                            rto = self.rto(shard_of(lo))
                            backoff[lo] = min(backoff[lo], rto)
                            due[lo] = min(due[lo], time.monotonic() + rto)
                    if i > lo:
                        self._fast_retransmit(i, due, backoff, later, overtaken, resend,
                                              shard_of, tos)
            else:
                self.impair.flush(self.sock.sendto)
            now = time.monotonic()
            if now < next_due:
                continue
            for i, t in list(due.items()):
                if t > now:
                    continue
                if now - started[i] > self.deadline:
                    self._raise_timeout(base, i, pending_bitmap.get(i), now - last_reply)
                resend(i)
                rto = self.rto(shard_of(i))
                # exponential backoff, capped at FAST_BACKOFF_CAP RTOs for the window's head
                # (every chunk behind it waits for it; with priority classes it may merely
                # wait in a lower class's queue, and keeps the full backoff), for a chunk
                # that later ones overtook FAST_RETRANSMIT_AFTER times (a lost packet) and for
                # a held chunk (it can go on the moment the straggler moves on): a cap, not
                # none, or a head waiting for a straggler and a merely reordered chunk would
                # resend every RTO
                cap = (self.FAST_BACKOFF_CAP * rto if i in overtaken or (i == lo and tos is None)
                       or pending_bitmap.get(i, 0) >> 32 else self.max_timeout)
                backoff[i] = min(max(backoff[i], rto) * 2, cap, self.max_timeout)
                due[i] = now + backoff[i]
        self.next_seq = (base + total) % P.SEQ_MOD
        if pkt_type == P.PktType.DATA:
            self.last_counts, self.last_bitmaps = counts, bitmaps

    def _compiled_fits(self, chunks: np.ndarray) -> bool:
        """Whether the compiled loop can carry this round: IPv4 literal addresses, a datagram
        it has room for, an IPv4 socket."""
        return (self.sock.family == socket.AF_INET
                and all(fastagg.ipv4_int(ip) is not None for ip, _ in self.aggregators)
                and P.HEADER_BYTES + chunks.shape[1] <= fastagg.CLIENT_MAX_DATAGRAM)

    def _stream_compiled(self, pkt_type, result_type, chunks, out, offset_base, lanes,
                         expect_payload, base, run, counts, bitmaps) -> None:
        """The same window in C (``_fastagg.stream``); its events become this module's
        exceptions, its counters this client's stats."""
        job = self.job
        other = P.PktType.MAX_RESULT if result_type == P.PktType.RESULT else P.PktType.RESULT
        header = (int(pkt_type), int(result_type), int(P.PktType.PENDING), int(other),
                  int(pkt_type == P.PktType.DATA), self.worker_id, job.job_id, job.pool_size,
                  run, base, offset_base % P.SEQ_MOD, lanes, job.n_workers,
                  int(P.PktType.REFUSED), job.granularity, self.incarnation)
        aggs = [(fastagg.ipv4_int(ip), port) for ip, port in self.aggregators]
        chunks = np.ascontiguousarray(chunks, dtype=np.uint8)
        self.last_datapath = "compiled"
        self.stats.compiled_rounds += 1
        event, info, st, srtt, rttvar = fastagg.stream(
            self.sock.fileno(), header, chunks, chunks.shape[1], aggs, self.epochs,
            self.window, (self.timeout, self.max_timeout, self.deadline), list(self._srtt),
            list(self._rttvar), out, out.itemsize, expect_payload, counts, bitmaps, self.gso)
        s = self.stats
        (sent, retransmitted, received, ignored, other_run, pending, bytes_sent,
         bytes_received, short) = st
        s.sent += sent
        s.retransmitted += retransmitted
        s.received += received
        s.ignored += ignored
        s.other_run += other_run
        s.pending += pending
        s.bytes_sent += bytes_sent
        s.bytes_received += bytes_received
        s.short += short
        self._srtt, self._rttvar = srtt, rttvar
        if event == fastagg.STREAM_RESTARTED:
            shard, old, new = info
            raise AggregatorRestarted(self.aggregators[shard], run, old, new,
                                      shard if len(self.aggregators) > 1 else None)
        if event == fastagg.STREAM_TIMEOUT:
            i, bitmap, silent = info
            self._raise_timeout(base, i, bitmap, silent)
        if event == fastagg.STREAM_OSERROR:
            raise OSError(info, os.strerror(info))
        if event == fastagg.STREAM_REFUSED:
            self._raise_refused(base, *info)
        self.next_seq = (base + len(chunks)) % P.SEQ_MOD
        if pkt_type == P.PktType.DATA:
            self.last_counts, self.last_bitmaps = counts, bitmaps

    FAST_RETRANSMIT_AFTER = 3
    """Results of this many later chunks mean an earlier chunk (or its result) was lost."""

    FAST_BACKOFF_CAP = 4
    """RTOs: the backoff cap of the window's head and of chunks found lost."""

    def _fast_retransmit(self, j: int, due: dict, backoff: dict, later: dict,
                         overtaken: set, resend, shard_of, tos: list[int] | None) -> None:
        """Chunk ``j`` overtook outstanding chunks of the same shard (chunks of different
        shards complete in no particular order): every worker's chunks get through, so these
        or their results were lost. Resend them after a few such overtakes (TCP's dupack
        idea), and from then on with a backoff capped at FAST_BACKOFF_CAP RTOs: the backoff
        a chunk built up while the others' contributions were late must not delay
        recovering its lost result
        (20% loss on every link held lost RESULTs for max_timeout, the windows of all
        workers stalled behind them, and chunks passed the deadline). Only a chunk of the
        same priority class is such evidence: a lower class may merely wait in its queue."""
        now = time.monotonic()
        shard = shard_of(j)
        rto = self.rto(shard)
        for i in [i for i in due if i < j and shard_of(i) == shard]:
            later[i] = later.get(i, 0) + 1
            if later[i] == self.FAST_RETRANSMIT_AFTER:
                resend(i, may_flush=False)
                due[i] = now + rto
                later[i] = -4 * self.FAST_RETRANSMIT_AFTER
                if tos is None or tos[i] == tos[j]:
                    overtaken.add(i)
                    backoff[i] = rto

    def rto(self, shard: int = 0) -> float:
        """Retransmission timeout towards ``shard``: RFC 6298's estimator, never below the
        configured timeout."""
        srtt = self._srtt[shard]
        if srtt is None:
            return self.timeout
        return min(self.max_timeout, max(self.timeout, srtt + 4 * self._rttvar[shard]))

    def _sample_rtt(self, shard: int, rtt: float) -> None:
        srtt = self._srtt[shard]
        if srtt is None:
            self._srtt[shard], self._rttvar[shard] = rtt, rtt / 2
        else:
            self._rttvar[shard] = 0.75 * self._rttvar[shard] + 0.25 * abs(srtt - rtt)
            self._srtt[shard] = 0.875 * srtt + 0.125 * rtt

    def _where(self, base: int, i: int) -> str:
        seq = (base + i) % P.SEQ_MOD
        slot, version = P.slot_of(base + i, self.job.pool_size)
        return (f"job {self.job.job_id}, worker {self.worker_id}, run {self._run}: chunk seq "
                f"{seq} (slot {slot}, version {version})")

    def _raise_refused(self, base: int, i: int, code: int, detail: int):
        try:
            reason = P.DropReason(code).name
        except ValueError:
            reason = f"reason {code}"
        raise AggregationRefused(self._where(base, i), reason, detail)

    def _raise_timeout(self, base: int, i: int, bitmap: int | None, silent: float = 0.0):
        """``silent``: seconds since the aggregator last answered anything of this run. A
        live aggregator answers every retransmission of a chunk it holds (PENDING), and they
        come at least every ``max_timeout``; silent for two of those (and half the deadline),
        the cause is the aggregator (gone, unreachable, or restarted without a program yet),
        not a missing worker: an old PENDING's bitmap would name workers that are fine."""
        job = self.job
        seq = (base + i) % P.SEQ_MOD
        slot, version = P.slot_of(base + i, job.pool_size)
        where = (f"job {job.job_id}, worker {self.worker_id}: chunk seq {seq} (slot {slot}, "
                 f"version {version}) not aggregated within {self.deadline:.1f}s")
        shard = job.shard_of(seq)
        ip, port = self.aggregators[shard]
        who = f"aggregator shard {shard}" if job.shards else "the aggregator"
        if bitmap is None:
            raise AggregationTimeout(f"{where}; no answer from {who} at {ip}:{port}", None)
        if silent >= max(self.deadline / 2, 2 * self.max_timeout):
            raise AggregationTimeout(f"{where}; {who} at {ip}:{port} stopped answering "
                                     f"{silent:.1f}s ago (down, unreachable, or restarted and "
                                     f"not yet serving this job): start a new run once it is "
                                     f"back", None)
        held, bitmap = bitmap >> 32, bitmap & 0xFFFFFFFF
        missing = [w for w in range(job.n_workers) if not bitmap >> w & 1]
        got = [w for w in range(job.n_workers) if bitmap >> w & 1]
        if held:
            raise AggregationTimeout(
                f"{where}; held: worker(s) {missing} have not moved past the previous use of "
                f"its slot version, so they may still need its result (straggling or gone; "
                f"moved past it: {got})", missing)
        raise AggregationTimeout(f"{where}; missing worker(s) {missing} "
                                 f"(contributed: {got})", missing)
