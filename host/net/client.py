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
``loss_bound`` of the round's chunks end short, and only at an aggregator heard in an
earlier round of the run (one first heard in this round may have restarted after serving
the peers this chunk's result). The :class:`AggregationResult` of
:meth:`AggregationClient.reduce` says per chunk who was counted. Each DATA packet may carry a
priority class in its IPv4 DSCP (:mod:`thc.net.priority`; IPv6's traffic class), set per packet
with an ``IP_TOS`` (``IPV6_TCLASS``) control message (as cheap as a plain ``sendto``).

This module holds the run and its failure policy; two windows run a round's chunks, both
behind host/net/window.py's interface: the Python loop of host/net/pywindow.py (the
readable reference, and the only one for impairments) and the compiled one of
host/net/fastclient.py (recvmmsg/sendmmsg batches without the GIL, the same validation,
retransmission, estimator, bounded loss and DSCP marks) for every other round.
``THC_CLIENT_DATAPATH`` (or the ``datapath`` argument) picks ``python``, ``compiled`` or
``auto`` (compiled where built); each round's :class:`AggregationResult` says which one ran
it.
"""
from __future__ import annotations

import errno
import math
import numbers
import select
import socket
import threading
import time

import numpy as np

from thc.codec.common import as_float32
from thc.codec.settings import DATAPATHS, ENV, Settings, current
from thc.net import fastclient
from thc.net.addresses import peer_address
from thc.net.fastclient import CompiledWindow
from thc.net.impair import Impairment
from thc.net.outcomes import (AggregationRefused, AggregationResult, AggregationTimeout,
                               AggregatorRestarted, ClientClosed, RunFailed, TransportStats)
from thc.net.priority import N_CLASSES, tos_of
from thc.net.pywindow import PythonWindow
from thc.net.window import DEFAULT_MAX_TIMEOUT, DEFAULT_TIMEOUT, RttEstimator, Round
from thc.wire import protocol as P
from thc.wire.jobs import Job, check_loss_bound

__all__ = ["AggregationClient", "AggregationResult", "AggregatorRestarted",
           "AggregationTimeout", "AggregationRefused", "RunFailed", "TransportStats",
           "resolve_datapath", "resolve_gso", "DATAPATH_ENV", "GSO_ENV"]

DATAPATH_ENV = ENV["client_datapath"]
GSO_ENV = ENV["client_gso"]


def resolve_datapath(choice: str | None = None, settings: Settings | None = None) -> str:
    """``choice`` (else the settings', else the process's) -> "compiled"
    or "python"; asking for the compiled one where it is not built is an error that says
    why."""
    if choice is None:
        choice = (settings or current()).client_datapath
    choice = choice.lower()
    if choice not in DATAPATHS:
        raise ValueError(f"client datapath {choice!r} is not one of {', '.join(DATAPATHS)} "
                         f"(argument or {DATAPATH_ENV})")
    if choice == "python" or (choice == "auto" and fastclient.CLIENT_UNAVAILABLE):
        return "python"
    if fastclient.CLIENT_UNAVAILABLE:
        raise ValueError(f"client datapath 'compiled' asked for, but "
                         f"{fastclient.CLIENT_UNAVAILABLE}")
    return "compiled"


def resolve_gso(choice: bool | None, job: Job, settings: Settings | None = None) -> bool:
    """``choice`` (else the settings', else the process's; where none says: whether the job
    is sharded)."""
    if choice is not None:
        return bool(choice)
    gso = (settings or current()).client_gso
    return bool(job.shards) if gso is None else gso


class AggregationClient:
    """One worker's connection to an aggregator (software or switch) for one job."""

    DEFAULT_WINDOW = 32
    """Chunks in flight. Larger windows caused retransmission storms on busy hosts (38% of
    packets resent at 128 in Mininet on 2 cores) and overflow BMv2's input queues."""

    DRAIN_SHARE = 0.05
    """The share of the deadline a round may spend dropping what was queued before it: a
    flood to the worker's port must not hold the round off (the rest is left to the
    window's checks)."""

    def __init__(self, job: Job, worker_id: int, aggregator: tuple[str, int] | None = None,
                 window: int | None = None, timeout: float = DEFAULT_TIMEOUT,
                 max_timeout: float = DEFAULT_MAX_TIMEOUT,
                 deadline: float = 10.0, impair: Impairment | None = None,
                 sock: socket.socket | None = None, run: int | None = None,
                 loss_bound: float | None = None, datapath: str | None = None,
                 gso: bool | None = None, settings: Settings | None = None):
        """``run``: this training run's id, the same on every worker (default: ``THC_RUN`` from
        the environment; :func:`thc.collective.worker.agree_run` agrees one over a process
        group). It may also be set later through :attr:`run`, before the first chunk.

        ``aggregator``: the switch's or central aggregator's address; leave it out for a
        sharded job, whose shard map (``job.shards``) says where each chunk goes.

        ``loss_bound``: overrides the job's (a fraction of each round's chunks in [0, 1)).

        ``datapath``: "python", "compiled" or "auto" (default: ``THC_CLIENT_DATAPATH``, else
        auto); the compiled one runs every round but an impaired one (host/net/impair.py).

        ``gso``: the compiled datapath sends a batch's DATA to one aggregator as one UDP GSO
        send and takes replies in by UDP GRO, as TCP does with its segments (default:
        ``THC_CLIENT_GSO`` = 0/1, else on for a sharded job, whose aggregators are hosts, and
        off where a switch may be next: a software switch on veths would see a burst as one
        frame).

        ``settings``: where ``datapath`` and ``gso`` are not given (default: the process's,
        :func:`thc.codec.settings.current`: those a command installed, else the
        environment's)."""
        self.job = job.validate()   # a Job built by hand too (pool 0: a window of nothing)
        self.worker_id = worker_id
        self.aggregators = _aggregators(job, aggregator, sock)
        self.aggregator = self.aggregators[0]
        """The aggregator (the first shard's address for a sharded job)."""
        self.epochs: list[int | None] = [None] * len(self.aggregators)
        self.window = self.DEFAULT_WINDOW if window is None else window
        _check_timeouts(timeout, max_timeout, deadline)
        self.rtt = RttEstimator(len(self.aggregators), timeout, max_timeout)
        """The round-trip estimate per shard, kept across rounds; it holds the timers."""
        self.deadline = deadline
        self.loss_bound = check_loss_bound(job.loss_bound if loss_bound is None else loss_bound,
                                           f"job {job.job_id}: ")
        self.impair = impair or Impairment()
        self.stats = TransportStats()
        settings = settings or current()
        self.datapath = resolve_datapath(datapath, settings)
        """The datapath rounds run in where they can ("compiled" or "python")."""
        self.gso = resolve_gso(gso, job, settings)
        """Whether compiled rounds batch datagrams by UDP GSO/GRO."""
        self.next_seq = 0
        self.incarnation = P.new_epoch()
        """This client's nonce, sent in the epoch field of every packet: the aggregator
        refuses a second incarnation of a worker under one run id (``reused_run``)."""
        self._run = P.run_from_env() if run is None else P.check_run(run)
        self.run_settled = run is not None
        """Whether the run id is settled: given (``run=``, or set since) or agreed over the
        process group; one read from ``THC_RUN`` alone is not. A transport agrees one over
        its group where it is not."""
        self._failed: str | None = None
        """Why a round of this run failed (then the run takes no more rounds)."""
        self.round_lock = threading.RLock()
        """Held by the round in flight, by a change of run, and by a reducer from its round's
        first exchange to its last (:func:`thc.collective.transports.round_lock`): another
        thread's call meanwhile is refused, as it would take sequence numbers between them,
        which its peers may give the reducer's sums."""
        self._windows = [CompiledWindow(), PythonWindow()] if self.datapath == "compiled" \
            else [PythonWindow()]
        try:
            me = job.worker(worker_id)
        except KeyError:
            raise ValueError(f"job {job.job_id} has no worker {worker_id!r} (its workers: "
                             f"{sorted(w.id for w in job.workers)})") from None
        self.sock = _socket(job, worker_id, me, sock)

    @property
    def timeout(self) -> float:
        """The least retransmission timeout, and the least margin over a round trip; it may
        be set after the client was made (checked when a round starts), and both windows
        and :meth:`rto` take it from there."""
        return self.rtt.timeout

    @timeout.setter
    def timeout(self, timeout: float) -> None:
        self.rtt.timeout = timeout

    @property
    def max_timeout(self) -> float:
        """The longest retransmission timeout (set as :attr:`timeout` is)."""
        return self.rtt.max_timeout

    @max_timeout.setter
    def max_timeout(self, max_timeout: float) -> None:
        self.rtt.max_timeout = max_timeout

    @property
    def window(self) -> int:
        """Chunks in flight, at most the job's pool (the aggregator acknowledges a slot
        version's use by the next one's); checked whenever it is set."""
        return self._window

    @window.setter
    def window(self, window: int) -> None:
        if not isinstance(window, numbers.Integral) or isinstance(window, bool) or window < 1:
            raise ValueError(f"window must be a positive number of chunks, got {window!r}")
        self._window = min(int(window), self.job.pool_size)

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
        if not self.round_lock.acquire(blocking=False):   # its end would write the old seq
            raise RuntimeError(f"job {self.job.job_id}, worker {self.worker_id}: a round is "
                               f"in flight on this client (another thread's); start run {run} "
                               f"after it ends")
        try:
            self._run = run
            self.run_settled = True
            self.next_seq = 0
            self.epochs = [None] * len(self.aggregators)
            self._failed = None
        finally:
            self.round_lock.release()

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
    def fail_run(self, why: str) -> None:
        """This worker left a round its peers send (it failed between their agreement and
        its send): its next round would take the sequence numbers whose slots hold their
        sums, and one of unchecked offsets (a vote's) would add into them. The run takes no
        more rounds (:class:`RunFailed`, naming ``why``); the first reason is kept."""
        if self._failed is None:
            self._failed = why

    def reduce(self, packed: np.ndarray, offset_base: int = 0,
               classes: np.ndarray | None = None) -> AggregationResult:
        """Sum of all workers' table values for ``packed`` 4-bit indices (lanes/2 bytes a chunk)
        or, in a vote job, the count of +1 votes for ``packed`` sign bits (lanes/8 bytes a
        chunk, :func:`thc.codec.packing.pack_bits` with 1 bit).

        The result's sums: one integer per lane (uint16), in order. ``classes``: a priority
        class per chunk (:func:`thc.net.priority.priority_class`), marked in DSCP; None sends
        best effort. A chunk closed short sums only the workers in the result's bitmaps (its
        count in its counts; all zero when nobody's packet arrived).
        """
        lanes = self.job.lanes
        packed = np.asarray(packed)
        if packed.dtype != np.uint8:
            raise TypeError(f"packed indices must be bytes (uint8), got {packed.dtype}: a "
                            f"wider value would be cut to its low byte")
        packed = np.ascontiguousarray(packed).reshape(-1)
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
            bad = sorted({c for c in classes.tolist() if c not in range(N_CLASSES)})
            if bad:
                raise ValueError(f"priority classes are 0..{N_CLASSES - 1}, got {bad[:4]}")
            tos = [tos_of(c) for c in classes]
        r = self._stream(P.PktType.DATA, chunks, out, offset_base, lanes,
                         P.sum_dtype(self.job.sum_bits), tos)
        r.sums = out.reshape(-1)
        return r

    def aggregate(self, packed: np.ndarray, offset_base: int = 0,
                  classes: np.ndarray | None = None) -> np.ndarray:
        """The sums of :meth:`reduce` alone, where every chunk counted every worker: a chunk
        closed short (loss bound) raises, as its sums mean nothing without its count."""
        r = self.reduce(packed, offset_base, classes)
        if r.short(self.job.n_workers):
            i = int(np.argmax(r.counts < self.job.n_workers))
            raise ValueError(f"chunk {i} ended short (counting {int(r.counts[i])} of "
                             f"{self.job.n_workers} workers): use reduce(), whose counts and "
                             f"bitmaps say who each chunk's sums hold")
        return r.sums

    def reduce_max(self, values: np.ndarray) -> AggregationResult:
        """Element-wise max over all workers of non-negative floats (the preliminary round)."""
        values = as_float32(np.asarray(values)).reshape(-1)
        u = P.floats_to_ordered_u32(values)
        n_chunks = -(-u.size // P.MAX_LANES)
        padded = np.zeros(n_chunks * P.MAX_LANES, dtype=">u4")
        padded[: u.size] = u
        out = np.zeros((n_chunks, P.MAX_LANES), dtype=np.uint32)
        chunks = padded.view(np.uint8).reshape(n_chunks, P.MAX_LANES * 4)
        r = self._stream(P.PktType.MAX, chunks, out, 0, P.MAX_LANES, np.dtype(">u4"))
        r.sums = P.ordered_u32_to_floats(out.reshape(-1)[: u.size].astype(np.uint32))
        return r

    def max(self, values: np.ndarray) -> np.ndarray:
        """The maxima of :meth:`reduce_max` alone."""
        return self.reduce_max(values).sums

    # -- the run and its failures ----------------------------------------------------
    def _stream(self, pkt_type: int, chunks: np.ndarray, out: np.ndarray, offset_base: int,
                lanes: int, dtype: np.dtype, tos: list[int] | None = None) -> AggregationResult:
        """One round at a time: two threads' rounds would take the same sequence numbers,
        and each could take the other's sums as its own. The timers are checked here, as
        they may be set after the client was made (a deadline of inf would wait for good)."""
        if self.sock.fileno() < 0:
            raise ClientClosed(f"job {self.job.job_id}, worker {self.worker_id}: this client "
                               f"was closed (close()); its socket is gone: make a new one")
        _check_timeouts(self.timeout, self.max_timeout, self.deadline)
        if not self.round_lock.acquire(blocking=False):
            raise RuntimeError(f"job {self.job.job_id}, worker {self.worker_id}: another "
                               f"thread's round (a call's, or a reducer's exchanges) is "
                               f"running on this client; its rounds take the sequence numbers "
                               f"one after another (one client per thread, or one call at a "
                               f"time)")
        try:
            return self._round(pkt_type, chunks, out, offset_base, lanes, dtype, tos)
        finally:
            self.round_lock.release()

    def _round(self, pkt_type: int, chunks: np.ndarray, out: np.ndarray, offset_base: int,
               lanes: int, dtype: np.dtype, tos: list[int] | None) -> AggregationResult:
        """One round; a round that fails leaves the run unusable (:class:`RunFailed`)."""
        job, me = self.job, self.worker_id
        total = len(chunks)
        counts = np.full(total, job.n_workers, dtype=np.uint8)
        bitmaps = np.full(total, job.full_bitmap, dtype=np.uint32)
        if total == 0:
            return AggregationResult(out, counts, bitmaps, self.datapath)
        if self._run is None:
            raise ValueError(f"job {job.job_id}, worker {me}: no run id. Pass "
                             f"AggregationClient(run=...), set {P.RUN_ENV} in the environment "
                             f"(the same on every worker), or agree one over the process group "
                             f"(thc.collective.worker.agree_run)")
        if self._failed is not None:
            raise RunFailed(f"job {job.job_id}, worker {me}: run {self._run} failed in an "
                            f"earlier round ({self._failed}); a retry under the same run "
                            f"would be answered from that round's slots. Start a new run "
                            f"(client.run = a newer id, the same on every worker)")
        rnd = Round(pkt_type, chunks, out, offset_base, lanes, dtype, tos, self.next_seq,
                    self._run, counts, bitmaps, [e is not None for e in self.epochs],
                    self.stats.elsewhere, self.stats.other_run, self.stats.strays,
                    self.stats.queue_full)
        window = next(w for w in self._windows if w.fits(self, rnd))
        self.stats.rounds += 1
        self._drain()
        try:
            window.run(self, rnd)
        except BaseException as e:
            self._failed = f"{type(e).__name__}: {e}"
            raise
        self.next_seq = (rnd.base + total) % P.SEQ_MOD
        return AggregationResult(out, counts, bitmaps, window.name)

    def _drain(self) -> None:
        """Drop what is queued before a round's first packet: nothing of the round was sent,
        so nothing there answers it. A process restarted under its predecessor's run id would
        otherwise take the results queued for its predecessor as its own before the
        aggregator's ``reused_run`` refusal reaches it. Bounded (:attr:`DRAIN_SHARE`): the
        oldest datagrams, a predecessor's results among them, go first."""
        poller = select.poll()   # not recv's timeout: a socket with one would wait it out
        poller.register(self.sock, select.POLLIN)
        stop = time.monotonic() + self.DRAIN_SHARE * self.deadline
        while poller.poll(0):
            try:
                self.sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_TRUNC)
            except (BlockingIOError, InterruptedError):
                return
            self.stats.drained += 1
            if time.monotonic() >= stop:
                return

    def rto(self, shard: int = 0) -> float:
        """Retransmission timeout towards ``shard``: RFC 6298's estimator, at least the
        configured timeout above the smoothed round trip (:class:`RttEstimator`)."""
        return self.rtt.rto(shard)


def _aggregators(job: Job, aggregator, sock) -> list[tuple[str, int]]:
    """The addresses chunks go to: the shard map's, or the one aggregator given."""
    if job.shards:
        if aggregator is not None:
            raise ValueError(f"job {job.job_id} is sharded over {job.n_shards} aggregators "
                             f"(its shard map names them); pass no aggregator address")
        return [(s.ip, s.port) for s in job.shards]
    if aggregator is None:
        raise ValueError(f"job {job.job_id} has no shard map: pass the aggregator's address")
    family = sock.family if sock is not None else socket.AF_INET
    return [peer_address(aggregator, family)]


def _check_timeouts(timeout, max_timeout, deadline) -> None:
    if not all(isinstance(t, numbers.Real) and not isinstance(t, bool) and math.isfinite(t)
               for t in (timeout, max_timeout, deadline)) or not 0 < timeout <= max_timeout \
            or deadline <= 0:
        raise ValueError(f"timeouts must be finite seconds with 0 < timeout <= max_timeout "
                         f"and deadline > 0, got timeout {timeout!r}, max_timeout "
                         f"{max_timeout!r}, deadline {deadline!r}")
    if deadline >= P.RUN_IDLE_S:
        raise ValueError(f"deadline {deadline!r} s: it must be below the aggregators' run "
                         f"idle time ({P.RUN_IDLE_S:g} s); a chunk still resent after "
                         f"that could reopen its slot for its run after another run took "
                         f"the job and went quiet, and its workers would decode different "
                         f"sums (docs/protocol.md, Runs)")


def _socket(job: Job, worker_id, me, sock: socket.socket | None) -> socket.socket:
    """``sock`` (checked: the client polls, so no timeout), or a UDP socket bound to the
    worker's address from the job's config."""
    if sock is not None:
        if sock.gettimeout() is not None:
            raise ValueError(f"the socket has a timeout ({sock.gettimeout()!r} s): the client "
                             f"waits by poll and reads without blocking, which such a socket "
                             f"turns into waits; pass it with settimeout(None)")
        return sock
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    try:
        sock.bind((me.ip, me.port))
    except OSError as e:
        sock.close()
        held = (": another process holds it (another launch of this job, or a client not "
                "closed)" if e.errno == errno.EADDRINUSE else "")
        raise OSError(e.errno, f"job {job.job_id}, worker {worker_id}: cannot bind its address "
                               f"{me.ip}:{me.port} from the job's config ({e.strerror}){held}"
                      ) from None
    return sock
