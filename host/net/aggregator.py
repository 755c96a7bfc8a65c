"""Software aggregator: THC's parameter server, with exactly the switch's semantics.

Per job it holds the run that owns the job (``thc_job_run``) and a pool of slots in two
versions (SwitchML), each with a run, a sequence number, a worker bitmap, a count, and
per-lane sums of lookup-table values (or, for a vote job, counts of +1 sign bits), and
whether a worker closed the use short (``FLUSH``,
DLCP's bounded loss). Names follow the P4 program (``thc_job_run``, ``thc_run``, ``thc_seq``,
``thc_bitmap``, ``thc_count``, ``thc_closed``, ``thc_sum``, ``thc_max``, drop reasons
and job counters from protocol.json), so the switch can be tested against it packet for
packet. Run as one shard of a sharded job (``shard``: its index in the job's shard map), it
aggregates only the chunks it owns and drops the others as ``wrong_shard``. Each start draws
a fresh ``epoch`` that every reply carries, so clients notice a restart (the in-flight state
is lost) instead of waiting for it. The per-packet path is a
handful of numpy calls; there is no loop per coordinate.

This module is the readable reference. :mod:`host.net.fastagg` runs the same semantics with
its datapath compiled (bit for bit, tests/test_fastagg.py), and ``thc aggregator`` runs that
one when it is built, saying which datapath runs in its first line.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

from host.net.impair import Impairment
from host.wire import protocol as P
from host.wire.jobs import Cluster, ConfigError, Job

Reply = tuple[bytes, tuple[str, int]]

HEADER_BYTES = P.HEADER_BYTES
unpack_header = P.HEADER_STRUCT.unpack_from
pack_header = P.HEADER_STRUCT.pack
KNOWN_TYPES = frozenset(int(t) for t in P.PktType)
DATA, MAX, RESULT, MAX_RESULT, PENDING, RESET, FLUSH = (int(P.PktType[t]) for t in (
    "DATA", "MAX", "RESULT", "MAX_RESULT", "PENDING", "RESET", "FLUSH"))
UP_TYPES = frozenset((DATA, MAX, FLUSH))
MAX_BYTES = P.payload_bytes(P.PktType.MAX)
SEQ_MOD, HALF = P.SEQ_MOD, P.SEQ_MOD // 2


class JobState:
    """Register state of one job, laid out as the switch's registers (slot x version).

    Scalar registers are Python lists (cheaper per packet than numpy scalars); the per-lane
    registers are numpy rows, one per slot and version.
    """

    def __init__(self, job: Job, shard: int | None = None):
        self.job = job.validate()
        if job.shards and shard is None:
            raise ConfigError(f"job {job.job_id} is spread over {job.n_shards} aggregator shards; "
                              f"run this aggregator as one of them (--shard 0..{job.n_shards - 1})")
        if shard is not None and not 0 <= shard < job.n_shards:
            raise ConfigError(f"shard {shard} is not in job {job.job_id}'s shard map "
                              f"(shards 0..{job.n_shards - 1})")
        self.n_shards = job.n_shards
        self.shard = shard or 0
        lut = np.asarray(job.table, dtype=P.sum_dtype(job.sum_bits))
        # One fancy-index maps a packed byte to its two lanes' table values.
        self.pair_lut = np.stack([lut[np.arange(256) >> 4], lut[np.arange(256) & 0x0F]], axis=1)
        self.n = job.n_workers
        self.pool = job.pool_size
        self.vote = job.aggregation == "vote"
        self.data_bytes = P.payload_bytes(P.PktType.DATA, job.lanes, aggregation=job.aggregation)
        self.addr = [(w.ip, w.port) for w in sorted(job.workers, key=lambda w: w.id)]
        self.thc_job_run = 0
        self.thc_run = [[0, 0] for _ in range(job.pool_size)]
        self.thc_seq = [[0, 0] for _ in range(job.pool_size)]
        self.thc_bitmap = [[0, 0] for _ in range(job.pool_size)]
        self.thc_count = [[0, 0] for _ in range(job.pool_size)]
        self.thc_closed = [[0, 0] for _ in range(job.pool_size)]
        shape = (job.pool_size, 2)
        self.thc_sum = np.zeros(shape + (job.lanes,), dtype=P.sum_dtype(job.sum_bits))
        self.thc_max = np.zeros(shape + (P.MAX_LANES,), dtype=">u4")
        self.counters = Counter({name: 0 for name in P.JOB_COUNTERS})

    def reset(self) -> None:
        """What the controller's RESET packets do to a switch pool (and install to the job run)."""
        self.thc_job_run = 0
        for regs, value in ((self.thc_run, 0), (self.thc_seq, P.SEQ_RESET),
                            (self.thc_bitmap, 0), (self.thc_count, 0), (self.thc_closed, 0)):
            for row in regs:
                row[0] = row[1] = value


class Aggregator:
    """Protocol logic (``handle``) plus an optional UDP server loop around it."""

    def __init__(self, jobs: list[Job] | tuple[Job, ...] = (), impair: Impairment | None = None,
                 epoch: int | None = None, shard: int | None = None):
        """``shard``: this aggregator's index in the shard map of the jobs that have one."""
        self.jobs: dict[int, JobState] = {}
        self.shard = shard
        self.epoch = P.new_epoch() if epoch is None else epoch
        self.drops = Counter({name: 0 for name in P.DropReason.__members__})
        self.impair = impair or Impairment()
        self.send_errors = 0
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        for job in jobs:
            self.install(job)

    # -- control plane -------------------------------------------------------------
    def install(self, job: Job) -> None:
        """Install or re-install a job, its slots reset as the controller resets a switch pool."""
        state = JobState(job, self.shard if job.shards else None)
        state.reset()
        with self._lock:
            self.jobs[job.job_id] = state

    def remove(self, job_id: int) -> None:
        with self._lock:
            if self.jobs.pop(job_id, None) is None:
                raise KeyError(f"job {job_id} is not installed")

    def counters(self) -> dict:
        """Counters of packets, completions, retransmissions and drops per reason."""
        with self._lock:
            return {"epoch": self.epoch, "drops": dict(self.drops),
                    "jobs": {jid: dict(s.counters) for jid, s in self.jobs.items()}}

    # -- data plane ----------------------------------------------------------------
    def _drop(self, reason: str) -> list[Reply]:
        self.drops[reason] += 1
        return []

    def handle(self, datagram: bytes | memoryview, src: tuple[str, int]) -> list[Reply]:
        """Process one datagram from ``src``; return the datagrams to send and where."""
        with self._lock:
            return self._handle(datagram, src)

    def _handle(self, datagram, src) -> list[Reply]:
        if len(datagram) < HEADER_BYTES:
            return self._drop("malformed")
        (pkt_type, worker_id, job_id, slot, version, _count, seq, offset,
         _bitmap, run, _epoch) = unpack_header(datagram)
        if pkt_type not in KNOWN_TYPES or version > 1 or (run == 0 and pkt_type in UP_TYPES):
            return self._drop("malformed")
        if pkt_type == RESET:
            return self._drop("not_from_cpu")
        if pkt_type not in UP_TYPES:
            return self._drop("wrong_direction")
        state = self.jobs.get(job_id)
        if state is None:
            return self._drop("unknown_job")
        payload = memoryview(datagram)[HEADER_BYTES:]
        if len(payload) != (state.data_bytes if pkt_type == DATA else
                            MAX_BYTES if pkt_type == MAX else 0):
            return self._drop("bad_lanes")
        n = state.n
        if worker_id >= n:
            return self._drop("worker_outside_job")
        if state.addr[worker_id] != src:
            return self._drop("unknown_worker")
        if slot >= state.pool:
            return self._drop("slot_outside_pool")
        if state.n_shards > 1 and seq % state.n_shards != state.shard:
            return self._drop("wrong_shard")
        job_run = state.thc_job_run
        if run != job_run:
            if job_run and not 0 < (run - job_run) % SEQ_MOD < HALF:
                return self._drop("stale_run")
            state.thc_job_run = run

        seqs, bitmaps, counts = state.thc_seq[slot], state.thc_bitmap[slot], state.thc_count[slot]
        runs = state.thc_run[slot]
        cur = seqs[version]
        same_use = runs[version] == run
        if same_use and seq != cur and not 0 < (seq - cur) % SEQ_MOD < HALF:
            return self._drop("stale")
        state.counters["packets"] += 1
        bit = 1 << worker_id
        is_max = pkt_type == MAX
        closed = state.thc_closed[slot]
        if same_use and seq == cur:
            bitmap = bitmaps[version]
            count = counts[version]
            if count == n or closed[version]:
                state.counters["retransmissions"] += 1
                return [(self._result(state, is_max, slot, version, seq, offset, run,
                                      self.epoch)(worker_id), src)]
            if pkt_type == FLUSH:
                closed[version] = 1
            elif bitmap & bit:
                state.counters["pending"] += 1
                return [(pack_header(PENDING, worker_id, job_id, slot, version, count, seq,
                                     offset, bitmap, run, self.epoch), src)]
            else:
                self._accumulate(state, is_max, slot, version, payload, first=False)
                bitmaps[version] = bitmap | bit
                count += 1
        elif pkt_type == FLUSH:
            # closed before anyone contributed: every lane sums nothing, count 0
            state.thc_sum[slot, version] = 0
            runs[version], seqs[version], bitmaps[version] = run, seq, 0
            closed[version] = 1
            count = 0
        else:
            self._accumulate(state, is_max, slot, version, payload, first=True)
            runs[version] = run
            seqs[version] = seq
            bitmaps[version] = bit
            closed[version] = 0
            count = 1
        counts[version] = count
        if count < n and not closed[version]:
            return []
        state.counters["completions"] += 1
        make = self._result(state, is_max, slot, version, seq, offset, run, self.epoch)
        return [(make(w), state.addr[w]) for w in range(n)]

    @staticmethod
    def _accumulate(state: JobState, is_max: bool, slot: int, version: int, payload,
                    first: bool) -> None:
        if is_max:
            vals = np.frombuffer(payload, dtype=">u4")
            regs = state.thc_max[slot, version]
            if first:
                regs[:] = vals
            else:
                np.maximum(regs, vals, out=regs)
        else:
            raw = np.frombuffer(payload, dtype=np.uint8)
            # a vote lane is one bit, counted as is (VOTE_TABLE maps b to b)
            vals = np.unpackbits(raw) if state.vote else state.pair_lut[raw].reshape(-1)
            regs = state.thc_sum[slot, version]
            if first:
                regs[:] = vals
            else:
                regs += vals

    @staticmethod
    def _result(state: JobState, is_max: bool, slot: int, version: int, seq: int, offset: int,
                run: int, epoch: int):
        """A function worker_id -> result datagram: the payload is serialized once."""
        if is_max:
            rtype, payload = MAX_RESULT, state.thc_max[slot, version].tobytes()
        else:
            rtype, payload = RESULT, state.thc_sum[slot, version].tobytes()
        job_id, count = state.job.job_id, state.thc_count[slot][version]
        bitmap = state.thc_bitmap[slot][version]
        return lambda w: pack_header(rtype, w, job_id, slot, version, count, seq, offset,
                                     bitmap, run, epoch) + payload

    # -- UDP server ------------------------------------------------------------------
    def bind(self, host: str = "127.0.0.1", port: int = P.UDP_PORT) -> tuple[str, int]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        sock.bind((host, port))
        self._sock = sock
        return sock.getsockname()

    @property
    def address(self) -> tuple[str, int]:
        if self._sock is None:
            raise RuntimeError("aggregator is not bound")
        return self._sock.getsockname()

    def serve(self, duration: float | None = None) -> None:
        """Receive and answer until ``stop()`` (or ``duration`` seconds)."""
        sock = self._sock
        if sock is None:
            raise RuntimeError("call bind() first")
        buf = bytearray(2048)
        view = memoryview(buf)
        end = None if duration is None else time.monotonic() + duration
        impair = self.impair

        def sendto(data, dst) -> None:
            try:
                sock.sendto(data, dst)
            except OSError:
                self.send_errors += 1

        while not self._stop.is_set() and (end is None or time.monotonic() < end):
            wait = 0.05
            if impair.jitter:
                release = impair.next_release()
                wait = wait if release is None else min(wait, release)
            ready, _, _ = select.select([sock], [], [], wait)
            if impair.jitter:
                impair.release_due()
            if not ready:
                impair.flush(sendto)
                continue
            while True:
                try:
                    nbytes, src = sock.recvfrom_into(buf, 2048, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                for data, dst in self.handle(view[:nbytes], src):
                    if impair.active:
                        impair.send(sendto, data, dst)
                    else:
                        sendto(data, dst)
        impair.flush(sendto, everything=True)

    def start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Bind and serve in a background thread (tests, embedded use)."""
        addr = self.bind(host, port)
        self._stop.clear()
        self._thread = threading.Thread(target=self.serve, name="thc-aggregator", daemon=True)
        self._thread.start()
        return addr

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


# -- `thc aggregator` ---------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default=f"0.0.0.0:{P.UDP_PORT}", metavar="HOST:PORT")
    parser.add_argument("--config", required=True, help="cluster JSON (the controller's format)")
    parser.add_argument("--shard", type=int, default=None, metavar="INDEX",
                        help="run as this shard of the jobs' shard maps (sharded jobs only)")
    parser.add_argument("--stats-interval", type=float, default=5.0,
                        help="print counters every N seconds (0: never)")
    parser.add_argument("--stats-file", help="rewrite counters as JSON to this file while running")
    parser.add_argument("--duration", type=float, help="exit after N seconds")
    parser.add_argument("--datapath", choices=("auto", "compiled", "python"), default="auto",
                        help="auto (default): the compiled datapath when it is built, else "
                             "this Python one; the first line printed says which runs")
    parser.add_argument("--no-gso", dest="gso", action="store_false",
                        help="compiled datapath: send every reply on its own, never as one UDP "
                             "GSO send per worker (emulated veth links would carry a GSO "
                             "burst as one packet)")
    for name in ("loss", "dup", "reorder"):
        parser.add_argument(f"--{name}", type=float, default=0.0,
                            help=f"inject {name} with this probability on sent results (testing)")
    parser.add_argument("--jitter", type=float, default=0.0, metavar="SECONDS",
                        help="delay each sent result by a random 0..SECONDS (testing)")


def parse_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host or "0.0.0.0", int(port)


def choose(datapath: str, jobs, impair: Impairment, gso: bool = True,
           shard: int | None = None):
    """The aggregator to run and how to name it: the compiled datapath unless told otherwise,
    it is not built, impairments are asked for (only the Python loop injects them), or the
    jobs use something it does not implement (:func:`host.net.fastagg.unsupported`)."""
    from host.net import fastagg

    if datapath == "python":
        return Aggregator(jobs, impair=impair, shard=shard), "python (as asked)"
    why_not = fastagg.UNAVAILABLE or ("impairment injection (--loss/--dup/--reorder/--jitter) "
                                      "runs in the Python datapath only" if impair.active
                                      else fastagg.unsupported(jobs))
    if why_not is None:
        return (fastagg.FastAggregator(jobs, gso=gso, shard=shard),
                "compiled (C, recvmmsg/sendmmsg" + (", UDP GSO)" if gso else ", no GSO)"))
    if datapath == "compiled":
        raise RuntimeError(f"--datapath compiled: {why_not}")
    return Aggregator(jobs, impair=impair, shard=shard), f"python ({why_not})"


def run(args: argparse.Namespace) -> int:
    try:
        cluster = Cluster.load(args.config)
        host, port = parse_hostport(args.listen)
    except (ConfigError, ValueError, OSError) as e:
        print(f"thc aggregator: {e}", file=sys.stderr)
        return 2
    try:
        impair = Impairment(loss=args.loss, dup=args.dup, reorder=args.reorder,
                             jitter=args.jitter)
    except ValueError as e:
        print(f"thc aggregator: {e}", file=sys.stderr)
        return 2
    try:
        agg, datapath = choose(args.datapath, cluster.jobs, impair, args.gso, args.shard)
    except (ConfigError, RuntimeError) as e:
        print(f"thc aggregator: {e}", file=sys.stderr)
        return 2
    try:
        addr = agg.start(host, port)
    except OSError as e:
        print(f"thc aggregator: cannot listen on {args.listen}: {e}", file=sys.stderr)
        return 2
    role = "" if args.shard is None else f" as shard {args.shard}"
    print(f"thc aggregator listening on {addr[0]}:{addr[1]}{role} with jobs "
          f"{[j.job_id for j in cluster.jobs]}, epoch {agg.epoch:#010x}, datapath {datapath}",
          flush=True)
    end = None if args.duration is None else time.monotonic() + args.duration
    last_print = time.monotonic()
    try:
        while end is None or time.monotonic() < end:
            time.sleep(0.5)
            if getattr(agg, "error", None) is not None:
                print(f"thc aggregator: the datapath stopped: {agg.error}", file=sys.stderr)
                return 1
            stats = agg.counters()
            if args.stats_file:
                # whole files only: readers poll it while it is rewritten
                tmp = Path(args.stats_file + ".tmp")
                tmp.write_text(json.dumps(stats, indent=2) + "\n")
                os.replace(tmp, args.stats_file)
            if args.stats_interval and time.monotonic() - last_print >= args.stats_interval:
                last_print = time.monotonic()
                print(json.dumps(stats), flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        agg.stop()
    print(json.dumps(agg.counters()), flush=True)
    return 0
