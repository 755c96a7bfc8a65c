"""The sliding window's interface: one round of chunks (:class:`Round`), what the window
reads and updates of its client (:class:`Endpoint`), the retransmission rules both windows
follow, and the failures they raise. host/net/pywindow.py and host/net/fastclient.py
implement :class:`Window`; the client picks one per round."""
from __future__ import annotations

import math
import socket
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from thc.codec.common import near_int
from thc.net.impair import Impairment
from thc.net.outcomes import (AggregationRefused, AggregationTimeout, AggregatorMisconfigured,
                              LossBoundExceeded, TransportStats, host_port)
from thc.net.priority import FLUSH_CLASS, tos_of
from thc.wire import protocol as P
from thc.wire.jobs import Job

FAST_RETRANSMIT_AFTER = 3
"""Results of this many later chunks mean an earlier chunk (or its result) was lost."""

DEFAULT_TIMEOUT = 0.02
"""Seconds: a client's default least retransmission timeout, its first RTO and its least
margin over the smoothed round trip. Short, so that losses behind a full queue are resent
early: a first RTO of 0.2 s took four to five times as long to train under congestion
(docs/results.md)."""

DEFAULT_MAX_TIMEOUT = 0.5
"""Seconds: a client's default cap on a chunk's backoff, the longest a waiting worker goes
between retransmissions. The controller's live check watches a job for two of these and a
margin (controller/jobs.py, ``LIVE_WINDOW``): a worker given a longer cap may look idle to it
while it waits, and its job be changed under it without ``--force``."""

FAST_BACKOFF_CAP = 4
"""RTOs: the backoff cap of the window's head and of chunks found lost."""

SILENT_AFTER = 3
"""Retransmissions to a shard, each unanswered for an RTO, after which (and half the
deadline of silence) a timeout names the shard silent rather than a missing worker: a live
one answers each (a PENDING), so one lost reply or two is no such evidence."""

RECV_BYTES = 4096
"""What a client window reads of one reply, on either datapath (the compiled one's
CLIENT_RECV_BYTES, checked by thc.net.cext)."""
RECV_BATCH = 256
"""Datagrams a window takes in before it looks at its timers again: a flood of them to the
worker's port must not hold its deadlines off."""


def timeout_for(round_trip: float) -> float:
    """The least timeout for a path whose unloaded round trip (seconds) is known, such as an
    emulated link's delay: half of it, within [DEFAULT_TIMEOUT, DEFAULT_MAX_TIMEOUT]. A
    first RTO under a third of the round trip sends a chunk three times before its first
    RESULT, and a chunk sent three times gives :class:`RttEstimator` no sample: every
    chunk of every round went three times. At half, the first window's chunks go twice,
    their spurious timeouts give the round trip, and later chunks go once."""
    return min(DEFAULT_MAX_TIMEOUT, max(DEFAULT_TIMEOUT, round_trip / 2))


class RttEstimator:
    """RFC 6298's round-trip estimator, one per shard (a co-located shard answers sooner
    than a remote one). The RTO is ``srtt + max(timeout, 4 * rttvar)``: as in Linux, the
    configured timeout is the least margin over the round trip, not only the least RTO.
    Steady samples take rttvar to about zero, and an RTO of ``srtt`` alone resends a whole
    window whenever a round trip comes a few milliseconds late.

    Both windows also sample a spurious timeout, which Karn's rule would drop: a chunk sent
    twice, the second time by its timer before any reply, that gets two RESULTs at least
    half the resend's delay apart had both sends answered (a duplicated answer comes at
    once), so the time from its first send to its first RESULT is a round trip.
    Without it, a round trip longer than the RTO (results queued on a slow link) gets every
    chunk resent, leaves no sample, and each resend's RESULT queues more (twice the bytes
    of Marsit's vote at 25 Mbit/s: docs/results.md). A chunk sent three times is no such
    evidence: its first RESULT may answer a later send, after the peers' recovery under
    loss. And a PENDING that is not held (count > 0) answers a resend, never a first send:
    for a chunk resent once so far its time is that resend's round trip, its own path's
    alone (peers that are late make a chunk wait, not its PENDING). After two resends it
    may answer either (paired with the latest, a sample is short by the gap between them
    where the round trip is longer); a held PENDING may answer the first send too."""

    def __init__(self, shards: int, timeout: float, max_timeout: float):
        self.timeout = timeout
        self.max_timeout = max_timeout
        self.srtt: list[float | None] = [None] * shards
        self.rttvar = [0.0] * shards

    def rto(self, shard: int = 0) -> float:
        srtt = self.srtt[shard]
        if srtt is None:
            return self.timeout
        return min(self.max_timeout, srtt + max(self.timeout, 4 * self.rttvar[shard]))

    def sample(self, shard: int, rtt: float) -> None:
        srtt = self.srtt[shard]
        if srtt is None:
            self.srtt[shard], self.rttvar[shard] = rtt, rtt / 2
        else:
            self.rttvar[shard] = 0.75 * self.rttvar[shard] + 0.25 * abs(srtt - rtt)
            self.srtt[shard] = 0.875 * srtt + 0.125 * rtt


class Endpoint(Protocol):
    """What a window uses of its client: settings, the socket and the state a round
    updates (the epochs learnt per shard, the estimator, the counters)."""

    job: Job
    worker_id: int
    aggregators: list[tuple[str, int]]
    epochs: list[int | None]
    window: int
    timeout: float
    max_timeout: float
    deadline: float
    loss_bound: float
    incarnation: int
    impair: Impairment
    stats: TransportStats
    sock: socket.socket
    rtt: RttEstimator
    gso: bool


def flush_budget(loss_bound: float, chunks: int) -> int:
    """floor(loss_bound x chunks), the chunks one worker may close short in a round. A
    product within floating point's own error of an integer (a few units in its last place)
    counts as that integer: 0.29 x 100 is 28.999999999999996, and the round closed one chunk
    fewer than the bound says. A bound just below, such as 0.9999999999, is not rounded up,
    and none below 1 reaches every chunk of the round: 0.9999999999999999 x 4 is 4.0 in
    floating point, which let one worker close the whole round short."""
    product = loss_bound * chunks
    near = near_int(product)
    budget = math.floor(product) if near is None else near
    return min(budget, chunks - 1) if 0 < chunks and loss_bound < 1 else budget


@dataclass
class Round:
    """One round: ``chunks`` (one row a chunk) of ``pkt_type`` from sequence number ``base``;
    results land in ``out`` (``dtype`` on the wire), counts and bitmaps per chunk in
    ``counts`` and ``bitmaps``; ``tos``: a DSCP mark per chunk, or None; ``heard``: per
    shard, whether its epoch was known before the round."""

    pkt_type: int
    chunks: np.ndarray
    out: np.ndarray
    offset_base: int
    lanes: int
    dtype: np.dtype
    tos: list[int] | None
    base: int
    run: int
    counts: np.ndarray
    bitmaps: np.ndarray
    heard: list[bool]
    elsewhere: int = 0
    """The worker's ``stats.elsewhere`` when the round began."""
    other_run: int = 0
    """The worker's ``stats.other_run`` when the round began."""
    strays: int = 0
    """The worker's ``stats.strays`` when the round began."""
    queue_full: int = 0
    """The worker's ``stats.queue_full`` when the round began."""

    @property
    def is_data(self) -> bool:
        return self.pkt_type == P.PktType.DATA

    @property
    def result_type(self) -> int:
        return P.PktType.RESULT if self.is_data else P.PktType.MAX_RESULT

    def expect_payload(self, job: Job) -> int:
        return P.payload_bytes(self.result_type, self.lanes, job.sum_bits)

    def budget(self, end: Endpoint) -> int:
        """The chunks of this round this worker may close short itself (FLUSH):
        floor(loss_bound x chunks) (docs/protocol.md); none in a MAX round or without a loss
        bound."""
        if not self.is_data or end.loss_bound <= 0:
            return 0
        return flush_budget(end.loss_bound, len(self.chunks))

    def short_cap(self, end: Endpoint) -> int:
        """The most chunks of this round that may end short: each worker may close its
        :meth:`budget`, so n times that. A short RESULT beyond it raises
        (:func:`raise_short`)."""
        return end.job.n_workers * self.budget(end)

    @property
    def flush_tos(self) -> int:
        """The TOS byte of this round's FLUSHes: the top class where its chunks are marked
        (a FLUSH ends a wait), else none."""
        return tos_of(FLUSH_CLASS) if self.tos else 0


class Window(Protocol):
    name: str

    def fits(self, end: Endpoint, rnd: Round) -> bool:
        """Whether this window can carry the round."""

    def run(self, end: Endpoint, rnd: Round) -> None:
        """Stream the round to completion, or raise what ended it."""


def where(end: Endpoint, run: int, seq: int) -> str:
    slot, version = P.slot_of(seq, end.job.pool_size)
    return (f"job {end.job.job_id}, worker {end.worker_id}, run {run}: chunk seq "
            f"{seq % P.SEQ_MOD} (slot {slot}, version {version})")


def raise_refused(end: Endpoint, rnd: Round, i: int, code: int, detail: int):
    try:
        reason = P.DropReason(code).name
    except ValueError:
        reason = f"reason {code}"
    raise AggregationRefused(where(end, rnd.run, rnd.base + i), reason, detail)


def check_epoch(end: Endpoint, shard: int, epoch: int) -> None:
    """An epoch learnt from ``shard`` must carry this worker's job's configuration tag."""
    if P.epoch_tag(epoch) != end.job.config_tag:
        raise_misconfigured(end, shard, epoch)


def raise_misconfigured(end: Endpoint, shard: int, epoch: int):
    raise AggregatorMisconfigured(end.aggregators[shard], end.job.job_id, P.epoch_tag(epoch),
                                  end.job.config_tag, shard if len(end.aggregators) > 1 else None)


def raise_short(end: Endpoint, rnd: Round, i: int, count: int, bitmap: int):
    job = end.job
    missing = [w.id for w in job.workers if not bitmap >> w.id & 1]
    raise LossBoundExceeded(where(end, rnd.run, rnd.base + i), count, job.n_workers, missing,
                            end.loss_bound, rnd.short_cap(end), len(rnd.chunks))


WITHHELD = ("a switch withholding the chunk's result because one of its recirculated passes "
            "was lost (`thc controller counters`: lost_passes)")
"""A Tofino answers nothing for such a chunk, neither the result nor its retransmissions':
to a worker that looks like silence (docs/switch.md, "What recirculation adds")."""


def _shard_name(end: Endpoint, shard: int) -> tuple[str, str]:
    """How a timeout names the chunk's shard, and its address."""
    return ((f"aggregator shard {shard}" if end.job.shards else "the aggregator"),
            host_port(end.aggregators[shard]))


def timeout_of(end: Endpoint, rnd: Round, i: int, bitmap: int | None, silent: float = 0.0,
               rejected: int = 0, unanswered: int = 0, taken: int = 0,
               not_float: int = 0) -> AggregationTimeout:
    """The error naming the cause of chunk ``i``'s timeout from the evidence of its own shard
    (one shard's replies say nothing about another's).

    ``bitmap``: the chunk's latest PENDING (bit 32: held), None when there is none or an
    impossible RESULT for it came since. ``rejected``: the shard's impossible replies this
    round (:attr:`TransportStats.rejected`): an aggregator that answers, but only those, is
    named as misconfigured, not as silent nor as waiting for a worker. ``silent``: seconds
    since the shard last answered anything of this round; ``unanswered``: the
    retransmissions to it since then that had an RTO to be answered (counted up to
    :data:`SILENT_AFTER`); ``taken``: the chunks it ended this round; ``not_float``: of the
    impossible replies, MAX_RESULTs with a lane above :data:`P.MAX_LANE_TOP`, a max the
    aggregator took from a sender that is no client of this project (they refuse to send
    a negative, infinite or NaN value): the peer is named, not the aggregator. A live aggregator
    answers every retransmission of a chunk it holds (PENDING): silent for half the
    deadline through SILENT_AFTER of them, the cause is the aggregator (gone, unreachable,
    or restarted without a program yet), not a missing worker: an old PENDING's bitmap
    would name workers that are fine. A shard first heard in this round may have restarted
    before that, unseen: its peers then raised AggregatorRestarted, and the missing workers
    are named beside that possibility."""
    job = end.job
    seq = (rnd.base + i) % P.SEQ_MOD
    slot, version = P.slot_of(rnd.base + i, job.pool_size)
    at = (f"job {job.job_id}, worker {end.worker_id}: chunk seq {seq} (slot {slot}, "
          f"version {version}) not aggregated within {end.deadline:.1f}s")
    shard = job.shard_of(seq)
    who, addr = _shard_name(end, shard)
    quiet = silent >= end.deadline / 2 and unanswered >= SILENT_AFTER
    if bitmap is None and not_float:
        return AggregationTimeout(
            f"{at}; {who} at {addr} answered with {not_float} MAX_RESULTs holding a "
            f"lane above the largest finite float's bits ({rejected} impossible replies in "
            f"all): a sender at a worker's address put a negative, infinite or NaN value in "
            f"its MAX chunk, and the aggregator took it into the maxima. This project's "
            f"clients refuse to send one (a worker's norms are checked before its MAX "
            f"round): look for a foreign or broken process on a worker's address", None,
            shard)
    if bitmap is None and rejected:
        return AggregationTimeout(
            f"{at}; {who} at {addr} answered with {rejected} impossible replies this "
            f"round (the wrong type or size, or sums, counts or bitmaps this job cannot "
            f"make): is it configured with this job (lanes, sum width, workers)?", None, shard)
    # datagrams this round from the shard (or from its port at another IP) that answered
    # nothing of this worker's: it is up, answering wrongly, and the hints below say how
    wrong = (end.stats.elsewhere - rnd.elsewhere) + (end.stats.other_run - rnd.other_run) \
        + (end.stats.strays - rnd.strays)
    if bitmap is None and not (quiet and taken and not wrong):
        return _unanswered(end, rnd, at, shard, taken)
    if quiet:   # it answered this round (a PENDING, or chunks it took), then fell silent
        return AggregationTimeout(f"{at}; {who} at {addr} stopped answering "
                                  f"{silent:.1f}s ago (down, unreachable"
                                  + (", or restarted and not yet serving this job" if job.shards
                                     else f", restarted and not yet serving this job, or "
                                     f"{WITHHELD}") + "): start a new run once it is back",
                                  None, shard)
    return _waiting(end, rnd, at, shard, bitmap)


def _unanswered(end: Endpoint, rnd: Round, at: str, shard: int,
                taken: int) -> AggregationTimeout:
    """:func:`timeout_of`'s error for a chunk its shard never answered: the causes that
    fit what the shard did answer this round, and the replies this worker ignored."""
    job = end.job
    who, addr = _shard_name(end, shard)
    # Dropped unanswered: every chunk at an aggregator without this job, this worker's
    # address or its lanes (DATA), or with another pool (once it answered, its epoch
    # names another configuration: AggregatorMisconfigured). A shard at another address
    # in the shards' own map never sees the chunk.
    answering = taken > 0   # this round: alive, and it takes other chunks
    causes = ["each send of it or its reply lost"] if answering else ["down", "unreachable"]
    if job.shards:
        causes.append("given another shard map than this worker's")
    lanes = f", {job.lanes} lanes" if rnd.is_data else ""
    if end.epochs[shard] is None:
        causes.append(f"not serving job {job.job_id} with this worker's address{lanes} "
                      f"and pool {job.pool_size}")
    if not job.shards:      # shards are software aggregators
        if end.epochs[shard] is None:   # BMv2 keys a worker on its port too
            causes.append("a switch expecting this worker on another switch_port")
        causes.append(WITHHELD)
    hint = (f" ({', '.join(causes[:-1])}, or {causes[-1]})" if len(causes) > 2 else
            f" ({' or '.join(causes)})")
    elsewhere = end.stats.elsewhere - rnd.elsewhere
    if elsewhere:
        hint += (f"; {elsewhere} replies to this worker this round came from the port of "
                 f"an aggregator of the job at another IP and were ignored: the workers "
                 f"take replies only from the address they send to, so an aggregator (or "
                 f"a NAT before it) answering from another one is not heard; let it "
                 f"listen on the address the workers send to (thc aggregator --listen "
                 f"{addr})")
    other_run = end.stats.other_run - rnd.other_run
    if other_run:
        hint += (f"; {other_run} replies to this worker this round came from {who} with "
                 f"another run id than this round's ({rnd.run}) and were ignored: it "
                 f"answers another run of this job, or writes the run field wrong")
    strays = end.stats.strays - rnd.strays
    if strays:
        hint += (f"; {strays} datagrams from {who}'s address this round answered no chunk "
                 f"of this worker in flight (another worker id, job id or packet type, or "
                 f"another offset, slot or version) and were ignored: it answers with "
                 f"another job's or worker's ids, or rewrites those fields")
    return AggregationTimeout(f"{at}; no answer from {who} at {addr}{hint}", None,
                              shard)


def _waiting(end: Endpoint, rnd: Round, at: str, shard: int,
             bitmap: int) -> AggregationTimeout:
    """:func:`timeout_of`'s error for a chunk its shard holds: the workers its latest
    PENDING says are missing, or held back by the slot version's previous use."""
    job = end.job
    held, bitmap = bitmap >> 32, bitmap & 0xFFFFFFFF
    missing = [w for w in range(job.n_workers) if not bitmap >> w & 1]
    got = [w for w in range(job.n_workers) if bitmap >> w & 1]
    if held:
        return AggregationTimeout(
            f"{at}; held: worker(s) {missing} have not moved past the previous use of "
            f"its slot version, so they may still need its result (straggling or gone; "
            f"moved past it: {got})", missing, shard)
    unseen = ("" if rnd.heard[shard] else "; or the aggregator restarted before this worker's "
              "first reply of the run, losing the round (its peers then raised "
              "AggregatorRestarted, or returned where their part was done before it)"
              + ("; the loss bound closes chunks short only at an aggregator heard in an "
                 "earlier round of the run" if rnd.is_data and end.loss_bound > 0 else ""))
    if job.shards:
        # a peer whose shard map differs sends this chunk to another shard; only the peer
        # hears the refusal (wrong_shard), or nothing where that shard owns the chunk
        unseen += (f"; a missing worker may also have been given another shard map than "
                   f"this worker's, sending this chunk to a shard other than {shard}")
    return AggregationTimeout(f"{at}; missing worker(s) {missing} "
                              f"(contributed: {got}){unseen}; a worker given another job "
                              f"configuration (cluster file) than the aggregator's is missing "
                              f"too: its packets are refused (the aggregator's wrong_config "
                              f"drops)", missing, shard)


def raise_timeout(end: Endpoint, rnd: Round, *evidence) -> None:
    """Raise :func:`timeout_of`'s error; where this worker's own send queue refused datagrams
    this round, it says how many: their chunks never reached the aggregator, which then
    names this worker as missing to its peers."""
    e = timeout_of(end, rnd, *evidence)
    full = end.stats.queue_full - rnd.queue_full
    if full:
        e = AggregationTimeout(
            f"{e}; {full} datagrams of this round were refused by this worker's own send "
            f"queue (ENOBUFS, EAGAIN or ENOMEM) and lost before the wire: a queue that stays "
            f"full starves the aggregator of this worker's chunks (fewer chunks in flight: "
            f"the client's window; or a larger send buffer: net.core.wmem_max)", e.missing,
            e.shard)
    raise e
