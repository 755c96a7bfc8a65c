"""``thc model --gpu-codec JSON``: where THC stops paying for 25M-, 100M- and 350M-parameter
models at a GPU codec's measured speed. A model: the break-evens it prints are estimates.

It reads the JSON that ``thc bench codec --device cuda --json FILE`` writes, or that of
``thc bench hook --json FILE`` (whose rows give the codec's cost as measured in a DDP step,
per bucket). The fields it needs, all written by those commands (a hand-made file needs only
these):

- ``results``: rows of ``name``, ``elements`` and ``median_s`` (seconds for that many float32
  elements). It takes the row ``THC encode+decode (<label>)`` of the fast path (a label
  without "reference", else the reference) and the row ``fp16 round trip
  (x.half().float())`` (FP16's cast down and back), both at the size nearest DDP's 25 MB
  bucket (6.6M elements): the hook encodes and decodes a bucket at a time.
- ``device`` and ``device_name`` (optional): printed with the figures.

Speeds are MB of float32 input a second (4 bytes an element); FP16's cast is charged to
FP16 as THC's codec is to THC (a run without the FP16 row leaves the cast out, and says so).
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

from thc.app.perfmodel import BUCKET_BYTES, Setup, break_even, ddp_buckets

SIZES = (25e6, 100e6, 350e6)
"""Model sizes (parameters) of the table."""
CODEC_ROW = "THC encode+decode ("
FP16_ROW = "fp16 round trip (x.half().float())"
COLUMNS = (("thc_switch", "fp32_ring"), ("thc_switch", "fp16_ring"),
           ("thc_allreduce", "fp32_ring"), ("thc_allreduce", "fp16_ring"))
"""(THC scheme, baseline) of each column."""


def _mbps(row: dict) -> float:
    return 4 * row["elements"] / row["median_s"] / 1e6


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) \
        and x > 0


def codec_speeds(report: dict) -> dict:
    """The codec's and the FP16 cast's speed from a ``thc bench codec`` report (see the
    module docstring for the rows it takes)."""
    rows = report.get("results") if isinstance(report, dict) else None
    if not isinstance(rows, list):
        raise ValueError("no 'results' list: not a report of `thc bench codec --json` or `thc "
                         "bench hook --json`")
    for r in rows:
        if not (isinstance(r, dict) and {"name", "elements", "median_s"} <= set(r)
                and isinstance(r["name"], str) and _positive(r["elements"])
                and _positive(r["median_s"])):
            raise ValueError(f"a row needs a name, elements > 0 and median_s > 0 (numbers): "
                             f"{r}")
    codec = [r for r in rows if r["name"].startswith(CODEC_ROW)]
    if not codec:
        raise ValueError(f"no '{CODEC_ROW}...)' row in the report")
    fast = [r for r in codec if "reference" not in r["name"]] or codec
    bucket = BUCKET_BYTES / 4
    size = min({r["elements"] for r in fast}, key=lambda n: abs(math.log(n / bucket)))
    row = min((r for r in fast if r["elements"] == size), key=lambda r: r["median_s"])
    fp16 = next((r for r in rows if r["name"] == FP16_ROW and r["elements"] == size), None)
    return {"device": report.get("device", "?"), "device_name": report.get("device_name", "?"),
            "row": row["name"], "elements": size, "codec_mbps": _mbps(row),
            "fp16_mbps": _mbps(fp16) if fp16 else None}


def break_evens(speeds: dict, base: Setup) -> list[dict]:
    """For each size of :data:`SIZES`: where each THC scheme beats each baseline (Gbit/s, a
    :func:`thc.app.perfmodel.break_even` result), in ``base``'s setting at the measured
    speeds. GPUs all-reduce over NCCL, where THC agrees on a bucket's tags at its first size
    only."""
    out = []
    for params in SIZES:
        s = replace(base, params=params, buckets=ddp_buckets(params), agree_each_round=False,
                    codec_mbps=speeds["codec_mbps"],
                    fp16_mbps=speeds["fp16_mbps"] or float("inf"))
        row = {"params": params, "buckets": s.buckets}
        for scheme, baseline in COLUMNS:
            row[f"{scheme}/{baseline}"] = break_even(s, scheme, baseline=baseline)
        out.append(row)
    return out


def _gbps(result: dict) -> str:
    """A :func:`thc.app.perfmodel.break_even` result in a cell: the bandwidth below which THC
    pays, "from" one (slower below it), or "always" or "never"."""
    relation, at = result["relation"], result["at"]
    if relation in ("above", "below"):
        return "always" if relation == "above" else "never"
    if relation == "band":
        return ",".join(f"{a:.3g}-{b:.3g}" for a, b in result["pays"])
    return f"from {at:.4g}" if relation == "from" else f"{at:.4g}"


def run(path: str, base: Setup) -> int:
    """Print the table of :func:`break_evens` for the report at ``path``."""
    try:
        speeds = codec_speeds(json.loads(Path(path).read_text()))
    except (OSError, ValueError) as e:
        print(f"thc model --gpu-codec: {path}: {e}", file=sys.stderr)
        return 2
    if speeds["device"] == "cpu":
        print(f"thc model --gpu-codec: {path} was measured on the CPU: give a GPU's report "
              f"(`make bench-gpu` writes out/gpu/hook.json); a CPU codec's speed goes in "
              f"--codec-mbps", file=sys.stderr)
        return 2
    try:   # sums no width holds (more workers than a job takes): said before any table
        rows = break_evens(speeds, base)
    except ValueError as e:
        print(f"thc model --gpu-codec: {e}", file=sys.stderr)
        return 2
    n = speeds["elements"]
    print(f"codec figures from {path}: {speeds['device_name']} ({speeds['device']}), "
          f"{speeds['row']} at {n} elements (2^{math.log2(n):.1f}): "
          f"{speeds['codec_mbps']:.0f} MB/s of float32; FP16 round trip "
          + (f"{speeds['fp16_mbps']:.0f} MB/s" if speeds["fp16_mbps"] else
             "not in the report (FP16's cast left out)"))
    print(f"MODEL (an estimate, not a measurement): {base.workers} workers, alpha "
          f"{base.latency_us:g} us, compute {1e3 * base.compute_s:g} ms a step for every "
          f"size, overlap {base.overlap}, DDP buckets of {BUCKET_BYTES >> 20} MB; THC through "
          f"a switch at line rate or over all-reduce")
    print("bandwidth (Gbit/s) below which THC beats the baseline (\"from x\": above x only; "
          "\"x-y\": between x and y only):")
    head = f"{'params':>7} {'buckets':>7}" + "".join(
        f" {a.split('_')[1] + ' vs ' + b.split('_')[0].upper():>18}" for a, b in COLUMNS)
    print(head)
    for row in rows:
        print(f"{row['params'] / 1e6:>6g}M {row['buckets']:>7}" + "".join(
            f" {_gbps(row[f'{a}/{b}']):>18}" for a, b in COLUMNS))
    return 0
