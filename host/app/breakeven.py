"""The break-even bandwidth of a bandwidth sweep: where a compressed mode stops beating a
baseline, measured and predicted.

Measured: between the two swept bandwidths that bracket the change of sign of
``baseline - mode`` (seconds a step, or to an accuracy), interpolated linearly in
1/bandwidth. Where its link term binds, a scheme of the performance model
(host/app/perfmodel.py) takes a + b/BW a step, so the difference of two modes is linear in
1/BW and two points fix its zero; interpolating in BW itself would bias it towards the
higher bandwidth. Where another term binds in the bracket (THC's window, a step's compute:
the model's THC is flat from 200 Mbit/s in docs/results.md's sweep) the step is piecewise
in 1/BW and the interpolation an approximation. The predicted break-even is the model's own
crossing, found on the model (``perfmodel.break_even``), not interpolated.

Predicted: the performance model fed the sweep's own figures (its calibrated inputs):
compute a step as the hooked runs measured it, each mode's codec seconds a step as its own
hook measured them, the aggregator each mode ran through (``perfmodel.mode_setup``), the
FP16 cast as timed beside the sweep, and alpha (per-message cost) and the link efficiency
fitted to the FP32 points alone (a least-squares line of step time against 1/BW, relative
residuals). FP16's
and THC's step times, and so every break-even, are then predictions; FP32's are fitted.
"""
from __future__ import annotations

from dataclasses import replace

from thc.app.perfmodel import (
    MODE_SCHEME,
    NO_HOOK,
    Setup,
    bounded_fit,
    break_even,
    fit_terms,
    iteration_s,
    mode_setup,
    modelled,
    report_setup,
    says,
    step_seconds,
)


def crossing(points: list[tuple[float, float, float]]) -> dict:
    """Where a mode stops beating its baseline, from ``(bandwidth, mode, baseline)`` triples
    (any unit of time; lower is better).

    Returns ``relation`` "between" with the interpolated ``at`` (the first crossing from
    beating to not beating, going up in bandwidth; a tie counts as not beating) and its
    ``bracket``; "above" (the mode beats the baseline at every point: the break-even lies
    above the highest, ``bracket`` [highest, None]); "below" (it beats it nowhere:
    [None, lowest]); or "from" (it loses at the lowest points and beats the baseline from the
    interpolated ``at`` up: the other way round). ``crossings`` lists every crossing from
    beating to not beating, more than one where the measured gain changes sign more than
    once.
    """
    pts = sorted(points)
    if len(pts) < 1:
        raise ValueError("no points")
    if len({bw for bw, _, _ in pts}) != len(pts):
        raise ValueError("two points at the same bandwidth")
    gains = [(bw, base - mode) for bw, mode, base in pts]
    found, rising = [], []
    for (b0, g0), (b1, g1) in zip(gains, gains[1:]):
        if (g0 > 0) != (g1 > 0):
            x0, x1 = 1.0 / b0, 1.0 / b1
            x = x0 + g0 / (g0 - g1) * (x1 - x0)
            (found if g0 > 0 else rising).append({"at": 1.0 / x, "bracket": [b0, b1]})
    if found:
        return {"relation": "between", **found[0], "crossings": [c["at"] for c in found]}
    if rising:   # slower at the lowest points, faster from the last rise up
        return {"relation": "from", **rising[-1], "crossings": []}
    if gains[0][1] > 0:
        return {"relation": "above", "at": None, "bracket": [gains[-1][0], None],
                "crossings": []}
    return {"relation": "below", "at": None, "bracket": [None, gains[0][0]], "crossings": []}


def describe(result: dict, unit: str = "Mbit/s") -> str:
    """One phrase for a :func:`crossing` result."""
    if result["relation"] == "between":
        lo, hi = result["bracket"]
        more = (f"; {len(result['crossings'])} crossings in all"
                if len(result["crossings"]) > 1 else "")
        return f"{result['at']:.0f} {unit} (between {lo:g} and {hi:g}{more})"
    if result["relation"] == "above":
        return f"above {result['bracket'][0]:g} {unit} (faster at every point)"
    if result["relation"] == "from":
        lo, hi = result["bracket"]
        return (f"none: slower below {result['at']:.0f} {unit}, faster from there up "
                f"(between {lo:g} and {hi:g})")
    return f"below {result['bracket'][1]:g} {unit} (slower at every point)"


def _point_report(point: dict, args: dict) -> dict:
    """A sweep point as the main job's report (its runs, the sweep's arguments at its
    bandwidth), the shape the performance model's calibration reads."""
    return {"args": {**args, "bw": point["bw_mbit"]}, "runs": point["runs"]}


def fit_links(sweep: dict, agg_pps: float) -> tuple[float, float]:
    """(alpha seconds, link efficiency) of the bounded least-squares line through the FP32
    points (:func:`thc.app.perfmodel.bounded_fit`): step = alpha x messages + wire bytes /
    (efficiency x BW), the two terms as the model counts them at each point's bandwidth.
    Relative residuals keep the slowest link from settling alpha, which the fast links,
    where the break-even lies, depend on."""
    rows = []
    for point in sweep["points"]:
        fp32 = next((r for r in point["runs"] if r["mode"] == "fp32"), None)
        if fp32 is None:
            continue
        base = report_setup(_point_report(point, sweep["args"]), agg_pps, links_only=True)
        msgs, wire, delay = fit_terms(base, "fp32_ring")
        rows.append((msgs, wire, step_seconds(fp32) - delay))
    if len({round(w, 12) for _, w, _ in rows}) < 2:
        raise ValueError("the fit needs FP32 at two bandwidths or more")
    return bounded_fit(rows)


def codec_mbps(sweep: dict, mode: str, params: float) -> float | None:
    """``mode``'s codec speed as its hook measured it, averaged over the points (MB of
    float32 a second); None where no run of it reports codec seconds."""
    secs = [r["history"][-1]["codec_seconds"] / r["history"][-1]["steps"]
            for p in sweep["points"] for r in p["runs"]
            if r["mode"] == mode and r["history"][-1].get("codec_seconds")]
    return 4 * params / (sum(secs) / len(secs)) / 1e6 if secs else None


def calibrated(sweep: dict, agg_pps: float, mode: str = "thc") -> Setup:
    """The model's setup for the sweep: its testbed and model size, compute averaged over
    the points, ``mode``'s codec seconds, the FP16 cast, alpha and efficiency from
    :func:`fit_links`."""
    bases = [report_setup(_point_report(p, sweep["args"]), agg_pps) for p in sweep["points"]
             if any(r["mode"] not in NO_HOOK for r in p["runs"])]
    if not bases:
        raise ValueError("no point has a run with a hook (THC) to measure compute and codec")
    alpha, eff = fit_links(sweep, agg_pps)
    params = bases[0].params
    cast = sweep.get("fp16_cast_s")
    return replace(bases[0], compute_s=sum(b.compute_s for b in bases) / len(bases),
                   codec_mbps=codec_mbps(sweep, mode, params) or 1e12,
                   fp16_mbps=4 * params / cast / 1e6 if cast else float("inf"),
                   latency_us=alpha * 1e6, efficiency=eff)


def mode_setups(sweep: dict, setup: Setup, modes) -> dict[str, Setup]:
    """Each of ``modes`` the model knows (:func:`perfmodel.modelled`) as it ran: through its
    own aggregator, at its own hook's codec speed where it has one."""
    return {m: replace(mode_setup(setup, m, sweep),
                       codec_mbps=codec_mbps(sweep, m, setup.params) or setup.codec_mbps)
            for m in modes if modelled(m, sweep)}


MODEL_RANGE_GBPS = (1e-3, 1e4)
"""Where the model's break-even is sought (1 Mbit/s to 10 Tbit/s)."""
PREDICTED = {"between": "between", "from": "from", "above": "pays everywhere",
             "below": "never pays"}
"""The model's relation (``perfmodel.break_even``) as a sweep's report names it; "between"
and "from" as the measured side's (:func:`crossing`), which they are compared with; a band
(slower at both ends of the range) in the model's own words."""
CURVE_POINTS = 41
"""Bandwidths of the model's curve across the swept range (evenly spaced in log)."""


def predicted_s(setup: Setup, mode: str, bw_mbit: float) -> float:
    """The model's seconds a step of a main-job mode at ``bw_mbit``, ``setup`` that mode's
    (:func:`mode_setups`)."""
    return iteration_s(replace(setup, bandwidth_gbps=bw_mbit / 1e3))[MODE_SCHEME[mode]]


def analyse(sweep: dict, mode: str = "thc", baselines: tuple[str, ...] = ("fp32", "fp16"),
            agg_pps: float = 86e3) -> dict:
    """Measured step times, the model's predictions and both break-evens of ``mode``
    against each baseline; with ``tta`` in the points, the break-even in time to accuracy
    too (measured only: the model has no accuracy)."""
    setup = calibrated(sweep, agg_pps, mode)
    modes = sorted({r["mode"] for p in sweep["points"] for r in p["runs"]})
    setups = mode_setups(sweep, setup, modes)
    ran = setups.get(mode, setup)
    out = {"mode": mode, "model": {"alpha_s": setup.alpha, "efficiency": setup.efficiency,
                                   "compute_s": setup.compute_s,
                                   "codec_s": 4 * setup.params / (setup.codec_mbps * 1e6),
                                   "fp16_cast_s": sweep.get("fp16_cast_s"),
                                   "params": setup.params, "workers": setup.workers,
                                   "buckets": setup.buckets, "lanes": ran.lanes,
                                   "agg_pps": ran.agg_pps,
                                   "fitted": "alpha and efficiency, to the FP32 points"},
           "points": [], "break_even": {}}
    for p in sweep["points"]:
        row = {"bw_mbit": p["bw_mbit"], "measured_s": {}, "predicted_s": {}, "tta_s": {}}
        for r in p["runs"]:
            row["measured_s"][r["mode"]] = step_seconds(r)
            if r["mode"] in setups:
                row["predicted_s"][r["mode"]] = predicted_s(setups[r["mode"]], r["mode"],
                                                            p["bw_mbit"])
        row["tta_s"] = dict(p.get("tta_s") or {})
        out["points"].append(row)
    bws = [p["bw_mbit"] for p in sweep["points"]]
    grid = [min(bws) * (max(bws) / min(bws)) ** (i / (CURVE_POINTS - 1))
            for i in range(CURVE_POINTS)] if len(bws) > 1 else bws
    out["curve"] = {"bw_mbit": grid,
                    **{m: [predicted_s(s, m, bw) for bw in grid] for m, s in setups.items()}}
    for base in baselines:
        have = [row for row in out["points"]
                if mode in row["measured_s"] and base in row["measured_s"]]
        if not have:
            continue
        measured = crossing([(row["bw_mbit"], row["measured_s"][mode],
                              row["measured_s"][base]) for row in have])
        lo, hi = min(r["bw_mbit"] for r in have), max(r["bw_mbit"] for r in have)
        entry = {"measured": measured, "predicted_mbit": None, "swept": [lo, hi],
                 "predicted_relation": "not modelled (BMv2's rate is known from a main "
                                       "job's probe only)"}
        if mode in setups:
            predicted = break_even(setups[mode], MODE_SCHEME[mode], lo=MODEL_RANGE_GBPS[0],
                                   hi=MODEL_RANGE_GBPS[1], baseline=MODE_SCHEME[base])
            at = predicted["at"]
            entry.update(predicted_mbit=None if at is None else 1e3 * at,
                         predicted_relation=PREDICTED.get(predicted["relation"])
                         or says(predicted, "Mbit/s", 1e3))
        model = entry["predicted_mbit"]
        if measured["at"] is not None and model is not None \
                and measured["relation"] == entry["predicted_relation"]:
            entry["predicted_over_measured"] = model / measured["at"]
        tta = [(row["bw_mbit"], row["tta_s"].get(mode), row["tta_s"].get(base))
               for row in have]
        tta = [t for t in tta if t[1] is not None and t[2] is not None]
        entry["tta_measured"] = crossing(tta) if tta else None
        entry["tta_points"] = len(tta)
        out["break_even"][base] = entry
    return out
