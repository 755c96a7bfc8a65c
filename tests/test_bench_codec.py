"""``thc bench codec``'s flags: a count that times nothing, or a backend that cannot run on
the device, is refused before any timing, as a usage error."""
from __future__ import annotations

import argparse

import pytest

from thc.bench import codec as bench


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="thc bench codec")
    bench.add_arguments(parser)
    return parser


@pytest.mark.parametrize("argv,message", [
    (["--size", "0"], "argument --size: must be at least 1, not 0"),
    (["--size", "-5"], "argument --size: must be at least 1, not -5"),
    (["--repeat", "0"], "argument --repeat: must be at least 1, not 0"),
    (["--repeat", "-5"], "argument --repeat: must be at least 1, not -5"),
    (["--ranks", "0"], "argument --ranks: must be at least 1, not 0"),
    (["--ranks", "1,x"], "argument --ranks: not an integer: 'x'"),
    (["--device", "bogus"], "argument --device: cpu, cuda or cuda:N, not 'bogus'")])
def test_counts_that_time_nothing_are_usage_errors(argv, message, capsys):
    """--size 0 ran the default sweep (a truth test), --repeat 0 or -5 ran once, --ranks 0
    timed a "PowerSGD rank 0"."""
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_the_ranks_parse_to_a_list_and_none_is_allowed():
    assert _parser().parse_args([]).ranks == [1, 4]
    assert _parser().parse_args(["--ranks", ""]).ranks == []


def test_a_repeat_given_wins_over_quicks(tmp_path):
    """--quick cut a --repeat given to 2 without a word (its help said 5)."""
    import json
    out = tmp_path / "codec.json"
    args = _parser().parse_args(["--quick", "--repeat", "3", "--sizes", "10", "--ranks", "",
                                 "--no-reference", "--json", str(out)])
    assert bench.run(args) == 0
    assert json.loads(out.read_text())["repeat"] == 3


def test_a_size_that_is_no_power_of_two_is_printed_as_measured(capsys):
    """--size 1000 was printed as 2^9: 512 elements, where 1000 were timed."""
    args = _parser().parse_args(["--size", "1000", "--repeat", "1", "--ranks", "",
                                 "--no-reference"])
    assert bench.run(args) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "copy (x.clone())" in line]
    assert rows and rows[0].split()[2] == "1000", rows


def test_a_backend_that_cannot_run_on_the_device_is_a_clear_error(monkeypatch, capsys):
    """--backend triton on the CPU without Triton's interpreter raised its RuntimeError from
    the first measurement, outside run()'s checks: a traceback."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = _parser().parse_args(["--backend", "triton", "--quick", "--repeat", "1"])
    assert bench.run(args) == 2
    assert "thc bench codec: the triton backend" in capsys.readouterr().err


def test_kernel_settings_are_for_the_gpu_and_named_as_bench_kernels_takes_them(capsys):
    """--configs replays the CUDA-graph rows under other kernel settings: off a GPU it is a
    usage error, a setting the kernels lack is refused by name, and the settings are put back
    after each replay, also when it raises."""
    import torch

    from thc.bench.tiles import applied
    from thc.codec import triton_kernels as tk
    args = _parser().parse_args(["--configs", "COLS_LOG=0", "--quick", "--repeat", "1"])
    assert bench.run(args) == 2
    assert "--configs sets the CUDA kernels' settings" in capsys.readouterr().err
    cuda = torch.device("cuda")
    assert bench._configs("", cuda) == []
    assert bench._configs(";COLS_LOG=0,TILE=1024;FORM=transpose", cuda) == [
        {"COLS_LOG": 0, "TILE": 1024}, {"FORM": "transpose"}]
    with pytest.raises(ValueError, match="use NAME=INTEGER"):
        bench._configs("TILES=2", cuda)
    tile = tk.TILE
    with pytest.raises(RuntimeError, match="inside"):
        with applied(tk, {"TILE": 1024}):
            assert tk.TILE == 1024
            raise RuntimeError("inside")
    assert tk.TILE == tile


@pytest.mark.skipif(not __import__("torch").cuda.is_available(),
                    reason="no CUDA device: the CUDA-graph rows replay on a GPU")
def test_each_kernel_setting_gets_a_graph_row_of_its_own(tmp_path):
    import json

    from thc.codec import triton_kernels as tk
    cols = tk.TILE_COLS
    out = tmp_path / "codec.json"
    args = _parser().parse_args(["--device", "cuda", "--sizes", "20", "--ranks", "",
                                 "--no-reference", "--repeat", "1", "--json", str(out),
                                 "--configs", "TILE_COLS=2048;NUM_WARPS_COLS=4"])
    assert bench.run(args) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    for label in ("TILE_COLS=2048", "NUM_WARPS_COLS=4"):
        r = rows[f"THC encode+decode, CUDA graph (triton, {label})"]
        assert r["median_s"] > 0 and 0 < r["speed_vs_copy"] < 1
    assert "THC encode+decode, CUDA graph (triton)" in rows and tk.TILE_COLS == cols


def test_the_readmes_gpu_headlines_are_their_committed_runs():
    """The README's GPU rows quote docs/runs (its encode+decode row a CUDA graph's replay, its
    hook row the step times): a figure left behind when a run is replaced, or copied by
    hand, drifts from the report it names."""
    import json
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    codec = next(li for li in readme.splitlines()
                 if li.startswith("| encode + decode, 2^26 floats, fused Triton kernels |"))
    hook = next(li for li in readme.splitlines() if li.startswith("| THC's DDP hook, ResNet-50"))
    runs = root / "docs" / "runs"
    rows = {(r["name"], r["elements"]): r for r in
            json.loads((runs / "gpu-codec-h200-2026-12-04.json").read_text())["results"]}
    thc = rows["THC encode+decode, CUDA graph (triton)", 1 << 26]
    copy = rows["copy, CUDA graph", 1 << 26]
    fp16 = rows["fp16 round trip (x.half().float())", 1 << 26]
    want = (f"{thc['median_s'] * 1e3:.3f} ms replayed from a CUDA graph: "
            f"{thc['gb_per_s']:.0f} GB/s of float32 input, {thc['speed_vs_copy']:.2f} of a "
            f"device copy ({copy['gb_per_s']:.0f} GB/s of float32 input, "
            f"{2 * copy['gb_per_s'] / 1e3:.1f} TB/s read plus written); FP16's round trip "
            f"{fp16['gb_per_s']:.0f} GB/s from Python")
    assert want in codec, (want, codec)
    steps = {(r["mode"], r["bucket_mb"]): r["median_s"] * 1e3 for r in
             json.loads((runs / "gpu-hook-h200-2026-12-04.json").read_text())["rows"]}
    ms = {k: f"{v:.2f}" for k, v in steps.items()}
    cost = {m: f"{steps[m, 25] - steps['fp32 hook', 25]:+.2f}" for m in ("thc deferred",
                                                                         "thc hook")}
    want = (f"{cost['thc deferred']} ms on a {ms['fp32 hook', 25]} ms step against the "
            f"project's FP32 hook, rounds replayed from CUDA graphs, checks deferred (the eager "
            f"hook: {cost['thc hook']} ms). Against DDP's own all-reduce ({ms['ddp', 25]} ms): "
            f"THC {steps['thc deferred', 25] - steps['ddp', 25]:+.2f} ms, torch's FP16 hook "
            f"{steps['fp16', 25] - steps['ddp', 25]:+.2f} ms")
    assert want in hook, (want, hook)
    assert re.search(r"\| one H200, 2026-12-04 \|", codec) and "one H200, 2026-12-04" in hook


def test_a_round_trips_median_is_the_median_of_its_runs(monkeypatch):
    """encode+decode was the median encode plus the median decode, taken from different
    runs: a figure no run gave (0.7503 ms where the runs' round trips had a median of
    0.7815 ms), and a best no run reached."""
    import torch
    enc, dec = [0.5744e-3, 0.6111e-3, 0.5061e-3], [0.2439e-3, 0.1704e-3, 0.1759e-3]

    def timed(ops, repeat, sync=lambda: None):
        import statistics
        runs = {name: (enc if name.startswith("THC encode (") else
                       dec if name.startswith("THC decode") else [1e-3] * 3)
                for name, _, _ in ops}
        return {name: {"median_s": statistics.median(r), "best_s": min(r), "runs_s": r}
                for name, r in runs.items()}
    monkeypatch.setattr(bench, "_time_interleaved", timed)
    rows = bench._measure(1 << 8, torch.device("cpu"), "reference", False, [], bench.THCParams(
        slice_size=256), 3, lambda: None)
    trip = next(r for r in rows if r["name"].startswith("THC encode+decode"))
    assert trip["median_s"] == pytest.approx(0.7815e-3, rel=1e-3)
    assert trip["best_s"] == pytest.approx(min(a + b for a, b in zip(enc, dec)))
