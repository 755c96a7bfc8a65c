"""The bandwidth sweep's break-even: the measured one interpolated between the bracketing
points, the model's calibrated on the sweep, both against figures worked out here by hand;
and the sweep command itself, small, on Mininet."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from thc.app.breakeven import analyse, crossing, describe, fit_links, step_seconds


ROOT = Path(__file__).resolve().parents[1]


def _pts(bws, mode, base):
    return [(bw, mode(bw), base(bw)) for bw in bws]


def test_crossing_interpolates_in_inverse_bandwidth():
    # mode 0.3 + 10/bw, baseline 0.1 + 50/bw: equal where 40/bw = 0.2, at 200 Mbit/s.
    r = crossing(_pts([1000, 50, 100, 500], lambda b: 0.3 + 10 / b, lambda b: 0.1 + 50 / b))
    assert r["relation"] == "between" and r["bracket"] == [100, 500]
    assert r["at"] == pytest.approx(200.0)
    assert r["crossings"] == [pytest.approx(200.0)]
    assert describe(r) == "200 Mbit/s (between 100 and 500)"


def test_no_crossing_says_on_which_side():
    faster = crossing(_pts([50, 100, 1000], lambda b: 0.1, lambda b: 0.2 + 1 / b))
    assert faster == {"relation": "above", "at": None, "bracket": [1000, None], "crossings": []}
    assert describe(faster).startswith("above 1000 Mbit/s")
    slower = crossing(_pts([50, 100, 1000], lambda b: 0.5, lambda b: 0.2 + 1 / b))
    assert slower == {"relation": "below", "at": None, "bracket": [None, 50], "crossings": []}
    assert describe(slower).startswith("below 50 Mbit/s")


def test_crossing_at_the_edges():
    # a tie at the highest point: the break-even is that point
    top = crossing([(50, 1.0, 2.0), (100, 1.0, 1.5), (200, 1.0, 1.0)])
    assert top["relation"] == "between" and top["at"] == pytest.approx(200.0)
    # a tie at the lowest point is not a win: below the swept range
    low = crossing([(50, 1.0, 1.0), (100, 1.0, 0.9), (200, 1.0, 0.8)])
    assert low["relation"] == "below"
    # slower at the lowest point, faster above: it was "below 50 (slower at every point)"
    rises = crossing([(50, 700, 600), (100, 200, 700), (200, 150, 360)])
    assert rises["relation"] == "from" and rises["bracket"] == [50, 100]
    assert describe(rises).startswith("none: slower below ")
    # in the last bracket: gain +0.1 at 1/500, -0.1 at 1/1000 -> 1/x = 1.5/1000
    last = crossing([(200, 1.0, 1.5), (500, 1.0, 1.1), (1000, 1.0, 0.9)])
    assert last["bracket"] == [500, 1000] and last["at"] == pytest.approx(1000 / 1.5)


def test_several_crossings_report_the_first_and_count_them():
    r = crossing([(50, 1, 2), (100, 2, 1), (200, 1, 2), (500, 2, 1)])
    assert r["bracket"] == [50, 100] and len(r["crossings"]) == 2
    assert r["at"] == pytest.approx(1 / (0.5 / 50 + 0.5 / 100))
    assert "2 crossings in all" in describe(r)
    with pytest.raises(ValueError):
        crossing([(50, 1, 2), (50, 2, 1)])


F = 1514 / 1448
"""TCP's framing: a 1448-byte segment in a 1514-byte frame (the model charges Gloo's bytes it)."""
PARAMS, STEPS, FIRST = 200_000, 40, 10
"""A model of 200k parameters (one DDP bucket), runs of 40 steps evaluated at 10 and 40."""


def _run(mode, step_s, compute_s=None, codec_s=None):
    """A main-job run whose steady-state step is ``step_s`` (evaluations at 10 and 40
    steps) and whose hook, if any, reports ``compute_s`` of compute and ``codec_s`` of codec
    a step."""
    last = {"steps": STEPS, "seconds": STEPS * step_s, "accuracy": 0.8}
    if compute_s is not None:
        last.update(codec_seconds=codec_s * STEPS,
                    exposed_comm_seconds=(step_s - compute_s) * STEPS)
    return {"mode": mode, "params": PARAMS, "testbed": "mininet", "wire_bytes": 1,
            "train_seconds": STEPS * step_s, "final_accuracy": 0.8, "epochs_done": 1.0,
            "stopped": None,
            "history": [{"steps": FIRST, "seconds": FIRST * step_s, "accuracy": 0.7}, last]}


def _sweep(thc_s):
    """FP32 worked out by hand from the ring formula: 4 workers, alpha 5 ms (6 messages: one
    bucket, 2(p-1) hops), efficiency 0.8: 0.030 + 2 x 4 x 200k x F x 3/4 x 8 / (0.8 x bw x
    1e6) = 0.030 + 12 F / bw seconds (bw in Mbit/s). THC: compute 10 ms, codec 20 ms."""
    points = [{"bw_mbit": bw, "runs": [_run("fp32", 0.030 + 12 * F / bw),
                                       _run("thc", thc_s, 0.010, 0.020)],
               "tta_s": {"fp32": 10 * (0.030 + 12 * F / bw), "thc": 10 * thc_s}}
              for bw in (50, 100, 200, 500, 1000)]
    return {"args": {"workers": 4, "software_lanes": 0, "loss": 0.0, "loss_bound": 0.05},
            "modes": ["fp32", "thc"], "points": points}


def test_links_fitted_to_the_fp32_points():
    alpha, eff = fit_links(_sweep(0.085), 86e3)
    assert alpha == pytest.approx(0.005, rel=1e-6) and eff == pytest.approx(0.8, rel=1e-6)


def test_noisy_points_get_the_nearest_fit_within_the_bounds():
    """Step times that fall as the link slows (noise in a few steps), or that a free line
    fits with a negative alpha, get a fit with alpha >= 0 and efficiency <= 1: the sweep
    keeps its analysis."""
    falling = _sweep(0.085)
    for p, t in zip(falling["points"], (0.30, 0.29, 0.28, 0.27, 0.26)):
        p["runs"][0] = _run("fp32", t)
    alpha, eff = fit_links(falling, 86e3)
    assert alpha > 0 and eff == 1.0
    assert analyse(falling, "thc", ("fp32",))["model"]["efficiency"] == 1.0
    steep = _sweep(0.085)
    for p in steep["points"]:
        p["runs"][0] = _run("fp32", 14 / p["bw_mbit"] - 0.004)
    alpha, eff = fit_links(steep, 86e3)
    assert alpha == 0.0 and 0 < eff <= 1


def test_measured_and_predicted_break_even_against_hand_figures():
    """Measured: THC's 85 ms against 30 + 12000 F/bw ms meet at 12 F/bw = 0.055, 228.1
    Mbit/s. Predicted: through the software aggregator a step of 200k parameters is 139
    packets of ~1444 lanes, 5 windows of 32 chunks, each a round trip of 2 alpha (50 ms), plus
    the MAX round (2 alpha): 60 ms, over the 10 ms of compute, plus 20 ms of codec: 80 ms
    while the bytes (~210 kB down, 9 ms at 251 Mbit/s x 0.8) stay under the windows. FP32
    meets that where 12 F/bw = 0.050: 250.9 Mbit/s."""
    a = analyse(_sweep(0.085), "thc", ("fp32",))
    be = a["break_even"]["fp32"]
    assert be["measured"]["bracket"] == [200, 500]
    assert be["measured"]["at"] == pytest.approx(12 * F / 0.055, rel=1e-9)
    assert be["predicted_mbit"] == pytest.approx(240.0 * F, rel=1e-3)
    assert be["predicted_over_measured"] == pytest.approx(0.055 / 0.050, rel=1e-3)
    assert be["tta_measured"]["at"] == pytest.approx(12 * F / 0.055, rel=1e-9)
    for row in a["points"]:
        assert row["predicted_s"]["fp32"] == pytest.approx(0.030 + 12 * F / row["bw_mbit"])
        if row["bw_mbit"] >= 100:
            assert row["predicted_s"]["thc"] == pytest.approx(0.080, rel=1e-6)
    assert a["model"]["compute_s"] == pytest.approx(0.010)
    assert a["model"]["codec_s"] == pytest.approx(0.020)


def _renamed(sweep, mode):
    for p in sweep["points"]:
        for r in p["runs"]:
            r["mode"] = mode if r["mode"] == "thc" else r["mode"]
        p["tta_s"][mode] = p["tta_s"].pop("thc")
    sweep["modes"] = ["fp32", mode]
    return sweep


def test_each_mode_is_predicted_through_the_aggregator_it_ran_through():
    """Every THC mode of a sweep was modelled as shards on the worker hosts. Through one
    central aggregator its link carries every worker's RESULTs: at 100 Mbit/s x 0.8, 4 x 138.5
    packets of 1514 bytes take 83.9 ms, after the MAX round's 2 alpha (10 ms), above the
    windows, plus the codec's 20 ms."""
    a = analyse(_renamed(_sweep(0.085), "thc-central"), "thc-central", ("fp32",))
    link = 4 * PARAMS / 1444 * 1514 / (0.8 * 100e6 / 8)
    # shards on the worker hosts: 80 ms (the hand figures above); where the windows bind
    # (at 500 Mbit/s the central link takes 16.8 ms) the two are one
    sharded = analyse(_sweep(0.085), "thc", ("fp32",))
    for bw, central in ((100, 0.010 + link + 0.020), (500, 0.080)):
        assert next(r for r in a["points"] if r["bw_mbit"] == bw)[
            "predicted_s"]["thc-central"] == pytest.approx(central, rel=1e-6)
        assert next(r for r in sharded["points"] if r["bw_mbit"] == bw)[
            "predicted_s"]["thc"] == pytest.approx(0.080, rel=1e-6)


def test_a_bmv2_mode_without_its_rate_is_not_modelled():
    """A sweep keeps no BMv2 probe: its BMv2 modes were predicted at line rate."""
    a = analyse(_renamed(_sweep(0.085), "thc-bmv2"), "thc-bmv2", ("fp32",))
    assert all("thc-bmv2" not in r["predicted_s"] for r in a["points"])
    assert "thc-bmv2" not in a["curve"] and "fp32" in a["curve"]
    be = a["break_even"]["fp32"]
    assert be["predicted_mbit"] is None and be["predicted_relation"].startswith("not modelled")
    assert be["measured"]["at"] == pytest.approx(12 * F / 0.055, rel=1e-9)


def test_each_mode_takes_its_own_hooks_codec_seconds():
    """The codec seconds of every hooked run were averaged: a Marsit run's sign packing
    set THC's codec."""
    sweep = _sweep(0.085)
    for p in sweep["points"]:
        p["runs"].append(_run("marsit", 0.2, 0.010, 0.200))
    sweep["modes"].append("marsit")
    assert analyse(sweep, "thc", ("fp32",))["model"]["codec_s"] == pytest.approx(0.020)


@pytest.mark.parametrize("model,relation", [("below", "never pays"),
                                            ("above", "pays everywhere"),
                                            ("between", "between"), ("from", "from"),
                                            ("band", "pays between 200 and 240 Mbit/s")])
def test_the_predicted_relation_follows_the_models_break_even(monkeypatch, model, relation):
    """The model's break-even in the report's words. A model that loses on slow links and
    pays from 240 Mbit/s up was told "never pays"; its bandwidth is no ratio to a measured
    break-even of another kind."""
    from thc.app import breakeven
    at = None if model in ("below", "above", "band") else 0.24
    pays = {"below": [], "above": [[1e-3, 1e4]], "between": [[1e-3, 0.24]],
            "from": [[0.24, 1e4]], "band": [[0.2, 0.24]]}[model]
    monkeypatch.setattr(breakeven, "break_even",
                        lambda *a, **k: {"relation": model, "at": at, "pays": pays,
                                         "range": [1e-3, 1e4]})
    be = analyse(_sweep(0.085), "thc", ("fp32",))["break_even"]["fp32"]
    assert be["predicted_relation"] == relation
    assert be["predicted_mbit"] == (None if at is None else pytest.approx(240.0))
    assert ("predicted_over_measured" in be) == (relation == be["measured"]["relation"]), be


def _sweep_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "thc.cli", "sweep", *argv],
                          capture_output=True, text=True, timeout=400)


def _sweep_here(*argv: str) -> int:
    """``thc sweep`` in this process (its exit status), for the checks that run nothing."""
    import argparse

    from thc.emu import sweep
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    return sweep.run(parser.parse_args(list(argv)))


def test_a_sweep_the_links_cannot_be_fitted_to_is_refused_before_it_runs(tmp_path, capsys):
    """One bandwidth, or no FP32, leaves the fit of the links nothing to fit: refused at once,
    not after every run."""
    for bw, modes in (("1000", "fp32,thc"), ("100,1000", "fp16,thc")):
        assert _sweep_here("--bw", bw, "--modes", modes, "--out", str(tmp_path)) == 2
        assert "fp32 at two bandwidths" in capsys.readouterr().err
        assert not (tmp_path / "sweep.json").exists()


@pytest.mark.parametrize("argv, said", [
    (["--modes", "fp32,fp16"], "names no THC mode"),
    (["--evals", "1"], "--evals and --steps must be at least 2"),
    (["--steps", "1"], "--evals and --steps must be at least 2"),
    (["--bw", "100,200000"], "--bw 200000: bandwidth must lie in"),
    (["--workers", "1"], "--workers 1: the modes compare gradient exchanges"),
    (["--plot", "sweep.txt"], "a figure's file name ends in"),
    (["--json", "."], "cannot write .: it is a folder")])
def test_a_sweep_that_could_not_end_well_is_refused_before_it_runs(tmp_path, capsys,
                                                                   argv, said):
    """Each ran every run first: a sweep without a THC mode then found no break-even, a
    --json naming a folder or a --plot matplotlib cannot draw failed with a traceback,
    --workers past a job's limit and a bandwidth past the links' failed in every run (of
    that bandwidth), and one step a run gave one evaluation, whose step time counted the
    first step's set-up."""
    assert _sweep_here("--bw", "100,1000", "--modes", "fp32,thc", *argv,
                       "--out", str(tmp_path)) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "sweep.json").exists()


def test_a_run_whose_workers_diverged_is_left_out_of_the_analysis(tmp_path, capsys):
    """Its step time went into the break-even, and the sweep exited 0."""
    data = json.loads((ROOT / "docs" / "runs" / "sweep-bandwidth.json").read_text())
    point = next(p for p in data["points"] if p["bw_mbit"] == 200)
    next(r for r in point["runs"] if r["mode"] == "thc")["replicas_diverged_at"] = 8
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(data))
    assert _sweep_here("--report", str(path), "--out", str(tmp_path)) == 1
    out = capsys.readouterr().out
    assert "thc at 200 Mbit/s FAILED (not in the table): the workers' parameters differed " \
           "after step 8" in out
    analysed = json.loads(path.read_text())
    point = next(p for p in analysed["points"] if p["bw_mbit"] == 200)
    assert "thc" not in [r["mode"] for r in point["runs"]] and analysed["analysis"]
    kept = next(f for f in analysed["failed"] if f["mode"] == "thc")
    assert kept["run"]["replicas_diverged_at"] == 8   # its measurements kept, not analysed


def test_run_flags_beside_a_report_are_refused(tmp_path, capsys):
    """--report analyses runs already made: --bw and the other run flags were ignored."""
    assert _sweep_here("--report", "x.json", "--bw", "5", "--workers", "8",
                       "--out", str(tmp_path)) == 2
    assert "it would ignore --bw, --workers" in capsys.readouterr().err


def test_a_malformed_sweep_report_is_a_line_not_a_traceback(tmp_path, capsys):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"modes": ["fp32", "thc"], "points": [{"bw_mbit": 100}]}))
    assert _sweep_here("--report", str(path), "--out", str(tmp_path / "out")) == 1
    assert f"thc sweep: no analysis of the runs in {path}:" in capsys.readouterr().err


def test_a_sweep_that_cannot_be_analysed_keeps_its_runs_and_says_why(tmp_path, capsys):
    """A sweep whose analysis fails (here: FP32 measured at one bandwidth only) ends with the
    reason and exit status 1, its JSON untouched, not with a traceback."""
    one = _sweep(0.085)
    one["points"] = one["points"][:1]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(one))
    assert _sweep_here("--report", str(path), "--out", str(tmp_path)) == 1
    err = capsys.readouterr().err
    assert "no analysis" in err and "two bandwidths" in err
    assert json.loads(path.read_text()) == one


@pytest.mark.slow
@pytest.mark.mininet
def test_sweep_command_runs_small_on_mininet(tmp_path):
    """Two bandwidths, FP32 and THC, 2 workers, 4 steps of the digits CNN: the JSON holds
    every run on shaped links (THC moving far fewer bytes) and the analysis of them, the plot
    is written. (FP16's bytes: test_mainjob.py.)"""
    from thc.emu.testbed import mininet_unavailable_reason
    if why := mininet_unavailable_reason("sharded"):
        pytest.skip(f"the sweep shapes links with Mininet: {why}")
    out = _sweep_cli("--bw", "100,1000", "--modes", "fp32,thc", "--steps", "4", "--evals", "2",
                     "--workers", "2", "--batch", "32", "--data", "digits", "--out",
                     str(tmp_path))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert [p["bw_mbit"] for p in data["points"]] == [100.0, 1000.0]
    for p in data["points"]:
        runs = {r["mode"]: r for r in p["runs"]}
        assert list(runs) == ["fp32", "thc"]
        for r in runs.values():
            assert r["testbed"] == "mininet" and r["history"][-1]["steps"] == 4
        assert runs["fp32"]["wire_bytes"] > 2 * runs["thc"]["wire_bytes"] > 0
    be = data["analysis"]["break_even"]["fp32"]
    # the analysis reads the runs it was given: THC's gain over FP32 at each bandwidth
    gain = [step_seconds(runs["fp32"]) - step_seconds(runs["thc"])
            for runs in ({r["mode"]: r for r in p["runs"]} for p in data["points"])]
    want = ("between" if gain[0] > 0 >= gain[1] else "above" if gain[0] > 0 else
            "from" if gain[1] > 0 else "below")
    assert be["measured"]["relation"] == want, (gain, be["measured"])
    assert "| FP32 |" in out.stdout and data["fp16_cast_s"] > 0
    assert (tmp_path / "sweep.png").stat().st_size > 10_000


@pytest.mark.parametrize("modes", [["fp32", "thc-bmv2"], ["fp32", "thc"]])
def test_every_mode_of_a_sweep_trains_its_steps_under_its_limit(modes):
    """A BMv2 mode trained the main job's 3 steps under its 3600 s limit, whatever --steps
    and --timeout said, beside FP32's --steps: its time to accuracy compared unlike runs."""
    import argparse

    from thc.emu import mainargs, sweep
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    args = parser.parse_args(["--steps", "8", "--timeout", "100", "--workers", "2"])
    job = sweep._job_args(args, 50.0, modes)
    assert mainargs.check_args(job, modes) is None
    assert job.timeout == 100
    if "thc-bmv2" in modes:
        assert (job.bmv2_steps, job.bmv2_timeout) == (None, 100)   # None: every step
    # the bandwidth refused or taken is the one the runs get (printed to 6 digits, 100000.4
    # was refused and would have run at 100000)
    assert sweep._job_args(args, 1234.5678, modes).bw == 1234.5678


def test_the_links_are_fitted_in_relative_error():
    """Noisy FP32 steps (a few percent off the hand line of _sweep): the fit is the least
    squares of the residuals relative to each step, 6 alpha + 9.6 F x / bw - t over t (x =
    1/efficiency; 6 messages, 2 x 4 x 200k x 3/4 x 8 bits at full efficiency), solved here
    as a linear system scaled by 1/t. Unweighted, the slowest link settles alpha (alpha 1.24
    ms against 2.39 in docs/results.md's sweep)."""
    import numpy as np
    sweep = _sweep(0.085)
    bws = [p["bw_mbit"] for p in sweep["points"]]
    steps = [(0.030 + 12 * F / bw) * k for bw, k in zip(bws, (1.04, 0.97, 1.03, 0.96, 1.02))]
    for p, t in zip(sweep["points"], steps):
        p["runs"][0] = _run("fp32", t)
    a = np.array([[6 / t, 9.6 * F / bw / t] for bw, t in zip(bws, steps)])
    (alpha, x), *_ = np.linalg.lstsq(a, np.ones(len(steps)), rcond=None)
    assert alpha > 0 and x > 1   # inside the bounds: the free fit is the answer
    got = fit_links(sweep, 86e3)
    assert got == (pytest.approx(alpha, rel=1e-9), pytest.approx(1 / x, rel=1e-9))
    unweighted, *_ = np.linalg.lstsq(a * np.array(steps)[:, None], np.array(steps),
                                     rcond=None)
    assert abs(unweighted[0] / alpha - 1) > 0.01   # the data tell the two fits apart


def test_compute_and_codec_are_averaged_over_the_points():
    """Each point's hooked run measures its compute and codec seconds; the model takes their
    mean over the sweep (10 and 20 ms here), not the first point's."""
    sweep = _sweep(0.085)
    for p, k in zip(sweep["points"], (0.5, 1.5, 1.0, 1.2, 0.8)):
        p["runs"][1] = _run("thc", 0.085, 0.010 * k, 0.020 * k)
    model = analyse(sweep, "thc", ("fp32",))["model"]
    assert model["compute_s"] == pytest.approx(0.010)
    assert model["codec_s"] == pytest.approx(0.020)


def test_fp16_is_charged_its_cast_of_four_bytes_a_coordinate():
    """The cast timed beside the sweep (4 ms for 200k float32s, down to half and back) is
    added to FP16's ring of 2 bytes a coordinate: half FP32's bytes and the same 6 messages,
    0.030 + 6 F / bw seconds, plus the 4 ms."""
    sweep = _sweep(0.085)
    sweep["fp16_cast_s"] = 0.004
    for p in sweep["points"]:
        p["runs"].append(_run("fp16", 0.030 + 6 * F / p["bw_mbit"] + 0.004))
    sweep["modes"].append("fp16")
    for row in analyse(sweep, "thc", ("fp32", "fp16"))["points"]:
        assert row["predicted_s"]["fp16"] == pytest.approx(0.030 + 6 * F / row["bw_mbit"]
                                                           + 0.004, rel=1e-9)


def test_the_fit_on_the_efficiency_bound_and_the_swept_range():
    """Step times that fall as the link slows put the free line above efficiency 1: on that
    bound alpha is the least squares of what the messages leave, relative residuals,
    6 alpha / t against 1 - 9.6 F / (bw t), solved here on its own. The analysis says which
    bandwidths it swept, lowest first, and draws the model's curve across all of them, 41
    points evenly spaced in log bandwidth."""
    import numpy as np
    falling = _sweep(0.085)
    steps = (0.30, 0.29, 0.28, 0.27, 0.26)
    for p, t in zip(falling["points"], steps):
        p["runs"][0] = _run("fp32", t)
    bws = [p["bw_mbit"] for p in falling["points"]]
    a = np.array([[6 / t] for t in steps])
    b = np.array([1 - 9.6 * F / (bw * t) for bw, t in zip(bws, steps)])
    (alpha,), *_ = np.linalg.lstsq(a, b, rcond=None)
    assert fit_links(falling, 86e3) == (pytest.approx(alpha, rel=1e-9), 1.0)
    a = analyse(_sweep(0.085), "thc", ("fp32",))
    assert a["break_even"]["fp32"]["swept"] == [50, 1000]
    grid = a["curve"]["bw_mbit"]
    assert len(grid) == 41 and grid[0] == pytest.approx(50) and grid[-1] == pytest.approx(1000)
    assert np.diff(np.log(grid)) == pytest.approx(np.full(40, np.log(20) / 40))


def test_a_sigterm_ends_the_sweep_with_a_line(tmp_path, capsys, monkeypatch):
    """SIGTERM mid-sweep exited 143 with no line at all."""
    import os
    import signal
    import time

    from thc.emu import sweep
    from thc.emu.testbed import mininet_unavailable_reason
    if why := mininet_unavailable_reason("sharded"):
        pytest.skip(f"the sweep needs the Mininet testbed: {why}")

    def terminated(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not end the sweep")
    monkeypatch.setattr(sweep, "sweep", terminated)
    assert _sweep_here("--bw", "100,1000", "--modes", "fp32,thc", "--data", "digits",
                       "--out", str(tmp_path)) == 143
    assert "thc sweep: terminated (SIGTERM); no bandwidth was done" in capsys.readouterr().err


def test_the_plotted_lines_cross_where_the_measured_break_even_lies():
    """The plot joined the measured points straight on log axes, so two modes' lines crossed
    away from the break-even, which interpolates linearly in 1/bandwidth (764 against 798
    Mbit/s in one sweep)."""
    from thc.emu.sweepreport import between
    bws = [50.0, 100.0, 200.0, 500.0, 1000.0]
    thc = [0.30, 0.28, 0.27, 0.265, 0.262]
    fp32 = [1.20, 0.65, 0.40, 0.28, 0.24]
    at = crossing(list(zip(bws, thc, fp32)))["at"]
    xs, a = between(list(zip(bws, thc)))
    _, b = between(list(zip(bws, fp32)))
    k = next(i for i in range(1, len(xs)) if (b[i - 1] > a[i - 1]) != (b[i] > a[i]))
    assert xs[k - 1] <= at <= xs[k] and xs[k] / xs[k - 1] < 1.05, (at, xs[k - 1], xs[k])
    assert (xs[0], xs[-1]) == (50.0, 1000.0) and all(x in xs for x in bws)


def test_a_report_whose_lowest_bandwidth_has_no_run_is_analysed(tmp_path, capsys):
    """Its table and plot read the sweep's dataset off the lowest bandwidth's first run: an
    IndexError where every run there had failed."""
    data = json.loads((ROOT / "docs" / "runs" / "sweep-bandwidth.json").read_text())
    data["points"][0]["runs"] = []
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(data))
    assert _sweep_here("--report", str(path), "--out", str(tmp_path)) == 0
    assert "fashion-mnist, 1.20M parameters" in capsys.readouterr().out
    assert (tmp_path / "sweep.png").stat().st_size > 0


def _mutations(report: dict):
    """The report with one field at a time replaced by a hostile value, two levels down
    (into the first element of a list)."""
    hostile = (None, 0, 1e400, "x", {}, [1])

    def walk(node, path):
        items = node.items() if isinstance(node, dict) else \
            enumerate(node[:1]) if isinstance(node, list) else ()
        for key, child in items:
            for value in hostile:
                yield path + (key,), value
            if len(path) < 2:
                yield from walk(child, path + (key,))
    for path, value in walk(report, ()):
        copy = json.loads(json.dumps(report))
        node = copy
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        yield path, copy


def test_a_damaged_sweep_report_is_refused_by_name_never_a_traceback(tmp_path, capsys,
                                                                     monkeypatch):
    """`thc sweep --report` of the committed report with one field damaged at a time: a
    TypeError, KeyError, AttributeError or ZeroDivisionError traceback for 32 of 161 such
    changes (modes null, machine {}, bw_mbit 0, failed [1], date [1]). The plot is laid out
    from the report, its footer signed, and not rendered (a second each)."""
    import matplotlib.pyplot as plt

    from thc.bench import footer
    from thc.emu import sweepreport
    from thc.emu.testbed import REPO_ROOT
    monkeypatch.setattr(sweepreport, "save_figure",
                        lambda fig, path, recorded: (footer(recorded), plt.close(fig)))
    report = json.loads((REPO_ROOT / "docs" / "runs" / "sweep-bandwidth.json").read_text())
    path, tried = tmp_path / "sweep.json", 0
    for where, damaged in _mutations(report):
        path.write_text(json.dumps(damaged, allow_nan=True))
        try:
            code = _sweep_here("--report", str(path), "--out", str(tmp_path / "out"))
        except Exception as e:   # noqa: BLE001 (the failure this test looks for)
            pytest.fail(f"{'/'.join(map(str, where))}: {type(e).__name__}: {e}")
        assert code in (0, 1, 2), where
        tried += 1
    capsys.readouterr()
    assert tried > 100
