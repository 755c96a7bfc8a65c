"""The sliding window in Python: the readable reference of the client's datapath, and the
only one for impairments (see host/net/client.py for the rules it follows)."""
from __future__ import annotations

import errno
import math
import select
import socket
import struct
import time

import numpy as np

from thc.net.outcomes import AggregatorRestarted
from thc.net.window import (FAST_BACKOFF_CAP, FAST_RETRANSMIT_AFTER, RECV_BATCH, RECV_BYTES,
                             SILENT_AFTER, Endpoint, Round, check_epoch, raise_refused,
                             raise_short, raise_timeout)
from thc.wire import protocol as P

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
    """send(data, dst, tos): counted, marked with ``tos`` in an IP_TOS control message (an
    IPV6_TCLASS one to an IPv6 address, which ignores IP_TOS, as an IPv4-mapped one ignores
    IPV6_TCLASS; as cheap as a plain sendto), through the impairment when one is active."""
    stats, sock, impair = end.stats, end.sock, end.impair
    v6 = sock.family == socket.AF_INET6
    cmsgs: dict[tuple[str, int], list] = {}   # (destination ip, tos): one lookup a packet

    def cmsg_of(ip: str, tos: int) -> list:
        mark = ((socket.IPPROTO_IPV6, socket.IPV6_TCLASS)
                if v6 and not (ip.startswith("::ffff:") and "." in ip)
                else (socket.IPPROTO_IP, socket.IP_TOS))
        cmsg = cmsgs[ip, tos] = [(*mark, struct.pack("i", tos))]
        return cmsg

    def sendto(d, a):
        _lost_if_full(stats, sock.sendto, d, a)

    def send(data: bytes, dst: tuple[str, int], tos: int = 0) -> None:
        stats.sent += 1
        stats.bytes_sent += len(data)
        if tos:
            cmsg = cmsgs.get((dst[0], tos)) or cmsg_of(dst[0], tos)
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
        _Stream(end, rnd).run()


class _Stream:
    """One round through the window: chunks sent as it has room, replies taken, timers
    resent with backoff, until every chunk has its result (or an exception names why not).
    The compiled twin, _fastagg_stream.c, has the same steps under like names (cl_take, ...)."""

    def __init__(self, end: Endpoint, rnd: Round):
        self.end, self.rnd = end, rnd
        job = end.job
        self.me, self.job_id, self.n_workers = end.worker_id, job.job_id, job.n_workers
        self.pkt_type, self.chunks, self.out = rnd.pkt_type, rnd.chunks, rnd.out
        self.offset_base, self.lanes, self.dtype = rnd.offset_base, rnd.lanes, rnd.dtype
        self.tos, self.counts, self.bitmaps = rnd.tos, rnd.counts, rnd.bitmaps
        self.total = total = len(self.chunks)
        self.run_id, self.base, self.pool = rnd.run, rnd.base, job.pool_size
        self.aggs, self.epochs = end.aggregators, end.epochs
        self.n_shards = n_shards = len(end.aggregators)
        self.expect_payload, self.result_type = rnd.expect_payload(job), rnd.result_type
        self.send = _sender(end)
        self.packets: dict[int, bytes] = {}
        self.due: dict[int, float] = {}
        self.backoff: dict[int, float] = {}
        self.started: dict[int, float] = {}
        self.resent: set[int] = set()    # retransmitted chunks: no RTT sample (Karn)
        # resent once, by the timer, before any reply: a second RESULT shows the timeout
        # spurious (RttEstimator); ``answered`` holds the first RESULT's round trip from the
        # first send, and when the second may come
        self.lone: set[int] = set()
        # when the chunk's first resend went (for a spurious timeout's spacing, and the
        # PENDING that answers it: RttEstimator); chunks resent again, held or sampled: no
        # PENDING sample
        self.resent_at: dict[int, float] = {}
        self.unpaired: set[int] = set()
        self.answered: dict[int, tuple[float, float]] = {}
        self.overtaken: set[int] = set()  # a lost packet, not a missing worker: no backoff
        self.pending_bitmap: dict[int, int] = {}
        self.later: dict[int, int] = {}
        self.done = np.zeros(total, dtype=bool)
        self.budget = rnd.budget(end)
        # chunks flushed by this worker (until they end full) or ended short: the loss
        # bound's count
        self.short: set[int] = set()
        self.ended_short, self.short_cap = 0, rnd.short_cap(end)
        self.flush_tos = rnd.flush_tos
        self.lo = self.hi = 0
        self.buf = bytearray(RECV_BYTES)
        self.poller = select.poll()
        self.poller.register(end.sock, select.POLLIN)
        now = time.monotonic()
        # per shard (one shard's replies say nothing of another's): when it last answered,
        # its impossible replies, the first SILENT_AFTER resends to it since it answered
        self.last_reply = [now] * n_shards
        self.rejected = [0] * n_shards
        self.not_float = [0] * n_shards  # of them, MAX_RESULTs with a lane no float has
        self.taken = [0] * n_shards      # chunks each shard ended this round
        self.asked: list[list[float]] = [[] for _ in range(n_shards)]
        self.full, self.incarnation, self.tag = job.full_bitmap, end.incarnation, job.config_tag
        self.is_data = self.pkt_type == P.PktType.DATA
        self.reach = job.reachable_sums if self.is_data else None
        # this worker's table values in every lane, in the sums' width: a sum below its own
        # value wraps past any bound on the rest (n x g fits the width)
        self.own = (job.lane_values(self.chunks).astype(self.dtype).reshape(total, self.lanes)
                    if self.is_data else None)

    def shard_of(self, i: int) -> int:
        return ((self.base + i) % P.SEQ_MOD) % self.n_shards

    def dst(self, i: int) -> tuple[str, int]:
        return self.aggs[self.shard_of(i)]

    def header(self, pkt_type: int, i: int) -> bytes:
        slot, version = P.slot_of(self.base + i, self.pool)
        return P.HEADER_STRUCT.pack(pkt_type, self.me, self.job_id, slot, version, 0,
                                    (self.base + i) % P.SEQ_MOD,
                                    (self.offset_base + i * self.lanes) % P.SEQ_MOD, self.tag,
                                    self.run_id, self.incarnation)

    def packet(self, i: int) -> bytes:
        return self.header(self.pkt_type, i) + self.chunks[i].tobytes()

    def run(self) -> None:
        end = self.end
        jitter = end.impair.jitter
        now = time.monotonic()
        while self.lo < self.total:
            now = self.open(now)
            next_due = min(self.due.values()) if self.due else now + end.timeout
            wait = max(0.0, next_due - time.monotonic())
            if jitter:
                release = end.impair.next_release()
                if release is not None:
                    wait = min(wait, release)
            ready = self.poller.poll(math.ceil(wait * 1000))  # ms; any descriptor number
            if jitter:
                end.impair.release_due()
            if ready:
                self.receive()
            else:
                end.impair.flush()
            now = time.monotonic()
            if now >= next_due:
                self.timers(now)

    def open(self, now: float) -> float:
        """Send the chunks the window has room for; the time after the last."""
        end, tos = self.end, self.tos
        while self.hi < self.total and self.hi < self.lo + end.window:
            hi = self.hi
            self.packets[hi] = self.packet(hi)
            self.send(self.packets[hi], self.dst(hi), tos[hi] if tos else 0)
            now = time.monotonic()
            self.due[hi] = now + min(end.rtt.rto(self.shard_of(hi)), end.deadline)
            self.backoff[hi], self.started[hi] = end.timeout, now
            self.hi += 1
        return now

    def receive(self) -> None:
        """Take up to RECV_BATCH waiting datagrams (then the timers, even under a flood)."""
        end, buf, sock = self.end, self.buf, self.end.sock
        for _ in range(RECV_BATCH):
            try:
                nbytes, src = sock.recvfrom_into(buf, len(buf), socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            end.stats.received += 1
            end.stats.bytes_received += nbytes
            self.take(nbytes, src)

    def take(self, nbytes: int, src) -> None:
        """One reply: ignored and counted, or it ends its chunk, or it raises."""
        end, stats, me, full = self.end, self.end.stats, self.me, self.full
        if nbytes < _HEADER_BYTES:
            stats.ignored += 1
            return
        (r_type, r_worker, r_job, r_slot, r_version, r_count, r_seq, r_offset,
         r_bitmap, r_run, r_epoch) = _unpack(self.buf)
        shard = r_seq % self.n_shards
        agg = self.aggs[shard]
        if r_job != self.job_id or r_worker != me or r_type not in _REPLY_TYPES:
            stats.ignored += 1
            if src == agg:
                stats.strays += 1
            return
        if src != agg:
            stats.ignored += 1
            if src[1:] == agg[1:]:   # the port, from another IP
                stats.elsewhere += 1
            return
        if r_run != self.run_id:
            stats.other_run += 1
            return
        i = (r_seq - self.base) % P.SEQ_MOD
        ours = (i < self.hi and (r_slot, r_version) == P.slot_of(r_seq, self.pool)
                and r_offset == (self.offset_base + i * self.lanes) % P.SEQ_MOD)
        if not ours or self.done[i]:
            stats.ignored += 1
            stats.strays += not ours and i < self.hi   # of this round
            if (ours and i in self.answered and r_type == self.result_type
                    and nbytes - _HEADER_BYTES == self.expect_payload
                    and not r_bitmap & ~full
                    and bin(r_bitmap).count("1") == r_count
                    and time.monotonic() >= self.answered[i][1]):
                stats.spurious += 1
                end.rtt.sample(shard, self.answered.pop(i)[0])
            return
        self.last_reply[shard] = time.monotonic()
        if self.asked[shard]:
            self.asked[shard] = []
        epochs = self.epochs
        if r_epoch != epochs[shard]:
            if epochs[shard] is not None:
                raise AggregatorRestarted(agg, self.run_id, epochs[shard], r_epoch,
                                          shard if self.n_shards > 1 else None)
            # another configuration's is refused at once; the first of this one's is learnt
            # from a reply that passes its checks
            check_epoch(end, shard, r_epoch)
        if r_type == _REFUSED:
            epochs[shard] = r_epoch
            raise_refused(end, self.rnd, i, r_count, r_bitmap)
        if r_type == _PENDING:
            if (r_bitmap & ~full or not r_bitmap >> me & 1
                    or (r_bitmap == full if r_count == 0 else
                        r_count >= self.n_workers or bin(r_bitmap).count("1") != r_count)):
                # a PENDING no aggregator sends: one without our bit (it answers our packet,
                # which acknowledged the use before and joined this one), a held one that
                # every worker acknowledged, or a wait for a chunk that has every worker
                self.impossible(shard, i)
                return
            epochs[shard] = r_epoch
            stats.pending += 1
            # bit 32: held (count 0): the bitmap names who holds the previous use's result,
            # and a FLUSH could only close the chunk empty
            self.pending_bitmap[i] = r_bitmap & full | (r_count == 0) << 32
            self.lone.discard(i)
            if r_count and i in self.resent_at and i not in self.unpaired:
                end.rtt.sample(shard, time.monotonic() - self.resent_at[i])
            self.unpaired.add(i)
            return
        if (r_type != self.result_type or nbytes - _HEADER_BYTES != self.expect_payload
                or r_bitmap & ~full or bin(r_bitmap).count("1") != r_count
                or (r_count < self.n_workers and not self.is_data)):
            self.impossible(shard, i)
            return
        sums = np.frombuffer(self.buf, dtype=self.dtype, count=self.lanes,
                             offset=_HEADER_BYTES)
        if self.lanes_bad(i, shard, sums, r_count, r_bitmap):
            # a max below our own or no float's; a sum without our own value, or more than
            # it and the other contributors' can make
            self.impossible(shard, i)
            return
        epochs[shard] = r_epoch
        self.ended(i, shard, sums, r_count, r_bitmap)

    def lanes_bad(self, i: int, shard: int, sums: np.ndarray, r_count: int,
                  r_bitmap: int) -> bool:
        """Whether a RESULT's lanes are impossible: no max below ours or above a float's; a
        sum that counts us holds our own value, and every sum (less ours) is one the other
        contributors' table values can make (Job.reachable_sums)."""
        if not self.is_data:
            above = sums.max() > P.MAX_LANE_TOP
            self.not_float[shard] += int(above)
            return bool(above or (sums < self.chunks[i].view(">u4")).any())
        ours = r_bitmap >> self.me & 1
        # unsigned: a sum below our own value wraps past every row
        rest, row = (sums - self.own[i] if ours else sums), self.reach[r_count - ours]
        return bool(rest.max() >= row.size or not row[rest].all())

    def ended(self, i: int, shard: int, sums: np.ndarray, r_count: int,
              r_bitmap: int) -> None:
        """Chunk i ends with these sums: of every worker, or closed short (FLUSH)."""
        end = self.end
        if r_count != self.n_workers:
            # closed short: count and bitmap say who was counted
            if self.ended_short >= self.short_cap:
                raise_short(end, self.rnd, i, r_count, r_bitmap)
            self.ended_short += 1
            end.stats.short += 1
            self.short.add(i)
            self.counts[i], self.bitmaps[i] = r_count, r_bitmap
        else:   # flushed, but every worker's DATA came first
            self.short.discard(i)
        self.out[i] = sums
        self.done[i] = True
        self.taken[shard] += 1
        if i not in self.resent:
            end.rtt.sample(shard, time.monotonic() - self.started[i])
        elif i in self.lone:
            # the resend's answer comes about as much later as the resend went: a duplicate
            # of one answer comes at once
            at = time.monotonic()
            self.answered[i] = (at - self.started[i],
                                at + (self.resent_at[i] - self.started[i]) / 2)
            self.lone.discard(i)
        self.resent.discard(i)
        self.overtaken.discard(i)
        for d in (self.packets, self.due, self.backoff, self.started, self.later,
                  self.resent_at):
            d.pop(i, None)
        self.unpaired.discard(i)
        if i == self.lo:
            while self.lo < self.total and self.done[self.lo]:
                self.lo += 1
            lo = self.lo
            if lo < self.hi and self.tos is None:
                # the new head: the whole window waits for it
                rto = end.rtt.rto(self.shard_of(lo))
                self.backoff[lo] = min(self.backoff[lo], rto)
                self.due[lo] = min(self.due[lo], time.monotonic() + rto)
        if i > self.lo:
            self.overtaken_by(i)

    def overtaken_by(self, j: int) -> None:
        """Chunk ``j`` overtook outstanding chunks of the same shard (chunks of different
        shards complete in no particular order): every worker's chunks get through, so these
        or their results were lost. Resend them after a few such overtakes (TCP's dupack
        idea), and from then on with a backoff capped at FAST_BACKOFF_CAP RTOs: the backoff a
        chunk built up while the others' contributions were late must not delay recovering
        its lost result (20% loss on every link held lost RESULTs for max_timeout, the
        windows of all workers stalled behind them, and chunks passed the deadline). Only a
        chunk of the same priority class is such evidence: a lower class may merely wait in
        its queue."""
        end, tos = self.end, self.tos
        now = time.monotonic()
        shard = self.shard_of(j)
        rto = end.rtt.rto(shard)
        for i in [i for i in self.due if i < j and self.shard_of(i) == shard
                  and (tos is None or tos[i] == tos[j])]:
            self.later[i] = self.later.get(i, 0) + 1
            if self.later[i] == FAST_RETRANSMIT_AFTER:
                self.resend(i, may_flush=False)
                self.due[i] = min(now + rto, self.started[i] + end.deadline)
                self.later[i] = -4 * FAST_RETRANSMIT_AFTER
                self.overtaken.add(i)
                self.backoff[i] = rto

    def timers(self, now: float) -> None:
        """The chunks whose timers are due at ``now``: resent with backoff, or the round's
        timeout raised."""
        end = self.end
        for i, t in list(self.due.items()):
            if t > now:
                continue
            if now - self.started[i] >= end.deadline:
                s = self.shard_of(i)
                rto = end.rtt.rto(s)
                raise_timeout(end, self.rnd, i, self.pending_bitmap.get(i),
                              now - self.last_reply[s], self.rejected[s],
                              sum(now - at >= rto for at in self.asked[s]), self.taken[s],
                              self.not_float[s])
            first = i not in self.resent and i not in self.pending_bitmap
            self.resend(i)
            if first and i not in self.short:   # a DATA, not a FLUSH
                self.lone.add(i)
            rto = end.rtt.rto(self.shard_of(i))
            # exponential backoff, capped at FAST_BACKOFF_CAP RTOs for the window's head
            # (every chunk behind it waits for it; with priority classes it may merely wait
            # in a lower class's queue, and keeps the full backoff), for a chunk that later
            # ones overtook FAST_RETRANSMIT_AFTER times (a lost packet) and for a held chunk
            # (it can go on the moment the straggler moves on): a cap, not none, or a head
            # waiting for a straggler and a merely reordered chunk would resend every RTO
            cap = (FAST_BACKOFF_CAP * rto
                   if i in self.overtaken or (i == self.lo and self.tos is None)
                   or self.pending_bitmap.get(i, 0) >> 32 else end.max_timeout)
            self.backoff[i] = min(max(self.backoff[i], rto) * 2, cap, end.max_timeout)
            # then it raises
            self.due[i] = min(now + self.backoff[i], self.started[i] + end.deadline)

    def impossible(self, shard: int, i: int) -> None:
        """A reply no aggregator of this job sends: counted, and newer than any PENDING (the
        timeout names the impossible replies)."""
        self.end.stats.ignored += 1
        self.end.stats.rejected += 1
        self.rejected[shard] += 1
        self.pending_bitmap.pop(i, None)

    def resend(self, i: int, may_flush: bool = True) -> None:
        """Retransmit chunk i, or close it short while the loss bound allows. Only a timeout
        closes a chunk: overtaken chunks (fast retransmit) may merely sit in a lower class's
        queue, and a duplicate DATA costs nothing."""
        end, tos, shard = self.end, self.tos, self.shard_of(i)
        self.lone.discard(i)
        if i in self.resent:
            self.unpaired.add(i)
        else:
            self.resent_at[i] = time.monotonic()
        self.resent.add(i)
        ask = self.asked[shard]
        if len(ask) < SILENT_AFTER:
            ask.append(time.monotonic())
        if self.pending_bitmap.get(i, 0) >> 32:
            # held: a FLUSH could only open the use closed and empty; the DATA waits in the
            # same place and counts once the previous use is acknowledged
            end.stats.retransmitted += 1
            self.send(self.packet(i), self.dst(i), tos[i] if tos else 0)
        elif self.budget and (i in self.short or (may_flush and len(self.short) < self.budget
                                                   and self.rnd.heard[shard])):
            if i not in self.short:
                self.short.add(i)
                self.packets[i] = self.header(_FLUSH, i)
            end.stats.flushed += 1
            self.send(self.packets[i], self.dst(i), self.flush_tos)
        else:
            end.stats.retransmitted += 1
            self.send(self.packets[i], self.dst(i), tos[i] if tos else 0)


_unpack, _HEADER_BYTES = P.HEADER_STRUCT.unpack_from, P.HEADER_BYTES
_PENDING, _REFUSED, _FLUSH = (int(P.PktType[t]) for t in ("PENDING", "REFUSED", "FLUSH"))
_REPLY_TYPES = frozenset(int(P.PktType[t]) for t in ("PENDING", "REFUSED", "RESULT",
                                                     "MAX_RESULT"))
