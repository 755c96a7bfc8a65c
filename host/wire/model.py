"""The aggregation protocol's reference model: docs/protocol.md as one socket-free function.

``Model.handle(datagram, src, now)`` maps the aggregator's state and one datagram to the
replies it sends and the reason it dropped the packet, if it did. No sockets, no clock, no
randomness: time comes in as ``now`` and every install's epoch as an argument, so a fuzzer
replays any interleaving exactly. The Python aggregator (:mod:`thc.net.aggregator`) is a
UDP shell around it; the compiled aggregator and the v1model program (on BMv2) are checked
against it (tests/model_fuzz.py, tests/bmv2/test_switch_model_fuzz.py, tests/conformance/).

State per job follows the switch's registers, one entry per slot and version:
``thc_run``/``thc_seq`` name the use, ``thc_op`` its kind (a sum of DATA or a MAX) and
``thc_offset`` the chunk's offset (a packet that disagrees with either is ``wrong_use``),
``thc_bitmap``/``thc_count`` its contributors, ``thc_closed`` whether a FLUSH closed it
short, ``thc_acked`` the workers known to hold its result, and the lane values. Per job:
the run that owns it (``thc_job_run``), when that run was last heard (``run_seen``), the
incarnation each worker's packets of a run carry (``thc_worker_nonce``, sent in the ``epoch``
field upstream) and the epoch of its install, whose configuration tag every upstream packet
must carry in ``bitmap`` (``wrong_config``).
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from thc.wire import protocol as P
from thc.wire.jobs import ConfigError, Job

HEADER_BYTES = P.HEADER_BYTES
unpack_header = P.HEADER_STRUCT.unpack_from
pack_header = P.HEADER_STRUCT.pack
KNOWN_TYPES = frozenset(int(t) for t in P.PktType)
DATA, MAX, RESULT, MAX_RESULT, PENDING, RESET, FLUSH, REFUSED = (int(P.PktType[t]) for t in (
    "DATA", "MAX", "RESULT", "MAX_RESULT", "PENDING", "RESET", "FLUSH", "REFUSED"))
UP_TYPES = frozenset((DATA, MAX, FLUSH))
OP_OF = {DATA: DATA, FLUSH: DATA, MAX: MAX}
"""The kind of slot use a packet type belongs to: FLUSH closes a sum of DATA."""
MAX_BYTES = P.payload_bytes(P.PktType.MAX)
SEQ_MOD, HALF = P.SEQ_MOD, P.SEQ_MOD // 2

Reply = tuple[bytes, tuple[str, int]]


def newer(a: int, b: int) -> bool:
    """RFC 1982 order on 32 bits: is ``a`` newer than ``b``?"""
    return 0 < (a - b) % SEQ_MOD < HALF


Outcome = tuple[list[Reply], "str | None"]
"""What one packet does: the replies to send and the drop reason (protocol.json's
drop_reasons), None when the packet was taken."""


class JobState:
    """One job's registers, laid out as the switch's (slot x version)."""

    __slots__ = ("job", "n_shards", "shard", "epoch", "tag", "n", "pool", "full",
                 "data_bytes", "addr", "thc_job_run", "run_seen", "thc_worker_run",
                 "thc_worker_nonce", "thc_run", "thc_seq",
                 "thc_op", "thc_bitmap", "thc_count", "thc_closed", "thc_acked", "thc_offset",
                 "thc_sum", "thc_max", "counters")

    def __init__(self, job: Job, shard: int | None, epoch: int):
        self.job = job.validate()
        self.n_shards, self.shard = job.aggregator_shard(shard)
        self.epoch = P.check_run(epoch)
        self.tag = P.epoch_tag(epoch)
        self.n, self.pool, self.full = job.n_workers, job.pool_size, job.full_bitmap
        self.data_bytes = P.payload_bytes(P.PktType.DATA, job.lanes, aggregation=job.aggregation)
        self.addr = [(w.ip, w.port) for w in sorted(job.workers, key=lambda w: w.id)]
        self.thc_job_run = 0
        self.run_seen = 0.0
        self.thc_worker_run = [0] * job.n_workers
        self.thc_worker_nonce = [0] * job.n_workers
        uses = 2 * job.pool_size
        self.thc_run = [0] * uses
        self.thc_seq = [P.SEQ_RESET] * uses
        self.thc_op = [0] * uses
        self.thc_bitmap = [0] * uses
        self.thc_count = [0] * uses
        self.thc_closed = [0] * uses
        self.thc_acked = [0] * uses
        self.thc_offset = [0] * uses
        self.thc_sum = np.zeros((uses, job.lanes), dtype=P.sum_dtype(job.sum_bits))
        self.thc_max = np.zeros((uses, P.MAX_LANES), dtype=">u4")
        self.counters = Counter({name: 0 for name in P.JOB_COUNTERS})


class Model:
    """Every installed job's state, the drop counters, and the per-packet rules."""

    def __init__(self, shard: int | None = None, run_idle: float = P.RUN_IDLE_S):
        """``shard``: this aggregator's index in the shard map of the jobs that have one.
        ``run_idle``: seconds after which a job's run is idle and any run may take it over."""
        self.shard = shard
        self.run_idle = run_idle
        self.jobs: dict[int, JobState] = {}
        self.drops = Counter({name: 0 for name in P.DropReason.__members__})

    def install(self, job: Job, epoch: int) -> None:
        """Install or re-install a job: its pool reset, no run, a new ``epoch`` (nonzero, with
        the job's configuration tag: :meth:`Job.new_epoch`) that every reply carries, so a
        client whose run spans the re-install fails instead of meeting slots that forgot its
        chunks, and one whose job differs refuses the replies."""
        if P.epoch_tag(epoch) != job.config_tag:
            raise ConfigError(f"job {job.job_id}: epoch {epoch:#010x} does not carry the job's "
                              f"configuration tag {job.config_tag:#06x} (Job.new_epoch)")
        self.jobs[job.job_id] = JobState(job, self.shard if job.shards else None, epoch)

    def remove(self, job_id: int) -> None:
        if self.jobs.pop(job_id, None) is None:
            raise KeyError(f"job {job_id} is not installed")

    def _drop(self, reason: str) -> Outcome:
        self.drops[reason] += 1
        return [], reason

    def _refuse(self, reason: str, detail: int, st: JobState, src, datagram) -> Outcome:
        """A drop answered with REFUSED to the (verified) sender: the reason's code in
        ``count``, ``detail`` in ``bitmap``, the packet's other fields echoed."""
        self.drops[reason] += 1
        (_t, w, job_id, slot, version, _c, seq, offset, _b, run, _e) = unpack_header(datagram)
        return [(pack_header(REFUSED, w, job_id, slot, version, int(P.DropReason[reason]), seq,
                             offset, detail, run, st.epoch), src)], reason

    def handle(self, datagram, src: tuple[str, int], now: float) -> Outcome:
        """One datagram from ``src`` at time ``now`` (seconds, any fixed origin)."""
        if len(datagram) < HEADER_BYTES:
            return self._drop("malformed")
        fields = unpack_header(datagram)
        admitted = self._admit(fields, datagram, src)
        if not isinstance(admitted, JobState):
            return admitted
        w, run, nonce = fields[1], fields[9], fields[10]
        taken = self._take_run(admitted, w, run, nonce, now, src, datagram)
        if taken is not None:
            return taken
        return self._use(admitted, fields, datagram, src)

    def _admit(self, fields, datagram, src: tuple[str, int]) -> "JobState | Outcome":
        """The job's state, for a datagram that passes the checks before the run's; else
        its drop or refusal (docs/protocol.md, "Drops", in this order)."""
        (pkt_type, w, job_id, slot, version, _count, seq, _offset, tag, run, _nonce) = fields
        if pkt_type not in KNOWN_TYPES or version > 1 or (run == 0 and pkt_type in UP_TYPES):
            return self._drop("malformed")
        if pkt_type == RESET:
            return self._drop("not_from_cpu")
        if pkt_type not in UP_TYPES:
            return self._drop("wrong_direction")
        st = self.jobs.get(job_id)
        if st is None:
            return self._drop("unknown_job")
        if len(datagram) - HEADER_BYTES != (st.data_bytes if pkt_type == DATA else
                                            MAX_BYTES if pkt_type == MAX else 0):
            return self._drop("bad_lanes")
        pool = st.pool
        if w >= st.n:
            return self._drop("worker_outside_job")
        if st.addr[w] != src:
            return self._drop("unknown_worker")
        if P.upstream_tag(tag) != st.tag:
            return self._refuse("wrong_config", 0, st, src, datagram)
        if slot >= pool:
            return self._drop("slot_outside_pool")
        if slot != seq & (pool - 1) or version != (seq & pool != 0):  # pool: a power of 2
            return self._refuse("wrong_slot", 0, st, src, datagram)
        if st.n_shards > 1 and seq % st.n_shards != st.shard:
            return self._refuse("wrong_shard", P.shard_detail(st.shard, st.n_shards), st, src,
                                datagram)
        return st

    def _take_run(self, st: JobState, w: int, run: int, nonce: int, now: float, src,
                  datagram) -> "Outcome | None":
        """The job's run rule and the worker's one incarnation a run: a refusal, or None."""
        job_run = st.thc_job_run
        if run != job_run:
            if job_run and not ((newer(run, job_run) and (run - job_run) % SEQ_MOD <= P.RUN_JUMP)
                                or now - st.run_seen >= self.run_idle):
                return self._refuse("stale_run", job_run, st, src, datagram)
            st.thc_job_run = run
        st.run_seen = now
        # One incarnation of each worker per run: a process restarted under the same run id
        # would meet its predecessor's slot uses (and their results) at the same seqs.
        if st.thc_worker_run[w] != run:
            st.thc_worker_run[w], st.thc_worker_nonce[w] = run, nonce
        elif st.thc_worker_nonce[w] != nonce:
            return self._refuse("reused_run", st.thc_worker_nonce[w], st, src, datagram)
        return None

    def _use(self, st: JobState, fields, datagram, src) -> Outcome:
        """The packet's slot version: its acknowledgements, then a new use, the same use or
        a refusal, and the replies."""
        (pkt_type, w, job_id, slot, version, _count, seq, offset, _tag, run, _nonce) = fields
        payload = memoryview(datagram)[HEADER_BYTES:]
        n, pool = st.n, st.pool
        i = 2 * slot + version
        bit = 1 << w
        # This packet proves its worker holds the result of every seq <= seq - pool of the
        # run (its window never exceeds the pool): it acknowledges the slot's older uses.
        runs, seqs, acked = st.thc_run, st.thc_seq, st.thc_acked
        past, j = seq - pool, i ^ 1
        if runs[i] == run and not 0 < (seqs[i] - past) % SEQ_MOD < HALF:
            acked[i] |= bit
        if runs[j] == run and not 0 < (seqs[j] - past) % SEQ_MOD < HALF:
            acked[j] |= bit
        op = OP_OF[pkt_type]
        same_run = runs[i] == run
        cur = seqs[i]
        if same_run and seq != cur and not 0 < (seq - cur) % SEQ_MOD < HALF:
            return self._refuse("stale", cur, st, src, datagram)
        if same_run and seq == cur:
            if st.thc_op[i] != op or st.thc_offset[i] != offset:
                return self._refuse("wrong_use", st.thc_op[i], st, src, datagram)
            st.counters["packets"] += 1
            count = st.thc_count[i]
            if count == n or st.thc_closed[i]:
                st.counters["retransmissions"] += 1
                return [(self._result(st, i, slot, version)(w), src)], None
            if pkt_type == FLUSH:
                st.thc_closed[i] = 1
            elif st.thc_bitmap[i] & bit:
                st.counters["pending"] += 1
                return [(pack_header(PENDING, w, job_id, slot, version, count, seq, offset,
                                     st.thc_bitmap[i], run, st.epoch), src)], None
            else:
                self._accumulate(st, op, i, payload, first=False)
                st.thc_bitmap[i] |= bit
                st.thc_count[i] = count + 1
        else:
            if same_run and st.thc_op[i] and st.thc_acked[i] != st.full:
                # A new use of this slot version while a worker may still need the previous
                # one's result: wait (a worker that closed chunks short may run ahead).
                st.counters["packets"] += 1
                st.counters["held"] += 1
                # count 0: nothing of this use yet; bitmap: who holds the previous result
                return [(pack_header(PENDING, w, job_id, slot, version, 0, seq, offset,
                                     acked[i], run, st.epoch), src)], None
            st.counters["packets"] += 1
            st.thc_run[i], st.thc_seq[i], st.thc_op[i], st.thc_acked[i] = run, seq, op, 0
            st.thc_offset[i] = offset
            if pkt_type == FLUSH:
                # closed before anyone contributed: every lane sums nothing, count 0
                st.thc_sum[i] = 0
                st.thc_bitmap[i], st.thc_count[i], st.thc_closed[i] = 0, 0, 1
            else:
                self._accumulate(st, op, i, payload, first=True)
                st.thc_bitmap[i], st.thc_count[i], st.thc_closed[i] = bit, 1, 0
        if st.thc_count[i] < n and not st.thc_closed[i]:
            return [], None
        st.counters["completions"] += 1
        make = self._result(st, i, slot, version)
        return [(make(v), st.addr[v]) for v in range(n)], None

    @staticmethod
    def _accumulate(st: JobState, op: int, i: int, payload, first: bool) -> None:
        if op == MAX:
            vals = np.frombuffer(payload, dtype=">u4")
            regs = st.thc_max[i]
            if first:
                regs[:] = vals
            else:
                np.maximum(regs, vals, out=regs)
            return
        regs = st.thc_sum[i]
        if first:
            regs[:] = st.job.lane_values(payload)
        else:
            regs += st.job.lane_values(payload)

    @staticmethod
    def _result(st: JobState, i: int, slot: int, version: int):
        """worker -> the result datagram of use ``i``, built from the use (its op, seq,
        offset, run), never from the packet that asked; the payload is serialized once."""
        if st.thc_op[i] == MAX:
            rtype, payload = MAX_RESULT, st.thc_max[i].tobytes()
        else:
            rtype, payload = RESULT, st.thc_sum[i].tobytes()
        fields = (st.job.job_id, slot, version, st.thc_count[i], st.thc_seq[i],
                  st.thc_offset[i], st.thc_bitmap[i], st.thc_run[i], st.epoch)
        return lambda v: pack_header(rtype, v, *fields) + payload
