"""The sliding window in Python: the readable reference of the client's datapath, and the
only one for impairments, DLCP's bounded loss and DSCP marks (see host/net/client.py for
the rules it follows)."""
from __future__ import annotations

import errno
import math
import select
import socket
import struct
import time

import numpy as np

from thc.net.outcomes import AggregatorRestarted
from thc.net.priority import FLUSH_CLASS, tos_of
from thc.net.window import (FAST_BACKOFF_CAP, FAST_RETRANSMIT_AFTER, RECV_BATCH, SILENT_AFTER,
                             Endpoint, Round, check_epoch, raise_refused, raise_short,
                             raise_timeout)
from thc.wire import protocol as P

_TOS_CMSG: dict[int, list] = {}
QUEUE_FULL = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS, errno.ENOMEM})
"""Send errors of a full queue: the datagram is lost, as the network may lose it, and the
chunk's timer resends it (the compiled window's rule); any other refusal ends the round."""


def _lost_if_full(stats, send_one, *args) -> None:
    """``send_one(*args)``, a full queue's refusal taken as the datagram's loss (counted)."""
    try:
        send_one(*args)
    except OSError as e:
        if e.errno not in QUEUE_FULL:
            raise
        stats.queue_full += 1


def _sender(end: Endpoint):
    """send(data, dst, tos): counted, marked with ``tos`` in an IP_TOS control message (as
    cheap as a plain sendto), through the impairment when one is active."""
    stats, sock, impair = end.stats, end.sock, end.impair

    def sendto(d, a):
        _lost_if_full(stats, sock.sendto, d, a)

    def send(data: bytes, dst: tuple[str, int], tos: int = 0) -> None:
        stats.sent += 1
        stats.bytes_sent += len(data)
        if tos:
            cmsg = _TOS_CMSG.get(tos)
            if cmsg is None:
                cmsg = _TOS_CMSG[tos] = [(socket.IPPROTO_IP, socket.IP_TOS,
                                          struct.pack("i", tos))]
            out = lambda d, a: _lost_if_full(stats, sock.sendmsg, [d], cmsg, 0, a)  # noqa: E731
        else:
            out = sendto
        if impair.active:
            impair.send(out, data, dst)
        else:
            out(data, dst)
    return send


class PythonWindow:
    name = "python"

    def fits(self, end: Endpoint, rnd: Round) -> bool:
        return True

    def run(self, end: Endpoint, rnd: Round) -> None:
        job, me = end.job, end.worker_id
        pkt_type, chunks, out, offset_base = rnd.pkt_type, rnd.chunks, rnd.out, rnd.offset_base
        lanes, dtype, tos, counts, bitmaps = rnd.lanes, rnd.dtype, rnd.tos, rnd.counts, \
            rnd.bitmaps
        total = len(chunks)
        run, base = rnd.run, rnd.base
        pool = job.pool_size
        aggs, epochs, n_shards = end.aggregators, end.epochs, len(end.aggregators)
        expect_payload, result_type = rnd.expect_payload(job), rnd.result_type
        send = _sender(end)
        packets: dict[int, bytes] = {}
        due: dict[int, float] = {}
        backoff: dict[int, float] = {}
        started: dict[int, float] = {}
        resent: set[int] = set()    # retransmitted chunks: no RTT sample (Karn)
        # resent once, by the timer, before any reply: a second RESULT shows the timeout
        # spurious (RttEstimator); ``answered`` holds the first RESULT's round trip from the
        # first send, and when the second may come
        lone: set[int] = set()
        # when the chunk's first resend went (for a spurious timeout's spacing, and the
        # PENDING that answers it: RttEstimator); chunks resent again, held or sampled: no
        # PENDING sample
        resent_at: dict[int, float] = {}
        unpaired: set[int] = set()
        answered: dict[int, tuple[float, float]] = {}
        overtaken: set[int] = set()  # a lost packet, not a missing worker: no backoff
        pending_bitmap: dict[int, int] = {}
        later: dict[int, int] = {}
        done = np.zeros(total, dtype=bool)
        bounded = rnd.is_data and end.loss_bound > 0
        budget = math.floor(end.loss_bound * total) if bounded else 0
        short: set[int] = set()     # chunks flushed by this worker (until they end full)
        #                             or ended short: the loss bound's count
        ended_short, short_cap = 0, rnd.short_cap(end)
        flush_type, flush_tos = int(P.PktType.FLUSH), tos_of(FLUSH_CLASS) if tos else 0
        lo = 0
        hi = 0
        buf = bytearray(4096)
        sock = end.sock
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        jitter = end.impair.jitter
        now = time.monotonic()
        # per shard (one shard's replies say nothing of another's): when it last answered,
        # its impossible replies, the first SILENT_AFTER resends to it since it answered
        last_reply = [now] * n_shards
        rejected = [0] * n_shards
        not_float = [0] * n_shards  # of them, MAX_RESULTs with a lane no float has
        taken = [0] * n_shards      # chunks each shard ended this round
        asked: list[list[float]] = [[] for _ in range(n_shards)]

        pack, unpack = P.HEADER_STRUCT.pack, P.HEADER_STRUCT.unpack_from
        job_id, n_workers, header_bytes = job.job_id, job.n_workers, P.HEADER_BYTES
        pending_type, refused_type = int(P.PktType.PENDING), int(P.PktType.REFUSED)
        reply_types = (pending_type, refused_type, int(P.PktType.RESULT),
                       int(P.PktType.MAX_RESULT))
        full, incarnation, tag = job.full_bitmap, end.incarnation, job.config_tag
        top = job.granularity if pkt_type == P.PktType.DATA else P.MAX_LANE_TOP
        is_data = pkt_type == P.PktType.DATA
        # this worker's table values in every lane, in the sums' width: a sum below its own
        # value wraps past any bound on the rest (n x g fits the width)
        own = job.lane_values(chunks).astype(dtype).reshape(total, lanes) if is_data else None

        def packet(i: int) -> bytes:
            slot, version = P.slot_of(base + i, pool)
            return pack(pkt_type, me, job_id, slot, version, 0, (base + i) % P.SEQ_MOD,
                        (offset_base + i * lanes) % P.SEQ_MOD, tag, run,
                        incarnation) + chunks[i].tobytes()

        def impossible(shard: int, i: int) -> None:
            """A reply no aggregator of this job sends: counted, and newer than any PENDING
            (the timeout names the impossible replies)."""
            end.stats.ignored += 1
            end.stats.rejected += 1
            rejected[shard] += 1
            pending_bitmap.pop(i, None)

        def shard_of(i: int) -> int:
            return ((base + i) % P.SEQ_MOD) % n_shards

        def dst(i: int) -> tuple[str, int]:
            return aggs[shard_of(i)]

        def resend(i: int, may_flush: bool = True) -> None:
            """Retransmit chunk i, or close it short while the loss bound allows. Only a
            timeout closes a chunk: overtaken chunks (fast retransmit) may merely sit in a
            lower class's queue, and a duplicate DATA costs nothing."""
            lone.discard(i)
            if i in resent:
                unpaired.add(i)
            else:
                resent_at[i] = time.monotonic()
            resent.add(i)
            ask = asked[shard_of(i)]
            if len(ask) < SILENT_AFTER:
                ask.append(time.monotonic())
            if pending_bitmap.get(i, 0) >> 32:
                # held: a FLUSH could only open the use closed and empty; the DATA waits in
                # the same place and counts once the previous use is acknowledged
                end.stats.retransmitted += 1
                send(packet(i), dst(i), tos[i] if tos else 0)
            elif bounded and (i in short or (may_flush and len(short) < budget
                                             and rnd.heard[shard_of(i)])):
                if i not in short:
                    short.add(i)
                    slot, version = P.slot_of(base + i, pool)
                    packets[i] = pack(flush_type, me, job_id, slot, version, 0,
                                      (base + i) % P.SEQ_MOD,
                                      (offset_base + i * lanes) % P.SEQ_MOD, tag, run,
                                      incarnation)
                end.stats.flushed += 1
                send(packets[i], dst(i), flush_tos)
            else:
                end.stats.retransmitted += 1
                send(packets[i], dst(i), tos[i] if tos else 0)

        while lo < total:
            while hi < total and hi < lo + end.window:
                packets[hi] = packet(hi)
                send(packets[hi], dst(hi), tos[hi] if tos else 0)
                now = time.monotonic()
                due[hi] = now + min(end.rtt.rto(shard_of(hi)), end.deadline)
                backoff[hi], started[hi] = end.timeout, now
                hi += 1
            next_due = min(due.values()) if due else now + end.timeout
            wait = max(0.0, next_due - time.monotonic())
            if jitter:
                release = end.impair.next_release()
                if release is not None:
                    wait = min(wait, release)
            ready = poller.poll(math.ceil(wait * 1000))  # ms; any descriptor number
            if jitter:
                end.impair.release_due()
            if ready:
                for _ in range(RECV_BATCH):  # then the timers, even under a flood
                    try:
                        nbytes, src = sock.recvfrom_into(buf, len(buf), socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        break
                    end.stats.received += 1
                    end.stats.bytes_received += nbytes
                    if nbytes < header_bytes:
                        end.stats.ignored += 1
                        continue
                    (r_type, r_worker, r_job, r_slot, r_version, r_count, r_seq, r_offset,
                     r_bitmap, r_run, r_epoch) = unpack(buf)
                    shard = r_seq % n_shards
                    if r_job != job_id or r_worker != me or r_type not in reply_types:
                        end.stats.ignored += 1
                        if src == aggs[shard]:
                            end.stats.strays += 1
                        continue
                    if src != aggs[shard]:
                        end.stats.ignored += 1
                        if src[1:] == aggs[shard][1:]:   # the port, from another IP
                            end.stats.elsewhere += 1
                        continue
                    if r_run != run:
                        end.stats.other_run += 1
                        continue
                    i = (r_seq - base) % P.SEQ_MOD
                    ours = (i < hi and (r_slot, r_version) == P.slot_of(r_seq, pool)
                            and r_offset == (offset_base + i * lanes) % P.SEQ_MOD)
                    if not ours or done[i]:
                        end.stats.ignored += 1
                        end.stats.strays += not ours and i < hi   # of this round
                        if (ours and i in answered and r_type == result_type
                                and nbytes - header_bytes == expect_payload
                                and not r_bitmap & ~full
                                and bin(r_bitmap).count("1") == r_count
                                and time.monotonic() >= answered[i][1]):
                            end.stats.spurious += 1
                            end.rtt.sample(shard, answered.pop(i)[0])
                        continue
                    last_reply[shard] = time.monotonic()
                    if asked[shard]:
                        asked[shard] = []
                    if r_epoch != epochs[shard]:
                        if epochs[shard] is not None:
                            raise AggregatorRestarted(aggs[shard], run, epochs[shard], r_epoch,
                                                      shard if n_shards > 1 else None)
                        # another configuration's is refused at once; the first of this
                        # one's is learnt from a reply that passes its checks
                        check_epoch(end, shard, r_epoch)
                    if r_type == refused_type:
                        epochs[shard] = r_epoch
                        raise_refused(end, rnd, i, r_count, r_bitmap)
                    if r_type == pending_type and (
                            r_bitmap & ~full or not r_bitmap >> me & 1
                            or (r_bitmap == full if r_count == 0 else
                                r_count >= n_workers or bin(r_bitmap).count("1") != r_count)):
                        # a PENDING no aggregator sends: one without our bit (it answers our
                        # packet, which acknowledged the use before and joined this one), a
                        # held one that every worker acknowledged, or a wait for a chunk
                        # that has every worker
                        impossible(shard, i)
                        continue
                    if r_type == pending_type:
                        epochs[shard] = r_epoch
                        end.stats.pending += 1
                        # bit 32: held (count 0): the bitmap names who holds the previous
                        # use's result, and a FLUSH could only close the chunk empty
                        pending_bitmap[i] = r_bitmap & full | (r_count == 0) << 32
                        lone.discard(i)
                        if r_count and i in resent_at and i not in unpaired:
                            end.rtt.sample(shard, time.monotonic() - resent_at[i])
                        unpaired.add(i)
                        continue
                    if (r_type != result_type or nbytes - header_bytes != expect_payload
                            or r_bitmap & ~full or bin(r_bitmap).count("1") != r_count
                            or (r_count < n_workers and not is_data)):
                        impossible(shard, i)
                        continue
                    sums = np.frombuffer(buf, dtype=dtype, count=lanes, offset=header_bytes)
                    if not is_data:
                        above = sums.max() > top
                        not_float[shard] += int(above)
                        bad = above or (sums < chunks[i].view(">u4")).any()
                    elif r_bitmap >> me & 1:
                        bad = (sums - own[i]).max() > (r_count - 1) * top
                    else:
                        bad = sums.max() > r_count * top
                    if bad:
                        # a max below our own or no float's; a sum without our own value, or
                        # more than it and the other contributors' can make
                        impossible(shard, i)
                        continue
                    epochs[shard] = r_epoch
                    if r_count != n_workers:
                        # closed short (FLUSH): count and bitmap say who was counted
                        if ended_short >= short_cap:
                            raise_short(end, rnd, i, r_count, r_bitmap)
                        ended_short += 1
                        end.stats.short += 1
                        short.add(i)
                        counts[i], bitmaps[i] = r_count, r_bitmap
                    else:   # flushed, but every worker's DATA came first
                        short.discard(i)
                    out[i] = sums
                    done[i] = True
                    taken[shard] += 1
                    if i not in resent:
                        end.rtt.sample(shard, time.monotonic() - started[i])
                    elif i in lone:
                        # the resend's answer comes about as much later as the resend went:
                        # a duplicate of one answer comes at once
                        at = time.monotonic()
                        answered[i] = (at - started[i], at + (resent_at[i] - started[i]) / 2)
                        lone.discard(i)
                    resent.discard(i)
                    overtaken.discard(i)
                    for d in (packets, due, backoff, started, later, resent_at):
                        d.pop(i, None)
                    unpaired.discard(i)
                    if i == lo:
                        while lo < total and done[lo]:
                            lo += 1
                        if lo < hi and tos is None:
                            # the new head: the whole window waits for it
                            rto = end.rtt.rto(shard_of(lo))
                            backoff[lo] = min(backoff[lo], rto)
                            due[lo] = min(due[lo], time.monotonic() + rto)
                    if i > lo:
                        _fast_retransmit(end, i, due, started, backoff, later, overtaken,
                                         resend, shard_of, tos)
            else:
                end.impair.flush()
            now = time.monotonic()
            if now < next_due:
                continue
            for i, t in list(due.items()):
                if t > now:
                    continue
                if now - started[i] >= end.deadline:
                    s, rto = shard_of(i), end.rtt.rto(shard_of(i))
                    raise_timeout(end, rnd, i, pending_bitmap.get(i), now - last_reply[s],
                                  rejected[s], sum(now - at >= rto for at in asked[s]),
                                  taken[s], not_float[s])
                first = i not in resent and i not in pending_bitmap
                resend(i)
                if first and i not in short:   # a DATA, not a FLUSH
                    lone.add(i)
                rto = end.rtt.rto(shard_of(i))
                # exponential backoff, capped at FAST_BACKOFF_CAP RTOs for the window's head
                # (every chunk behind it waits for it; with priority classes it may merely
                # wait in a lower class's queue, and keeps the full backoff), for a chunk
                # that later ones overtook FAST_RETRANSMIT_AFTER times (a lost packet) and for
                # a held chunk (it can go on the moment the straggler moves on): a cap, not
                # none, or a head waiting for a straggler and a merely reordered chunk would
                # resend every RTO
                cap = (FAST_BACKOFF_CAP * rto if i in overtaken or (i == lo and tos is None)
                       or pending_bitmap.get(i, 0) >> 32 else end.max_timeout)
                backoff[i] = min(max(backoff[i], rto) * 2, cap, end.max_timeout)
                due[i] = min(now + backoff[i], started[i] + end.deadline)   # then it raises


def _fast_retransmit(end: Endpoint, j: int, due: dict, started: dict, backoff: dict,
                     later: dict, overtaken: set, resend, shard_of,
                     tos: list[int] | None) -> None:
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
    rto = end.rtt.rto(shard)
    for i in [i for i in due if i < j and shard_of(i) == shard
              and (tos is None or tos[i] == tos[j])]:
        later[i] = later.get(i, 0) + 1
        if later[i] == FAST_RETRANSMIT_AFTER:
            resend(i, may_flush=False)
            due[i] = min(now + rto, started[i] + end.deadline)
            later[i] = -4 * FAST_RETRANSMIT_AFTER
            overtaken.add(i)
            backoff[i] = rto
