"""When does compression pay? The iteration-time model of Agarwal et al. (MLSys 2022).

T_iter = max(lambda * T_compute, T_comm) + T_encode + T_decode, with lambda ~ 1.04-1.1 (the
slowdown of compute when communication overlaps it). A ring all-reduce of b bytes over p
workers costs 2*alpha*(p-1) + 2*b*(p-1)/(p*BW). Through a switch (or a parameter server
with a fat link) each worker sends its compressed gradient once and receives the sums once,
full duplex: alpha*2 + max(up, down)/BW, unless the aggregator's own link (p x up) or, for
the software aggregator, its packet rate (p x packets / agg_pps) is slower. Marsit sends one
bit per coordinate through a ring (2(p-1)/p * d/8 bytes) or, as a vote through an
aggregator, d/8 bytes up and d 8-bit counts down. DLCP: under a packet loss rate q,
retransmitting everything sends 1/(1-q) of the bytes and waits a retransmission timeout
for the round's last lost chunk; a loss bound b >= q closes the round without either (a
bound below q still retransmits q - b of the chunks). Compression pays only when the
communication it saves is not hidden behind compute and exceeds its own encode/decode cost.

CPU contention: where workers and a software aggregator share ``cores`` (Mininet on one
machine), the CPU-bound parts are serialized: an iteration takes at least the CPU seconds
of every process (workers' compute and codec, the aggregator's packets) over the cores.

``thc model --calibrate out/mainjob.json`` feeds the model what the main job measured (its
compute per step, the codec seconds the THC hook really spent, the link bandwidth) plus the
project's benchmark figures (the software aggregator's packet rate, ``--agg-pps``; the
cores, ``--cores``) and prints the predicted iteration time of each mode beside the
measured one.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path

from host.wire import protocol as P


@dataclass(frozen=True)
class Setup:
    params: float = 25e6
    """Gradient elements per iteration."""
    workers: int = 8
    bandwidth_gbps: float = 10.0
    latency_us: float = 10.0
    compute_s: float = 0.1
    overlap: float = 1.05
    codec_mbps: float = 270.0
    """THC encode + decode throughput per worker (MB of float32 per second; `thc bench codec`)."""
    lanes: int = P.LANES
    granularity: int = 30
    agg_pps: float = float("inf")
    """Packets/s the aggregator handles (all workers together); inf for a switch at line
    rate. The software aggregator: 86e3 at 4 workers (`thc bench aggregator`)."""
    agg_bw_factor: float = float("inf")
    """The aggregator's link as a multiple of a worker's (the Mininet testbed: workers)."""
    cores: float = float("inf")
    """CPU cores shared by all workers and the aggregator (inf: each has its own)."""
    loss: float = 0.0
    """Packet loss rate on the way to and from the aggregator (DLCP)."""
    loss_bound: float = 0.0
    """DLCP's bound: the fraction of a round's chunks it may finish without."""
    rto_s: float = 0.02
    """Retransmission timeout (the client's initial one)."""

    @property
    def sum_bits(self) -> int:
        """Width of the aggregated sums: 8 bits up to 255 = workers x granularity, else 16."""
        return P.sum_bits_for(self.workers, self.granularity)

    @property
    def bw(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8

    @property
    def alpha(self) -> float:
        return self.latency_us * 1e-6


def ring_allreduce_s(nbytes: float, s: Setup) -> float:
    p = s.workers
    return 2 * s.alpha * (p - 1) + 2 * nbytes * (p - 1) / (p * s.bw)


def thc_wire_bytes(s: Setup) -> tuple[float, float]:
    """Bytes a worker sends and receives per iteration through the aggregator (with headers)."""
    overhead = P.ETH_IP_UDP_BYTES + P.HEADER_BYTES
    packets = s.params / s.lanes
    up = packets * (overhead + P.payload_bytes(P.PktType.DATA, s.lanes))
    down = packets * (overhead + P.payload_bytes(P.PktType.RESULT, s.lanes, s.sum_bits))
    return up, down


def vote_wire_bytes(s: Setup) -> tuple[float, float]:
    """Bytes a worker sends (sign bits) and receives (8-bit counts) per iteration in a vote."""
    overhead = P.ETH_IP_UDP_BYTES + P.HEADER_BYTES
    lanes = s.lanes // 8 * 8
    packets = s.params / lanes
    up = packets * (overhead + P.payload_bytes(P.PktType.DATA, lanes, aggregation="vote"))
    down = packets * (overhead + P.payload_bytes(P.PktType.RESULT, lanes, 8))
    return up, down


def aggregator_s(up: float, down: float, packets: float, s: Setup) -> float:
    """One round through an aggregator: the worker's link (full duplex), the aggregator's
    link (every worker's packets) and the aggregator's packet rate, whichever is slowest."""
    p = s.workers
    return 2 * s.alpha + max(max(up, down) / s.bw, p * max(up, down) / (s.agg_bw_factor * s.bw),
                             p * packets / s.agg_pps)


def lossy_s(wire_s: float, packets: float, s: Setup, bound: float) -> float:
    """A round of ``wire_s`` under loss ``s.loss`` with loss bound ``bound`` (DLCP; 0:
    retransmit everything): resent bytes, plus one timeout while a chunk is still owed."""
    q = s.loss
    if q <= 0:
        return wire_s
    resent = max(0.0, q - bound)
    owed = 1 - (1 - resent) ** packets if resent else 0.0
    return wire_s * (1 + resent / (1 - q)) + owed * s.rto_s


def iteration_s(s: Setup) -> dict[str, float]:
    """Modelled iteration time of each scheme: FP32 ring all-reduce, THC via a switch (and
    with DLCP's loss bound), THC via all-reduce, Marsit's ring and Marsit's vote."""
    compute = s.overlap * s.compute_s
    codec = 4 * s.params / (s.codec_mbps * 1e6)
    up, down = thc_wire_bytes(s)
    packets = s.params / s.lanes
    thc_agg = aggregator_s(up, down, packets, s)
    vup, vdown = vote_wire_bytes(s)
    vpackets = s.params / (s.lanes // 8 * 8)
    t = {
        "fp32_ring": max(compute, ring_allreduce_s(4 * s.params, s)),
        "thc_switch": max(compute, lossy_s(thc_agg, packets, s, 0.0)) + codec,
        "thc_switch_dlcp": max(compute, lossy_s(thc_agg, packets, s, s.loss_bound)) + codec,
        "thc_allreduce": max(compute, ring_allreduce_s(s.params * s.sum_bits / 8, s)) + codec,
        "marsit_ring": max(compute, ring_allreduce_s(s.params / 8, s)),
        "marsit_vote": max(compute, aggregator_s(vup, vdown, vpackets, s)),
    }
    if s.cores != float("inf"):
        # CPU-bound work of every process over the shared cores: a floor under each scheme
        agg_cpu = {"thc_switch": s.workers * packets, "thc_switch_dlcp": s.workers * packets,
                   "marsit_vote": s.workers * vpackets}
        for name in t:
            own = s.workers * (s.compute_s + (codec if name.startswith("thc") else 0.0))
            cpu = own + agg_cpu.get(name, 0.0) / s.agg_pps * min(s.cores, 1.0)
            t[name] = max(t[name], cpu / s.cores)
    return t


MODE_SCHEME = {"fp32": "fp32_ring", "thc": "thc_switch", "thc-bmv2": "thc_switch",
               "thc-dist": "thc_allreduce", "marsit": "marsit_ring",
               "marsit-vote": "marsit_vote", "marsit-vote-bmv2": "marsit_vote",
               "dlcp": "thc_switch_dlcp"}
"""Main-job modes and the model's scheme for each (TopK's all-gather is not modelled)."""


def calibrate(report: dict) -> list[dict]:
    """Predicted against measured seconds per training step for each run of a main job.

    Compute per step comes from the runs whose hook reports how much communication backward
    waited for (step time minus exposed communication, averaged); the codec cost from the
    THC hook's own encode/decode/feedback seconds; bandwidth and workers from the job.
    """
    args, runs = report["args"], report["runs"]
    rows, computes = [], []
    for r in runs:
        last = r["history"][-1]
        step = r["train_seconds"] / last["steps"]
        if last.get("exposed_comm_seconds") is not None and r["mode"] != "fp32":
            computes.append(step - last["exposed_comm_seconds"] / last["steps"])
    if not computes:
        raise ValueError("the report has no run with a communication breakdown")
    compute = sum(computes) / len(computes)
    base = Setup(params=float(runs[0]["params"]), workers=int(args["workers"]),
                 bandwidth_gbps=float(args["bw"]) / 1e3, latency_us=0.0, compute_s=compute,
                 overlap=1.0, lanes=int(args.get("software_lanes") or P.LANES))
    for r in runs:
        scheme = MODE_SCHEME.get(r["mode"])
        last = r["history"][-1]
        measured = r["train_seconds"] / last["steps"]
        if scheme is None:
            continue
        codec_s = (last.get("codec_seconds") or 0.0) / last["steps"]
        s = replace(base, lanes=P.LANES if r["mode"] == "thc-bmv2" else base.lanes,
                    codec_mbps=(4 * base.params / codec_s / 1e6) if codec_s else 1e12)
        predicted = iteration_s(s)[scheme]
        rows.append({"mode": r["mode"], "scheme": scheme, "measured_s": measured,
                     "predicted_s": predicted, "error": predicted / measured - 1,
                     "compute_s": compute, "codec_s": codec_s})
    return rows


def break_even_gbps(s: Setup, scheme: str = "thc_switch", lo: float = 1e-3,
                    hi: float = 1e4) -> float | None:
    """Bandwidth below which ``scheme`` beats FP32 (None if it never does in [lo, hi])."""
    def gain(bw: float) -> float:
        t = iteration_s(Setup(**{**s.__dict__, "bandwidth_gbps": bw}))
        return t["fp32_ring"] - t[scheme]

    if gain(lo) <= 0:
        return None
    if gain(hi) > 0:
        return hi
    for _ in range(100):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if gain(mid) > 0 else (lo, mid)
    return lo


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=float, default=25e6, help="gradient elements")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--bw", default="1,10,25,100", help="link bandwidths, Gbit/s")
    parser.add_argument("--latency-us", type=float, default=10.0)
    parser.add_argument("--compute-ms", type=float, default=100.0, help="compute per iteration")
    parser.add_argument("--overlap", type=float, default=1.05, help="lambda (1.04-1.1)")
    parser.add_argument("--codec-mbps", type=float, default=270.0,
                        help="THC encode+decode MB/s per worker (see thc bench codec)")
    parser.add_argument("--calibrate", metavar="MAINJOB_JSON",
                        help="compare the model with a main job's measured step times "
                             "(out/mainjob.json)")


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        rows = calibrate(json.loads(Path(args.calibrate).read_text()))
        print(f"{'mode':<9} {'scheme':<14} {'measured ms':>12} {'predicted ms':>13} "
              f"{'error':>7}   (compute {1e3 * rows[0]['compute_s']:.0f} ms/step, measured)")
        for r in rows:
            print(f"{r['mode']:<9} {r['scheme']:<14} {1e3 * r['measured_s']:>12.1f} "
                  f"{1e3 * r['predicted_s']:>13.1f} {100 * r['error']:>+6.0f}%")
        return 0
    base = Setup(params=args.params, workers=args.workers, latency_us=args.latency_us,
                 compute_s=args.compute_ms / 1e3, overlap=args.overlap,
                 codec_mbps=args.codec_mbps)
    print(f"{args.params / 1e6:g}M parameters, {args.workers} workers, compute "
          f"{args.compute_ms:g} ms, overlap {args.overlap}, codec {args.codec_mbps:g} MB/s")
    print(f"{'Gbit/s':>7} {'FP32 ring ms':>13} {'THC switch ms':>14} {'THC allred ms':>14} "
          f"{'switch speedup':>15}")
    for bw in (float(x) for x in args.bw.split(",")):
        t = iteration_s(Setup(**{**base.__dict__, "bandwidth_gbps": bw}))
        print(f"{bw:>7g} {1e3 * t['fp32_ring']:>13.1f} {1e3 * t['thc_switch']:>14.1f} "
              f"{1e3 * t['thc_allreduce']:>14.1f} {t['fp32_ring'] / t['thc_switch']:>14.2f}x")
    for scheme in ("thc_switch", "thc_allreduce"):
        be = break_even_gbps(base, scheme)
        print(f"{scheme} pays below {be:.3g} Gbit/s" if be else f"{scheme} never pays here")
    return 0
