"""What a bandwidth sweep shows: the table of step times (measured, and the model's beside
them), the break-even bandwidths, and the plot of step time against bandwidth."""
from __future__ import annotations

from pathlib import Path

from thc.app.breakeven import describe
from thc.bench import figure, save_figure

LABEL = {"fp32": "FP32", "fp16": "FP16", "thc": "THC", "thc-dist": "THC (Gloo)",
         "thc-central": "THC (central)"}


def first_run(data: dict) -> dict:
    """The sweep's first run (the lowest bandwidth's runs may all have failed)."""
    return next(r for p in data["points"] for r in p["runs"])


def _label(mode: str) -> str:
    return LABEL.get(mode, mode)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}"


def markdown(data: dict) -> str:
    """The sweep as Markdown: where and how it ran, step times and ratios per bandwidth,
    then the break-evens, measured beside predicted."""
    a = data["analysis"]
    mode, m = a["mode"], a["model"]
    others = [x for x in data["modes"] if x != mode]
    mach = data["machine"]
    first = first_run(data)
    lines = [f"Measured {data['date']} on a {mach['cpus']}-core VM ({mach['cpu']}, "
             f"{mach['memory_gib']} GiB, Linux {mach['kernel']}): `{data['command']}`. "
             f"{first['dataset']}, {first['params'] / 1e6:.2f}M parameters, "
             f"{data['args']['workers']} workers in Mininet, {data['steps']} steps a run "
             f"(batch {data['args']['batch']} a worker). Seconds a step: steady state, first "
             f"evaluation to last."
             + (f" Analysed by `{data['analysed_by']}`." if data.get("analysed_by") else ""),
             ""]
    head = (["Mbit/s"] + [f"{_label(x)} ms/step" for x in data["modes"]]
            + [f"{_label(x)}/{_label(mode)}" for x in others]
            + [f"model {_label(x)} ms" for x in data["modes"]]
            + [f"{_label(mode)} MB/step (links)", "load before"])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p, row in zip(data["points"], a["points"]):
        meas, pred = row["measured_s"], row["predicted_s"]
        ratios = [f"{meas[x] / meas[mode]:.2f}x" if x in meas and mode in meas else "-"
                  for x in others]
        run = next((r for r in p["runs"] if r["mode"] == mode), None)
        mb = (f"{run['wire_bytes'] / run['history'][-1]['steps'] / 1e6:.2f}" if run else "-")
        load = max((v[0] for v in p["load_before"].values()), default=None)
        lines.append("| " + " | ".join(
            [f"{row['bw_mbit']:g}"] + [_ms(meas.get(x)) for x in data["modes"]] + ratios
            + [_ms(pred.get(x)) for x in data["modes"]]
            + [mb, "-" if load is None else f"{load:.2f}"])
            + " |")
    lines += ["", *_split(data, mode)]
    lines += ["", f"Model inputs, calibrated on this sweep: compute {1e3 * m['compute_s']:.0f} ms "
              f"a step and codec {1e3 * m['codec_s']:.0f} ms a step (the THC runs' hooks), "
              f"FP16 cast {_ms(m['fp16_cast_s'])} ms, alpha {1e3 * m['alpha_s']:.2f} ms and "
              f"link efficiency {m['efficiency']:.3f} (fitted to the FP32 points; FP32's model "
              f"column is that fit, the others are predictions).", ""]
    lines += [f"| {_label(mode)} against | measured break-even | model's prediction "
              f"(estimate) | model / measured | time-to-accuracy break-even (measured) |",
              "|---|---|---|---|---|"]
    for base, be in a["break_even"].items():
        pred = be["predicted_mbit"]
        ratio = be.get("predicted_over_measured")
        tta = be["tta_measured"]
        lines.append(f"| {_label(base)} | {describe(be['measured'])} | "
                     f"{_predicted(be)} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'} | "
                     f"{'-' if tta is None else describe(tta)} "
                     f"(from the {be['tta_points']} of {len(a['points'])} bandwidths at "
                     f"which both reached {data.get('tta_target', 'the target')}) |")
    return "\n".join(lines)


def _predicted(be: dict) -> str:
    """The model's break-even as the table gives it: a bandwidth, "from" one (THC slower
    below it), or the relation where the model has none."""
    pred = be["predicted_mbit"]
    if pred is None:
        return be["predicted_relation"]
    return f"from {pred:.0f} Mbit/s up" if be["predicted_relation"] == "from" else \
        f"{pred:.0f} Mbit/s"


def _split(data: dict, mode: str) -> list[str]:
    """Where a step of ``mode`` goes at each bandwidth, as its hook measured it (whole run,
    first steps included): the time the step did not wait for communication (the model's
    compute), the time it waited (from the last bucket handed over to the last reduced), and
    the codec's seconds, which fall in both (buckets encoded while backward went on, and the
    last bucket's after it)."""
    lines = [f"| Mbit/s | {_label(mode)} ms a step (whole run) | not waiting ms | waiting for "
             f"communication ms | codec ms (within both) |", "|---|---|---|---|---|"]
    for p in data["points"]:
        run = next((r for r in p["runs"] if r["mode"] == mode), None)
        if run is None:
            continue
        last = run["history"][-1]
        n = last["steps"]
        exposed = last.get("exposed_comm_seconds") or 0.0
        lines.append(f"| {p['bw_mbit']:g} | {_ms(run['train_seconds'] / n)} | "
                     f"{_ms((run['train_seconds'] - exposed) / n)} | {_ms(exposed / n)} | "
                     f"{_ms((last.get('codec_seconds') or 0.0) / n)} |")
    return lines


def between(pts: list[tuple[float, float]], k: int = 32) -> tuple[list[float], list[float]]:
    """The measured points joined as the break-even interpolates them, linearly in
    1/bandwidth (host/app/breakeven.py), ``k`` steps a segment: two modes' lines then cross
    where the measured break-even lies, not where straight segments would on log axes."""
    bws, ts = [pts[0][0]], [pts[0][1]]
    for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
        for i in range(1, k):
            bws.append(1 / (1 / b0 + (1 / b1 - 1 / b0) * i / k))
            ts.append(t0 + (t1 - t0) * i / k)
        bws.append(b1)
        ts.append(t1)
    return bws, ts


def plot(data: dict, path: Path) -> None:
    """Step time against bandwidth: a solid line per mode (measured points, joined linearly
    in 1/bandwidth as the break-even interpolates them), its model dashed in the same
    colour, the measured break-evens as dotted verticals."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    a = data["analysis"]
    fig, axes = figure(7.5, 4.8)
    ax = axes[0][0]
    colours = {}
    for mode in data["modes"]:
        pts = [(row["bw_mbit"], row["measured_s"][mode]) for row in a["points"]
               if mode in row["measured_s"]]
        if not pts:
            continue
        bws, ts = between(pts)
        line, = ax.plot(bws, [1e3 * t for t in ts], label=f"{_label(mode)} measured")
        colours[mode] = line.get_color()
        ax.plot([b for b, _ in pts], [1e3 * t for _, t in pts], "o", color=colours[mode])
        if mode in a["curve"]:
            ax.plot(a["curve"]["bw_mbit"], [1e3 * t for t in a["curve"][mode]], "--",
                    color=colours[mode], alpha=0.8, label=f"{_label(mode)} model")
    for base, be in a["break_even"].items():
        at = be["measured"]["at"]
        if at is not None:
            ax.axvline(at, color=colours.get(base, "grey"), linestyle=":",
                       label=f"{_label(a['mode'])} = {_label(base)} at {at:.0f} Mbit/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("link bandwidth (Mbit/s)")
    ax.set_ylabel("time a training step (ms)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    first = first_run(data)
    ax.set_title(f"{first['dataset']}, {first['params'] / 1e6:.1f}M parameters, "
                 f"{data['args']['workers']} workers (Mininet, {data['machine']['cpus']} cores)",
                 fontsize=10)
    m = data.get("machine", {})
    save_figure(fig, path, data.get("recorded") or {
        "command": data.get("command"), "utc": data.get("date"), "cpu": m.get("cpu"),
        "cores": m.get("cpus")})   # a report written before sweeps recorded their commit
