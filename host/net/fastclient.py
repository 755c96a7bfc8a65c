"""The client's sliding window in C (``_fastagg.stream``): recvmmsg/sendmmsg batches without
the GIL, the same validation, retransmission rules (passed from host/net/window.py),
estimator, DLCP's bounded loss and DSCP marks as the Python window, for every round but an
impaired one (host/net/impair.py wraps Python's sends). Where the extension is missing or
older, :data:`CLIENT_UNAVAILABLE` says why."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import numpy as np

from thc.net.addresses import ipv4_int
from thc.net.cext import UNAVAILABLE, _fastagg
from thc.net.outcomes import AggregatorRestarted
from thc.net.window import (FAST_BACKOFF_CAP, FAST_RETRANSMIT_AFTER, RECV_BATCH, SILENT_AFTER,
                             Endpoint, Round, raise_misconfigured, raise_refused,
                             raise_short, raise_timeout)
from thc.wire import protocol as P

CLIENT_WINDOW = 12
"""The version of ``_fastagg.stream``'s arguments and timeout report this module speaks."""

CLIENT_UNAVAILABLE: str | None = UNAVAILABLE or (
    None if getattr(_fastagg, "CLIENT_WINDOW", 0) == CLIENT_WINDOW
    else "the compiled datapath predates this client window: rebuild it")
"""Why the client's compiled window cannot run here; None when it can."""

CLIENT_MAX_DATAGRAM = getattr(_fastagg, "CLIENT_MAX_DATAGRAM", 0)

(STREAM_DONE, STREAM_RESTARTED, STREAM_TIMEOUT, STREAM_OSERROR, STREAM_REFUSED, STREAM_SHORT,
 STREAM_MISCONFIGURED) = range(7)
"""The events the compiled window returns with."""


@dataclass
class Streamed:
    """What the C window returns: the event it ended with and its detail, its counters, and
    the estimator's state per shard."""

    event: int
    info: object
    sent: int
    retransmitted: int
    received: int
    ignored: int
    other_run: int
    pending: int
    bytes_sent: int
    bytes_received: int
    rejected: int
    spurious: int
    elsewhere: int
    gso_sends: int
    gro_bursts: int
    strays: int
    queue_full: int
    flushed: int
    short: int
    srtt: list
    rttvar: list


def stream(end: Endpoint, rnd: Round, chunks: np.ndarray) -> Streamed:
    """One call of the C window with the round's header fields by name."""
    job = end.job
    other = P.PktType.MAX_RESULT if rnd.result_type == P.PktType.RESULT else P.PktType.RESULT
    header = (int(rnd.pkt_type), int(rnd.result_type), int(P.PktType.PENDING), int(other),
              int(rnd.is_data), end.worker_id, job.job_id, job.pool_size, rnd.run, rnd.base,
              rnd.offset_base % P.SEQ_MOD, rnd.lanes, job.n_workers, int(P.PktType.REFUSED),
              job.granularity if rnd.is_data else P.MAX_LANE_TOP, end.incarnation,
              (job.config_tag << P.EPOCH_TAG_SHIFT, P.SEQ_MOD - 1 - P.NONCE_MASK,
               job.config_tag),
              np.asarray(job.table, dtype=np.uint32).tobytes(), job.aggregation == "vote",
              job.reachable_sums if rnd.is_data else b"")
    aggs = [(ipv4_int(ip), port) for ip, port in end.aggregators]
    dlcp = (bytes(rnd.tos) if rnd.tos else b"", rnd.flush_tos, int(P.PktType.FLUSH),
            rnd.budget(end), rnd.short_cap(end), bytes(rnd.heard))
    timing = (end.timeout, end.max_timeout, end.deadline, FAST_RETRANSMIT_AFTER,
              FAST_BACKOFF_CAP, SILENT_AFTER, RECV_BATCH)
    event, info, st, srtt, rttvar = _fastagg.stream(
        end.sock.fileno(), header, chunks, chunks.shape[1], aggs, end.epochs, end.window,
        timing, list(end.rtt.srtt), list(end.rtt.rttvar), rnd.out, rnd.out.itemsize,
        rnd.expect_payload(job), end.gso, dlcp, rnd.counts, rnd.bitmaps)
    return Streamed(event, info, *st, srtt, rttvar)


class CompiledWindow:
    name = "compiled"

    def fits(self, end: Endpoint, rnd: Round) -> bool:
        """No impairment; IPv4 literal addresses, a datagram it has room for, an IPv4
        socket."""
        return (CLIENT_UNAVAILABLE is None and not end.impair.active
                and end.sock.family == socket.AF_INET
                and all(ipv4_int(ip) is not None for ip, _ in end.aggregators)
                and P.HEADER_BYTES + rnd.chunks.shape[1] <= CLIENT_MAX_DATAGRAM)

    def run(self, end: Endpoint, rnd: Round) -> None:
        """The C window's events become the client's exceptions, its counters the client's
        stats."""
        s = end.stats
        s.compiled_rounds += 1
        r = stream(end, rnd, np.ascontiguousarray(rnd.chunks, dtype=np.uint8))
        for name in ("sent", "retransmitted", "received", "ignored", "other_run", "pending",
                     "bytes_sent", "bytes_received", "rejected", "spurious", "elsewhere",
                     "gso_sends", "gro_bursts", "strays", "queue_full", "flushed", "short"):
            setattr(s, name, getattr(s, name) + getattr(r, name))
        end.rtt.srtt, end.rtt.rttvar = r.srtt, r.rttvar
        if r.event == STREAM_RESTARTED:
            shard, old, new = r.info
            raise AggregatorRestarted(end.aggregators[shard], rnd.run, old, new,
                                      shard if len(end.aggregators) > 1 else None)
        if r.event == STREAM_MISCONFIGURED:
            raise_misconfigured(end, *r.info)
        if r.event == STREAM_TIMEOUT:
            i, bitmap, silent, unanswered, rejected, taken, not_float = r.info  # its shard's
            raise_timeout(end, rnd, i, bitmap, silent, rejected, unanswered, taken, not_float)
        if r.event == STREAM_OSERROR:
            raise OSError(r.info, os.strerror(r.info))
        if r.event == STREAM_REFUSED:
            raise_refused(end, rnd, *r.info)
        if r.event == STREAM_SHORT:
            raise_short(end, rnd, *r.info)
