"""``thc model --gpu-codec``: the break-even bandwidths it prints for a codec report written
here from known figures, against answers worked out here from the ring formula."""
from __future__ import annotations

import json
import re

import pytest

from thc.cli import main

N = 1 << 23
"""The report's size nearest DDP's 25 MB bucket (6.6M elements)."""
CODEC_S, FP16_S = 4 * N / 93e9, 4 * N / 741e9
"""Seconds for N elements: THC encode+decode at 93 GB/s, FP16 round trip at 741 GB/s."""


def _report(path):
    rows = [
        {"name": "copy (x.clone())", "group": "baseline", "elements": N,
         "median_s": 4 * N / 1.3e12},
        {"name": "fp16 round trip (x.half().float())", "group": "baseline", "elements": N,
         "median_s": FP16_S},
        {"name": "THC encode+decode (cuda, triton)", "group": "cuda, triton", "elements": N,
         "median_s": CODEC_S},
        # slower rows the model must not take: the reference path, a size far from a bucket
        {"name": "THC encode+decode (cuda, reference)", "group": "cuda, reference",
         "elements": N, "median_s": 30 * CODEC_S},
        {"name": "THC encode+decode (cuda, triton)", "group": "cuda, triton", "elements": 1 << 20,
         "median_s": (1 << 20) * 4 / 10e9},
        {"name": "fp16 round trip (x.half().float())", "group": "baseline", "elements": 1 << 20,
         "median_s": (1 << 20) * 4 / 10e9},
    ]
    path.write_text(json.dumps({"device": "cuda", "device_name": "figures of the test",
                                "results": rows}))


def _printed(text: str) -> dict[float, list[float]]:
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\s*(\d+)M\s+\d+\s+(.*)$", line)
        if m:
            rows[float(m.group(1)) * 1e6] = [float(x) for x in m.group(2).split()]
    return rows


def test_break_even_of_each_size_matches_the_ring_formula(tmp_path, capsys):
    """4 workers, no per-message cost, 100 ms of compute (x 1.05 overlap): FP32's step is
    max(0.105, 6dF / B) (a ring of 4 bytes a coordinate, 2 x 3/4 of it per worker, F TCP's
    framing, 1514/1448), FP16's max(0.105, 3dF / B) + its cast, THC's 0.105 + its codec
    while its bytes (at most 1.2 bytes a coordinate: 4-bit indices up, 8-bit sums down,
    headers) take less than the compute. So THC pays below B = 6dF / (0.105 + codec) against
    FP32 and 3dF / (0.105 + codec - cast) against FP16, d the parameters, B in bytes a
    second."""
    _report(tmp_path / "codec.json")
    assert main(["model", "--gpu-codec", str(tmp_path / "codec.json"), "--workers", "4",
                 "--latency-us", "0", "--compute-ms", "100", "--overlap", "1.05"]) == 0
    out = capsys.readouterr().out
    assert "MODEL (an estimate" in out and "figures of the test" in out
    rows = _printed(out)
    assert set(rows) == {25e6, 100e6, 350e6}
    lam_c = 1.05 * 0.100
    for d, printed in rows.items():
        codec, cast = 4 * d / 93e9, 4 * d / 741e9
        framing = 1514 / 1448
        vs_fp32 = 6 * d * framing / (lam_c + codec)
        vs_fp16 = 3 * d * framing / (lam_c + codec - cast)
        assert 1.2 * d / vs_fp16 < lam_c        # THC's bytes hidden behind compute there
        assert printed[0] == pytest.approx(8 * vs_fp32 / 1e9, rel=1e-3)
        assert printed[1] == pytest.approx(8 * vs_fp16 / 1e9, rel=1e-3)


def test_a_report_without_the_codec_row_is_refused(tmp_path, capsys):
    (tmp_path / "codec.json").write_text(json.dumps({"results": [
        {"name": "copy (x.clone())", "elements": N, "median_s": 1e-4}]}))
    assert main(["model", "--gpu-codec", str(tmp_path / "codec.json")]) == 2
    assert "no 'THC encode+decode (...)' row" in capsys.readouterr().err


@pytest.mark.parametrize("row", [
    {"elements": 0, "median_s": 1e-3},          # was "math domain error"
    {"elements": N, "median_s": "0.001"},       # was a TypeError traceback
    {"elements": N, "median_s": float("nan")}])
def test_a_row_without_positive_numbers_is_refused_by_name(tmp_path, capsys, row):
    (tmp_path / "codec.json").write_text(json.dumps({"results": [
        {"name": "THC encode+decode (triton)", **row}]}))
    assert main(["model", "--gpu-codec", str(tmp_path / "codec.json")]) == 2
    assert "a row needs a name, elements > 0 and median_s > 0" in capsys.readouterr().err


def test_the_fast_path_is_taken_even_where_only_the_reference_is_near_a_bucket():
    """The row of the fast path wins over the reference's, even at a size farther from DDP's
    bucket: the reference ran at 2^23 elements (near 6.6M), the fast path at 2^20 only."""
    from thc.app.gpucodec import codec_speeds
    rows = [{"name": "THC encode+decode (cuda, reference)", "elements": 1 << 23,
             "median_s": 1.0},
            {"name": "THC encode+decode (cuda, triton)", "elements": 1 << 20, "median_s": 0.5}]
    speeds = codec_speeds({"device": "cuda", "results": rows})
    assert speeds["row"] == "THC encode+decode (cuda, triton)"
    assert speeds["codec_mbps"] == pytest.approx(4 * (1 << 20) / 0.5 / 1e6)


def test_thc_over_nccl_agrees_once_and_the_overlap_is_read(tmp_path, capsys):
    """Over NCCL THC agrees on a bucket's tags at its first size only: a step is two ring
    all-reduces a bucket (norms, 8-bit sums at 4 workers), not three. Latency-bound, 4
    workers, alpha 1 ms, no compute, 25M parameters in 5 buckets, codec 1 ms: THC over
    all-reduce takes 2 x 2 x 3 alpha x 5 + 2 d F x 3/4 / B + codec, FP32 2 x 3 alpha x 5 +
    2 x 4d F x 3/4 / B, equal at B = 4.5 d F / (30 alpha + codec). And --overlap stretches the
    compute: with 100 ms of it at overlap 2 and no per-message cost, THC through a switch
    beats FP32 below B = 6 d F / (0.2 s + codec)."""
    from thc.app.gpucodec import break_evens
    from thc.app.perfmodel import Setup
    d, framing, codec = 25e6, 1514 / 1448, 1e-3
    speeds = {"codec_mbps": 4 * d / codec / 1e6, "fp16_mbps": None}
    row = break_evens(speeds, Setup(workers=4, latency_us=1000.0, compute_s=0.0))[0]
    assert row["params"] == d and row["buckets"] == 5
    assert row["thc_allreduce/fp32_ring"]["at"] == pytest.approx(
        8 * 4.5 * d * framing / (30e-3 + codec) / 1e9, rel=1e-6)
    _report(tmp_path / "codec.json")
    assert main(["model", "--gpu-codec", str(tmp_path / "codec.json"), "--workers", "4",
                 "--latency-us", "0", "--compute-ms", "100", "--overlap", "2"]) == 0
    printed = _printed(capsys.readouterr().out)
    assert printed[d][0] == pytest.approx(
        8 * 6 * d * framing / (0.2 + 4 * d / 93e9) / 1e9, rel=1e-3)


def test_a_scheme_that_pays_at_every_bandwidth_is_said_to_pay_always():
    """No per-message cost, no compute and a codec of no cost: through a switch a worker's
    link carries its RESULTs, about 1.3 bytes a coordinate with headers, against FP32's ring
    of 2 x 4 x 3/4 x F, so THC pays at every bandwidth the search spans (to 10 Tbit/s):
    printed "always", not the top of the search taken for a break-even."""
    from thc.app.gpucodec import _gbps, break_evens
    from thc.app.perfmodel import Setup
    row = break_evens({"codec_mbps": 1e15, "fp16_mbps": None},
                      Setup(workers=4, latency_us=0.0, compute_s=0.0))[0]
    assert row["thc_switch/fp32_ring"]["relation"] == "above"
    assert _gbps(row["thc_switch/fp32_ring"]) == "always"
