"""``thc bench hook``: its arithmetic on made-up step times, and a short real run on the CPU
whose JSON ``thc model --gpu-codec`` reads."""
import json
import subprocess
import sys

import pytest

from thc.app.gpucodec import codec_speeds
from thc.bench.hook import GRAPHED, MODES, costs


def _rows(mb, times, buckets=4, spread=0.0):
    return [{"bucket_mb": mb, "mode": m, "median_s": t, "min_s": t - spread,
             "buckets": None if m == "ddp" else buckets} for m, t in zip(MODES, times)]


def test_costs_are_differences_against_ddps_own_all_reduce():
    """The baseline thc model's FP32 and FP16 columns take: THC's hook machinery (the FP32
    hook's cost over DDP's) is THC's cost too, not left out of it."""
    rows = _rows(25, [0.100, 0.104, 0.110, 0.150, 0.120, 0.112]) \
        + _rows(5, [0.100, 0.099, 0.110, 0.130, 0.115, 0.111], 13)
    got = {r["name"]: r for r in costs(rows, 26_000_000)}
    thc = got["THC encode+decode (DDP hook, 25 MB buckets)"]
    assert thc["step_cost_s"] == pytest.approx(0.050)          # THC hook - DDP
    assert thc["vs_fp32_hook_s"] == pytest.approx(0.040)       # THC hook - FP32 hook
    assert thc["median_s"] == pytest.approx(0.0125)            # per bucket
    assert thc["elements"] == 6_500_000
    assert thc["mb_per_s"] == pytest.approx(4 * 26e6 / 0.050 / 1e6)
    graphed = got["THC encode+decode (DDP hook, CUDA graphs, 25 MB buckets)"]
    assert graphed["step_cost_s"] == pytest.approx(0.020)      # THC graphed - DDP
    deferred = got["THC encode+decode (DDP hook, CUDA graphs, checks deferred, 5 MB buckets)"]
    assert deferred["step_cost_s"] == pytest.approx(0.011)
    assert deferred["vs_fp32_hook_s"] == pytest.approx(0.001)
    fp16 = [r for r in costs(rows, 26_000_000) if r["name"].startswith("fp16")]
    assert fp16[0]["bucket_mb"] == 5 and "median_s" not in fp16[0]   # below DDP's own: noise
    assert "vs_fp32_hook_s" not in fp16[0]
    assert fp16[1]["median_s"] == pytest.approx(0.001)               # (0.104 - 0.100) / 4


def test_a_cost_within_the_step_times_spread_is_no_figure():
    """A difference of medians of a few steps below their own spread became a throughput
    (0.65 ms against a 20 ms spread: 157 500 MB/s)."""
    rows = _rows(25, [0.100, 0.104, 0.110, 0.150, 0.120, 0.112], spread=0.020)
    got = {r["mode"]: r for r in costs(rows, 26_000_000)}
    assert got["fp16"]["step_cost_s"] == pytest.approx(0.004) and "mb_per_s" not in got["fp16"]
    assert got["fp16"]["noise_s"] == pytest.approx(0.020)
    assert got["thc hook"]["mb_per_s"] == pytest.approx(4 * 26e6 / 0.050 / 1e6)


def test_a_short_run_on_the_cpu_feeds_the_model(tmp_path):
    """At --image 16 (batch norms of two values at the last stage) the model went to NaN
    within a step, and the THC hook refused its gradients."""
    out = tmp_path / "hook.json"
    r = subprocess.run([sys.executable, "-m", "thc.cli", "bench", "hook", "--device", "cpu",
                        "--quick", "--image", "16", "--buckets", "25", "--json", str(out),
                        "--plot",
                        str(tmp_path / "hook.png")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["params"] == 25_557_032
    assert (tmp_path / "hook.png").stat().st_size > 10_000
    assert {row["mode"] for row in report["rows"]} == set(MODES) - set(GRAPHED)   # CUDA only
    assert all(row["buckets"] == 4 for row in report["rows"] if row["mode"] != "ddp")
    speeds = codec_speeds(report)
    assert speeds["row"] == "THC encode+decode (DDP hook, 25 MB buckets)"
    assert speeds["codec_mbps"] > 0


def test_a_size_given_wins_over_quick(monkeypatch, capsys):
    """``--quick --steps 10`` timed 2 steps (and ``--batch 0 --quick`` ran), silently."""
    from thc.bench import hook
    from thc.cli import main
    seen = []
    monkeypatch.setattr(hook, "_group", lambda device: None)
    monkeypatch.setattr(hook, "_measure", lambda mb, args, *a: seen.append(
        (mb, args.batch, args.image, args.steps, args.warmup)) or [])
    assert main(["bench", "hook", "--device", "cpu", "--quick", "--buckets", "7",
                 "--steps", "10", "--image", "64"]) == 0
    assert seen == [(7, 2, 64, 10, 1)]
    with pytest.raises(SystemExit):
        main(["bench", "hook", "--device", "cpu", "--quick", "--batch", "0"])
    assert "argument --batch: must be at least 1, not 0" in capsys.readouterr().err
