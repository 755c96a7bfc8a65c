"""``thc bench aggregator``: software aggregator throughput against a UDP echo ceiling.

Both servers run the same receive/send loop and serve the same windowed clients; the echo
server answers every packet at once with a result-sized packet and does no aggregation.
Their ratio is the cost of aggregation itself, measured in one run on one machine.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import time

from host.bench import add_common, emit_json
from host.codec.packing import pack_bits
from host.net.aggregator import Aggregator
from host.net.client import AggregationClient
from host.testing.clusters import free_port_block, local_job
from host.wire import protocol as P


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    parser.add_argument("--workers", default="2,4,8", help="comma-separated worker counts")
    parser.add_argument("--chunks", type=int, default=4096, help="chunks per worker and run")
    parser.add_argument("--lanes", type=int, default=None, help="lanes per packet")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2, help="runs per point (best kept)")


def _serve(kind: str, jobs, port_q, stop_ev, count_q):

    class Echo(Aggregator):
        """Answers each packet to its sender with a result-sized packet; adds nothing.

        As lean per packet as the aggregator's own fast path (struct header, payload built
        once), so the ratio measures aggregation and not a slower ceiling."""

        def __init__(self, jobs):
            super().__init__(jobs)
            self.echoed = 0
            self.payload = {j.job_id: bytes(P.payload_bytes(P.PktType.RESULT, j.lanes))
                            for j in jobs}
            self.full = {j.job_id: (j.n_workers, j.full_bitmap) for j in jobs}

        def handle(self, datagram, src):
            (_, worker, job_id, slot, version, _, seq, offset,
             _, run, epoch) = P.HEADER_STRUCT.unpack_from(datagram)
            n, bitmap = self.full[job_id]
            self.echoed += 1
            return [(P.HEADER_STRUCT.pack(P.PktType.RESULT, worker, job_id, slot, version, n,
                                          seq, offset, bitmap, run, epoch)
                     + self.payload[job_id], src)]

    agg = Echo(jobs) if kind == "echo" else Aggregator(jobs)
    port_q.put(agg.start("127.0.0.1", 0)[1])
    stop_ev.wait()
    agg.stop()
    count_q.put(agg.echoed if kind == "echo"
                else agg.counters()["jobs"][jobs[0].job_id]["packets"])


def _client(job, w, addr, chunks, window, start_ev, done_q):
    import numpy as np


    rng = np.random.default_rng(w)
    packed = pack_bits(rng.integers(0, 16, chunks * job.lanes).astype(np.uint8), P.INDEX_BITS)
    with AggregationClient(job, w, addr, window=window, deadline=60, run=1) as c:
        start_ev.wait()
        t0 = time.perf_counter()
        c.aggregate(packed)
        done_q.put((t0, time.perf_counter(), c.stats.retransmitted))


def run_point(kind: str, n: int, chunks: int, lanes: int, window: int) -> dict:

    ctx = mp.get_context("fork")
    job = local_job(1, n, free_port_block(n), pool_size=max(window, 64), lanes=lanes,
                    granularity=255 // n)
    port_q, count_q, done_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    stop_ev, start_ev = ctx.Event(), ctx.Event()
    server = ctx.Process(target=_serve, args=(kind, [job], port_q, stop_ev, count_q))
    server.start()
    addr = ("127.0.0.1", port_q.get(timeout=30))
    clients = [ctx.Process(target=_client, args=(job, w, addr, chunks, window, start_ev, done_q))
               for w in range(n)]
    for c in clients:
        c.start()
    time.sleep(0.3)
    start_ev.set()
    spans = [done_q.get(timeout=300) for _ in clients]
    for c in clients:
        c.join()
    stop_ev.set()
    handled = count_q.get(timeout=30)
    server.join()
    elapsed = max(e for _, e, _ in spans) - min(s for s, _, _ in spans)
    return {"kind": kind, "workers": n, "lanes": lanes, "chunks": chunks, "seconds": elapsed,
            "packets_in_per_s": handled / elapsed,
            "coords_per_s": chunks * lanes / elapsed,
            "retransmitted": sum(r for _, _, r in spans),
            "packet_bytes_up": P.ETH_IP_UDP_BYTES + P.HEADER_BYTES
            + P.payload_bytes(P.PktType.DATA, lanes),
            "packet_bytes_down": P.ETH_IP_UDP_BYTES + P.HEADER_BYTES
            + P.payload_bytes(P.PktType.RESULT, lanes)}


def run(args: argparse.Namespace) -> int:

    lanes = args.lanes or P.LANES
    P.check_lanes(lanes)
    chunks = 512 if args.quick else args.chunks
    rows = []
    print(f"software aggregator vs UDP echo, {lanes} lanes/packet, {chunks} chunks per worker")
    print(f"{'workers':>7} {'agg coords/s':>14} {'agg pkts/s':>12} {'echo pkts/s':>12} "
          f"{'ratio':>6}")
    for n in [int(x) for x in args.workers.split(",")]:
        best = {}
        for kind in ("aggregator", "echo"):
            runs = [run_point(kind, n, chunks, lanes, args.window)
                    for _ in range(1 if args.quick else args.repeat)]
            best[kind] = max(runs, key=lambda r: r["packets_in_per_s"])
        ratio = best["aggregator"]["packets_in_per_s"] / best["echo"]["packets_in_per_s"]
        rows.append({"workers": n, "aggregator": best["aggregator"], "echo": best["echo"],
                     "ratio": ratio})
        print(f"{n:>7} {best['aggregator']['coords_per_s']:>14,.0f} "
              f"{best['aggregator']['packets_in_per_s']:>12,.0f} "
              f"{best['echo']['packets_in_per_s']:>12,.0f} {ratio:>6.2f}", flush=True)
    emit_json(args, {"benchmark": "aggregator", "lanes": lanes, "rows": rows})
    return 0
