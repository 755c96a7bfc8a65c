"""``thc bench aggregator``: the compiled and the Python aggregator against their UDP echoes.

Four servers, measured in one run on the same packets: the compiled aggregator, the Python
aggregator, a compiled UDP echo with the compiled aggregator's receive/send loop and
batching (recvmmsg/sendmmsg), and a Python UDP echo with the Python aggregator's loop. An echo
answers every packet at once with a result-sized packet and aggregates nothing, so an
aggregator/echo ratio is the cost of aggregation itself. Each server runs in its own
process; by default the workers are played by a compiled load generator (one socket per
worker, a window of chunks each, ``--load-procs`` processes), so the clients are not what
is measured;
``--load python`` uses the real client (:class:`AggregationClient`, one process a worker).
"""
from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import queue
import sys
import time

from thc.argtypes import memory_refusal, positive_int
from thc.bench import add_common, emit_json
from thc.codec.packing import pack_bits
from thc.codec.settings import Settings
from thc.net import fastagg, fastload
from thc.net.aggregator import Aggregator
from thc.net.client import AggregationClient, resolve_datapath
from thc.testing.clusters import free_port_block, local_job
from thc.wire import protocol as P

SERVERS = ("compiled", "python", "compiled echo", "python echo")
RUN = 1


def odd_count(text: str) -> int:
    """A run count whose median is one of its runs: of an even count, the upper middle one
    was reported as the median (of 2, the best run)."""
    n = positive_int(text)
    if n % 2 == 0:
        raise argparse.ArgumentTypeError(f"an odd count, so that the median is a run: not {n}")
    return n


def worker_counts(text: str) -> list[int]:
    """Comma-separated worker counts, each one a job can have: 0 would divide the table's
    granularity by zero, and an empty item is a typo, not a count."""
    counts = []
    for part in text.split(","):
        n = positive_int(part.strip())
        if n > P.MAX_WORKERS:
            raise argparse.ArgumentTypeError(f"a job takes 1..{P.MAX_WORKERS} workers, not {n}")
        counts.append(n)
    return counts


def window_size(text: str) -> int:
    """Chunks in flight per worker: at least 1, and no more than the slot field can name."""
    n = positive_int(text)
    if n > P.SLOT_MOD:
        raise argparse.ArgumentTypeError(f"at most {P.SLOT_MOD} chunks in flight, not {n}")
    return n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    parser.add_argument("--workers", type=worker_counts, default="4",
                        help="comma-separated worker counts")
    parser.add_argument("--chunks", type=positive_int, default=None,
                        help="chunks per worker and run (default 32768; 2048 with --quick)")
    parser.add_argument("--lanes", type=int, default=None,
                        help=f"lanes per packet (default {P.LANES})")
    parser.add_argument("--window", type=window_size, default=64,
                        help="chunks in flight per worker")
    parser.add_argument("--repeat", type=odd_count, default=None,
                        help="runs per server, taken in turns, the median run kept: an odd "
                             "count (default 5; 1 with --quick)")
    parser.add_argument("--load", choices=("compiled", "python"), default="compiled",
                        help="who plays the workers: the compiled load generator (default) or "
                             "the Python client, one process per worker")
    parser.add_argument("--no-gso", dest="gso", action="store_false",
                        help="compiled servers send every reply on its own (no UDP GSO)")
    parser.add_argument("--load-procs", type=positive_int, default=None,
                        help="processes the compiled load generator spreads the workers over "
                             "(--load compiled only; default 1)")


class PythonEcho(Aggregator):
    """Answers each packet to its sender with a result-sized RESULT of zeros under the job's
    epoch (what a client of index-0 chunks takes); adds nothing.

    As lean per packet as the aggregator's own fast path (struct header, payload built
    once), so the ratio measures aggregation and not a slower ceiling. Like the compiled
    echo, it answers only a worker's upstream packet from its own address (anything else
    is a counted drop): an echo of a RESULT would answer another echo for good."""

    def __init__(self, jobs):
        super().__init__(jobs)
        self.echoed = 0
        self.payload = {j.job_id: bytes(P.payload_bytes(P.PktType.RESULT, j.lanes, j.sum_bits))
                        for j in jobs}
        self.full = {j.job_id: (j.n_workers, j.full_bitmap) for j in jobs}

    def handle(self, datagram, src):
        if len(datagram) < P.HEADER_BYTES:
            return self._dropped("malformed")
        (pkt_type, worker, job_id, slot, version, _, seq, offset,
         _, run, _) = P.HEADER_STRUCT.unpack_from(datagram)
        st = self.model.jobs.get(job_id)
        if pkt_type not in (P.PktType.DATA, P.PktType.MAX, P.PktType.FLUSH):
            return self._dropped("wrong_direction")
        if st is None:
            return self._dropped("unknown_job")
        if worker >= st.n:
            return self._dropped("worker_outside_job")
        if st.addr[worker] != src:
            return self._dropped("unknown_worker")
        n, bitmap = self.full[job_id]
        self.echoed += 1
        return [(P.HEADER_STRUCT.pack(P.PktType.RESULT, worker, job_id, slot, version, n,
                                      seq, offset, bitmap, run, self.model.jobs[job_id].epoch)
                 + self.payload[job_id], src)]

    def _dropped(self, reason: str) -> list:
        self.model.drops[reason] += 1
        return []


class _Flag:
    """A shared byte its maker raises: an Event's set() waits for every waiter to wake, for
    good where one was killed while it waited. A waiter (a child of the maker) stops waiting
    once the maker is gone: a bench killed before it raised the flag."""

    def __init__(self, ctx):
        self._byte = ctx.RawValue("b", 0)
        self.maker = os.getpid()

    def set(self) -> None:
        self._byte.value = 1

    def wait(self, poll: float = 0.0005) -> bool:
        """True once raised; False once the maker is gone."""
        while not self._byte.value:
            if os.getppid() != self.maker:
                return False
            time.sleep(poll)
        return True


def _serve(kind: str, jobs, port_q, stop, count_q, gso: bool):
    """Serves until ``stop``, or until the bench is gone (killed: nothing else would end
    it)."""
    if kind.startswith("compiled"):
        agg = (fastagg.FastEcho if kind.endswith("echo") else fastagg.FastAggregator)(jobs, gso=gso)
    else:
        agg = (PythonEcho if kind.endswith("echo") else Aggregator)(jobs)
    port_q.put(agg.start("127.0.0.1", 0)[1])
    stop.wait(poll=0.05)
    counters = agg.counters()
    agg.stop()
    count_q.put(agg.echoed if kind.endswith("echo")
                else counters["jobs"][jobs[0].job_id]["packets"])


def _payload(lanes: int, w: int, chunks: int) -> bytes:
    """Worker ``w``'s packed indices; the same bytes for every server of a run."""
    import numpy as np

    rng = np.random.default_rng(w)
    return pack_bits(rng.integers(0, 16, chunks * lanes).astype(np.uint8),
                     P.INDEX_BITS).tobytes()


def _child(label: str, target, args, done_q) -> None:
    """Runs ``target(*args)`` in a load process; its exception goes to the parent through
    ``done_q`` (and the traceback to stderr), so the parent names it at once."""
    try:
        target(*args)
    except BaseException as e:
        done_q.put(("failed", label, f"{type(e).__name__}: {e}"))
        raise


def _gather(done_q, procs: dict[str, mp.process.BaseProcess], server, timeout: float = 300.0
            ) -> list:
    """One result from each process of ``procs`` (label -> process). A process that fails
    or dies, or the ``server`` ending, ends the wait at once with a RuntimeError naming it
    and its exception or exit code, the others stopped, instead of waiting out ``timeout``
    for a result that cannot come."""
    results, end = [], time.monotonic() + timeout
    try:
        while len(results) < len(procs):
            try:
                item = done_q.get(timeout=0.1)
            except queue.Empty:
                if server.exitcode is not None:
                    raise RuntimeError(f"the aggregator under test ended mid-run (exit code "
                                       f"{server.exitcode})") from None
                dead = {k: p.exitcode for k, p in procs.items() if p.exitcode not in (None, 0)}
                if dead:
                    try:    # its exception, sent just before it ended, says more than the code
                        item = done_q.get(timeout=1.0)
                    except queue.Empty:
                        label, code = next(iter(dead.items()))
                        raise RuntimeError(f"{label} died with exit code {code}") from None
                elif time.monotonic() > end:
                    raise RuntimeError(f"no result from {', '.join(procs)} in {timeout:g} s")
                else:
                    continue
            if item[0] == "failed":
                raise RuntimeError(f"{item[1]} failed: {item[2]}")
            results.append(item[1])
    except BaseException:
        for p in procs.values():
            if p.is_alive():
                p.terminate()
        for p in procs.values():
            p.join(5)
        raise
    for p in procs.values():
        p.join()
    return results


def _client(job, w, addr, chunks, window, start, done_q):
    import numpy as np

    # index 0 (table value 0): sums every server answers alike, the echoes' zeros included
    packed = np.zeros(chunks * job.lanes // 2, dtype=np.uint8)
    with AggregationClient(job, w, addr, window=window, deadline=50, run=RUN) as c:
        if not start.wait():
            return
        t0 = time.perf_counter()
        c.aggregate(packed)
        done_q.put(("done", (t0, time.perf_counter(), c.stats.retransmitted)))


def _python_load(ctx, job, addr, chunks, window, server) -> tuple[float, int]:
    done_q, start = ctx.Queue(), _Flag(ctx)
    clients = {}
    for w in range(job.n_workers):
        label = f"the client of worker {w}"
        clients[label] = ctx.Process(name=label, target=_child, args=(label, _client, (
            job, w, addr, chunks, window, start, done_q), done_q))
    for c in clients.values():
        c.start()
    time.sleep(0.3)
    start.set()
    spans = _gather(done_q, clients, server)
    return (max(e for _, e, _ in spans) - min(s for s, _, _ in spans),
            sum(r for _, _, r in spans))


def _drive_group(job, workers, addr, chunks, window, payloads, start, done_q):
    import socket

    socks = {}
    try:
        for w in workers:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
            wk = job.worker(w)
            s.bind((wk.ip, wk.port))
            socks[w] = s
        if not start.wait():
            return
        t0 = time.perf_counter()
        out = fastload.drive(socks, addr, job, RUN, chunks, window, payloads)
        done_q.put(("done", (t0, time.perf_counter(), out)))
    finally:
        for s in socks.values():
            s.close()


def _compiled_load(ctx, job, addr, chunks, window, payloads, procs, server
                   ) -> tuple[float, int]:
    """The workers split over ``procs`` load-generator processes, started together."""
    done_q, start = ctx.Queue(), _Flag(ctx)
    groups = [list(range(job.n_workers))[i::procs] for i in range(procs)]
    gens = {}
    for i, g in enumerate(x for x in groups if x):
        label = f"load generator {i} (workers {','.join(map(str, g))})"
        gens[label] = ctx.Process(name=label, target=_child, args=(label, _drive_group, (
            job, g, addr, chunks, window, payloads, start, done_q), done_q))
    for g in gens.values():
        g.start()
    time.sleep(0.3)
    start.set()
    spans = _gather(done_q, gens, server)
    for _, _, out in spans:
        if not out["complete"]:
            raise RuntimeError(f"the load generator did not finish: {out}")
    return (max(e for _, e, _ in spans) - min(s for s, _, _ in spans),
            sum(out["retransmitted"] for _, _, out in spans))


def run_point(kind: str, n: int, chunks: int, lanes: int, window: int, load: str,
              payloads: dict[int, bytes], procs: int = 1, gso: bool = True) -> dict:
    """One point, its server and load forked from this process. What they inherit includes
    other libraries' objects (gRPC's, in a test process that used it) whose finalizers are
    unsafe after a fork: this process collects its garbage first and freezes the rest, so
    that no forked process's collection visits them."""
    gc.collect()
    gc.freeze()
    try:
        return _run_point(kind, n, chunks, lanes, window, load, payloads, procs, gso)
    finally:
        gc.unfreeze()


def _run_point(kind: str, n: int, chunks: int, lanes: int, window: int, load: str,
               payloads: dict[int, bytes], procs: int, gso: bool) -> dict:
    ctx = mp.get_context("fork")
    pool = 1 << (max(window, 64) - 1).bit_length()   # a power of two, as a job's pool is
    job = local_job(1, n, free_port_block(n), pool_size=pool, lanes=lanes,
                    granularity=255 // n)
    port_q, count_q, stop = ctx.Queue(), ctx.Queue(), _Flag(ctx)
    server = ctx.Process(target=_serve, args=(kind, [job], port_q, stop, count_q, gso))
    server.start()
    try:
        addr = ("127.0.0.1", port_q.get(timeout=30))
        if load == "python":
            elapsed, retransmitted = _python_load(ctx, job, addr, chunks, window, server)
        else:
            elapsed, retransmitted = _compiled_load(ctx, job, addr, chunks, window, payloads,
                                                    procs, server)
        stop.set()
        try:
            handled = count_q.get(timeout=30)
        except queue.Empty:
            raise RuntimeError(f"the aggregator under test sent no count within 30 s of its "
                               f"stop (exit code {server.exitcode})") from None
    except BaseException:
        stop.set()
        server.join(5)
        if server.is_alive():
            server.terminate()
        raise
    server.join()
    return {"server": kind, "workers": n, "lanes": lanes, "chunks": chunks, "load": load,
            "seconds": elapsed, "packets_in": handled, "packets_in_per_s": handled / elapsed,
            "coords_per_s": chunks * lanes / elapsed, "retransmitted": retransmitted,
            "packet_bytes_up": P.ETH_IP_UDP_BYTES + P.HEADER_BYTES
            + P.payload_bytes(P.PktType.DATA, lanes),
            "packet_bytes_down": P.ETH_IP_UDP_BYTES + P.HEADER_BYTES
            + P.payload_bytes(P.PktType.RESULT, lanes)}


def run(args: argparse.Namespace) -> int:
    lanes = P.LANES if args.lanes is None else args.lanes
    try:
        P.check_lanes(lanes)
        settings = Settings.from_env()      # ValueError: a bad THC_* variable
        if args.load == "python" and args.load_procs is not None:
            raise ValueError("--load-procs applies to --load compiled; --load python runs one "
                             "client process a worker")
        if (args.load_procs or 1) > max(args.workers):
            raise ValueError(f"--load-procs {args.load_procs}: the load generator runs at most "
                             f"a process a worker, and --workers {max(args.workers)} (the "
                             f"most) has fewer")
    except ValueError as e:
        print(f"thc bench aggregator: {e}", file=sys.stderr)
        return 2
    if not fastagg.available():
        print(f"thc bench aggregator: {fastagg.UNAVAILABLE}")
        return 2
    chunks = args.chunks if args.chunks is not None else 2048 if args.quick else 32768
    payload = chunks * lanes * P.INDEX_BITS // 8
    if why := memory_refusal(max(args.workers) * payload + chunks * lanes * 8,
                             f"--chunks {chunks} of {lanes} lanes for {max(args.workers)} "
                             f"workers"):
        print(f"thc bench aggregator: {why}", file=sys.stderr)
        return 2
    repeat = args.repeat if args.repeat is not None else 1 if args.quick else 5
    procs = None if args.load == "python" else args.load_procs or 1
    rows = []
    print(f"aggregators vs UDP echoes, {lanes} lanes/packet, {chunks} chunks per worker, "
          f"window {args.window}, compiled servers {'with' if args.gso else 'without'} UDP GSO, "
          f"load: "
          + (f"compiled load generator in {procs} process(es) (at most one a worker)"
             if args.load == "compiled" else f"AggregationClient processes, one a worker, "
                                             f"client datapath {resolve_datapath(None, settings)} "
                                             f"(THC_CLIENT_DATAPATH)"))
    print(f"{'workers':>7} {'server':>14} {'pkts/s in':>12} {'coords/s':>14} {'seconds':>8} "
          f"{'resent':>7}")
    for n in args.workers:
        payloads = {} if args.load == "python" else {w: _payload(lanes, w, chunks)
                                                     for w in range(n)}
        runs = {kind: [] for kind in SERVERS}
        try:
            for _ in range(repeat):   # in turns: a load that comes and goes meets every server
                for kind in SERVERS:
                    runs[kind].append(run_point(kind, n, chunks, lanes, args.window, args.load,
                                                payloads, procs or 1, args.gso))
        except RuntimeError as e:
            print(f"thc bench aggregator: {e}", file=sys.stderr)
            return 1
        median = {}
        for kind in SERVERS:
            ordered = sorted(runs[kind], key=lambda r: r["packets_in_per_s"])
            median[kind] = b = {**ordered[len(ordered) // 2],
                              "packets_in_per_s_runs": [r["packets_in_per_s"]
                                                        for r in runs[kind]]}
            print(f"{n:>7} {kind:>14} {b['packets_in_per_s']:>12,.0f} {b['coords_per_s']:>14,.0f} "
                  f"{b['seconds']:>8.3f} {b['retransmitted']:>7}  (median of {repeat}: "
                  f"{min(b['packets_in_per_s_runs']):,.0f}-{max(b['packets_in_per_s_runs']):,.0f})",
                  flush=True)
        rate = {k: v["packets_in_per_s"] for k, v in median.items()}
        ratios = {"compiled_vs_python": rate["compiled"] / rate["python"],
                  "compiled_vs_compiled_echo": rate["compiled"] / rate["compiled echo"],
                  "python_vs_python_echo": rate["python"] / rate["python echo"],
                  "compiled_echo_vs_python_echo": rate["compiled echo"] / rate["python echo"]}
        print(f"{n:>7} compiled/python {ratios['compiled_vs_python']:.2f}x (target >= 5), "
              f"compiled/compiled echo {ratios['compiled_vs_compiled_echo']:.2f} (target >= 0.5), "
              f"python/python echo {ratios['python_vs_python_echo']:.2f}, "
              f"compiled echo/python echo {ratios['compiled_echo_vs_python_echo']:.2f}x",
              flush=True)
        rows.append({"workers": n, **{k.replace(" ", "_"): v for k, v in median.items()},
                     "ratios": ratios,
                     "load_procs": None if procs is None else min(procs, n)})
    emit_json(args, {"benchmark": "aggregator", "lanes": lanes, "load": args.load,
                     "client_datapath": resolve_datapath(None, settings) if args.load == "python"
                     else None,
                     "load_procs": procs, "window": args.window, "gso": args.gso,
                     "rows": rows})
    return 0
