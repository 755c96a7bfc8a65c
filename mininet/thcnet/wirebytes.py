"""Computed bytes of an all-reduce on the wire: FP32/FP16 rings over TCP, THC's packets through
a central aggregator, shards or the switch, and the ideal seconds and speedups they imply,
beside which ``thc bench allreduce`` sets what it measured."""
from __future__ import annotations

import math

from thc.codec.params import THCParams
from thc.codec.thc import THCCodec
from thc.wire import protocol as P


def fp32_wire_bytes(numel: int, p: int, elem_bytes: int = 4) -> dict:
    """Per worker and direction: ring all-reduce payload and its TCP frames (ACKs excluded)."""
    payload = 2 * (p - 1) / p * elem_bytes * numel
    return {"payload": payload, "frames": payload / P.TCP_MSS * P.TCP_FRAME,
            "up": payload / P.TCP_MSS * P.TCP_FRAME, "down": payload / P.TCP_MSS * P.TCP_FRAME}


def thc_wire_bytes(numel: int, lanes: int, params=None, sum_bits: int = P.SUM_WIDTHS[0],
                   layout: str = "central", p: int = 1, agg_bw_factor: float = 1.0) -> dict:
    """Per worker: THC uplink (indices) and downlink (sums of ``sum_bits``) frames, MAX round
    included, and ``busiest`` (bytes of the busiest link direction, in worker-link units).

    ``central``/``bmv2``: a worker link carries all of it; the central aggregator's link
    (``agg_bw_factor`` x as fast) p times the uplink down and the downlink up. ``sharded``: a
    worker link carries (p-1)/p of the uplink and (p-1)/p of the downlink in each direction
    (its own chunks to the remote shards and its shard's sums to the remote workers up; the
    remote shards' sums and the remote workers' chunks to its shard down)."""

    lay = THCCodec(params or THCParams()).layout(numel)
    packets = math.ceil(lay.total_padded / lanes)
    hdr = P.HEADER_BYTES + P.ETH_IP_UDP_BYTES
    max_packets = math.ceil(lay.n_slices / P.MAX_LANES)
    max_bytes = max_packets * (hdr + P.payload_bytes(P.PktType.MAX))
    up = packets * (hdr + P.payload_bytes(P.PktType.DATA, lanes)) + max_bytes
    down = packets * (hdr + P.payload_bytes(P.PktType.RESULT, lanes, sum_bits)) + max_bytes
    if layout == "sharded":
        up = down = (p - 1) / p * (up + down)
        busiest = up
    elif layout == "central":
        busiest = max(up, down, p * max(up, down) / agg_bw_factor)
    else:
        busiest = max(up, down)
    return {"packets": packets, "padded": lay.total_padded, "up": up, "down": down,
            "busiest": busiest,
            "header_overhead_down": packets * hdr / down,
            "payload_up": lay.total_padded * P.INDEX_BITS / 8,
            "sum_bits": sum_bits, "payload_down": lay.total_padded * sum_bits / 8}


def ideal_bytes(name: str, m: dict, p: int, lanes: int, agg_bw_factor: float) -> dict:
    """Computed bytes per worker link and direction for one mode at its own size."""
    numel = m["numel"]
    if name.startswith("fp32") or name == "fp16":
        ring = fp32_wire_bytes(numel, p, 2 if name == "fp16" else 4)
        return {"up": ring["up"], "down": ring["down"], "busiest": ring["up"]}
    sum_bits = P.sum_bits_for(p, THCParams().granularity)
    if name == "thc-dist":  # sums in the narrowest integer dtype, norms in a small FP32 ring
        lay = THCCodec(THCParams()).layout(numel)
        ring = fp32_wire_bytes(lay.total_padded, p, 1 if sum_bits == 8 else 2)
        norms = fp32_wire_bytes(lay.n_slices, p)
        up = ring["up"] + norms["up"]
        return {"up": up, "down": up, "busiest": up}
    layout = name.removeprefix("thc-")
    ideal = thc_wire_bytes(numel, P.LANES if layout == "bmv2" else lanes, sum_bits=sum_bits,
                           layout=layout, p=p, agg_bw_factor=agg_bw_factor)
    return {"up": ideal["up"], "down": ideal["down"], "busiest": ideal["busiest"],
            "packets": ideal["packets"], "header_overhead_down": ideal["header_overhead_down"]}


def annotate(point: dict, p: int, lanes: int, agg_bw_factor: float = 1.0) -> None:
    """Ideal bytes and seconds of every mode, and its speedup over the FP32 run on the same
    elements in the same point (``baseline``: BMv2's smaller run has its own)."""
    bw_bytes = point["bw_mbit"] * 1e6 / 8 if point["bw_mbit"] else None
    for name, m in point["modes"].items():
        ideal = ideal_bytes(name, m, p, lanes, agg_bw_factor)
        m["ideal_bytes"] = {k: v for k, v in ideal.items() if k != "busiest"}
        m["ideal_bytes"]["busiest_link"] = ideal["busiest"]
        m["ideal_seconds"] = ideal["busiest"] / bw_bytes if bw_bytes else None
        if name.startswith("fp32"):
            continue
        base = point["modes"][m.get("baseline", "fp32")]
        base_busiest = ideal_bytes(m.get("baseline", "fp32"), base, p, lanes,
                                   agg_bw_factor)["busiest"]
        m["speedup_vs_fp32"] = base["seconds"] / m["seconds"]
        m["ideal_ratio"] = base_busiest / ideal["busiest"]
        if "wire_per_worker" in m and "wire_per_worker" in base:
            fw, tw = base["wire_per_worker"], m["wire_per_worker"]
            busiest = max(tw["tx"], tw["rx"])
            if "agg_link_bytes_per_round" in m:  # the central aggregator's link
                al = m["agg_link_bytes_per_round"]
                busiest = max(busiest, max(al["tx"], al["rx"]) / agg_bw_factor)
            m["measured_wire_ratio"] = max(fw["tx"], fw["rx"]) / busiest
