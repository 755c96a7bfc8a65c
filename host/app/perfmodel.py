"""When does compression pay? The iteration-time model of Agarwal et al. (MLSys 2022).

T_iter = max(lambda * T_compute, T_comm) + T_encode + T_decode, with lambda ~ 1.04-1.1 (the
slowdown of compute when communication overlaps it). A ring all-reduce of b bytes over p
workers costs 2*alpha*(p-1) + 2*f*b*(p-1)/(p*BW) (f: TCP's framing, 1514/1448; THC's
datagrams count their own headers), alpha paid once per message and per DDP
bucket (``buckets``: DDP's 1 MB first bucket, then 25 MB ones). Schemes:

- FP32: one ring all-reduce of 4 bytes a coordinate.
- FP16: the same of 2 bytes a coordinate, plus the cast to half and back (``fp16_mbps``).
- THC over all-reduce: a MAX all-reduce of the norms and one of the sums (the narrowest of
  8, 16, 32 bits that holds them, as the all-reduce carries them: 16 bits up to 1092 workers
  at granularity 30, where a switch's unsigned sums hold 2184), after the round's agreement
  (a small MAX all-reduce of its tags) on Gloo.
- THC through a switch or the software aggregator: each worker streams its chunks once and
  receives the sums once, full duplex; the round takes the slowest of the worker's link, the
  aggregator's link (p x the bytes, ``agg_bw_factor`` x BW), its packet rate (``agg_pps``)
  and the client's window (``window`` chunks a round trip of 2 alpha), plus the MAX round.
  Shards on the worker hosts (``colocated``) share the workers' links: each carries, each
  way, (p - 1) / p of a worker's bytes up plus down.
- Marsit's ring: the agreement, an all-reduce of the scales and a ring of d/8 bytes of signs:
  2(p-1) hops of d/(8p) bytes.
- Marsit's vote: the agreement and the scales' all-reduce, then d/8 bytes of signs up and d
  8-bit counts down
  through the aggregator, as THC's chunks.
- TopK: the agreement, then two all-gathers (values and indices, 4 bytes each) of
  k = ratio x d per worker.
- Loss: under a loss rate q a link, a packet to or from the aggregator is lost with
  q' = 1 - (1-q)^links (``agg_links``: one to a switch, two to a host behind it); a chunk
  whose DATA or RESULT is lost is sent again, so a round sends 1/(1-q')^2 of the bytes, and
  it waits a retransmission timeout when any of its chunks, any worker's, was lost: the step
  waits for its slowest worker. DLCP's loss bound is
  charged alike: the client resends a chunk found lost by later results (fast retransmit)
  as it would without one, and closes one short only where its timer expired, with a
  ``FLUSH`` in place of the resent ``DATA`` (host/net/pywindow.py), so the wait is the
  same and only that chunk's payload is saved. DLCP's gain in the main job came from its
  priority queues under congestion (docs/results.md), which the model leaves out.

Compression pays only when the communication it saves is not hidden behind compute and
exceeds its own encode/decode cost. Only THC's and FP16's rows carry that cost: TopK's
selection and Marsit's sign packing are left out, so their rows are lower bounds (and a
Marsit run that fits alpha carries its own CPU time into it).

``thc model --calibrate A.json [B.json ...]`` feeds the model what main jobs measured (their
compute per step, the codec seconds the hooks really spent, the link bandwidth) and two
testbed figures: alpha and the link efficiency (the fraction of the nominal bandwidth a
shaped Mininet link delivers to the frames, headers counted). Given as
``--alpha-ms``/``--efficiency``, or fitted to the first report's FP32 run (bandwidth-bound)
and Marsit ring run (latency-bound), which are then labelled as fitted; every other row is a
prediction. On Mininet with 2 cores for 4 workers, alpha is not the wire's latency (0 there)
but the per-message cost of the software path under CPU contention (Gloo, Python, the Linux
bridge): what the plain bandwidth model missed (it put FP32's steps 14% and Marsit's 79%
below the measured ones). A report's link delay (``--delay``) is added to alpha where a
message crosses the links (``link_delay_s``), not fitted into it, so alpha carries over to
reports with another delay.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace

from thc.argtypes import (DAMAGED, fraction, non_negative_float, positive_float, positive_floats,
                          positive_int, read_json, refusal, slowdown, whole_count)
from thc.codec.common import wire_sum_bits
from thc.collective.agreement import TAG_LANES
from thc.wire import protocol as P

TCP_FRAMING = P.TCP_FRAME / P.TCP_MSS
"""Frame bytes a TCP payload byte takes on the wire: a 1448-byte segment (MSS at a 1500-byte
MTU, with timestamps) in a 1514-byte Ethernet frame. Gloo's collectives are charged it as
THC's datagrams are charged their headers, so a link efficiency fitted to an FP32 run
(``--calibrate``) is the link's alone, not TCP's framing charged again to THC's headers."""
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20
"""DDP's default bucket sizes (its first bucket is smaller, so communication starts early)."""


def ddp_buckets(params: float) -> int:
    """Buckets DDP makes of ``params`` float32 gradients with its default sizes, where its
    tensors are small beside a bucket: an approximation from above, as DDP closes a bucket
    once it reaches its size, so large tensors fill fewer (ResNet-50's 25.6M gradients made
    4 buckets, where this gives 5; a bucket's alpha terms are all that differ)."""
    return 1 + math.ceil(max(0.0, 4 * params - FIRST_BUCKET_BYTES) / BUCKET_BYTES)


@dataclass(frozen=True)
class Setup:
    params: float = 25e6
    """Gradient elements per iteration."""
    workers: int = 8
    bandwidth_gbps: float = 10.0
    latency_us: float = 10.0
    """alpha: cost of one message (a ring hop, half an aggregator round trip), beyond the
    links' delay (``link_delay_s``)."""
    compute_s: float = 0.1
    overlap: float = 1.05
    codec_mbps: float = 1000.0
    """THC encode + decode throughput per worker (MB of float32 per second): the compiled CPU
    codec on one core, 1.00-1.16 GB/s on the 2-core VM (`thc bench codec --sizes 24`, the
    README's figure). Error feedback's decode of the worker's own indices (training's
    default) is not in it: calibrated from a main job, the hooks' own codec seconds are."""
    fp16_mbps: float = float("inf")
    """FP16's cast down and back, MB of float32 per second (`thc bench codec`'s fp16 round
    trip); inf leaves it out."""
    lanes: int = P.LANES
    granularity: int = 30
    buckets: int = 1
    """Collective rounds per iteration (DDP buckets), each paying its own latencies."""
    window: int = 32
    """Chunks a client keeps in flight (AggregationClient.DEFAULT_WINDOW)."""
    agg_pps: float = float("inf")
    """Packets/s the aggregator handles (all workers together); inf for a switch at line
    rate. ``--agg-pps``'s default for the software aggregators in the main job, 86e3 at 4
    workers, is an assumed figure (docs/results.md says why it binds no prediction there)."""
    efficiency: float = 1.0
    """Fraction of the nominal bandwidth the frames get (shaping): every scheme's bytes carry
    their headers (:data:`TCP_FRAMING` on everything Gloo carries, Marsit's ring included;
    THC's and the vote's datagrams their own)."""
    agg_bw_factor: float = float("inf")
    """The aggregator's link as a multiple of a worker's: inf for a switch, 1 for one central
    software aggregator on a link like the workers' (the Mininet testbed's default); shards
    on every worker host are ``colocated`` instead."""
    colocated: bool = False
    """Shards on the worker hosts: a worker's link carries, each way, its chunks to the other
    shards and its shard's results to the other workers, (p - 1) / p of up plus down."""
    topk_ratio: float = 0.1
    loss: float = 0.0
    """Packet loss rate of a link (the testbed's ``--loss``), on the way to and from the
    aggregator (DLCP)."""
    link_delay_s: float = 0.0
    """One way delay of a link (the testbed's ``--delay``): a message between two worker
    hosts crosses two links (worker, switch, worker), a packet to the aggregator
    ``agg_links``."""
    agg_links: int = 1
    """Links a packet crosses each way between a worker and its aggregator: 1 to a switch,
    2 to a software aggregator on a host behind the testbed's switch (a shard's own
    worker's chunks cross none, and are counted as crossing)."""
    rto_s: float = 0.02
    """Retransmission timeout (the client's initial one)."""
    agree_each_round: bool = True
    """THC over all-reduce agrees on its round's tags before every round, as on Gloo
    (``DistTransport.agree_each_round``); False: at a bucket's first size only (NCCL)."""

    @property
    def sum_bits(self) -> int:
        """Width of the aggregated sums: 8 bits up to 255 = workers x granularity, else 16."""
        return P.sum_bits_for(self.workers, self.granularity)

    @property
    def bw(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8 * self.efficiency

    @property
    def alpha(self) -> float:
        return self.latency_us * 1e-6

    @property
    def hop_s(self) -> float:
        """One message between two worker hosts: alpha and two links' delay."""
        return self.alpha + 2 * self.link_delay_s

    @property
    def agg_hop_s(self) -> float:
        """One packet between a worker and its aggregator."""
        return self.alpha + self.agg_links * self.link_delay_s


AGREE_BYTES, TOGETHER_BYTES = 4 * TAG_LANES, 4 * (TAG_LANES + 1)
"""One agreement all-reduce (thc.collective.agreement, float32 lanes): THC's tag lanes
(``agree``); TopK's and Marsit's tag lanes and a mark lane (``together``)."""


def ring_allreduce_s(nbytes: float, s: Setup, collectives: int = 1) -> float:
    """``collectives`` ring all-reduces per bucket moving ``nbytes`` in all."""
    p = s.workers
    return (2 * s.hop_s * (p - 1) * collectives * s.buckets
            + 2 * nbytes * TCP_FRAMING * (p - 1) / (p * s.bw))


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
    """One iteration's chunks through an aggregator: the slowest of the worker's link (full
    duplex), the aggregator's link (every worker's packets), its packet rate and the
    client's window (``window`` chunks a round trip, per bucket)."""
    p = s.workers
    per_bucket = packets / s.buckets
    windowed = s.buckets * math.ceil(per_bucket / s.window) * 2 * s.agg_hop_s
    links = ((p - 1) / p * (up + down) / s.bw if s.colocated else
             max(max(up, down) / s.bw, p * max(up, down) / (s.agg_bw_factor * s.bw)))
    return max(links, p * packets / s.agg_pps, windowed)


def lossy_s(wire_s: float, packets: float, s: Setup) -> float:
    """The rounds of a step (one a bucket), ``wire_s`` and a worker's ``packets`` in all,
    under loss ``s.loss`` a link: resent bytes, plus a timeout for each round in which a
    DATA or a RESULT of any worker's chunk was lost."""
    if s.loss <= 0:
        return wire_s
    kept = (1 - s.loss) ** s.agg_links   # one way
    sent = 2 * s.workers * packets / s.buckets   # a round's DATA and RESULT, every worker's
    owed = s.buckets * (1 - kept ** sent)
    return wire_s / kept ** 2 + owed * s.rto_s


def iteration_s(s: Setup) -> dict[str, float]:
    """Modelled iteration time of each scheme (see the module docstring)."""
    compute = s.overlap * s.compute_s
    codec = 4 * s.params / (s.codec_mbps * 1e6)
    p = s.workers
    up, down = thc_wire_bytes(s)
    packets = s.params / s.lanes
    max_round = s.buckets * 2 * s.agg_hop_s
    thc_agg = aggregator_s(up, down, packets, s)
    vup, vdown = vote_wire_bytes(s)
    vote = aggregator_s(vup, vdown, s.params / (s.lanes // 8 * 8), s)
    k = s.topk_ratio * s.params
    agree = TOGETHER_BYTES * s.buckets   # TopK's and Marsit's agreement before each call
    thc_agree = AGREE_BYTES * s.buckets if s.agree_each_round else 0
    return {
        "fp32_ring": max(compute, ring_allreduce_s(4 * s.params, s)),
        "fp16_ring": max(compute, ring_allreduce_s(2 * s.params, s))
        + 4 * s.params / (s.fp16_mbps * 1e6),
        "thc_switch": max(compute, max_round + lossy_s(thc_agg, packets, s)) + codec,
        "thc_allreduce": max(compute, ring_allreduce_s(
            s.params * wire_sum_bits(p, s.granularity) / 8 + thc_agree, s,
            3 if thc_agree else 2)) + codec,
        "marsit_ring": max(compute, ring_allreduce_s(s.params / 8 + agree, s, 3)),
        "marsit_vote": max(compute, ring_allreduce_s(agree, s, 2) + vote),
        "topk_allgather": max(compute, ring_allreduce_s(agree, s) + 2 * s.hop_s * (p - 1)
                              * s.buckets + (p - 1) * k * 8 * TCP_FRAMING / s.bw),
    }


MODE_SCHEME = {"fp32": "fp32_ring", "fp16": "fp16_ring", "thc": "thc_switch",
               "thc-central": "thc_switch", "thc-bmv2": "thc_switch",
               "thc-dist": "thc_allreduce", "marsit": "marsit_ring",
               "marsit-vote": "marsit_vote", "marsit-vote-bmv2": "marsit_vote",
               "topk": "topk_allgather", "thc-lossy": "thc_switch", "thc-dlcp": "thc_switch"}
"""Main-job modes and the model's scheme for each."""
CENTRAL_MODES = ("thc-central", "thc-lossy", "thc-dlcp", "marsit-vote")
"""Main-job modes through one central software aggregator on its own host, whose link is a
worker's (mininet/thcnet/mainjob.py); ``thc`` runs a shard on every worker host."""
NO_HOOK = ("fp32", "fp16")
"""Modes that run DDP's own all-reduce: no hook says how much of a step was communication."""


def step_seconds(run: dict) -> float:
    """Steady-state seconds per step: from the first evaluation to the last (the first steps
    pay DDP's bucket rebuild and Gloo's connection setup, which the model leaves out)."""
    h = run["history"]
    if len(h) >= 2 and h[-1]["steps"] > h[0]["steps"]:
        return (h[-1]["seconds"] - h[0]["seconds"]) / (h[-1]["steps"] - h[0]["steps"])
    return run["train_seconds"] / h[-1]["steps"]


def report_setup(report: dict, agg_pps: float, links_only: bool = False) -> Setup:
    """The main job's setup: compute per step from the runs whose hook reports how much
    communication backward waited for (step time minus exposed communication, averaged),
    bandwidth and workers from its arguments, DDP's buckets from the model size.
    ``links_only``: no compute (0), for what the links cost alone: a report whose hooked
    runs failed still has that."""
    args, runs = report["args"], report["runs"]
    computes = []
    for r in runs:
        last = r["history"][-1]
        if last.get("exposed_comm_seconds") is not None and r["mode"] not in NO_HOOK:
            computes.append((r["train_seconds"] - last["exposed_comm_seconds"])
                            / last["steps"])
    if links_only:
        computes = [0.0]
    if not computes:
        raise ValueError("the report has no run with a communication breakdown")
    params = float(runs[0]["params"])
    workers = int(args["workers"])
    lanes = int(args.get("software_lanes") or 0) or P.max_software_lanes(
        P.sum_bits_for(workers, 30))
    return Setup(params=params, workers=workers, bandwidth_gbps=float(args["bw"]) / 1e3,
                 latency_us=0.0, compute_s=sum(computes) / len(computes), overlap=1.0,
                 lanes=lanes, buckets=ddp_buckets(params), agg_pps=agg_pps,
                 agg_bw_factor=workers, colocated=True, agg_links=2, codec_mbps=1e12,
                 loss=float(args.get("loss") or 0.0) / 100,
                 link_delay_s=float(args.get("delay") or 0.0) / 1e3)


def fit_terms(base: Setup, scheme: str) -> tuple[float, float, float]:
    """A scheme's seconds a step without compute, in the parts the fits solve for: its
    messages (seconds per second of alpha), its bytes at full efficiency, and its links'
    delay (known, not fitted)."""
    s = replace(base, compute_s=0.0, latency_us=0.0, link_delay_s=0.0)
    msgs = iteration_s(replace(s, latency_us=1e6, bandwidth_gbps=1e12))[scheme]
    delay = iteration_s(replace(s, link_delay_s=base.link_delay_s, bandwidth_gbps=1e12))[scheme]
    return msgs, iteration_s(s)[scheme], delay


BMV2_THC_OF_L2 = 0.048
"""BMv2's rate of THC packets (256 lanes, 8-bit sums) as a share of its own L2 forwarding,
the two measured in one run (`thc bench switch`, docs/results.md "The switch", 2026-11-23;
the ratio follows the L2 rate a run's sender offers, 0.06-0.14 in later runs). A main job's report
carries the L2 rate of its BMv2 (``bmv2_probe``), which differs by build and machine."""


def bmv2_pps(report: dict) -> float | None:
    """The packets/s a report's BMv2 modes are modelled at: :data:`BMV2_THC_OF_L2` of its
    probe's L2 rate; None without a probe, or for a build with logging macros (they slow
    the THC program about 3x and L2 forwarding far less: the ratio does not carry)."""
    probe = report.get("bmv2_probe") or {}
    l2 = probe.get("l2_pps")
    if not l2 or not str(probe.get("build", "")).startswith("fast"):
        return None
    return BMV2_THC_OF_L2 * float(l2)


def mode_setup(base: Setup, mode: str, report: dict) -> Setup:
    """``base`` (a main job's setup: :func:`report_setup`, shards on the worker hosts) as
    ``mode`` ran: through BMv2 at its lanes, at the packet rate of the report's probe and one
    link a way; through one central software aggregator whose link is a worker's."""
    if mode.endswith("bmv2"):
        return replace(base, lanes=P.LANES, agg_pps=bmv2_pps(report) or float("inf"),
                       agg_bw_factor=float("inf"), colocated=False, agg_links=1)
    if mode in CENTRAL_MODES:
        return replace(base, agg_bw_factor=1.0, colocated=False)
    return base


def modelled(mode: str, report: dict) -> bool:
    """Whether the model knows the aggregator ``mode`` ran through: BMv2's rate only from a
    report's probe (:func:`bmv2_pps`)."""
    return not mode.endswith("bmv2") or bmv2_pps(report) is not None


def bounded_fit(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(alpha seconds, link efficiency) of the least-squares fit of ``rows`` (messages,
    bytes at full efficiency, measured seconds: step = alpha x messages + bytes /
    efficiency). Residuals are relative (weights 1/step^2): step times span an order of
    magnitude, and absolute ones would let the slowest settle alpha. The fit is bounded,
    alpha >= 0 and efficiency <= 1 (a link delivers at most its nominal rate): noisy steps
    can put the free fit outside them, and the nearest fit within them is then taken (the
    optimum lies on a bound's edge: each edge is a one-term fit)."""
    if any(t <= 0 for _, _, t in rows):
        raise ValueError("a step no longer than its links' delay leaves nothing to fit")
    w = [1.0 / (t * t) for _, _, t in rows]
    saa = sum(wi * a * a for wi, (a, _, _) in zip(w, rows))
    sab = sum(wi * a * b for wi, (a, b, _) in zip(w, rows))
    sbb = sum(wi * b * b for wi, (_, b, _) in zip(w, rows))
    sat = sum(wi * a * t for wi, (a, _, t) in zip(w, rows))
    sbt = sum(wi * b * t for wi, (_, b, t) in zip(w, rows))
    det = saa * sbb - sab * sab
    if det <= 0:
        raise ValueError("the runs do not separate alpha from bandwidth")
    free = ((sat * sbb - sbt * sab) / det, (saa * sbt - sab * sat) / det)
    fits = [free] if free[0] >= 0 and free[1] >= 1 else []
    fits += [(0.0, max(1.0, sbt / sbb)), (max(0.0, (sat - sab) / saa), 1.0)]

    def cost(fit: tuple[float, float]) -> float:
        return sum(wi * (fit[0] * a + fit[1] * b - t) ** 2 for wi, (a, b, t) in zip(w, rows))
    alpha, inv_eff = min(fits, key=cost)
    return alpha, 1.0 / inv_eff


FIT_MODES = ("fp32", "marsit")
"""The runs alpha and the link efficiency are fitted to: one bandwidth-bound, one
latency-bound."""


def fit(report: dict, agg_pps: float = 86e3) -> tuple[float, float]:
    """(alpha seconds, link efficiency) that make the model meet the report's FP32 and
    Marsit ring step times: two equations, alpha x messages + bytes / (efficiency x BW),
    solved within the bounds of :func:`bounded_fit` (outside them, its nearest fit)."""
    base = report_setup(report, agg_pps)
    runs = {r["mode"]: r for r in report["runs"]}
    missing = [m for m in FIT_MODES if m not in runs]
    if missing:
        raise ValueError(f"cannot fit alpha and efficiency without the {missing} run(s) "
                         f"(a main job run with --modes including fp32,marsit): give "
                         f"--alpha-ms and --efficiency, or such a report")
    rows = []
    for mode in FIT_MODES:
        msgs, wire, delay = fit_terms(base, MODE_SCHEME[mode])
        rows.append((msgs, wire, step_seconds(runs[mode]) - delay))
    return bounded_fit(rows)


def calibrate(report: dict, alpha_s: float | None = None, efficiency: float | None = None,
              agg_pps: float = 86e3, fitted: bool = False) -> list[dict]:
    """Predicted against measured seconds per training step for each run of a main job.

    The codec cost of each mode comes from its hook's own encode/decode/feedback seconds;
    alpha and efficiency as given, else fitted to this report (:func:`fit`), and then its
    FP32 and Marsit rows say ``fitted``.
    """
    if (alpha_s is None) != (efficiency is None):
        raise ValueError("alpha and efficiency are given together or fitted together")
    base = report_setup(report, agg_pps)
    if alpha_s is None or efficiency is None:
        alpha_s, efficiency = fit(report, agg_pps)
        fitted = True
    base = replace(base, latency_us=alpha_s * 1e6, efficiency=efficiency)
    rows = []
    for r in report["runs"]:
        scheme = MODE_SCHEME.get(r["mode"])
        if scheme is None:
            continue
        last = r["history"][-1]
        codec_s = (last.get("codec_seconds") or 0.0) / last["steps"]
        s = replace(mode_setup(base, r["mode"], report),
                    codec_mbps=(4 * base.params / codec_s / 1e6) if codec_s else 1e12)
        measured, predicted = step_seconds(r), iteration_s(s)[scheme]
        rows.append({"mode": r["mode"], "scheme": scheme, "measured_s": measured,
                     "predicted_s": predicted, "error": predicted / measured - 1,
                     "compute_s": base.compute_s, "codec_s": codec_s, "alpha_s": alpha_s,
                     "efficiency": efficiency, "bw_mbit": float(report["args"]["bw"]),
                     "steps": last["steps"], "testbed": r.get("testbed"),
                     "fitted": fitted and r["mode"] in FIT_MODES,
                     "modelled": modelled(r["mode"], report)})
    return rows


GRID_POINTS = 71
"""Bandwidths :func:`break_even` samples the gain at, evenly on a log scale (10 a decade over
[1 Mbit/s, 10 Tbit/s]) before it bisects each change of sign: about as many evaluations as a
bisection of the whole range took; a band narrower than a step of the grid (x1.26) where
the sign changes twice is passed over."""


def break_even(s: Setup, scheme: str = "thc_switch", lo: float = 1e-3, hi: float = 1e4,
               baseline: str = "fp32_ring") -> dict:
    """Where ``scheme`` beats ``baseline`` in [lo, hi] Gbit/s. ``pays``: the bands where it
    does, ``[start, end]`` each. ``relation``, in the words of the measured side
    (thc.app.breakeven.crossing): "between" (it beats the baseline from ``lo`` up to ``at``,
    the first crossing from beating to not beating; bands further up may follow), "from"
    (slower below ``at``, faster from there to ``hi``), "band" (slower at both ends, ``at``
    None), "above" (faster everywhere) or "below" (nowhere). The gain need not fall as the
    bandwidth rises: a codec cheaper than FP16's cast loses to FP16 on slow links and beats
    it on fast ones, so the gain is sampled over the range and each change of sign bisected."""
    def gain(bw: float) -> float:
        t = iteration_s(Setup(**{**s.__dict__, "bandwidth_gbps": bw}))
        return t[baseline] - t[scheme]

    grid = [lo * (hi / lo) ** (i / (GRID_POINTS - 1)) for i in range(GRID_POINTS)]
    gains = [gain(bw) for bw in grid]
    pays, start = [], lo if gains[0] > 0 else None
    for b0, b1, g0, g1 in zip(grid, grid[1:], gains, gains[1:]):
        if (g0 > 0) == (g1 > 0):
            continue
        a, b = b0, b1   # a: on b0's side of the crossing, b: on b1's
        for _ in range(50):
            mid = (a * b) ** 0.5
            a, b = (mid, b) if (gain(mid) > 0) == (g0 > 0) else (a, mid)
        if g0 > 0:
            pays.append([start, a])
        else:
            start = b
    if gains[-1] > 0:
        pays.append([start, hi])
    first = pays[0] if pays else None
    if first is None or first == [lo, hi]:
        relation, at = ("below", None) if first is None else ("above", None)
    elif first[0] == lo:
        relation, at = "between", first[1]
    elif len(pays) == 1 and first[1] == hi:
        relation, at = "from", first[0]
    else:
        relation, at = "band", None
    return {"relation": relation, "at": at, "pays": pays, "range": [lo, hi]}


def says(result: dict, unit: str = "Gbit/s", scale: float = 1.0) -> str:
    """One phrase for a :func:`break_even` result (bandwidths in Gbit/s x ``scale``)."""
    lo, hi = result["range"]
    if result["relation"] in ("above", "below"):
        return "never pays here" if result["relation"] == "below" else \
            f"pays at every bandwidth up to {hi * scale:g} {unit}"
    bands = [f"below {b * scale:.3g} {unit}" if a == lo else
             f"from {a * scale:.3g} {unit} up" if b == hi else
             f"between {a * scale:.3g} and {b * scale:.3g} {unit}" for a, b in result["pays"]]
    return f"pays {', '.join(bands)}" + (" (slower below)" if result["relation"] == "from"
                                         else "")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=whole_count, default=25e6, help="gradient elements")
    parser.add_argument("--workers", type=positive_int, default=8)
    parser.add_argument("--bw", type=positive_floats, default="1,10,25,100",
                        help="link bandwidths, Gbit/s")
    parser.add_argument("--latency-us", type=non_negative_float, default=10.0)
    parser.add_argument("--compute-ms", type=non_negative_float, default=100.0,
                        help="compute per iteration")
    parser.add_argument("--overlap", type=slowdown, default=1.05,
                        help="lambda, compute's slowdown while communication overlaps it "
                             "(1.04-1.1; 1 or more)")
    parser.add_argument("--codec-mbps", type=positive_float, default=Setup.codec_mbps,
                        help="THC encode+decode MB/s per worker (default: the compiled CPU "
                             "codec on one core; `thc bench codec` measures this machine's)")
    parser.add_argument("--calibrate", metavar="MAINJOB_JSON", nargs="+",
                        help="compare the model with main jobs' measured step times "
                             "(out/mainjob.json, one or more)")
    parser.add_argument("--alpha-ms", type=non_negative_float, default=None,
                        help="with --calibrate: per-message cost alpha (default: fitted "
                             "to the first report's FP32 and Marsit runs)")
    parser.add_argument("--efficiency", type=fraction, default=None,
                        help="with --calibrate: link efficiency (default: fitted with alpha)")
    parser.add_argument("--agg-pps", type=positive_float, default=86e3,
                        help="with --calibrate: the software aggregators' packets/s in the main "
                             "job, where they share the worker hosts' cores with training "
                             "(default: an assumed rate, the one docs/results.md's calibration "
                             "took; `thc bench aggregator` measures one alone)")


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        reports = [read_json(path, "a main job's report (out/mainjob.json of `thc run`)",
                             ("args", "runs"), "thc model") for path in args.calibrate]
        alpha = None if args.alpha_ms is None else args.alpha_ms / 1e3
        eff = args.efficiency
        if (alpha is None) != (eff is None):   # the one given was dropped for the fit
            raise refusal("thc model --calibrate: give both --alpha-ms and --efficiency, "
                             "or neither (both are then fitted)")
        fitted_on = None
        try:
            if alpha is None or eff is None:
                alpha, eff = fit(reports[0], args.agg_pps)
                fitted_on = args.calibrate[0]
                print(f"fitted to the fp32 and marsit runs of {fitted_on}: alpha "
                      f"{1e3 * alpha:.2f} ms, link efficiency {eff:.3f}"
                      + (" (at its bound: a link delivers at most its nominal rate)"
                         if eff == 1.0 else ""))
            rows = [row for path, rep in zip(args.calibrate, reports)
                    for row in calibrate(rep, alpha, eff, args.agg_pps,
                                         fitted=path == fitted_on)]
        except DAMAGED as e:    # a damaged report, or (ValueError) the fit's own refusals
            if type(e) is ValueError:
                raise refusal(f"thc model --calibrate: {e}") from None
            what = f"a run lacks {e}" if isinstance(e, KeyError) else \
                f"{type(e).__name__}: {e}"
            raise refusal(f"thc model --calibrate: {', '.join(args.calibrate)}: not a main "
                          f"job's report it can read ({what})") from None
        print(f"{'Mbit/s':>6} {'mode':<12} {'testbed':<8} {'scheme':<15} {'steps':>5} "
              f"{'measured ms':>11} {'predicted ms':>12} {'error':>6}  {'compute ms':>10} "
              f"{'codec ms':>8}")
        for r in rows:
            print(f"{r['bw_mbit']:>6g} {r['mode']:<12} {str(r['testbed']):<8} "
                  f"{r['scheme']:<15} {r['steps']:>5} {1e3 * r['measured_s']:>11.1f} "
                  f"{1e3 * r['predicted_s']:>12.1f} {100 * r['error']:>+5.0f}%  "
                  f"{1e3 * r['compute_s']:>10.1f} {1e3 * r['codec_s']:>8.1f}"
                  + ("  (fitted here)" if r["fitted"] else "")
                  + ("" if r["modelled"] else "  (not modelled: BMv2's THC rate is known for "
                     "a build without logging macros only)"))
        predicted = [r for r in rows if not r["fitted"] and r["modelled"]]
        ok = [r for r in predicted if abs(r["error"]) <= 0.25]
        print(f"{len(ok)} of {len(predicted)} predicted configurations (bandwidth x mode) "
              f"within 25% of the measured step time")
        return 0
    base = Setup(params=args.params, workers=args.workers, latency_us=args.latency_us,
                 compute_s=args.compute_ms / 1e3, overlap=args.overlap,
                 codec_mbps=args.codec_mbps, buckets=ddp_buckets(args.params))
    try:   # sums no width holds (more workers than a job takes): said before any table
        iteration_s(replace(base, bandwidth_gbps=1.0))
    except ValueError as e:
        raise refusal(f"thc model: {e}") from None
    print(f"A model (estimates, not measurements): {args.params / 1e6:g}M parameters, "
          f"{args.workers} workers, alpha {args.latency_us:g} us, compute "
          f"{args.compute_ms:g} ms, overlap {args.overlap}, codec {args.codec_mbps:g} MB/s")
    if args.workers > P.MAX_WORKERS:
        print(f"(a model: a job through this project's switch takes at most {P.MAX_WORKERS} "
              f"workers; the THC switch column is a switch that takes {args.workers})")
    print(f"{'Gbit/s':>7} {'FP32 ring ms':>13} {'THC switch ms':>14} {'THC allred ms':>14} "
          f"{'switch speedup':>15}")
    try:
        for bw in args.bw:
            t = iteration_s(Setup(**{**base.__dict__, "bandwidth_gbps": bw}))
            print(f"{bw:>7g} {1e3 * t['fp32_ring']:>13.1f} {1e3 * t['thc_switch']:>14.1f} "
                  f"{1e3 * t['thc_allreduce']:>14.1f} "
                  f"{t['fp32_ring'] / t['thc_switch']:>14.2f}x")
        for scheme in ("thc_switch", "thc_allreduce"):
            print(f"{scheme} {says(break_even(base, scheme))}")
    except ValueError as e:
        raise refusal(f"thc model: {e}") from None
    return 0
